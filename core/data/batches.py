"""Training and evaluation batches: document packing, resumable position, synthetic tokens.

The documents and tokenizers (`dataset_type`, `hf_path`, held-out evaluation documents,
`tokenizer_path`) come from core/data/sources.py.

Packing (DESIGN.md, "Notation"): each document is [BOS] ids [EOS]; its (input, next-token) pairs
stream into rows of `max_target_length`. A document cut by a row end continues in the next row
as a new segment whose positions restart at 0. `segment_ids` count segments from 1 per row (0 is
padding), `positions` restart at 0 per segment, `targets[t]` is always the next token of the same
document, and `loss_mask` is 1 exactly on non-padding tokens. Training rows are never padded (the
stream runs over epochs, reshuffled per epoch); only the last evaluation row can be.

Rows (docs/scaling.md#data-per-process): row r of the R-row global training batch is a stream of
its own over positions r, r + R, ... of each epoch's shuffled documents, so each process reads and
tokenises only its rows and the global batches do not depend on the process count.

Position: `TrainBatches.state()` is a small JSON-able dict (per row: epoch, document position, token
offset; plus a fingerprint of the data settings and a cheap identity of the contents,
core/data/identity.py); `merge_positions` joins the processes' rows into the checkpoint's,
`restore(state)` continues exactly where it was, and refuses changed data unless allow_data_change.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from core.data import identity as data_identity
from core.data.sources import Documents, document_ids, load_tokenizer
from core.errors import DataError

BATCH_KEYS = ("tokens", "positions", "segment_ids", "targets", "loss_mask")


# ----------------------------------------------------------------------------- packing


def _empty_batch(batch: int, length: int) -> dict[str, np.ndarray]:
    return {k: np.zeros((batch, length), np.int32) for k in BATCH_KEYS}


class _Packer:
    """Streams documents' (input, next-token) pairs into rows; subclasses supply the documents."""

    _stride = 1  # document positions between one document of the stream and the next

    def __init__(self, tokenizer, batch_size: int, length: int):
        self.tokenizer, self.batch_size, self.length = tokenizer, batch_size, length
        self._doc = 0      # index of the current document in the epoch's order
        self._offset = 0   # pairs of the current document already emitted
        self._ids: np.ndarray | None = None
        self._used_in_epoch = False  # some document of this epoch had a token to predict

    def _next_text(self) -> str | None:
        raise NotImplementedError

    def _current(self) -> np.ndarray | None:
        """The current document's ids (>= 2 of them), or None when the documents are exhausted."""
        while self._ids is None:
            text = self._next_text()
            if text is None:
                return None
            ids = document_ids(self.tokenizer, text)
            if len(ids) >= 2:
                self._ids, self._used_in_epoch = ids, True
            else:
                self._doc += self._stride  # nothing to predict in an empty document
        return self._ids

    def _fill(self, out: dict[str, np.ndarray], row: int) -> bool:
        """Packs one row in place; False if no document was left for it."""
        pos, seg = 0, 0
        while pos < self.length:
            ids = self._current()
            if ids is None:
                break
            o = self._offset
            take = min(len(ids) - 1 - o, self.length - pos)
            sl = slice(pos, pos + take)
            out["tokens"][row, sl] = ids[o:o + take]
            out["targets"][row, sl] = ids[o + 1:o + 1 + take]
            out["positions"][row, sl] = np.arange(take)
            seg += 1
            out["segment_ids"][row, sl] = seg
            out["loss_mask"][row, sl] = 1
            pos += take
            self._offset += take
            if self._offset == len(ids) - 1:
                self._doc, self._offset, self._ids = self._doc + self._stride, 0, None
        return pos > 0


class _RowStream(_Packer):
    """One training row: positions row, row + R, row + 2R, ... of each epoch's shuffled document order
    (R rows in the global batch), packed into rows of its own; its cursor is (epoch, position, offset)."""

    def __init__(self, tokenizer, length: int, texts: "_RowTexts", row: int, source: str):
        super().__init__(tokenizer, 1, length)
        self.row, self._stride, self._texts, self._source = row, texts.stride, texts, source
        self._epoch, self._doc = 0, row

    def _next_text(self) -> str | None:
        while True:
            text = self._texts.text(self._epoch, self._doc)
            if text is not None:
                return text
            if not self._used_in_epoch:
                raise DataError(f"row {self.row} of the {self._stride}-row global batch found no document with text in "
                                f"an epoch of {self._source!r}: each row reads every {self._stride}th training document "
                                "(docs/scaling.md#data-per-process), so give at least as many non-empty documents as "
                                "rows (check hf_text_column and the data files) or lower per_device_batch_size.")
            self._epoch, self._doc, self._used_in_epoch = self._epoch + 1, self.row, False

    def cursor(self) -> list[int]:
        return [self._epoch, self._doc, self._offset]

    def restore(self, cursor) -> None:
        self._epoch, self._doc, self._offset = (int(v) for v in cursor)
        self._ids, self._used_in_epoch = None, self._doc > self.row


