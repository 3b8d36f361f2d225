"""A pytest plugin: where the suite's time goes, per test, in JAX's tracing, lowering and XLA compiles.

    PYTHONPATH=$PWD:$PWD/tools SUITE_PROFILE_DIR=/tmp/prof pytest -p suite_profile --durations=0
    python tools/suite_profile.py /tmp/prof            # the summary: per file, the largest compiles

Each pytest process (every xdist worker) appends JSON lines to SUITE_PROFILE_DIR/events.<worker>.jsonl:
the durations JAX's monitoring reports (jaxpr tracing, MLIR lowering, XLA's backend compile) and the
persistent compilation cache's hits and misses with their keys, each tagged with the running test.
Subprocesses that tests start are not counted (their time shows in `--durations`). Developer tool:
docs/development.md#tests.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import threading
import time

_DURATIONS = ("/jax/core/compile/backend_compile_duration", "/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/jaxpr_to_mlir_module_duration")
_lock = threading.Lock()
_last_key: dict[int, tuple[str, str]] = {}


def _write(record: dict) -> None:
    record.update(test=os.environ.get("PYTEST_CURRENT_TEST", "?"), worker=os.environ.get("PYTEST_XDIST_WORKER", "main"),
                  t=time.time())
    path = os.path.join(os.environ.get("SUITE_PROFILE_DIR", "."), f"events.{record['worker']}.jsonl")
    with _lock, open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class _CacheLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        for prefix, kind in (("PERSISTENT COMPILATION CACHE MISS", "miss"), ("Persistent compilation cache hit", "hit")):
            if msg.startswith(prefix):
                _last_key[threading.get_ident()] = (record.args[0], record.args[1])
                _write({"ev": kind, "name": record.args[0], "key": record.args[1]})


def pytest_configure(config) -> None:
    import jax.monitoring

    def duration(event: str, seconds: float, **_) -> None:
        if event in _DURATIONS:
            record = {"ev": event.rsplit("/", 1)[1], "s": seconds}
            if event == _DURATIONS[0] and threading.get_ident() in _last_key:
                record["name"], record["key"] = _last_key[threading.get_ident()]
            _write(record)

    jax.monitoring.register_event_duration_secs_listener(duration)
    logger = logging.getLogger("jax._src.compiler")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(_CacheLog())
    logger.propagate = False  # the debug records stay out of the tests' captured output


def summary(directory: str, top: int = 25) -> None:
    events = [json.loads(line) for name in sorted(os.listdir(directory)) if name.startswith("events.")
              for line in open(os.path.join(directory, name))]
    per_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        per_file[e["test"].split("::")[0]][e["ev"]] += e.get("s", 1)
    print(f"{'file':56s} {'compile s':>10s} {'trace s':>8s} {'lower s':>8s} {'hits':>5s}")
    for f, c in sorted(per_file.items(), key=lambda kv: -kv[1]["backend_compile_duration"])[:top]:
        print(f"{f:56s} {c['backend_compile_duration']:10.1f} {c['jaxpr_trace_duration']:8.1f} "
              f"{c['jaxpr_to_mlir_module_duration']:8.1f} {c['hit']:5d}")
    compiles = sorted((e for e in events if e["ev"] == "backend_compile_duration"), key=lambda e: -e["s"])
    print(f"\n{len(compiles)} compiles, {sum(e['s'] for e in compiles):.0f} s; the largest:")
    for e in compiles[:top]:
        print(f"{e['s']:6.1f} s  {e.get('name', '?')[:30]:30s} {e['test'][:100]}")
    workers = collections.defaultdict(set)
    for e in compiles:
        if "key" in e:
            workers[e["key"]].add(e["worker"])
    print(f"\nprograms compiled on more than one worker: {sum(len(w) > 1 for w in workers.values())} of {len(workers)}")


if __name__ == "__main__":
    summary(sys.argv[1] if len(sys.argv) > 1 else ".")
