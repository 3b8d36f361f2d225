"""Text sources and tokenizers: where training and evaluation documents come from.

Sources (`dataset_type`):
- `hf`: `hf_path` is a hub dataset name (`datasets.load_dataset(hf_path, hf_name, data_files=...)`)
  or a local file, glob or directory of .txt/.text/.json/.jsonl/.parquet files (a .txt file is
  split into documents at blank lines). Empty `hf_path`: the Python standard library's pydoc
  topics (`pydoc_data.topics`, 79 documents of real English) so a fresh machine trains
  offline. Evaluation documents come from `hf_eval_split`, else the last `eval_holdout_fraction`
  of the documents (streaming: every round(1 / fraction)-th document) and never reach training.
- `synthetic`: uniformly random tokens, one document per row (core/data/batches.py, `SyntheticBatches`).

Tokenizer (`tokenizer_path`): `byte` = UTF-8 bytes 0..255 with BOS 256 and EOS 257; otherwise a
tokenizer.json file or hub id through the optional `tokenizers` package.

core/data/batches.py packs these documents into batches.
"""

from __future__ import annotations

import glob as globlib
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from core.data import identity as data_identity
from core.errors import DataError

BYTE_BOS, BYTE_EOS = 256, 257
_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_STREAM_SHUFFLE_BUFFER = 1024  # documents


# ----------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, BOS 256, EOS 257."""

    name = "byte"
    vocab_size = 258
    bos_id, eos_id = BYTE_BOS, BYTE_EOS

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


class HFTokenizer:
    """A `tokenizers.Tokenizer`; BOS/EOS are its first known begin/end special tokens, if any."""

    _BOS = ("<｜begin▁of▁sentence｜>", "<|begin_of_text|>", "<s>", "<bos>", "[CLS]")
    _EOS = ("<｜end▁of▁sentence｜>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]")

    def __init__(self, tokenizer: Any, name: str):
        self._tok = tokenizer
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = next((i for t in self._BOS if (i := tokenizer.token_to_id(t)) is not None), None)
        self.eos_id = next((i for t in self._EOS if (i := tokenizer.token_to_id(t)) is not None), None)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)


def load_tokenizer(path: str, vocab_size: int) -> ByteTokenizer | HFTokenizer:
    """`byte`, a tokenizer.json path or a hub id; raises DataError if it does not fit `vocab_size`."""
    if path == "byte":
        tok: ByteTokenizer | HFTokenizer = ByteTokenizer()
    else:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"tokenizer_path={path!r} needs the `tokenizers` package: "
                            "pip install 'dsv4[tokenizers]', or use tokenizer_path=byte.") from None
        local = Path(path).expanduser()
        try:
            raw = Tokenizer.from_file(str(local)) if local.exists() else Tokenizer.from_pretrained(path)
        except Exception as e:  # tokenizers raises plain Exception for both files and the hub
            raise DataError(f"tokenizer_path={path!r} cannot be loaded ({str(e).splitlines()[0]}): "
                            "give a tokenizer.json file, a reachable hub id, or byte.") from None
        tok = HFTokenizer(raw, path)
    if tok.vocab_size > vocab_size:
        raise DataError(f"tokenizer {path!r} produces token ids up to {tok.vocab_size - 1} but "
                        f"vocab_size={vocab_size}: set vocab_size={tok.vocab_size} or more.")
    return tok


def document_ids(tokenizer, text: str) -> np.ndarray:
    """[BOS] ids [EOS] (each marker only if the tokenizer has one), int32."""
    parts = [tokenizer.encode(text)]
    if tokenizer.bos_id is not None:
        parts.insert(0, np.array([tokenizer.bos_id], np.int32))
    if tokenizer.eos_id is not None:
        parts.append(np.array([tokenizer.eos_id], np.int32))
    return np.concatenate(parts)


# ----------------------------------------------------------------------------- sources


def embedded_documents() -> list[str]:
    """The pydoc topics of the standard library, one document per topic, in sorted order."""
    from pydoc_data.topics import topics

    return [topics[k].strip() for k in sorted(topics) if topics[k].strip()]


def _local_files(hf_path: str) -> list[str] | None:
    """Files for a local hf_path, None if it names a hub dataset; DataError if it matches none."""
    path = Path(hf_path).expanduser()
    # Hub ids are "name" or "org/name"; anything else path-like is a local path.
    looks_local = (path.exists() or any(c in hf_path for c in "*?[") or hf_path.startswith((".", "/", "~"))
                   or path.suffix in _BUILDERS or hf_path.count("/") >= 2)
    if not looks_local:
        return None
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and p.suffix in _BUILDERS)
    else:
        files = sorted(globlib.glob(str(path), recursive=True))
    if not files:
        raise DataError(f"hf_path={hf_path!r} matches no file: give an existing .txt/.json/.jsonl/.parquet "
                        "file, glob or directory, or a hub dataset name.")
    kinds = {_BUILDERS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) > 1:
        raise DataError(f"hf_path={hf_path!r} matches {len(files)} files of types "
                        f"{sorted({Path(f).suffix for f in files})}: use one of .txt, .json/.jsonl or .parquet.")
    return files


def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    return datasets


