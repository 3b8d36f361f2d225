"""Write a random DeepSeek-V4-Flash-width checkpoint with a few layers, for timing `dsv4 import-hf`.

The released V4-Flash config.json (tests/fixtures/deepseek_v4_flash_config.json) with fewer layers
and routed experts: hidden 4096, 64 heads x 512, q/o low rank 1024, 8 output groups, indexer 64 x
128, expert width 2048, vocab 129,280 all stay Flash-sized. Official on-disk layout (FP8 block-scaled
weights, FP4 experts, BF16/F32 rest, one shard per layer, index file, an MTP block), written one
shard at a time by tests/hf_checkpoints.py.

    .venv/bin/python tools/make_flash_width_checkpoint.py runs/flash4-src --layers 4 --experts 2
    .venv/bin/python tools/make_flash_width_checkpoint.py DeepSeek-V4-Small --small   # toy width, seconds
    /usr/bin/time -v .venv/bin/dsv4 import-hf runs/flash4-src --output runs/flash4   # docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers: SWA, CSA, HCA, CSA, then (HCA, CSA) pairs")
    parser.add_argument("--experts", type=int, default=2, help="routed experts per layer (Flash: 256)")
    parser.add_argument("--small", action="store_true", help="the tests' toy-width 6-layer model instead (a few MB)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.hf_checkpoints import SMALL, write_official

    if args.small:
        write_official(args.out, SMALL, keep_values=False)
        print(f"wrote {args.out}: the tests' small DeepSeek-V4 (6 layers, width 64)")
        return

    c = json.loads((ROOT / "tests" / "fixtures" / "deepseek_v4_flash_config.json").read_text())
    for key in ("architectures", "model_type", "quantization_config", "expert_dtype", "torch_dtype",
                "num_nextn_predict_layers", "transformers_version"):
        c.pop(key, None)
    ratios = [0, 4, 128, 4] + [128, 4] * 20
    c.update(num_hidden_layers=args.layers, compress_ratios=ratios[:args.layers],
             num_hash_layers=min(2, args.layers), n_routed_experts=args.experts,
             num_experts_per_tok=min(c["num_experts_per_tok"], args.experts))
    write_official(args.out, c, shards=None, keep_values=False)
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(f"wrote {args.out}: {args.layers} layers, {args.experts} experts, {size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
