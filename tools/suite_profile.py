"""A pytest plugin: where the suite's time goes, per test: its CPU seconds, JAX's tracing, lowering and XLA compiles.

    PYTHONPATH=$PWD:$PWD/tools SUITE_PROFILE_DIR=/tmp/prof pytest -p suite_profile --durations=0
    python tools/suite_profile.py /tmp/prof            # the summary: per file by CPU seconds, the largest compiles

Each pytest process (every xdist worker) appends JSON lines to SUITE_PROFILE_DIR/events.<worker>.jsonl:
the durations JAX's monitoring reports (jaxpr tracing, MLIR lowering, XLA's backend compile) and the
persistent compilation cache's hits and misses with their keys, each tagged with the running test.
Each test's CPU seconds are recorded too (setup, call and teardown; with those of the subprocesses
it started and waited for): the suite's wall time on N cores is bounded below by its CPU time / N.
Developer tool: docs/development.md#tests.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import resource
import sys
import threading
import time

import pytest

_DURATIONS = ("/jax/core/compile/backend_compile_duration", "/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/jaxpr_to_mlir_module_duration")
_lock = threading.Lock()
_last_key: dict[int, tuple[str, str]] = {}


def _write(record: dict) -> None:
    record.setdefault("test", os.environ.get("PYTEST_CURRENT_TEST", "?"))  # the running test unless named
    record.update(worker=os.environ.get("PYTEST_XDIST_WORKER", "main"), t=time.time())
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


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start, wall = _cpu_s(), time.time()
    yield
    _write({"ev": "test_cpu", "s": _cpu_s() - start, "wall": time.time() - wall, "test": item.nodeid})


def summary(directory: str, top: int = 25) -> None:
    events = [json.loads(line) for name in sorted(os.listdir(directory)) if name.startswith("events.")
              for line in open(os.path.join(directory, name))]
    per_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        per_file[e["test"].split("::")[0]][e["ev"]] += e.get("s", 1)
    total = sum(c["test_cpu"] for c in per_file.values())
    print(f"CPU seconds in tests (with their subprocesses): {total:.0f}")
    print(f"{'file':56s} {'CPU s':>7s} {'compile s':>10s} {'trace s':>8s} {'lower s':>8s} {'hits':>5s}")
    for f, c in sorted(per_file.items(), key=lambda kv: -kv[1]["test_cpu"])[:top]:
        print(f"{f:56s} {c['test_cpu']:7.1f} {c['backend_compile_duration']:10.1f} {c['jaxpr_trace_duration']:8.1f} "
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
    missed = collections.defaultdict(set)  # key -> the workers that compiled it (a miss, then the compile)
    for e in events:
        if e["ev"] == "miss":
            missed[e["key"]].add(e["worker"])
    hits = [e for e in events if e["ev"] == "hit"]
    across = sum(bool(missed[e["key"]] - {e["worker"]}) for e in hits)
    print(f"cache hits: {len(hits)}, of which on a program another worker compiled: {across}")
    balance(events)


def balance(events: list[dict]) -> None:
    """Per worker: its tests' CPU seconds, when its first test started and its last ended (minutes from
    the first start of any worker), and its last file: the suite's wall time is the later worker's."""
    runs = [e for e in events if e["ev"] == "test_cpu"]
    if not runs:
        return
    origin = min(e["t"] - e["wall"] for e in runs)
    print(f"\n{'worker':8s} {'CPU s':>7s} {'start':>6s} {'end':>6s}  last file")
    for worker in sorted({e["worker"] for e in runs}):
        mine = sorted((e for e in runs if e["worker"] == worker), key=lambda e: e["t"])
        start, end = (min(e["t"] - e["wall"] for e in mine) - origin) / 60, (mine[-1]["t"] - origin) / 60
        print(f"{worker:8s} {sum(e['s'] for e in mine):7.1f} {start:6.1f} {end:6.1f}  {mine[-1]['test'].split('::')[0]}")


if __name__ == "__main__":
    summary(sys.argv[1] if len(sys.argv) > 1 else ".")
