"""The evaluation set: which rows `dsv4 eval-indexer` scores, fixed by the evaluation's own keys.

An `EvalSet` is (rows, length, seed) on the run's data source (or the one the overrides name):
the first `rows` held-out rows of `length` tokens, packed as training packs them
(core.data.batches.eval_batches, read one row at a time, so a row never depends on how many
rows a step holds), with synthetic data drawn from `seed`. Nothing of it comes from the run's
training batch, so every stage of a recipe is scored on the same rows. `batch_rows` only says how
many rows one step runs (one per batch shard of the mesh by default); a last, short batch is
filled with padding rows (segment 0: no visible block, no target), which add nothing to any sum.
The random baseline draws per (row, query position) from `row_keys`, so it does not depend on the
batching either.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import numpy as np

from core.data.batches import BATCH_KEYS, eval_batches
from core.spec.resolve import data_spec
from core.errors import ConfigError

EVAL_KEYS = BATCH_KEYS + ("rows",)  # an eval batch: the training batch's arrays and each row's index


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """The evaluation's own keys (module docstring).

    rows: sequences scored (fewer when the held-out documents run out).
    length: tokens per row; None: the run's max_target_length.
    seed: synthetic rows and the random baseline's draws.
    batch_rows: rows per step; None: one per batch shard of the mesh (`core.ops.placement.BATCH_AXES`).
    """

    rows: int = 16
    length: int | None = None
    seed: int = 0
    batch_rows: int | None = None


def eval_config(cfg, eval_set: EvalSet):
    """`cfg` with the evaluation's length and seed; ConfigError for a length the model cannot take.

    The length must fit the model's positions (max_position_embeddings) and every layer's blocks
    (config validation: a multiple of each compress ratio, indexer_topk <= length // 4).
    """
    length = cfg.max_target_length if eval_set.length is None else eval_set.length
    if length < 1:
        raise ConfigError(f"--length {length} must be a positive number of tokens.")
    if length > cfg.max_position_embeddings:
        raise ConfigError(f"--length {length} is longer than the model's max_position_embeddings="
                          f"{cfg.max_position_embeddings}: evaluate at most {cfg.max_position_embeddings} tokens per row.")
    if eval_set.rows < 1:
        raise ConfigError(f"--rows {eval_set.rows} must be at least 1.")
    return cfg.replace(max_target_length=length, data_shuffle_seed=eval_set.seed)


def batch_rows(eval_set: EvalSet, mesh) -> int:
    """Rows per step: `eval_set.batch_rows`, which must split over the mesh's batch shards, or one per shard."""
    from core.ops.placement import BATCH_AXES

    shards = 1 if mesh is None else math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)
    if eval_set.batch_rows is not None and eval_set.batch_rows < 1:
        raise ConfigError(f"--batch-rows {eval_set.batch_rows} must be at least 1 (or left out: one per shard).")
    rows = eval_set.batch_rows or shards
    if rows % shards:
        raise ConfigError(f"--batch-rows {rows} does not split over the mesh's {shards} data/fsdp/expert shards: "
                          f"use a multiple of {shards}.")
    return rows


def row_batches(cfg, rows: int, batch: int) -> Iterator[tuple[dict[str, np.ndarray], int, int]]:
    """(batch of `batch` rows, index of its first row, real rows in it) over the first `rows` eval rows.

    `cfg` is `eval_config`'s. A batch holds int32 arrays EVAL_KEYS: the training batch's [B, T] and
    "rows" [B], each row's index in the evaluation set. The last batch is filled up with padding
    rows (all zeros but their index).
    """
    source = eval_batches(data_spec(cfg), 1, rows)
    first = 0
    while first < rows:
        got = [row for _, row in zip(range(min(batch, rows - first)), source)]
        if not got:
            return
        out = {k: np.zeros((batch, cfg.max_target_length), np.int32) for k in BATCH_KEYS}
        out["rows"] = np.arange(first, first + batch, dtype=np.int32)
        for i, row in enumerate(got):
            for k in BATCH_KEYS:
                out[k][i] = row[k][0]
        yield out, first, len(got)
        first += len(got)
        if len(got) < batch:
            return


def row_keys(seed: int, rows_b):
    """One PRNG key per row: fold_in(key(seed), row index) for the row indices rows_b [B] (jit-safe)."""
    import jax

    return jax.vmap(lambda r: jax.random.fold_in(jax.random.key(seed), r))(rows_b)
