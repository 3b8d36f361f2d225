"""Host batches read ahead on a background thread while the device runs the step (docs/scaling.md#host-work).

`Prefetch(stream, count)` takes over a resumable batch stream (core/data/batches.py: `next`, `state()`)
and yields (batch, position) pairs in the stream's order, where position is `stream.state()` right
after that batch: the position a checkpoint of the step that consumes the batch must hold, so that a
resume continues with the next batch whatever was read ahead. At most `depth` batches wait in the
queue; an error of the stream (a DataError, a failed read) is raised by the `next` that would have
returned its batch. Nothing else may touch the stream while a Prefetch holds it.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

DEPTH = 2  # batches read ahead: one for the step in flight, one ready for the next dispatch


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetch:
    """The next `count` (batch, position) pairs of `stream`, read ahead on one daemon thread."""

    def __init__(self, stream, count: int, depth: int = DEPTH):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._left = count
        self._thread = threading.Thread(target=self._read, args=(stream, count), name="dsv4-prefetch", daemon=True)
        self._thread.start()

    def _read(self, stream, count: int) -> None:
        try:
            for _ in range(count):
                if not self._put((next(stream), stream.state())):
                    return
        except BaseException as e:  # noqa: BLE001  (handed to the consumer, which raises it)
            self._put(_Failure(e))

    def _put(self, item) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Prefetch":
        return self

    def __next__(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if self._left <= 0:
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _Failure):
            self._left = 0
            raise item.error
        self._left -= 1
        return item

    def close(self) -> None:
        """Stop reading ahead and end the thread (batches not yet taken are dropped)."""
        self._closed.set()
        self._thread.join()

    def __enter__(self) -> "Prefetch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
