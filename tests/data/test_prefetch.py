"""core.data.prefetch: batches read ahead on a thread, each with the position after it; errors reach the consumer."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from core.data import batches as data
from core.data.prefetch import Prefetch
from core.errors import DataError
from tests.conftest import tiny_data


def test_prefetched_batches_and_positions_equal_the_stream_read_in_turn():
    cfg = tiny_data()
    straight = data.train_batches(cfg, 3)
    want = [(next(straight), straight.state()) for _ in range(5)]
    with Prefetch(data.train_batches(cfg, 3), 5, depth=2) as feed:
        got = list(feed)
    assert len(got) == 5
    for (wb, ws), (gb, gs) in zip(want, got):
        assert ws == gs and all(np.array_equal(wb[k], gb[k]) for k in data.BATCH_KEYS)


def test_a_resume_from_a_prefetched_position_continues_the_stream():
    cfg = tiny_data()
    with Prefetch(data.train_batches(cfg, 3), 4) as feed:
        next(feed)
        _, position = next(feed)  # the thread has read further ahead by now; the position is batch 2's
    resumed = data.train_batches(cfg, 3)
    resumed.restore(position)
    straight = data.train_batches(cfg, 3)
    for _ in range(2):
        next(straight)
    a, b = next(resumed), next(straight)
    assert all(np.array_equal(a[k], b[k]) for k in data.BATCH_KEYS)


class _Failing:
    def __init__(self):
        self.n = 0

    def __next__(self):
        self.n += 1
        if self.n == 2:
            raise DataError("the training documents are all empty")
        return {"tokens": np.full((1, 2), self.n)}

    def state(self):
        return {"batch": self.n}


def test_a_stream_error_is_raised_by_the_next_that_would_return_its_batch():
    with Prefetch(_Failing(), 4) as feed:
        assert next(feed)[1] == {"batch": 1}
        with pytest.raises(DataError, match="all empty"):
            next(feed)
        with pytest.raises(StopIteration):
            next(feed)


def test_close_ends_a_thread_blocked_on_a_full_queue():
    class Endless:
        def __next__(self):
            return {}

        def state(self):
            return {}

    feed = Prefetch(Endless(), 1000, depth=1)
    next(feed)
    feed.close()
    assert not any(t.name == "dsv4-prefetch" and t.is_alive() for t in threading.enumerate())
