"""What tracing and lowering a stage's step costs under CPython's default collector and under dsv4's.

    python tools/trace_cost.py MODEL STAGE [KEY=VALUE ...] [--devices N] [--rounds R]

Each round starts two fresh processes, one per collector setting (CPython's default thresholds;
`core.process.tune_garbage_collector`), that lower the step from abstract inputs as a training
command does (`core.train.program.lowered_step`: nothing allocated, nothing compiled) and report the
CPU seconds of that alone. Developer tool: docs/development.md#tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(model: str, stage: str, overrides: list[str], tuned: bool) -> dict:
    import gc
    import time

    if tuned:
        from core.process import tune_garbage_collector

        tune_garbage_collector()
    from core.config.schema import load_config
    from core.parallel.mesh import make_mesh, mesh_platform
    from core.spec.resolve import resolve
    from core.train.program import lowered_step

    cfg = load_config(model, [*overrides, "jax_cache_dir="], stage=stage)
    start = time.process_time()
    mesh = make_mesh(cfg)
    lowered_step(resolve(cfg, mesh_platform(mesh), mesh.shape), mesh)
    return {"tuned": tuned, "threshold": gc.get_threshold(), "lower_cpu_s": time.process_time() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("stage")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--devices", type=int, default=1, help="fake CPU devices (the run's mesh)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"}
    results = {False: [], True: []}
    for _ in range(args.rounds):
        for tuned in (False, True):
            out = subprocess.run([sys.executable, __file__, "--child", json.dumps([args.model, args.stage, args.overrides, tuned])],
                                 env=env, capture_output=True, text=True, check=True).stdout
            results[tuned].append(json.loads(out.strip().splitlines()[-1]))
    for tuned, rows in results.items():
        name = "dsv4's collector   " if tuned else "CPython's default  "
        cpu = ", ".join(f"{r['lower_cpu_s']:.2f}" for r in rows)
        print(f"{name} {tuple(rows[0]['threshold'])}: lower {cpu} CPU-s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_child(*json.loads(sys.argv[2]))), flush=True)
    else:
        main()
