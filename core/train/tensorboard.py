"""TensorBoard events of a run: every numeric metrics.jsonl scalar under `<run>/tensorboard/`.

Written with tensorboardX (numpy + protobuf, no TensorFlow), tag = the metrics key, step = the
row's step. A resume opens a new event file with `purge_step` = its first step, so TensorBoard
hides the events a crashed or diverged run logged after the checkpoint it resumes from: every
step appears once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping

TENSORBOARD_DIR = "tensorboard"


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a metrics row except the step (booleans such as `compile` excluded)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class EventWriter:
    """Appends metrics rows to `<run_dir>/tensorboard/` as scalar events.

    Args:
      run_dir: the run directory.
      start_step: the first step this process trains; events already there from that step on
        are purged (only when the directory already holds events).
    """

    def __init__(self, run_dir: str | Path, start_step: int):
        self.dir, self.start_step = Path(run_dir) / TENSORBOARD_DIR, start_step
        self._writer = None

    def write(self, row: Mapping[str, Any]) -> None:
        if self._writer is None:  # created on the first row: a run with nothing to do writes no file
            from tensorboardX import SummaryWriter

            purge = self.start_step if self.dir.is_dir() and any(self.dir.iterdir()) else None
            # pid and time in the name: two runs within one second never share a file
            self._writer = SummaryWriter(logdir=str(self.dir), purge_step=purge, flush_secs=30,
                                         filename_suffix=f".{os.getpid()}.{time.time_ns()}")
        for tag, value in scalars(row).items():
            self._writer.add_scalar(tag, value, global_step=int(row["step"]))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
