"""Which failure reads as which message (core/train/write_errors.py, core/errors.py, dsv4cli/errors.py):
only a full disk reads as one; a storage rate limit or quota, a device out-of-memory and other
OS errors each get their own line. No jax program is compiled here."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from core.errors import DEVICE_MEMORY_FIX, DeviceMemoryError, RunWriteError, device_memory_error
from core.train.write_errors import WriteGuard, quiet_write_errors, write_failure

XLA_OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 25769803776 bytes."
TPU_OOM = "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 16.00G. That was not possible."
RATE_LIMIT = ("RESOURCE_EXHAUSTED: Error writing \"checkpoints/3/model/d/0\" in GCS: HTTP response code: 429 "
              "with body: rateLimitExceeded")


def _guard(tmp_path, latest=1):
    (tmp_path / "checkpoints").mkdir(exist_ok=True)
    return WriteGuard(tmp_path, tmp_path / "checkpoints", 3 * 2**20, lambda: latest, lambda: None)


def _error(tmp_path, exc: BaseException, what: str = "checkpoint") -> str:
    with pytest.raises(RunWriteError) as info:
        with _guard(tmp_path).writing(what, tmp_path / "checkpoints", 3):
            raise exc
    assert "\n" not in str(info.value)
    return str(info.value)


def _chained(outer: str, inner: BaseException) -> Exception:
    try:
        try:
            raise inner
        except BaseException as e:
            raise ValueError(outer) from e
    except ValueError as e:
        return e


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                                 ValueError("tensorstore: OUT_OF_RANGE [source locations] os_error_code='28'"),
                                 ValueError("Error writing: No space left on device"),
                                 ValueError("RESOURCE_EXHAUSTED: write failed: No space left on device"),
                                 _chained("async save failed", OSError(errno.ENOSPC, "disk full"))],
                         ids=["oserror", "tensorstore-errno", "message", "resource-exhausted-disk", "cause"])
def test_only_a_full_disk_reads_as_one(tmp_path, exc):
    line = _error(tmp_path, exc)
    assert line.startswith(f"cannot write checkpoint step 3 to {str(tmp_path / 'checkpoints' / '3')!r}: "
                           "No space left on device [errno 28]; free "), line
    assert " MiB or point --output elsewhere; rerun the same command to resume from checkpoint step 1." in line, line


@pytest.mark.parametrize("text", [XLA_OOM, TPU_OOM])
def test_device_out_of_memory_while_saving_reads_as_such(tmp_path, text):
    line = _error(tmp_path, _chained("save failed", RuntimeError(text)))
    assert f"out of device memory ({text[:160]})" in line and DEVICE_MEMORY_FIX in line, line
    assert "No space" not in line and "free " not in line and "rate limit" not in line, line


def test_storage_rate_limit_reads_as_such(tmp_path):
    line = _error(tmp_path, ValueError(f"save failed\n{RATE_LIMIT}"), what="metrics")
    assert line.startswith(f"cannot write metrics to {str(tmp_path / 'checkpoints')!r}: the storage refused it, "
                           f"a rate limit or quota rather than a full disk ({RATE_LIMIT[:160]}); wait before "
                           "rerunning, or save less often"), line
    assert "No space" not in line and "device memory" not in line, line


def test_other_os_errors_name_themselves(tmp_path):
    line = _error(tmp_path, PermissionError(errno.EACCES, os.strerror(errno.EACCES)), what="config")
    assert ": Permission denied [errno 13]; make it writable or point --output elsewhere; " in line, line
    line = _error(tmp_path, ValueError("Read-only file system"), what="config")
    assert ": Read-only file system [errno 30]; make it writable" in line, line


def test_other_errors_pass_through_and_partial_steps_go(tmp_path):
    guard = _guard(tmp_path, latest=None)
    with pytest.raises(KeyError):
        with guard.writing("checkpoint", tmp_path / "checkpoints", 3):
            raise KeyError("not a write failure")
    assert write_failure(RuntimeError("INTERNAL: something else")) is None
    (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-17").mkdir()
    with pytest.raises(RunWriteError, match="rerun the same command to start again"):
        with guard.writing("checkpoint", tmp_path / "checkpoints", 3):
            raise OSError(errno.ENOSPC, "full")
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_logged_write_failures_are_dropped_others_kept(caplog):
    logger = logging.getLogger("absl")
    with caplog.at_level(logging.ERROR, logger="absl"), quiet_write_errors():
        for text in (RATE_LIMIT, XLA_OOM, "[Errno 28] No space left on device", "an unrelated error"):
            logger.error(text)
    assert [r.getMessage() for r in caplog.records] == ["an unrelated error"]


def test_device_out_of_memory_is_one_line_in_the_cli(capsys):
    """A step's XLA out-of-memory (no DsvError) is one line with the fix and exit 2; anything else
    keeps its traceback."""
    import typer

    from dsv4cli.errors import handle_errors

    def step_oom():
        raise _chained("step failed", RuntimeError(f"{XLA_OOM}\nmore lines of the allocator's report"))

    with pytest.raises(typer.Exit) as info:
        handle_errors(step_oom)()
    err = capsys.readouterr().err
    assert info.value.exit_code == DeviceMemoryError.exit_code == 2
    assert err.strip() == f"error: out of device memory ({XLA_OOM}): {DEVICE_MEMORY_FIX}.", err
    assert device_memory_error(RuntimeError(RATE_LIMIT)) is None

    def other():
        raise RuntimeError("INTERNAL: not memory")

    with pytest.raises(RuntimeError, match="INTERNAL"):
        handle_errors(other)()