class _RowTexts:
    """The training texts of this process's rows, by (epoch, position). A map-style source is read at the
    position; a stream is read once per epoch, in order, and a text is kept for its row (position mod R)
    until that row asks for it."""

    def __init__(self, documents: Documents, stride: int):
        self.documents, self.stride = documents, stride
        self.rows: dict[int, _RowStream] = {}
        self._streams: dict[int, list] = {}  # epoch -> [texts iterator, next position, {position: text}]

    def reset(self) -> None:
        self._streams = {}

    def text(self, epoch: int, position: int) -> str | None:
        if not self.documents.streaming:
            return self.documents.text(epoch, position)
        for e in [e for e in self._streams if all(r._epoch > e for r in self.rows.values())]:
            del self._streams[e]
        stream = self._streams.setdefault(epoch, [self.documents.epoch(epoch, 0, shuffle=True), 0, {}])
        texts, upcoming, kept = stream
        while position not in kept and upcoming <= position:
            text = next(texts, None)
            if text is None:
                break
            owner = self.rows.get(upcoming % self.stride)
            if owner is not None and (owner._epoch, owner._doc) <= (epoch, upcoming):
                kept[upcoming] = text
            upcoming += 1
        stream[1] = upcoming
        return kept.pop(position, None)


class TrainBatches:
    """Endless packed training batches over epochs of shuffled documents, one stream per row; resumable.

    Row r of every global batch (`batch_size` = R rows) packs positions r, r + R, r + 2R, ... of each
    epoch's shuffled document order, so a row depends on nothing but its index: a process reads and
    tokenises only its own `rows`, and any number of processes yields one process's global batches.
    """

    def __init__(self, spec, batch_size: int, rows: range | None = None):
        tokenizer = load_tokenizer(spec.tokenizer_path, spec.vocab_size)
        self.batch_size, self.length = batch_size, spec.max_target_length
        self.rows = range(batch_size) if rows is None else rows
        self.documents = Documents(spec, "train")
        self.fingerprint = {**data_fingerprint(spec), "contents": self.documents.identity}
        self._allow_change = spec.allow_data_change
        self._texts = _RowTexts(self.documents, batch_size)
        self._rows = {r: _RowStream(tokenizer, self.length, self._texts, r, self.fingerprint["source"])
                      for r in self.rows}
        self._texts.rows = self._rows

    def __iter__(self) -> "TrainBatches":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        out = _empty_batch(len(self.rows), self.length)
        for i, stream in enumerate(self._rows.values()):
            stream._fill(out, i)
        return out

    def state(self) -> dict[str, Any]:
        """Where the next batch starts: JSON-able; a row this process does not read is None
        (`merge_positions` joins the processes' positions into the checkpoint's)."""
        return {"rows": [self._rows[r].cursor() if r in self._rows else None for r in range(self.batch_size)],
                "data": self.fingerprint}

    def check(self, state: dict[str, Any]) -> list[str]:
        """DataError if `state` was saved for other data (see `_check_fingerprint`) or another global
        batch; returns notices."""
        notices = _check_fingerprint(state, self.fingerprint, self._allow_change)
        rows = state.get("rows")
        if rows is not None and len(rows) == self.batch_size and all(rows[r] is not None for r in self.rows):
            return notices
        saved = "one stream for all rows (an older dsv4)" if rows is None else f"a global batch of {len(rows)} rows"
        change = f"the checkpoint's data position was saved for {saved}, not {self.batch_size} rows"
        if self._allow_change:
            return [*notices, f"{change}; the data starts from its beginning (allow_data_change=true)."]
        raise DataError(f"{change}: resume with the same per_device_batch_size and device count, or set "
                        "allow_data_change=true to restart the data from its beginning.")

    def restore(self, state: dict[str, Any]) -> list[str]:
        """Continue from `state()`: the following batches equal an uninterrupted run's. Returns `check`'s notices."""
        notices = self.check(state)
        rows = state.get("rows")
        fits = rows is not None and len(rows) == self.batch_size
        for r, stream in self._rows.items():
            stream.restore(rows[r] if fits else [0, r, 0])
        self._texts.reset()
        return notices


