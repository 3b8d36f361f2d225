"""core/process.py: every process a dsv4 command runs in tunes CPython's garbage collector first,
the CLI's and the child processes' that the planner and the benchmark start."""

from __future__ import annotations

import ast
import gc
import sys
from pathlib import Path

import pytest

from core.process import YOUNG_GENERATION_THRESHOLD, tune_garbage_collector

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def default_collector():
    """CPython's default thresholds for the test; the process's own afterwards."""
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def test_tuning_raises_only_the_youngest_threshold(default_collector):
    tune_garbage_collector()
    assert gc.get_threshold() == (YOUNG_GENERATION_THRESHOLD, 10, 10)


def test_the_cli_tunes_the_collector(default_collector, monkeypatch):
    from dsv4cli.main import main

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(sys, "argv", ["dsv4", "--help"])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 0
    assert gc.get_threshold()[0] == YOUNG_GENERATION_THRESHOLD


def _main_blocks(path: Path) -> list[ast.If]:
    return [node for node in ast.parse(path.read_text()).body if isinstance(node, ast.If)
            and ast.unparse(node.test) in ("__name__ == '__main__'", '__name__ == "__main__"')]


def test_every_entry_point_tunes_the_collector_first():
    """The `python -m core....` children (planner, benchmark) and the CLI script: the first statement
    of each `if __name__ == "__main__":` block after its imports calls `tune_garbage_collector` or `main`
    (which does)."""
    blocks = {path: _main_blocks(path) for path in sorted([*ROOT.glob("core/**/*.py"), *ROOT.glob("dsv4cli/*.py")])}
    blocks = {path: found for path, found in blocks.items() if found}
    assert {p.relative_to(ROOT).as_posix() for p in blocks} >= {
        "core/plan/compile.py", "core/plan/search.py", "core/bench/train.py", "dsv4cli/main.py"}
    for path, [block] in blocks.items():
        first = next(s for s in block.body if not isinstance(s, (ast.Import, ast.ImportFrom)))
        call = first.value if isinstance(first, ast.Expr) and isinstance(first.value, ast.Call) else None
        assert call is not None and ast.unparse(call.func) in ("tune_garbage_collector", "main"), \
            f"{path.relative_to(ROOT)}: its __main__ block starts with {ast.unparse(first)!r}"
