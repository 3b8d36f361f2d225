"""One stop decision for every process of a run (docs/scaling.md#stopping-and-preemption).

A run stops early for three reasons, recorded locally by `StopRequest`:
- "interrupted": Ctrl-C (SIGINT); a second Ctrl-C raises at once;
- "preempted": SIGTERM (a single process), or JAX's preemption notice in a multi-process run
  (`multihost_utils.reached_preemption_sync_point`: the coordination service turns a SIGTERM on any
  process into the same step on all of them, so that decision needs no agreement of ours);
- "write": a metrics or event write failed on this process (its RunWriteError message).

Processes must stop after the same step, or one of them enters a checkpoint save (whose Orbax barriers
wait for the others) while the others dispatch the next step. `StopRequest.agreed(step)` therefore
asks the coordination service every `STOP_CHECK_EVERY` steps and at the run's last step: each
process publishes its reason under the step's key, all meet at a barrier, and all read the same
set of reasons; the most severe wins (write > preempted > interrupted). In between, a process that
wants to stop keeps training. A single process decides alone, every step (no cost).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

import jax
from jax.experimental import multihost_utils

from core.parallel.mesh import exchange

STOP_CHECK_EVERY = 4          # steps between agreements in a multi-process run
SEVERITY = ("interrupted", "preempted", "write")


class StopRequest:
    """This process's wish to stop (`reason`, `message`) and the agreed decision."""

    def __init__(self, last_step: int):
        self.last_step, self.reason, self.message = last_step, None, ""

    def request(self, reason: str, message: str = "") -> None:
        """Record a reason to stop; a more severe one replaces a milder one."""
        if self.reason is None or SEVERITY.index(reason) > SEVERITY.index(self.reason):
            self.reason, self.message = reason, message

    @contextlib.contextmanager
    def signals(self) -> Iterator["StopRequest"]:
        """Ctrl-C (and SIGTERM in a single process: a multi-process run leaves SIGTERM to JAX's preemption
        notifier) record a request instead of raising; a second Ctrl-C raises at once."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        handled = {signal.SIGINT: "interrupted"}
        if jax.process_count() == 1:
            handled[signal.SIGTERM] = "preempted"
        previous = {s: signal.getsignal(s) for s in handled}

        def handler(signum, frame):
            self.request(handled[signum])
            if signum == signal.SIGINT:
                signal.signal(signal.SIGINT, previous[signal.SIGINT])

        for s in handled:
            signal.signal(s, handler)
        try:
            yield self
        finally:
            for s, old in previous.items():
                if signal.getsignal(s) is handler:
                    signal.signal(s, old)

    def agreed(self, step: int) -> tuple[str, str] | None:
        """(reason, message) when every process stops after `step`, else None. Call it after every
        step on every process (multi-process: it meets the others only on check steps)."""
        if jax.process_count() == 1:
            return (self.reason, self.message) if self.reason else None

        if multihost_utils.reached_preemption_sync_point(step):
            self.request("preempted")  # the same step on every process, by the service's design; the
            return self._exchange(step)  # exchange keeps a write error elsewhere from splitting the stop
        if (step + 1) % STOP_CHECK_EVERY and step != self.last_step:
            return None
        return self._exchange(step)

    def _exchange(self, step: int) -> tuple[str, str] | None:
        wishes = [value.split("\n", 1) for value in exchange("dsv4-stop", f"{self.reason or ''}\n{self.message}")]
        wishes = [(r, m) for r, m in wishes if r]
        if not wishes:
            return None
        reason, message = max(wishes, key=lambda w: SEVERITY.index(w[0]))
        self.request(reason, message)
        return reason, message
