"""Load a `dsv4 export-hf` directory in transformers' DeepseekV4ForCausalLM and compare logits with dsv4.

Two halves, one per venv (the project never imports torch; the torch venv has no JAX):

    # 1. project venv: dsv4's logits of a run on fixed random tokens
    .venv/bin/python tools/compare_hf_export.py dsv4 runs/base /tmp/dsv4_logits.npz --tokens 128
    # 2. export, then the torch + transformers venv: load with from_pretrained, same tokens, compare
    .venv/bin/dsv4 export-hf runs/base exported/ --layout official
    /work/torchvenv/bin/python tools/compare_hf_export.py hf exported/ /tmp/dsv4_logits.npz [--resave resaved/]

Both run in float32 on the CPU. The second prints max |dsv4 - HF| over every position and vocab
entry, the relative error, and the share of positions whose argmax agrees.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def dsv4_logits(run: str, out: str, tokens: int, seed: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import jax.numpy as jnp

    from core.checkpoint import store as ckpt

    model, cfg, _ = ckpt.restore_model(run)
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, tokens)).astype(np.int32)
    positions = jnp.arange(tokens, dtype=jnp.int32)[None]
    logits, _ = model(jnp.asarray(ids), positions, jnp.ones_like(positions), mode="eval")
    np.savez(out, tokens=ids, logits=np.asarray(logits, np.float32), run=str(run))
    print(f"dsv4 logits {tuple(logits.shape)} of {run} -> {out}")


def hf_logits(export: str, ref: str, resave: str | None = None) -> None:
    import torch
    import transformers
    from transformers import DeepseekV4ForCausalLM

    data = np.load(ref)
    model, info = DeepseekV4ForCausalLM.from_pretrained(export, dtype=torch.float32, output_loading_info=True)
    model.eval()
    if resave:  # what transformers itself writes (upstream-form names): `dsv4 import-hf` must read it back
        model.save_pretrained(resave)
    with torch.no_grad():
        out = model(torch.from_numpy(data["tokens"].astype(np.int64)), use_cache=False).logits.float().numpy()
    ours = data["logits"]
    diff = np.abs(out.astype(np.float64) - ours)
    agree = float(np.mean(out.argmax(-1) == ours.argmax(-1)))
    print(json.dumps({"export": export, "transformers": transformers.__version__, "torch": torch.__version__,
                      "shape": list(out.shape), "max_abs_diff": float(diff.max()),
                      "max_rel_diff": float(diff.max() / np.abs(ours).max()), "argmax_agreement": agree,
                      "missing_keys": sorted(info["missing_keys"]), "unexpected_keys": sorted(info["unexpected_keys"])},
                     indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="side", required=True)
    a = sub.add_parser("dsv4", help="project venv: write dsv4's logits of RUN to OUT.npz")
    a.add_argument("run")
    a.add_argument("out")
    a.add_argument("--tokens", type=int, default=128)
    a.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("hf", help="torch venv: load EXPORT with transformers and compare with REF.npz")
    b.add_argument("export")
    b.add_argument("ref")
    b.add_argument("--resave", help="also write the loaded model with save_pretrained to this directory")
    args = parser.parse_args()
    if args.side == "dsv4":
        dsv4_logits(args.run, args.out, args.tokens, args.seed)
    else:
        hf_logits(args.export, args.ref, args.resave)


if __name__ == "__main__":
    main()
