"""dsv4's sparse training step beside MaxText's deepseek4-tiny, at the same shapes, in one table.

What it measures, for every B x T of --batch x --seq (deepseek4-tiny, synthetic data, CPU):

- dsv4: `dsv4 bench --train --stage sparse --seq T --batch B --train-steps N --json` (one fresh
  subprocess per shape): tokens/s and step time (median of N steps after an untimed first one),
  the step's compile time, XLA's compiled temp memory and the subprocess's peak RSS;
- MaxText: its own trainer on its `deepseek4-tiny` model with the same B and T,

      DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=1 \\
      MAXTEXT_VENV/bin/python -m maxtext.trainers.pre_train.train MAXTEXT_SRC/src/maxtext/configs/base.yml \\
        model_name=deepseek4-tiny run_name=BxT dataset_type=synthetic hardware=cpu enable_checkpointing=False \\
        base_output_directory=DIR/maxtext skip_jax_distributed_system=True attention=dot_product megablox=False \\
        steps=S per_device_batch_size=B max_target_length=T jax_cache_dir=DIR/maxtext-cache-BxT

  (a fresh, empty jax_cache_dir per shape, so nothing is read from an earlier compile): the mean of
  its `Tokens/s/device` over steps 2 .. S-1 (its step 0 compiles, step 1 still warms up), the
  process's peak RSS and the seconds from launch to its step-0 line (in --json and the log).

dsv4 runs first, then MaxText, one shape after another; the last column is dsv4's tokens/s over
MaxText's. docs/benchmarks.md#train-step-beside-maxtext has the figures. The MaxText half follows
the command lines recorded with those figures; check its log (DIR/maxtext-BxT.log) when MaxText's
snapshot differs.

Prerequisites: the project installed (`pip install -e .`); for the MaxText half, MaxText at commit
e591f30 in its own Python 3.12 venv (`bash tools/setup_maxtext.sh MAXTEXT_GIT_DIR`, which prints
the MAXTEXT_SRC and MAXTEXT_VENV it made; defaults ~/maxtext-src and ~/maxtext-venv). An idle
machine: the figures are wall-clock.

Usage (from the repository root; DIR, default runs/maxtext_side_by_side, is created):

    python tools/maxtext_side_by_side.py                                   # 1,4 x 256,1024
    python tools/maxtext_side_by_side.py --seq 256 --batch 1 --skip-maxtext  # the dsv4 half only
    python tools/maxtext_side_by_side.py --maxtext-src ~/maxtext-src --maxtext-venv ~/maxtext-venv --json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from time_to_step0 import dsv4_executable, timed_run

MAXTEXT_STEP = re.compile(r"completed step: (\d+), seconds: [\d.]+, TFLOP/s/device: [\d.]+, Tokens/s/device: ([\d.]+)")
MAXTEXT_FLAGS = ["model_name=deepseek4-tiny", "dataset_type=synthetic", "hardware=cpu", "enable_checkpointing=False",
                 "skip_jax_distributed_system=True", "attention=dot_product", "megablox=False"]


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def run_dsv4(seqs: list[int], batches: list[int], steps: int) -> dict[tuple[int, int], dict]:
    """`dsv4 bench --train` over every shape: {(B, T): its row}."""
    argv = [dsv4_executable(), "bench", "--train", "--stage", "sparse", "--seq", ",".join(map(str, seqs)),
            "--batch", ",".join(map(str, batches)), "--train-steps", str(steps), "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return {(r["batch"], r["seq"]): r for r in json.loads(proc.stdout)["rows"]}


def run_maxtext(src: Path, venv: Path, base: Path, batch: int, seq: int, steps: int) -> dict:
    """One MaxText training run at B x T: mean Tokens/s/device over steps 2 .. steps-1, peak RSS, and
    the seconds from launch to its first "completed step" line (step 0: its time to step 0, cold)."""
    name = f"{batch}x{seq}"
    cache = base / f"maxtext-cache-{name}"
    for d in (cache, base / "maxtext" / name):
        shutil.rmtree(d, ignore_errors=True)
    argv = [str(venv / "bin" / "python"), "-m", "maxtext.trainers.pre_train.train",
            str(src / "src" / "maxtext" / "configs" / "base.yml"), *MAXTEXT_FLAGS, f"run_name={name}",
            f"base_output_directory={(base / 'maxtext').resolve()}", f"steps={steps}",
            f"per_device_batch_size={batch}", f"max_target_length={seq}", f"jax_cache_dir={cache.resolve()}"]
    env = {"DECOUPLE_GCLOUD": "TRUE", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    log = base / f"maxtext-{name}.log"
    run = timed_run(argv, log, env=env, pattern=MAXTEXT_STEP)
    rates = {}
    for line in log.read_text().splitlines():
        m = MAXTEXT_STEP.search(line)
        if m:
            rates[int(m.group(1))] = float(m.group(2))
    timed = [rates[s] for s in range(2, steps) if s in rates]
    if run["returncode"] != 0 or not timed:
        return {"error": f"exit {run['returncode']}, {len(timed)} timed steps: see {log}"}
    return {"tokens_per_s": statistics.mean(timed), "peak_rss_bytes": run["peak_rss_bytes"],
            "step0_s": run["step0_s"], "log": str(log)}


def table(rows: list[dict]) -> str:
    """One line per shape, columns aligned; a failed half shows its error instead of figures."""
    grid = [["B x T", "dsv4 tokens/s", "step (s)", "compile (s)", "XLA temp (MiB)", "peak RSS (GiB)",
             "MaxText tokens/s", "MaxText peak RSS (GiB)", "dsv4 / MaxText"]]
    for r in rows:
        d, m = r["dsv4"], r.get("maxtext") or {"error": "not run"}
        cells = [f"{r['batch']} x {r['seq']}"]
        cells += ([f"{d['tokens_per_s']:.1f}", f"{d['step_time_s']:.3f}", f"{d['compile_s']:.1f}",
                   f"{d['temp_bytes'] / 2**20:.1f}", f"{d['peak_rss_bytes'] / 2**30:.2f}"]
                  if "error" not in d else [f"dsv4: {d['error']}", "", "", "", ""])
        cells += ([f"{m['tokens_per_s']:.1f}", f"{m['peak_rss_bytes'] / 2**30:.2f}"]
                  if "error" not in m else [f"MaxText: {m['error']}", ""])
        both = "error" not in d and "error" not in m
        cells.append(f"{d['tokens_per_s'] / m['tokens_per_s']:.2f}x" if both else "-")
        grid.append(cells)
    widths = [max(len(row[i]) for row in grid) for i in range(len(grid[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in grid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=ints, default=[256, 1024], help="comma-separated T [256,1024]")
    parser.add_argument("--batch", type=ints, default=[1, 4], help="comma-separated B [1,4]")
    parser.add_argument("--train-steps", type=int, default=5, help="dsv4's timed steps per shape [5]")
    parser.add_argument("--maxtext-steps", type=int, default=6, help="MaxText's steps per shape; 2 .. S-1 are timed [6]")
    parser.add_argument("--maxtext-src", type=Path, default=Path(os.environ.get("MAXTEXT_SRC", "~/maxtext-src")))
    parser.add_argument("--maxtext-venv", type=Path, default=Path(os.environ.get("MAXTEXT_VENV", "~/maxtext-venv")))
    parser.add_argument("--skip-maxtext", action="store_true", help="run the dsv4 half only")
    parser.add_argument("--dir", type=Path, default=Path("runs/maxtext_side_by_side"),
                        help="MaxText's output, caches and logs (created) [runs/maxtext_side_by_side]")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if args.train_steps < 1 or args.maxtext_steps < 3:
        parser.error("--train-steps must be >= 1 and --maxtext-steps >= 3 (steps 0 and 1 are not timed)")
    src, venv = args.maxtext_src.expanduser(), args.maxtext_venv.expanduser()
    if not args.skip_maxtext and not (venv / "bin" / "python").exists():
        parser.error(f"no MaxText venv at {venv}: run tools/setup_maxtext.sh, pass --maxtext-venv, or --skip-maxtext")
    args.dir.mkdir(parents=True, exist_ok=True)
    dsv4 = run_dsv4(args.seq, args.batch, args.train_steps)
    rows = []
    for seq in args.seq:
        for batch in args.batch:
            row = {"batch": batch, "seq": seq, "dsv4": dsv4[(batch, seq)]}
            if not args.skip_maxtext:
                print(f"MaxText {batch} x {seq} ...", file=sys.stderr, flush=True)
                row["maxtext"] = run_maxtext(src, venv, args.dir, batch, seq, args.maxtext_steps)
            rows.append(row)
    print(json.dumps({"rows": rows}, indent=2) if args.json else table(rows))


if __name__ == "__main__":
    main()