class SyntheticBatches:
    """Uniform random tokens, one document per row; row r of batch n depends only on (seed, n, r)."""

    def __init__(self, spec, batch_size: int, split: str = "train", rows: range | None = None):
        self.batch_size, self.length, self.vocab = batch_size, spec.max_target_length, spec.vocab_size
        self.rows = range(batch_size) if rows is None else rows
        self.seed = [spec.data_shuffle_seed, 0 if split == "train" else 1]
        self.fingerprint = {**data_fingerprint(spec), "contents": data_identity.SYNTHETIC}
        self._allow_change = spec.allow_data_change
        self._step = 0

    def __iter__(self) -> "SyntheticBatches":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        ids = np.stack([np.random.default_rng([*self.seed, self._step, r]).integers(0, self.vocab, self.length + 1,
                                                                                   dtype=np.int32) for r in self.rows])
        self._step += 1
        shape = (len(self.rows), self.length)
        positions = np.broadcast_to(np.arange(self.length, dtype=np.int32), shape)
        ones = np.ones(shape, np.int32)
        return {"tokens": ids[:, :-1], "positions": positions.copy(), "segment_ids": ones,
                "targets": ids[:, 1:], "loss_mask": ones.copy()}

    def state(self) -> dict[str, Any]:
        return {"batch": self._step, "data": self.fingerprint}

    def check(self, state: dict[str, Any]) -> list[str]:
        return _check_fingerprint(state, self.fingerprint, self._allow_change)

    def restore(self, state: dict[str, Any]) -> list[str]:
        notices = self.check(state)
        self._step = int(state["batch"])
        return notices


def merge_positions(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One global data position from every process's `state()` (each knows only its own rows)."""
    out = dict(states[0])
    if out.get("rows") is not None:
        out["rows"] = [next((s["rows"][r] for s in states if s["rows"][r] is not None), None)
                       for r in range(len(out["rows"]))]
    return out


class _EvalPacker(_Packer):
    """One pass over the evaluation documents in stored order."""

    def __init__(self, spec, batch_size: int):
        super().__init__(load_tokenizer(spec.tokenizer_path, spec.vocab_size), batch_size, spec.max_target_length)
        self._texts = Documents(spec, "eval").epoch(0, 0, shuffle=False)

    def _next_text(self) -> str | None:
        return next(self._texts, None)

    def batches(self, max_batches: int | None) -> Iterator[dict[str, np.ndarray]]:
        count = 0
        while max_batches is None or count < max_batches:
            out = _empty_batch(self.batch_size, self.length)
            if not [self._fill(out, row) for row in range(self.batch_size)][0]:
                return
            count += 1
            yield out


def data_fingerprint(spec) -> dict[str, Any]:
    """The data settings a saved position is only meaningful for."""
    keys = ("dataset_type", "hf_path", "hf_name", "hf_data_files", "hf_split", "hf_eval_split",
            "hf_text_column", "hf_streaming", "tokenizer_path", "eval_holdout_fraction", "data_shuffle_seed")
    fp = {k: getattr(spec, k) for k in keys}
    fp["source"] = spec.hf_path or ("synthetic" if spec.dataset_type == "synthetic" else "embedded pydoc topics")
    return fp


def _check_fingerprint(state: dict[str, Any], fingerprint: dict[str, Any], allow_change: bool = False) -> list[str]:
    """DataError if the settings differ, or the contents (unless `allow_change`); returns notices."""
    saved = state.get("data", {})
    diff = sorted(k for k in fingerprint if k != "contents" and saved.get(k) != fingerprint[k])
    if diff:
        k = diff[0]
        raise DataError(f"the checkpoint's data position was saved with {k}={saved.get(k)!r}, not {fingerprint[k]!r}: "
                        "resume with the same data settings or start a new run (--output).")
    return data_identity.check_contents(saved.get("contents"), fingerprint["contents"], source=fingerprint["source"],
                                        allow=allow_change)


def train_batches(spec, batch_size: int, rows: range | None = None) -> TrainBatches | SyntheticBatches:
    """The training batch stream of `spec` (global `batch_size` rows of `max_target_length`).

    Args:
      spec: the run's data (core.spec.resolve.DataSpec, `data_spec(cfg)`).
      batch_size: rows of the global batch.
      rows: the rows this process reads (`core.parallel.sharding.local_batch_slice`); default all.
    Returns:
      an iterator of dicts of int32 [len(rows), max_target_length] arrays (`BATCH_KEYS`) with
      `state()` / `restore(state)`.
    """
    if spec.dataset_type == "synthetic":
        return SyntheticBatches(spec, batch_size, rows=rows)
    return TrainBatches(spec, batch_size, rows)


def eval_batches(spec, batch_size: int, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Held-out batches in a fixed order (same keys as training); the last batch may hold padding.

    Stops when the evaluation documents run out or after `max_batches`. Synthetic data yields
    `max_batches` (default 1) batches from a seed stream disjoint from training's.
    """
    if spec.dataset_type == "synthetic":
        synthetic = SyntheticBatches(spec, batch_size, split="eval")
        for _ in range(max_batches or 1):
            yield next(synthetic)
        return
    yield from _EvalPacker(spec, batch_size).batches(max_batches)
