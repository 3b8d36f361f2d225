"""tools/suite_profile.py, the suite's profiler: a test's CPU seconds include the subprocesses it waited
for, and the summary ranks the files by them (docs/development.md#tests)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _plugin():
    spec = importlib.util.spec_from_file_location("suite_profile", ROOT / "tools" / "suite_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _profiled(plugin, nodeid: str, work) -> None:
    """One test through the plugin's pytest_runtest_protocol wrapper, `work()` as its body."""
    wrapper = plugin.pytest_runtest_protocol(types.SimpleNamespace(nodeid=nodeid), None)
    next(wrapper)
    work()
    try:
        wrapper.send(None)
    except StopIteration:
        pass


def test_a_tests_cpu_seconds_count_its_subprocesses_and_rank_the_summary(tmp_path, monkeypatch, capsys):
    plugin = _plugin()
    monkeypatch.setenv("SUITE_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
    child = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"
    _profiled(plugin, "tests/a/test_child.py::test_one", lambda: subprocess.run([sys.executable, "-c", child], check=True))
    _profiled(plugin, "tests/b/test_own.py::test_two", lambda: _spin(0.2))

    rows = (tmp_path / "events.gw7.jsonl").read_text().splitlines()
    assert len(rows) == 2 and all('"ev": "test_cpu"' in r for r in rows)
    plugin.summary(str(tmp_path))
    out = capsys.readouterr().out.splitlines()
    files = [line.split()[0] for line in out if line.startswith("tests/")]
    assert files == ["tests/a/test_child.py", "tests/b/test_own.py"], out  # the child's 0.4 s counts
    cpu = {line.split()[0]: float(line.split()[1]) for line in out if line.startswith("tests/")}
    assert cpu["tests/a/test_child.py"] >= 0.4 and 0.2 <= cpu["tests/b/test_own.py"] < 0.4, cpu


def test_the_summary_shows_each_workers_span_and_the_hits_on_another_workers_programs(tmp_path, capsys):
    """The balance of the xdist workers (the suite's wall time is the later one's) and the compilation
    cache's hits on a program the other worker compiled (tests/conftest.py shares one cache)."""
    import json

    plugin = _plugin()
    rows = {"gw0": [{"ev": "miss", "key": "jit_f-1", "test": "tests/a.py::t"},
                    {"ev": "test_cpu", "s": 30.0, "wall": 60.0, "t": 1060.0, "test": "tests/a.py::t"},
                    {"ev": "test_cpu", "s": 5.0, "wall": 6.0, "t": 1300.0, "test": "tests/c.py::t"}],
            "gw1": [{"ev": "hit", "key": "jit_f-1", "test": "tests/b.py::t"},
                    {"ev": "miss", "key": "jit_g-2", "test": "tests/b.py::t"},
                    {"ev": "hit", "key": "jit_g-2", "test": "tests/b.py::u"},
                    {"ev": "test_cpu", "s": 12.0, "wall": 120.0, "t": 1120.0, "test": "tests/b.py::t"}]}
    for worker, events in rows.items():
        (tmp_path / f"events.{worker}.jsonl").write_text("".join(json.dumps({**e, "worker": worker}) + "\n" for e in events))
    plugin.summary(str(tmp_path))
    out = capsys.readouterr().out.splitlines()
    assert "cache hits: 2, of which on a program another worker compiled: 1" in out, out
    span = {line.split()[0]: line.split()[1:] for line in out if line.startswith("gw")}
    assert span["gw0"] == ["35.0", "0.0", "5.0", "tests/c.py"], span  # from 1000 s to 1300 s: 0 to 5 minutes
    assert span["gw1"] == ["12.0", "0.0", "2.0", "tests/b.py"], span
