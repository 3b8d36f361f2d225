"""What a multi-process run's stop agreement costs: time `StopRequest._exchange` (core/train/stop.py)
and JAX's preemption check on localhost processes (docs/scaling.md#stopping-and-preemption).

    python tools/stop_agreement_cost.py                 # two processes, 200 rounds each
    python tools/stop_agreement_cost.py --processes 4 --rounds 500

Starts the processes itself (one fake CPU device each), prints one JSON object per process:
milliseconds per exchange and per preemption check. Time it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker(pid: int, count: int, port: int, rounds: int) -> None:
    from core.parallel.mesh import initialize_distributed

    initialize_distributed(f"127.0.0.1:{port}", count, pid)
    from jax.experimental import multihost_utils

    from core.train.stop import StopRequest

    stop = StopRequest(last_step=10**9)
    for step in range(5):  # warm the service's keys and barriers
        stop._exchange(step)
    start = time.perf_counter()
    for step in range(rounds):
        stop._exchange(step)
    exchange = (time.perf_counter() - start) / rounds
    start = time.perf_counter()
    for step in range(rounds):
        multihost_utils.reached_preemption_sync_point(step)
    check = (time.perf_counter() - start) / rounds
    print(json.dumps({"process": pid, "exchange_ms": exchange * 1e3, "preemption_check_ms": check * 1e3}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--worker", type=int, nargs=3, help=argparse.SUPPRESS)  # pid, count, port
    args = parser.parse_args()
    if args.worker:
        pid, count, port = args.worker
        return _worker(pid, count, port, args.rounds)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, __file__, "--rounds", str(args.rounds), "--worker", str(pid),
                               str(args.processes), str(port)], env=env) for pid in range(args.processes)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
