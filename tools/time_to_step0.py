"""Time to step 0 of `dsv4 sparse`, cold (empty compilation cache) and warm (the cache filled).

What it measures: for each repeat, two runs of

    dsv4 sparse --steps 1 --output DIR/run-... dataset_type=synthetic jax_cache_dir=DIR/cache-N [KEY=VALUE ...]

first with `DIR/cache-N` empty (cold: every XLA program is compiled), then again with the cache
that run filled (warm: the compiled programs are read back). Every output line of the command is
timestamped from the launch; reported per run: the seconds from launch to the "step 0" row
(import, model build, trace, compile and the first step), the whole command's wall time (the
final checkpoint and the exit included), its CPU seconds (user + system, all threads) and its
peak RSS. Cold and warm runs alternate, so a machine whose speed drifts loads both alike; the
medians close the table. docs/benchmarks.md#time-to-step-0 has the figures.

Prerequisites: the project installed (`pip install -e .`), so `dsv4` is on PATH or beside this
Python; Linux or macOS (peak RSS from `os.wait4`). Nothing else should run on the machine: the
figures are wall-clock seconds.

Usage (from the repository root; DIR is created, and only its run-* and cache-* entries are
replaced):

    python tools/time_to_step0.py                                   # 3 cold + 3 warm, deepseek4-tiny 1 x 256
    python tools/time_to_step0.py --repeats 1 --dir runs/t0 max_target_length=1024
    python tools/time_to_step0.py --json                            # one JSON object instead of the table
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
import time
from pathlib import Path

STEP0 = re.compile(r"^step 0\s+total_loss")  # the first metrics row (not the "step 0: ..." summary)


def dsv4_executable() -> str:
    """`dsv4` beside this interpreter (a venv's bin/), else the one on PATH."""
    beside = Path(sys.executable).with_name("dsv4")
    found = str(beside) if beside.exists() else shutil.which("dsv4")
    if not found:
        sys.exit("dsv4 not found: run `pip install -e .` in the repository first")
    return found


def timed_run(argv: list[str], log: Path, env: dict[str, str] | None = None, pattern: re.Pattern = STEP0) -> dict:
    """Run `argv`, its output lines timestamped into `log`: the time of the first line matching
    `pattern`, wall and CPU seconds, peak RSS of that process and the exit code."""
    env = {**os.environ, "COLUMNS": "400", **(env or {})}  # unwrapped lines: the output is not a terminal
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    step0 = None
    with open(log, "w") as f:
        for line in proc.stdout:
            t = time.perf_counter() - start
            f.write(f"{t:8.2f}  {line}")
            if step0 is None and pattern.search(line):
                step0 = t
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"step0_s": step0, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_bytes": rss, "returncode": proc.returncode, "log": str(log)}


def measure(base: Path, repeats: int, overrides: list[str]) -> list[dict]:
    """`repeats` (cold, warm) pairs, each cold run with a fresh cache directory under `base`."""
    dsv4 = dsv4_executable()
    rows = []
    for i in range(repeats):
        cache = base / f"cache-{i}"
        shutil.rmtree(cache, ignore_errors=True)
        for kind in ("cold", "warm"):
            out = base / f"run-{kind}-{i}"
            shutil.rmtree(out, ignore_errors=True)  # a run directory left behind would resume, not start
            argv = [dsv4, "sparse", "--steps", "1", "--output", str(out), "dataset_type=synthetic",
                    f"jax_cache_dir={cache}", *overrides]
            row = {"run": kind, "repeat": i, **timed_run(argv, base / f"run-{kind}-{i}.log")}
            rows.append(row)
            if row["returncode"] != 0 or row["step0_s"] is None:
                sys.exit(f"{' '.join(argv)} failed (exit {row['returncode']}): see {row['log']}")
            print(f"{kind} {i}: step 0 row at {row['step0_s']:.1f} s", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["run    step 0 row at (s)  command wall (s)  CPU s (user + sys)  peak RSS (GiB)"]
    for r in rows:
        lines.append(f"{r['run']:<5}  {r['step0_s']:17.1f}  {r['wall_s']:16.1f}  {r['cpu_s']:18.1f}  "
                     f"{r['peak_rss_bytes'] / 2**30:14.2f}")
    for kind in ("cold", "warm"):
        of = [r for r in rows if r["run"] == kind]
        lines.append(f"median {kind}: step 0 row at {statistics.median(r['step0_s'] for r in of):.1f} s, command "
                     f"{statistics.median(r['wall_s'] for r in of):.1f} s ({len(of)} runs)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides passed to dsv4 sparse")
    parser.add_argument("--dir", type=Path, default=Path("runs/time_to_step0"),
                        help="directory for the runs, their caches and logs (created) [runs/time_to_step0]")
    parser.add_argument("--repeats", type=int, default=3, help="(cold, warm) pairs [3]")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = measure(args.dir, args.repeats, args.overrides)
    print(json.dumps({"overrides": args.overrides, "rows": rows}, indent=2) if args.json else table(rows))


if __name__ == "__main__":
    main()
