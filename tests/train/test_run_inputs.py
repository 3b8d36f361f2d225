"""Run directories a user hands the training commands (issue 14): an unusable --output, a torn or
corrupt metrics.jsonl, and data that changed between a run and its resume.

Every resume here reruns step 1 of tests/checkpoint/test_inspect.py's two-step warm-up (same model keys and
--steps, so the step compiled for that run is reused): a copy of the run with checkpoint 1
removed is a run killed after checkpoint 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core.checkpoint import store as ckpt
from core.checkpoint import run_files
from dsv4cli.main import app
from tests.checkpoint.test_inspect import OVERRIDES, STEPS, warmup_run

runner = CliRunner()


def _warmup(run: Path, *extra: str):
    return runner.invoke(app, ["warmup", "--steps", str(len(STEPS)), "--output", str(run), *OVERRIDES,
                               "checkpoint_period=1", *extra])


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory) -> Path:
    """The session's two-step warm-up (tests/checkpoint/test_inspect.py), which tests here copy."""
    return warmup_run(tmp_path_factory)


def _killed_after_step_0(warm_run: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the two-step warm-up as if killed after checkpoint 0 (step 1's metrics row kept)."""
    run = tmp_path / name
    shutil.copytree(warm_run, run)
    shutil.rmtree(run / "checkpoints" / "1")
    return run


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- --output


@contextlib.contextmanager
def _read_only_dir(tmp_path: Path):
    """A genuinely read-only directory: a read-only tmpfs as root (root ignores mode bits), else mode 0555."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("root without permission to mount a read-only tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("case", ["existing file", "under a file", "read-only directory", "inside read-only",
                                  "not writable (os.access)"])
def test_unusable_output_is_one_line_before_building(tmp_path, monkeypatch, case):
    file = tmp_path / "notes.txt"
    file.write_text("keep me\n")
    with contextlib.ExitStack() as stack:
        if case == "existing file":
            output, needle = file, "is an existing file"
        elif case == "under a file":
            output, needle = file / "run", f"{str(file)!r} is a file"
        elif case in ("read-only directory", "inside read-only"):
            ro = stack.enter_context(_read_only_dir(tmp_path))
            output = ro if case == "read-only directory" else ro / "a" / "run"
            needle = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
        else:  # where no read-only mount is possible: os.access as a non-writable directory answers
            real = os.access
            monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == tmp_path else real(p, mode))
            output, needle = tmp_path / "run", "is not writable (Permission denied)"
        result = runner.invoke(app, ["warmup", "--output", str(output), *OVERRIDES])
        line = _one_error_line(result)
    assert str(output) in line and needle in line, line
    assert "building" not in result.stdout  # refused before the model is built
    assert file.read_text() == "keep me\n" and sorted(p.name for p in tmp_path.iterdir()) in (["notes.txt"],
                                                                                             ["notes.txt", "ro"])


# ----------------------------------------------------------------------------- metrics.jsonl


def test_torn_last_metrics_line_is_dropped_and_the_run_goes_on(warm_run, tmp_path):
    run = _killed_after_step_0(warm_run, tmp_path, "torn")
    metrics = run / run_files.METRICS_FILE
    rows = metrics.read_text().splitlines()
    metrics.write_text(rows[0] + "\n" + rows[1][: len(rows[1]) // 2])  # killed while appending step 1's row
    # readers of a torn run are unaffected (eval-indexer reuses tests/eval/test_eval_cli.py's compiled step)
    for command in (["inspect-ckpt", str(run), "--json"], ["eval-indexer", str(run), "--rows", "1", "--topk", "2,4,8"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
    result = _warmup(run)
    assert result.exit_code == 0, result.output
    assert f"notice: {str(metrics)!r} line 2 is torn" in result.stdout, result.stdout
    assert [r["step"] for r in run_files.read_metrics(run)] == list(STEPS)
    assert all(json.loads(line) for line in metrics.read_text().splitlines())  # the file is whole again


def test_corrupt_metrics_line_is_one_line_and_nothing_changes(warm_run, tmp_path):
    run = _killed_after_step_0(warm_run, tmp_path, "corrupt")
    metrics = run / run_files.METRICS_FILE
    rows = metrics.read_text().splitlines()
    metrics.write_text("{garbage\n" + "\n".join(rows) + "\n")
    before = _snapshot(run)
    line = _one_error_line(_warmup(run))
    assert f"{str(metrics)!r} line 1 is corrupt" in line, line
    assert _snapshot(run) == before


# ----------------------------------------------------------------------------- changed data


def test_resume_on_changed_data_stops_unless_allowed(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}: " + "some words " * 40}) + "\n" for i in range(6)))
    run = tmp_path / "run"
    first = _warmup(run, f"hf_path={docs}")
    assert first.exit_code == 0, first.output
    shutil.rmtree(run / "checkpoints" / "1")  # killed after checkpoint 0
    with open(docs, "a") as f:
        f.write(json.dumps({"text": "an appended document"}) + "\n")
    before = _snapshot(run)
    line = _one_error_line(_warmup(run, f"hf_path={docs}"))
    assert f"the data {str(docs)!r} changed since the checkpoint was saved" in line and "allow_data_change=true" in line
    assert _snapshot(run) == before
    allowed = _warmup(run, f"hf_path={docs}", "allow_data_change=true")
    assert allowed.exit_code == 0, allowed.output
    assert "resuming anyway (allow_data_change=true)" in allowed.stdout
    assert ckpt.finished_steps(run / "checkpoints") == [0, 1]


def test_hub_and_embedded_identities():
    """A hub split is identified by its cache files' names and row count, not the machine's cache dir."""
    import datasets

    from core.data import identity as data_identity
    from core.data import sources as data_sources

    class Split(list):
        def __init__(self, rows, home):
            super().__init__(rows)
            self.cache_files = [{"filename": f"{home}/datasets/org___docs/default/0.0.0/{'ab' * 20}/docs-train.arrow"}]

    here, there = data_identity.dataset_identity(Split("xy", "/a")), data_identity.dataset_identity(Split("xy", "/b/c"))
    assert here == there and data_identity.dataset_identity(Split("xyz", "/a"))["digest"] != here["digest"]
    in_memory = datasets.Dataset.from_dict({"text": ["a", "b"]})
    assert data_identity.dataset_identity(in_memory)["digest"] == in_memory._fingerprint
    texts = data_sources.embedded_documents()
    assert data_identity.texts_identity(texts, "x") == data_identity.texts_identity(list(texts), "x")
    assert data_identity.texts_identity(texts[:-1], "x")["digest"] != data_identity.texts_identity(texts, "x")["digest"]
