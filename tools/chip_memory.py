"""What a training step holds on a real accelerator, beside what `dsv4 plan` predicted for it.

    python tools/chip_memory.py MODEL STAGE [KEY=VALUE ...] [--steps N] [--plan PLAN.json]

On a machine with one accelerator: runs the training command's own run in this process
(`core.train.run.Trainer`, as `dsv4 STAGE --steps N` runs it, checkpoints included) in a temporary
directory, then prints one JSON object:

- `compiled`: XLA's memory analysis of the step the run executed, compiled for this device
  (`core.train.memory.compiled_memory`: the figures `dsv4 plan` reports, and the run's header line);
- `allocator`: the device allocator's `memory_stats()` after the run: `peak_bytes_in_use` (the most
  its buffers ever held at once: state, batches, checkpoint copies; whether an executable's
  temporaries count depends on the runtime, and on a TPU v5e they do not), `bytes_in_use`,
  `bytes_limit`;
- `plan` (with `--plan`, the `--json` output of `dsv4 plan --target ...` for the same model, stage
  and keys, made on any machine beforehand): its per-device figures, beside the others;
- `phases`: the allocator's peak and bytes in use after the build and compile, after each logged
  step and at the end (where the peak arose);
- `losses`: the run's total loss per step.

The comparison of record: docs/planning.md#on-a-chip. Project's files on PYTHONPATH; the run's own
dependencies installed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _phase(name: str, device) -> dict:
    stats = device.memory_stats() or {}
    return {"after": name, "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_in_use": stats.get("bytes_in_use")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("stage")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--plan", help="`dsv4 plan ... --json` output for the same model, stage and keys")
    args = parser.parse_args()

    from core.process import tune_garbage_collector

    tune_garbage_collector()  # as in every dsv4 process
    import jax

    from core.config.schema import load_config
    from core.train.compile_cache import enable_compilation_cache
    from core.train.memory import compiled_memory
    from core.train.run import Trainer

    cfg = load_config(args.model, args.overrides, stage=args.stage, options={"steps": args.steps})
    enable_compilation_cache(cfg.jax_cache_dir)
    device = jax.local_devices()[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as run_dir:
        phases = [_phase("start", device)]
        trainer = Trainer(cfg, stage=args.stage, run_dir=Path(run_dir) / args.stage)
        phases.append(_phase("built and compiled", device))
        built_s = time.monotonic() - started
        rows = []
        for row in trainer.run():
            rows.append(row)
            phases.append(_phase(f"step {row['step']} logged", device))
        phases.append(_phase("run ended", device))
        compiled = getattr(trainer._step_fn, "compiled", None)  # the executable compiled ahead (compile_ahead)
        if compiled is None:
            raise SystemExit("the run did not execute the step compiled ahead: run with compile_ahead=true")
        stats = device.memory_stats() or {}  # after the run: the limit and counts beside the phases' figures
        out = {
            "model": args.model, "stage": args.stage, "overrides": args.overrides, "steps": len(rows),
            "device": f"{device.platform} {device.device_kind}", "jax": jax.__version__,
            "build_and_compile_s": round(built_s, 1), "run_s": round(time.monotonic() - started - built_s, 1),
            "compiled": compiled_memory(compiled),
            "allocator": {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit",
                                                    "largest_alloc_size", "num_allocs")},
            "phases": phases,
            "losses": [row["total_loss"] for row in rows],
        }
    if args.plan:
        report = json.loads(Path(args.plan).read_text())
        out["plan"] = {"target": report.get("target"), **report["per_device"]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
