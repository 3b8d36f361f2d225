"""Training and evaluation batches: document packing, resumable position, synthetic tokens.

The documents and tokenizers (`dataset_type`, `hf_path`, held-out evaluation documents,
`tokenizer_path`) come from core/data/sources.py.

Packing (DESIGN.md, "Notation"): each document is [BOS] ids [EOS]; its (input, next-token) pairs
stream into rows of `max_target_length`. A document cut by a row end continues in the next row
as a new segment whose positions restart at 0. `segment_ids` count segments from 1 per row (0 is
padding), `positions` restart at 0 per segment, `targets[t]` is always the next token of the same
document, and `loss_mask` is 1 exactly on non-padding tokens. Training rows are never padded (the
stream runs over epochs, reshuffled per epoch); only the last evaluation row can be.

Position: `TrainBatches.state()` is a small JSON-able dict (epoch, document index, token offset,
plus a fingerprint of the data settings and a cheap identity of the contents, core/data/identity.py);
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
                self._doc += 1  # nothing to predict in an empty document
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
                self._doc, self._offset, self._ids = self._doc + 1, 0, None
        return pos > 0


class TrainBatches(_Packer):
    """Endless packed training batches over epochs of shuffled documents; resumable."""

    def __init__(self, cfg, batch_size: int):
        tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.vocab_size)
        super().__init__(tokenizer, batch_size, cfg.max_target_length)
        self.documents = Documents(cfg, "train")
        self.fingerprint = {**data_fingerprint(cfg), "contents": self.documents.identity}
        self._allow_change = cfg.allow_data_change
        self._epoch = 0
        self._texts: Iterator[str] | None = None

    def _next_text(self) -> str | None:
        while True:
            if self._texts is None:
                self._texts = self.documents.epoch(self._epoch, self._doc, shuffle=True)
                self._used_in_epoch = self._doc > 0
            text = next(self._texts, None)
            if text is not None:
                return text
            if not self._used_in_epoch:
                raise DataError(f"the training documents of {self.fingerprint['source']!r} are all empty: "
                                "check hf_text_column and the data files.")
            self._epoch, self._doc, self._texts = self._epoch + 1, 0, None

    def __iter__(self) -> "TrainBatches":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        out = _empty_batch(self.batch_size, self.length)
        for row in range(self.batch_size):
            self._fill(out, row)
        return out

    def state(self) -> dict[str, Any]:
        """Where the next batch starts: JSON-able, for the checkpoint."""
        return {"epoch": self._epoch, "document": self._doc, "offset": self._offset, "data": self.fingerprint}

    def check(self, state: dict[str, Any]) -> list[str]:
        """DataError if `state` was saved for other data (see `_check_fingerprint`); returns notices."""
        return _check_fingerprint(state, self.fingerprint, self._allow_change)

    def restore(self, state: dict[str, Any]) -> list[str]:
        """Continue from `state()`: the following batches equal an uninterrupted run's. Returns `check`'s notices."""
        notices = self.check(state)
        self._epoch, self._doc, self._offset = int(state["epoch"]), int(state["document"]), int(state["offset"])
        self._ids, self._texts = None, None
        return notices


class SyntheticBatches:
    """Uniform random tokens, one document per row; batch n depends only on (seed, n)."""

    def __init__(self, cfg, batch_size: int, split: str = "train"):
        self.batch_size, self.length, self.vocab = batch_size, cfg.max_target_length, cfg.vocab_size
        self.seed = [cfg.data_shuffle_seed, 0 if split == "train" else 1]
        self.fingerprint = {**data_fingerprint(cfg), "contents": data_identity.SYNTHETIC}
        self._allow_change = cfg.allow_data_change
        self._step = 0

    def __iter__(self) -> "SyntheticBatches":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([*self.seed, self._step])
        self._step += 1
        ids = rng.integers(0, self.vocab, (self.batch_size, self.length + 1), dtype=np.int32)
        positions = np.broadcast_to(np.arange(self.length, dtype=np.int32), (self.batch_size, self.length))
        ones = np.ones((self.batch_size, self.length), np.int32)
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


class _EvalPacker(_Packer):
    """One pass over the evaluation documents in stored order."""

    def __init__(self, cfg, batch_size: int):
        super().__init__(load_tokenizer(cfg.tokenizer_path, cfg.vocab_size), batch_size, cfg.max_target_length)
        self._texts = Documents(cfg, "eval").epoch(0, 0, shuffle=False)

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


def data_fingerprint(cfg) -> dict[str, Any]:
    """The data settings a saved position is only meaningful for."""
    keys = ("dataset_type", "hf_path", "hf_name", "hf_data_files", "hf_split", "hf_eval_split",
            "hf_text_column", "hf_streaming", "tokenizer_path", "eval_holdout_fraction", "data_shuffle_seed")
    fp = {k: getattr(cfg, k) for k in keys}
    fp["source"] = cfg.hf_path or ("synthetic" if cfg.dataset_type == "synthetic" else "embedded pydoc topics")
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


def train_batches(cfg, batch_size: int) -> TrainBatches | SyntheticBatches:
    """The training batch stream of `cfg` (global `batch_size` rows of `max_target_length`).

    Returns:
      an iterator of dicts of int32 [batch_size, max_target_length] arrays (`BATCH_KEYS`) with
      `state()` / `restore(state)`.
    """
    if cfg.dataset_type == "synthetic":
        return SyntheticBatches(cfg, batch_size)
    return TrainBatches(cfg, batch_size)


def eval_batches(cfg, batch_size: int, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Held-out batches in a fixed order (same keys as training); the last batch may hold padding.

    Stops when the evaluation documents run out or after `max_batches`. Synthetic data yields
    `max_batches` (default 1) batches from a seed stream disjoint from training's.
    """
    if cfg.dataset_type == "synthetic":
        synthetic = SyntheticBatches(cfg, batch_size, split="eval")
        for _ in range(max_batches or 1):
            yield next(synthetic)
        return
    yield from _EvalPacker(cfg, batch_size).batches(max_batches)
