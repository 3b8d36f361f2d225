"""What the collective-order ties (core/ops/placement.py) cost a CPU mesh's step: the same step traced
tied (as dsv4 traces it on a CPU mesh of several devices) and untied, side by side in one process.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
      python tools/order_ties_cost.py warmup [--steps 6] [KEY=VALUE ...]

Prints one JSON object: per variant, the loops holding collectives and the collectives outside loops
of the compiled program, its at-risk pairs (core.parallel.collective_order), its temporaries, the
median time of `--steps` steps after one untimed step, and the last loss. The untied step may hang
on a CPU mesh (that is why the ties exist); it is run here in one process, where it does not.
Default shape: the shrunken deepseek4-tiny (5 layers, 1 x 128 per device) on fsdp 4 x tensor 2.
Figures: docs/scaling.md#collective-order-on-the-cpu.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = ("compress_ratios=[0,4,128,4,128]", "base_num_decoder_layers=5", "first_num_hash_layers=1",
         "vocab_size=512", "max_target_length=128", "per_device_batch_size=1", "dataset_type=synthetic",
         "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=("pretrain", "warmup", "sparse"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    import jax
    from flax import nnx

    from core.config.schema import load_config
    from core.data.batches import train_batches
    from core.parallel.collective_order import at_risk_pairs
    from core.parallel.sharding import shard_batch
    from core.train import program
    from core.parallel.sharding import state_shardings
    from core.train.materialise import build
    from core.train.step import step_fn
    from core.parallel.mesh import make_mesh
    from core.spec.resolve import data_spec, resolve

    cfg = load_config("deepseek4-tiny", [*SHAPE, *args.overrides], stage=args.stage)
    mesh = make_mesh(cfg)
    specs = resolve(cfg, "cpu", mesh.shape)
    setup = build(specs, mesh)
    graphdef, state = nnx.split((setup.model, setup.optimizer))
    batch = shard_batch(next(train_batches(data_spec(cfg), setup.batch_size)), setup.mesh)
    tied = program.tied  # with_mesh enters program.tied(...), looked up when it runs
    out = {"stage": args.stage, "devices": setup.mesh.size}
    try:
        for name, untie in (("tied", False), ("untied", True)):
            program.tied = (lambda on: tied(False)) if untie else tied
            step = program.jit_step(step_fn(specs, graphdef), specs.step.opt_level, setup.mesh,
                                    state_shardings(state, setup.mesh))
            compiled = step.lower(state, batch).compile()
            loops, outside, pairs = at_risk_pairs(compiled.as_text())
            s = jax.tree.map(lambda x: x.copy(), state)
            s, metrics = compiled(s, batch)
            jax.block_until_ready(metrics)
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                s, metrics = compiled(s, batch)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
            out[name] = {"loops_with_collectives": loops, "collectives_outside_loops": outside, "at_risk_pairs": len(pairs),
                         "temp_mib": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 2),
                         "median_step_s": round(sorted(times)[len(times) // 2], 4), "loss": float(metrics["total_loss"])}
    finally:
        program.tied = tied
    print(json.dumps(out))


if __name__ == "__main__":
    main()
