"""One writer per run directory (DESIGN.md, "Training, checkpoints, runs").

`RunLock` is an exclusive `fcntl.flock` on `<run>/.lock`. The kernel drops it when the process
exits, however it exits (kill -9 included), so a lock is never stale; the file itself stays and
names the holder (pid and command) for the next process's message.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

import jax

from core.errors import CheckpointError

LOCK_FILE = ".lock"


class RunLock:
    """An exclusive OS lock on a run directory, held from `acquire` to `release` (or process exit)."""

    def __init__(self, run_dir: str | Path, command: str):
        self.run_dir, self.command = Path(run_dir), command
        self._file, self._created = None, False

    def acquire(self) -> "RunLock":
        """Create the run directory if needed and lock it.

        Raises:
          CheckpointError: another live process holds the lock (names its pid), or the directory
            cannot be created. Nothing in the directory is changed in either case.
        """
        path = self.run_dir / LOCK_FILE
        self._created = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            f = open(path, "a+")
        except OSError as e:
            raise CheckpointError(f"cannot use {str(self.run_dir)!r} as a run directory ({e.strerror or e}): "
                                  "choose a writable --output.") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise CheckpointError(f"run directory {str(self.run_dir)!r} is in use by process {holder}: wait for it "
                                  "to finish or stop it, or choose another --output.") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()} ({self.command})\n")
        f.flush()
        self._file = f
        return self

    def release(self, *, undo: bool = False) -> None:
        """Drop the lock; `undo` also removes the run directory if `acquire` created it and it holds
        nothing but the lock file (a command that failed before writing anything leaves no trace)."""
        if self._file is None:
            return
        if undo and self._created and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
            (self.run_dir / LOCK_FILE).unlink()
            self.run_dir.rmdir()
        self._file.close()  # closing the descriptor drops the flock
        self._file = None

    @contextlib.contextmanager
    def undone_on_error(self) -> Iterator["RunLock"]:
        """Within: an exception releases the lock with `undo` and propagates (a run that fails while it
        starts leaves no trace)."""
        try:
            yield self
        except BaseException:
            self.release(undo=True)
            raise


def claim(run_dir: str | Path, command: str) -> RunLock:
    """Phase: the run directory's lock, held by process 0 alone (the one writer of the run's plain
    files, core/train/outputs.py); the other processes hold an unacquired lock, whose release does nothing."""
    lock = RunLock(run_dir, command)
    return lock.acquire() if jax.process_index() == 0 else lock
