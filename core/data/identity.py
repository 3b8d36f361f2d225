"""A cheap identity of the training documents, so a resume notices changed data (core.data.batches).

A saved data position (epoch, document, offset) only means the same batches if the documents
are the same ones. `core.data.batches.data_fingerprint` covers the settings (hf_path, split, seed, ...);
this covers the contents, without reading them:

- local files: their paths, sizes and modification times (append a document, replace a file,
  add one to the glob or directory: the identity changes; `touch` alone changes it too);
- a hub dataset loaded whole: the names of its Arrow cache files (dataset, configuration and
  revision) and its row count;
- a streamed hub dataset: none (nothing cheap identifies it; the settings still must match);
- the embedded text: a hash of its documents (pydoc_data changes between Python versions);
- synthetic data: its generator, which depends on the settings alone.

An identity is {"digest": short hash or None, "summary": words for the user}. `check_contents`
compares a saved identity with the current one; `allow_data_change` turns a mismatch into a
notice.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

from core.errors import DataError

SYNTHETIC = {"digest": "uniform-random-tokens-v1", "summary": "uniform random tokens (numpy default_rng)"}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def files_identity(files: Sequence[str]) -> dict[str, Any]:
    """Identity of local data files from their paths, sizes and modification times."""
    stats = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError as e:
            raise DataError(f"data file {f!r} cannot be read ({e.strerror}): check hf_path.") from None
        stats.append((os.path.abspath(f), st.st_size, st.st_mtime_ns))
    newest = max((m for _, _, m in stats), default=0)
    when = datetime.datetime.fromtimestamp(newest / 1e9).isoformat(sep=" ", timespec="seconds")
    size = sum(s for _, s, _ in stats)
    return {"digest": _digest(stats),
            "summary": f"{len(stats)} file{'s' * (len(stats) != 1)}, {size:,} bytes, newest modified {when}"}


def dataset_identity(ds: Any) -> dict[str, Any]:
    """Identity of a loaded `datasets` split (digest None when streamed).

    From the split's Arrow cache files, named by `datasets` after the dataset, its configuration
    and revision: their last path components (not the machine's cache directory, and not their
    modification times, which the library's own `_fingerprint` hashes, so a re-download or
    another HF_HOME keeps the identity), plus the row count. An in-memory split: `_fingerprint`.
    """
    files = [f["filename"] for f in (getattr(ds, "cache_files", None) or [])]
    if files:
        names = ["/".join(Path(f).parts[-4:]) for f in files]
        return {"digest": _digest([names, len(ds)]), "summary": f"{len(ds):,} rows, cache {Path(files[0]).parent.name[:16]}"}
    fingerprint = getattr(ds, "_fingerprint", None)
    if fingerprint is None:
        return {"digest": None, "summary": "a streamed hub dataset (contents not fingerprinted)"}
    return {"digest": str(fingerprint), "summary": f"{len(ds):,} rows, datasets fingerprint {fingerprint}"}


def texts_identity(texts: Sequence[str], what: str) -> dict[str, Any]:
    """Identity of an in-memory list of documents (the embedded text)."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8", "replace") + b"\0")
    return {"digest": h.hexdigest()[:16], "summary": f"{len(texts)} documents of {what}"}


def check_contents(saved: dict[str, Any] | None, current: dict[str, Any], *, source: str, allow: bool) -> list[str]:
    """Compare a checkpoint's content identity with the data's now.

    Args:
      saved: the identity stored with the checkpoint's data position (None: written before dsv4
        recorded one, accepted).
      current: the identity of the data as loaded now.
      source: the data source, for the message.
      allow: the config's `allow_data_change`.
    Returns:
      one-line notices (a change accepted under `allow`).
    Raises:
      DataError: the contents changed and `allow` is false.
    """
    if not saved or saved.get("digest") == current.get("digest"):
        return []
    change = f"the data {source!r} changed since the checkpoint was saved ({saved.get('summary')}; now {current.get('summary')})"
    if allow:
        return [f"{change}; resuming anyway (allow_data_change=true): the batches differ from an uninterrupted run's."]
    raise DataError(f"{change}: a resume would see other batches than the uninterrupted run and held-out documents "
                    "could shift into training; restore the data, train into a new --output, or set "
                    "allow_data_change=true to resume anyway.")
