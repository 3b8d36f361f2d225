"""core.train.run_lock: a start that fails inside `undone_on_error` leaves no trace; one that wrote keeps its files."""

from __future__ import annotations

import pytest

from core.train.run_lock import LOCK_FILE, RunLock


def test_a_failed_start_removes_the_directory_it_created_and_releases_the_lock(tmp_path):
    run = tmp_path / "run"
    lock = RunLock(run, "dsv4 warmup").acquire()
    with pytest.raises(RuntimeError, match="preflight"):
        with lock.undone_on_error():
            raise RuntimeError("preflight refused")
    assert not run.exists()
    RunLock(run, "dsv4 warmup").acquire().release()  # free again


def test_a_failed_start_keeps_what_was_written_and_a_clean_one_keeps_the_lock(tmp_path):
    run = tmp_path / "run"
    lock = RunLock(run, "dsv4 warmup").acquire()
    with pytest.raises(KeyboardInterrupt):
        with lock.undone_on_error():
            (run / "config.yml").write_text("steps: 1\n")
            raise KeyboardInterrupt
    assert sorted(p.name for p in run.iterdir()) == sorted(["config.yml", LOCK_FILE])
    lock = RunLock(run, "dsv4 warmup").acquire()
    with lock.undone_on_error():
        pass
    with pytest.raises(Exception, match="in use"):
        RunLock(run, "dsv4 sparse").acquire()
    lock.release()
