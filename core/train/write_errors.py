"""Write failures of a run (DESIGN.md, "Training, checkpoints, runs") as one typed error.

`WriteGuard` turns the failures of checkpoint (Orbax, possibly from its background thread),
metrics, config and event writes into one `RunWriteError` (exit 4) after removing the partial
`*.orbax-checkpoint-tmp*` directory. The message names the cause as the OS or the storage gave it:

- an OS error (`write_failure` finds its errno on an OSError or in an Orbax/TensorStore message):
  a full disk ("No space left on device") gets "free N MiB", the others (permission denied,
  read-only file system) "make it writable";
- `RESOURCE_EXHAUSTED` about memory: the device ran out of memory while saving, with the fix;
- any other `RESOURCE_EXHAUSTED`: the storage refused the write (a rate limit or a quota), which
  is not a full disk: wait and rerun, or save less often.

`quiet_write_errors` keeps Orbax's and asyncio's logged tracebacks of that same failure off the
terminal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import jax

from core.errors import DEVICE_MEMORY_FIX, DsvError, RunWriteError, is_device_memory, resource_exhausted

MIB = 2**20
_ERRNO_PATTERNS = (
    (re.compile(r"os_error_code='(\d+)'"), None), (re.compile(r"\[Errno (\d+)\]"), None),
    (re.compile(r"No space left on device"), errno.ENOSPC),
    (re.compile(r"Permission denied|PERMISSION_DENIED"), errno.EACCES),
    (re.compile(r"Read-only file system"), errno.EROFS),
)


@dataclasses.dataclass(frozen=True)
class WriteFailure:
    """Why a write failed: an OS error (`code`, its errno), or `detail`, a RESOURCE_EXHAUSTED line
    that is device memory (`device_memory`) or the storage's refusal (a rate limit or quota)."""

    code: int | None = None
    detail: str = ""
    device_memory: bool = False


def os_error_code(exc: BaseException) -> int | None:
    """The errno behind an OSError or an Orbax/TensorStore error that wraps one (by its message)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        text = str(exc)
        for pattern, code in _ERRNO_PATTERNS:
            m = pattern.search(text)
            if m:
                return code if code is not None else int(m.group(1))
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def write_failure(exc: BaseException) -> WriteFailure | None:
    """Why `exc` (or an exception in its cause chain) failed a write; None when it is no write failure."""
    code = os_error_code(exc)
    if code is not None:
        return WriteFailure(code=code)
    detail = resource_exhausted(exc)
    if detail is None:
        return None
    return WriteFailure(detail=detail, device_memory=is_device_memory(detail))


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


class WriteGuard:
    """Converts a run's write failures into one RunWriteError (exit 4) with the fix.

    Args:
      run_dir, checkpoints_dir: the run's directories.
      checkpoint_bytes: bytes of one checkpoint (model + optimizer arrays), for "free N MiB".
      latest_step: returns the latest complete checkpoint step (None: none yet).
      abandon: stops the checkpointer without raising (called before partial steps are removed).
    """

    def __init__(self, run_dir: Path, checkpoints_dir: Path, checkpoint_bytes: int,
                 latest_step: Callable[[], int | None], abandon: Callable[[], None]):
        self.run_dir, self.checkpoints_dir, self.checkpoint_bytes = run_dir, checkpoints_dir, checkpoint_bytes
        self.latest_step, self.abandon = latest_step, abandon

    def remove_partial_checkpoints(self) -> list[int]:
        """Delete Orbax's unfinished `<step>.orbax-checkpoint-tmp*` directories; returns their steps."""
        steps = []
        for p in sorted(self.checkpoints_dir.glob("*.orbax-checkpoint-tmp*")) if self.checkpoints_dir.is_dir() else []:
            shutil.rmtree(p, ignore_errors=True)
            head = p.name.split(".")[0]
            steps += [int(head)] if head.isdigit() else []
        return steps

    @contextlib.contextmanager
    def writing(self, what: str, path: Path, checkpoint_step: int | None = None) -> Iterator[None]:
        """Run a write; a write failure (`write_failure`) becomes RunWriteError, other errors pass through.

        Args:
          what: "checkpoint", "metrics", "config", "TensorBoard events".
          path: the file or directory written.
          checkpoint_step: the step being saved (what == "checkpoint").
        """
        try:
            yield
        except DsvError:
            raise
        except Exception as e:
            failure = write_failure(e)
            if failure is None:
                raise
            raise self.error(what, path, failure, checkpoint_step) from None

    def error(self, what: str, path: Path, failure: WriteFailure, checkpoint_step: int | None) -> RunWriteError:
        """The one-line error of `failure` writing `what` to `path`, after removing partial checkpoints."""
        with contextlib.suppress(Exception):
            self.abandon()
        partial = self.remove_partial_checkpoints()
        if what == "checkpoint":
            step = partial[0] if partial else checkpoint_step
            what, path = f"checkpoint step {step}", self.checkpoints_dir / str(step)
        latest = self.latest_step()
        resume = (f"rerun the same command to resume from checkpoint step {latest}" if latest is not None
                  else "rerun the same command to start again")
        if failure.device_memory:
            reason, fix = f"out of device memory ({failure.detail})", DEVICE_MEMORY_FIX
        elif failure.code is None:
            reason = f"the storage refused it, a rate limit or quota rather than a full disk ({failure.detail})"
            fix = "wait before rerunning, or save less often (a larger checkpoint_period)"
        elif failure.code == errno.ENOSPC:
            need = (self.checkpoint_bytes if what.startswith("checkpoint") else 0) + MIB
            reason = f"{os.strerror(failure.code)} [errno {failure.code}]"
            fix = f"free {max(math.ceil((need - _free_bytes(path)) / MIB), 1)} MiB or point --output elsewhere"
        else:
            reason = f"{os.strerror(failure.code)} [errno {failure.code}]"
            fix = "make it writable or point --output elsewhere"
        return RunWriteError(f"cannot write {what} to {str(path)!r}: {reason}; {fix}; {resume}.")


class _DropWriteFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        text = record.getMessage() + (logging.Formatter().formatException(record.exc_info) if record.exc_info else "")
        return write_failure(Exception(text)) is None


@contextlib.contextmanager
def quiet_write_errors() -> Iterator[None]:
    """Drop ERROR records about write failures from Orbax (absl) and asyncio while training: the
    same failure reaches the user once, as a RunWriteError."""
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    drop = _DropWriteFailures()
    for lg in loggers:
        lg.addFilter(drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(drop)


def tree_bytes(tree: Any) -> int:
    """Total bytes of the arrays in a pytree."""
    return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))
