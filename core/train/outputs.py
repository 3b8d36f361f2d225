"""A run's outputs (DESIGN.md, "Training, checkpoints, runs"): its checkpoints, its plain files
(config.yml, metrics.jsonl), TensorBoard events, and the guard that turns a failed write of any of
them into one RunWriteError (core/train/write_errors.py).

Every process writes its own shards of each checkpoint; only process 0 writes the plain files and
the events, so a run directory that every host sees has one writer per file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax

from core.checkpoint import run_files, store
from core.train.tensorboard import EventWriter
from core.train.write_errors import WriteGuard


@dataclasses.dataclass
class Outputs:
    """Where a run writes, and how each write fails."""

    run_dir: Path
    checkpointer: store.RunCheckpointer
    guard: WriteGuard
    events: EventWriter | None  # process 0's TensorBoard events, when enable_tensorboard
    main: bool                  # this process writes the plain files

    def append(self, row: Mapping[str, Any]) -> None:
        """Process 0: `row` appended to metrics.jsonl and the events (RunWriteError when a write fails)."""
        if not self.main:
            return
        with self.guard.writing("metrics", self.run_dir / run_files.METRICS_FILE):
            run_files.append_metrics(self.run_dir, row)
        if self.events is not None:
            with self.guard.writing("TensorBoard events", self.events.dir):
                self.events.write(row)

    def close(self, last_saved: int | None) -> None:
        """Close the events and the checkpointer: a failed background save surfaces here, as one
        RunWriteError naming `last_saved`, the last complete checkpoint."""
        if self.events is not None:
            self.events.close()
        with self.guard.writing("checkpoint", self.checkpointer.dir, last_saved):
            self.checkpointer.close()


def open_outputs(run_dir: Path, *, config_text: str, kept_metrics: Sequence[Mapping[str, Any]], start_step: int,
                 state_bytes: int, max_checkpoints: int, async_save: bool, tensorboard: bool) -> Outputs:
    """Phase: the run's checkpointer and guard; on process 0 config.yml written and metrics.jsonl
    rewritten to `kept_metrics` (the steps logged after the checkpoint a run resumes from are dropped:
    all of them when it starts fresh).

    Args:
      config_text: the resolved config (`core.config.schema.dump`).
      start_step: the first step to train (TensorBoard purges its events from there on).
      state_bytes: the bytes of one checkpoint's state (a full disk's message says how much to free).
    """
    checkpointer = store.RunCheckpointer(run_dir, max_to_keep=max_checkpoints, async_save=async_save)
    guard = WriteGuard(run_dir, checkpointer.dir, state_bytes, checkpointer.latest_step, checkpointer.abandon)
    main = jax.process_index() == 0
    if main:
        with guard.writing("config", run_dir / run_files.CONFIG_FILE):
            run_files.write_config(run_dir, config_text)
        with guard.writing("metrics", run_dir / run_files.METRICS_FILE):
            run_files.write_metrics(run_dir, list(kept_metrics))
    events = EventWriter(run_dir, start_step) if tensorboard and main else None
    return Outputs(run_dir, checkpointer, guard, events, main)
