"""Config variants of one train step, timed in turn in one process: an A/B that machine drift cannot bias.

`dsv4 bench --train` times one shape per subprocess, so two variants measured minutes apart carry
the machine's drift (on the 2-core container here the same program has run anywhere from 0.75 to
0.97 s a step within an hour). This script builds and compiles every variant's step first, runs
each once untimed, then steps them round-robin, ROUNDS times each, on its own fixed batch (the
loss falls as the step repeats; equal configs give equal losses), and prints per variant: the
median and minimum step time, the ratio of medians to the first variant, the compile time, XLA's
compiled temp memory, the last total loss and the process's minor page faults in its last step.

A variant is one argument of space-separated KEY=VALUE overrides; "-" is the config unchanged.
Process-wide settings (XLA_FLAGS, the allocator) are the same for all variants: compare those
across processes, interleaved.

Usage (from the repository root, project venv, an idle machine):

    python tools/step_ab.py - "remat_policy=minimal" "abort_on_nan_loss=false abort_on_inf_loss=false"
    python tools/step_ab.py --stage pretrain --seq 1024 --batch 4 --rounds 5 - remat_policy=full
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help='overrides per variant, e.g. "remat_policy=minimal"; "-" for none')
    parser.add_argument("--stage", default="sparse", choices=("pretrain", "warmup", "sparse"))
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()

    import jax

    from core.bench.train import compiled_shape, sweep_config, sweep_point

    runs = []
    for variant in args.variants:
        overrides = [] if variant == "-" else variant.split()
        run = compiled_shape(*sweep_point(sweep_config(args.stage, args.seq, args.batch, overrides)), 1)
        run["state"], metrics = run["step"](run["state"], run["batches"][0])  # the untimed first step
        jax.block_until_ready(metrics)
        runs.append({**run, "name": variant if overrides else "(unchanged)", "times": []})
    for _ in range(args.rounds):
        for run in runs:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            run["state"], metrics = run["step"](run["state"], run["batches"][0])
            jax.block_until_ready(metrics)
            run["times"].append(time.perf_counter() - start)
            run["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            run["loss"] = float(metrics["total_loss"])
    base = statistics.median(runs[0]["times"])
    print(f"{args.stage} {args.batch} x {args.seq}, {args.rounds} rounds  ·  median / min step, ratio of medians, "
          "compile, XLA temp, last total loss, minor page faults of the last step")
    for run in runs:
        median = statistics.median(run["times"])
        print(f"{run['name']:56s} {median:.4f} / {min(run['times']):.4f} s  x{median / base:.3f}  "
              f"{run['compile_s']:5.1f} s  {run['temp_bytes'] / 2**20:8.1f} MiB  {run['loss']:.6f}  {run['faults']}")


if __name__ == "__main__":
    main()