def _load_split(spec, split: str, files: list[str] | None):
    """A datasets.Dataset / IterableDataset of `split` (or of local `files`), text column only."""
    datasets = _quiet_datasets()
    try:
        if files is not None:
            builder = _BUILDERS[Path(files[0]).suffix]
            extra = {"sample_by": "paragraph"} if builder == "text" else {}
            ds = datasets.load_dataset(builder, data_files={"train": files}, split="train",
                                       streaming=spec.hf_streaming, **extra)
        else:
            ds = datasets.load_dataset(spec.hf_path, spec.hf_name or None, data_files=spec.hf_data_files or None,
                                       split=split, streaming=spec.hf_streaming)
    except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError...)
        raise DataError(f"hf_path={spec.hf_path!r} (split {split!r}) cannot be loaded: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}.") from None
    columns = ds.column_names or []
    if spec.hf_text_column not in columns:
        raise DataError(f"hf_text_column={spec.hf_text_column!r} is not a column of {spec.hf_path!r}: "
                        f"choose one of {', '.join(columns) or '(none)'}.")
    return ds.select_columns([spec.hf_text_column])


class Documents:
    """The train or eval documents of a `DataSpec` (core.spec.resolve), as an epoch-ordered text stream.

    Map-style sources index texts directly; streaming sources are read in order through a
    seeded shuffle buffer, so resuming replays the epoch's stream up to the saved document.
    """

    def __init__(self, spec, split: str):
        self.column = spec.hf_text_column
        self.seed = spec.data_shuffle_seed
        self.split = split
        self.streaming = False
        self._stream = None
        self._every = 0
        self._orders: dict[int, np.ndarray] = {}
        self._texts: Sequence[Any]
        if not spec.hf_path:
            texts = embedded_documents()
            self.identity = data_identity.texts_identity(texts, f"pydoc_data.topics (Python {sys.version.split()[0]})")
            self._texts, self._index = texts, self._holdout(len(texts), spec, split, "the embedded text")
            self.column = None
            return
        use_eval_split = split == "eval" and spec.hf_eval_split
        files = _local_files(spec.hf_path)
        if spec.hf_eval_split and files is not None:
            raise DataError(f"hf_eval_split={spec.hf_eval_split!r} applies to hub datasets; for local files "
                            "leave it empty and set eval_holdout_fraction.")
        ds = _load_split(spec, spec.hf_eval_split if use_eval_split else spec.hf_split, files)
        self.identity = data_identity.files_identity(files) if files is not None else data_identity.dataset_identity(ds)
        if spec.hf_streaming:
            self.streaming, self._stream = True, ds
            if not use_eval_split and not spec.hf_eval_split:
                self._every = max(2, round(1 / spec.eval_holdout_fraction)) if spec.eval_holdout_fraction > 0 else 0
                if split == "eval" and not self._every:
                    raise DataError("no evaluation documents: set hf_eval_split or eval_holdout_fraction > 0.")
            return
        self._texts = ds
        self._index = (np.arange(len(ds)) if use_eval_split or spec.hf_eval_split
                       else self._holdout(len(ds), spec, split, repr(spec.hf_path)))
        if len(self._index) == 0:
            raise DataError(f"hf_path={spec.hf_path!r} has no {split} documents: give a non-empty dataset.")

    @staticmethod
    def _holdout(n: int, spec, split: str, what: str) -> np.ndarray:
        n_eval = min(n - 1, max(1, round(n * spec.eval_holdout_fraction))) if spec.eval_holdout_fraction > 0 else 0
        if split == "eval" and n_eval <= 0:
            raise DataError(f"{what} has {n} document(s): no evaluation documents can be held out; "
                            "set eval_holdout_fraction > 0 or use more documents.")
        return np.arange(n - n_eval, n) if split == "eval" else np.arange(n - n_eval)

    def _text(self, row: Any) -> str:
        text = row if self.column is None else row[self.column]
        return text if isinstance(text, str) else ("" if text is None else str(text))

    def text(self, epoch: int, position: int) -> str | None:
        """Map-style sources: the text at `position` of `epoch`'s shuffled order; None past its end."""
        if position >= len(self._index):
            return None
        order = self._orders.get(epoch)
        if order is None:
            if len(self._orders) > 2:  # a cache: the rows of a process are seldom more than an epoch apart
                self._orders.pop(min(self._orders))
            order = self._orders[epoch] = self._index[np.random.default_rng([self.seed, epoch]).permutation(len(self._index))]
        return self._text(self._texts[int(order[position])])

    def epoch(self, epoch: int, start: int, shuffle: bool) -> Iterator[str]:
        """Texts of `epoch` from document `start` on (shuffled by (seed, epoch) if `shuffle`)."""
        if not self.streaming:
            order = self._index
            if shuffle:
                order = order[np.random.default_rng([self.seed, epoch]).permutation(len(order))]
            for i in order[start:]:
                yield self._text(self._texts[int(i)])
            return
        docs = (self._text(r) for i, r in enumerate(self._stream)
                if not self._every or (i % self._every == self._every - 1) == (self.split == "eval"))
        if shuffle:
            docs = _buffer_shuffle(docs, np.random.default_rng([self.seed, epoch]))
        for i, text in enumerate(docs):
            if i >= start:
                yield text


def _buffer_shuffle(items: Iterator[str], rng: np.random.Generator) -> Iterator[str]:
    buf: list[str] = []
    for item in items:
        buf.append(item)
        if len(buf) == _STREAM_SHUFFLE_BUFFER:
            j = int(rng.integers(len(buf)))
            buf[j], buf[-1] = buf[-1], buf[j]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf
