"""A run directory's plain files (DESIGN.md, "Training, checkpoints, runs"): the output-directory
check every writing command runs first, config.yml and metrics.jsonl.

The Orbax steps under checkpoints/ are core/checkpoint/store.py's.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, Mapping

from core.errors import CheckpointError

CONFIG_FILE = "config.yml"
METRICS_FILE = "metrics.jsonl"


def check_output_dir(path: str | Path, option: str = "--output") -> Path:
    """The output directory `path`, expanded, if it is or can be made a writable directory.

    Checks only (nothing is created or touched), so a command can call it before building
    anything: an existing path must be a directory this process may write into; a new one must
    have a writable directory as its nearest existing ancestor.

    Args:
      path: the directory a command will write (a run directory, an export directory).
      option: how the user gave it, for the message.
    Raises:
      CheckpointError: one line naming the path, what is wrong and the fix.
    """
    path = Path(path).expanduser()
    try:
        return _check_output_dir(path, option)
    except OSError as e:  # e.g. an ancestor this user may not even look into
        raise CheckpointError(f"{option} {str(path)!r} cannot be used ({e.strerror}): choose another {option}.") from None


def _check_output_dir(path: Path, option: str) -> Path:
    fix = f"choose another {option}"
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{option} {str(path)!r} is an existing file, not a directory: {fix} "
                              "(a new directory, or a run directory to resume).")
    target = path
    while not target.exists():  # the nearest existing ancestor is where the directory gets created
        if target.is_symlink():
            raise CheckpointError(f"{option} {str(path)!r} cannot be created: {str(target)!r} is a dangling link; {fix}.")
        target = target.parent
    if not target.is_dir():
        raise CheckpointError(f"{option} {str(path)!r} cannot be created: {str(target)!r} is a file, not a directory; {fix}.")
    if not os.access(target, os.W_OK | os.X_OK):
        reason = _unwritable_reason(target)
        what = "is not writable" if target == path else f"cannot be created: {str(target)!r} is not writable"
        raise CheckpointError(f"{option} {str(path)!r} {what} ({reason}): {fix} or fix the permissions.")
    return path


def _unwritable_reason(directory: Path) -> str:
    """The OS's words for why os.access refuses `directory`: read-only file system or permission denied."""
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return os.strerror(errno.EROFS if read_only else errno.EACCES)


def write_config(run_dir: Path, text: str) -> None:
    """config.yml: `text`, the run's resolved config as `core.config.schema.dump` writes it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(text)


def write_metrics(run_dir: Path, rows: list[Mapping[str, Any]]) -> None:
    """Replace metrics.jsonl by `rows` (the format of `append_metrics`)."""
    (run_dir / METRICS_FILE).write_text("".join(json.dumps(dict(r)) + "\n" for r in rows))


def append_metrics(run_dir: Path, row: Mapping[str, Any]) -> None:
    with open(run_dir / METRICS_FILE, "a") as f:
        f.write(json.dumps(dict(row)) + "\n")


def read_metrics(run_dir: Path, notices: list[str] | None = None) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (none if it does not exist).

    A run killed while appending leaves a torn last line: it is dropped, with a one-line notice
    appended to `notices`. Any other line that is not a JSON object is corruption.

    Raises:
      CheckpointError: naming the file and the line number of a corrupt line.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    numbered = [(i, line) for i, line in enumerate(path.read_bytes().decode("utf-8", "replace").splitlines(), 1)
                if line.strip(" \t\r\x00")]
    rows = []
    for n, (lineno, line) in enumerate(numbered, 1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a JSON {type(row).__name__}, not an object")
        except ValueError as e:
            if n == len(numbered):
                if notices is not None:
                    notices.append(f"{str(path)!r} line {lineno} is torn (a run killed while writing it): "
                                   "dropped; the earlier rows are kept.")
                break
            detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
            raise CheckpointError(f"{str(path)!r} line {lineno} is corrupt ({detail[:80]}): "
                                  "delete or repair that line, or train into a new --output.") from None
        rows.append(row)
    return rows

