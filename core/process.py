"""Settings of the Python process a dsv4 command runs in: the CLI and the child processes that the
planner and the benchmark start each call `tune_garbage_collector` first."""

from __future__ import annotations

import gc

# Allocations (minus deallocations) of container objects between two collections of CPython's
# youngest generation; CPython's own default is 700. Tracing and lowering a JAX program allocate
# many short-lived containers, so at the default a young collection runs every few hundred of them
# and sweeps objects that are about to die anyway. What it saves: docs/development.md#tests.
YOUNG_GENERATION_THRESHOLD = 10_000


def tune_garbage_collector() -> None:
    """Collect CPython's youngest generation every YOUNG_GENERATION_THRESHOLD allocations; the older
    generations keep their own thresholds (a collection of each per ten of the one below)."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, middle, old)
