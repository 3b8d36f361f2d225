"""Indexer-quality metrics of one CSA layer against its dense teacher, streamed by query block.

Part of `dsv4 eval-indexer` (the driver, the pooling over batches and the derived ratios
kl_captured and gain@k are in core/eval/evaluate.py), on top of DESIGN.md, "The indexer loss".
Per CSA layer, the *dense teacher* is the loss's "compressed" teacher with every visible block
allowed: P[t, :] = sum_h softmax_w(Q_h[t] . K[w] over visible w), L1-normalised (+1e-8, as in
the loss).

Definitions, per query row (b, t); n_vis = #visible blocks, k_eff = min(k, n_vis):
  valid row          n_vis >= 1 (rows with nothing visible have no teacher and are skipped).
  informative row    n_vis > k. On the other valid rows every k-selection takes all visible
                     blocks, so recall = overlap = 1 trivially; `informative` reports the
                     metrics on the informative rows only, `all` on every valid row.
  kl                 KL(P || softmax(I over visible)), unscaled, exactly the per-row term of the
                     indexer loss (so mean kl over valid rows = dense indexer_loss / scale).
  recall@k           sum of P over the indexer's top-k_eff blocks / sum of P over visible blocks.
  overlap@k          |indexer top-k_eff  ∩  teacher top-k_eff| / k_eff.
  recall_oracle      recall of the teacher's own top-k_eff (the best any k-selection can do).
  recall_recent      recall of the k_eff most recent visible blocks (highest block index; the
                     visible blocks of a row all belong to its document, in position order).
  recall_random      recall of k_eff visible blocks chosen uniformly at random: the top-k of
                     uniform draws seeded per (evaluation row, query position), the same in every
                     layer, so the figure depends neither on the batching nor on the query block.
  kl_uniform         KL(P || uniform over the visible blocks): the KL of a student that knows
                     nothing, on the same row.
Top-k everywhere is `core.ops.topk.select_topk`: ties to the lower block index.

Streaming (DESIGN.md, "Memory"): `layer_sums` runs inside the model's CSA layer (`layer_probe`, the
layer's probe: core.model.attention.IndexerView) on the indexer's and the teacher's inputs per run
of rows, as the layer's loss takes them, and scans
over query blocks of qc rows with the streamed loss's row machinery (core/loss/indexer_kl.py:
`teacher_rows`, `kl_terms`, `scan_blocks`). What lives at once, per block: the teacher's
[B, qc, hc, W] logits of one head group, the indexer's [B, qc, W, HI] logits, and a few
[B, qc, W] rows (scores, P, masks, random draws); per layer only the metric sums leave it. The
dense formulation ([B, T, W] and [B, H, T, W] whole) is the tests' reference
(tests/dense_eval.py).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from core.loss.indexer_kl import EPS, compute_dtype, kl_terms, resolve_chunk, scan_blocks, slice_t, teacher_rows
from core.ops.chunked_attention import block_keys, visible_rows
from core.ops.masked_attention import selection_mask
from core.ops.topk import IndexerInputs, indexer_scores, select_topk

METRICS = ("kl", "recall", "overlap", "recall_oracle", "recall_recent", "recall_random", "kl_uniform")
RATIO = 4  # CSA's compression ratio (DESIGN.md): the blocks the indexer scores


# ----------------------------------------------------------------------------- per block


def random_rows(keys_b, t0, rows: int, num_blocks: int):
    """float32 [B, rows, W] uniform draws: row b, query t0 + i draws from fold_in(keys_b[b], t0 + i)."""
    ts = t0 + jnp.arange(rows)
    draw = lambda key, t: jax.random.uniform(jax.random.fold_in(key, t), (num_blocks,), jnp.float32)  # noqa: E731
    return jax.vmap(lambda key: jax.vmap(lambda t: draw(key, t))(ts))(keys_b)


def _recall(p_btw, idx_btk, valid_btk, safe_mass_bt):
    """sum of P over the valid selected blocks / the row's visible mass, [B, t]."""
    picked_btk = jnp.take_along_axis(p_btw, idx_btk, axis=-1)
    return jnp.sum(jnp.where(valid_btk, picked_btk, 0.0), axis=-1) / safe_mass_bt


def row_metrics(p_btw, scores_btw, visible_btw, random_btw, k: int) -> dict[str, Any]:
    """Per-row selection metrics of one block of rows at one k (module docstring): recall,
    overlap, recall_oracle, recall_recent, recall_random ([B, t], 0 on invalid rows), and the
    bool [B, t] "valid" and "informative".

    Shapes:
      1. four top-k_eff selections idx_btk: indexer, teacher, recency, random
      2. recall_bt  = sum_k P[idx] / sum_w P * visible
      3. overlap_bt = |indexer's blocks & teacher's blocks| / k_eff
    """
    n_vis_bt = jnp.sum(visible_btw, axis=-1)
    valid_bt = n_vis_bt > 0
    mass_bt = jnp.sum(jnp.where(visible_btw, p_btw, 0.0), axis=-1)
    safe_mass_bt = jnp.where(valid_bt, mass_bt, 1.0)
    recency_btw = jnp.broadcast_to(jnp.arange(visible_btw.shape[-1], dtype=jnp.float32), visible_btw.shape)
    picks = {name: select_topk(s, visible_btw, k)
             for name, s in (("recall", scores_btw), ("recall_oracle", p_btw), ("recall_recent", recency_btw),
                             ("recall_random", random_btw))}
    out = {name: jnp.where(valid_bt, _recall(p_btw, *sel, safe_mass_bt), 0.0) for name, sel in picks.items()}
    # the indexer's blocks, looked up at the teacher's
    mask_btw = selection_mask(*picks["recall"], visible_btw.shape[-1])
    idx_t, ok_t = picks["recall_oracle"]
    shared_bt = jnp.sum(jnp.take_along_axis(mask_btw, idx_t, axis=-1) & ok_t, axis=-1)
    k_eff_bt = jnp.minimum(n_vis_bt, k)
    out["overlap"] = jnp.where(valid_bt, shared_bt / jnp.maximum(k_eff_bt, 1), 0.0).astype(p_btw.dtype)
    return {**out, "valid": valid_bt, "informative": n_vis_bt > k}


def block_sums(psum_btw, scores_btw, visible_btw, random_btw, ks: Sequence[int]) -> dict[str, Any]:
    """Metric sums of one block of rows: `layer_sums`' dict (counts and sums over its rows).

    Args:
      psum_btw: sum over heads of the teacher's per-head softmax over visible blocks [B, t, W]
        (`core.loss.indexer_kl.teacher_rows`), not yet L1-normalised.
      scores_btw: indexer scores [B, t, W]; visible_btw: bool [B, t, W].
      random_btw: the random baseline's scores [B, t, W]; ks: static k values.
    """
    dtype = psum_btw.dtype
    p_btw = psum_btw / (jnp.sum(psum_btw, axis=-1, keepdims=True) + EPS)
    # the KL terms of the indexer and of a uniform student, once: a row's KL is the sum of its
    # terms whatever k, so every k's subset of rows only masks them
    terms = [kl_terms(s_btw, psum_btw, visible_btw)[0] for s_btw in (scores_btw, jnp.zeros_like(p_btw))]

    def kls(rows_bt):  # (sum of kl, sum of kl_uniform) over the rows in rows_bt
        return tuple(jnp.sum(jnp.where(rows_bt[..., None], t_btw, 0.0)) for t_btw in terms)

    kl_all, klu_all = (jnp.sum(t_btw) for t_btw in terms)  # rows with nothing visible have no terms
    per_k, counts = {"all": [], "informative": []}, []
    for k in ks:
        r = row_metrics(p_btw, scores_btw, visible_btw, random_btw, k)
        kl_inf, klu_inf = kls(r["informative"])
        for subset, mask, kl, klu in (("all", r["valid"], kl_all, klu_all), ("informative", r["informative"], kl_inf, klu_inf)):
            sums = {m: jnp.sum(jnp.where(mask, r[m], 0.0)).astype(dtype) for m in METRICS if m not in ("kl", "kl_uniform")}
            per_k[subset].append({**sums, "kl": kl, "kl_uniform": klu})
        counts.append(jnp.sum(r["informative"], dtype=jnp.int32))
    stack = lambda entries: {m: jnp.stack([e[m] for e in entries]) for m in METRICS}  # noqa: E731
    return {"valid": jnp.sum(jnp.any(visible_btw, axis=-1), dtype=jnp.int32), "informative": jnp.stack(counts),
            "sums": {subset: stack(entries) for subset, entries in per_k.items()}}


# ----------------------------------------------------------------------------- per layer


def layer_sums(index: IndexerInputs, queries, compressed_bwd, positions, segment_ids, rows: int, *,
               ks: Sequence[int], keys_b, head_chunk: int = 0,
               tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """Row sums of every metric of one CSA layer, for each k in `ks`, one query block at a time.

    Run inside the layer by `layer_probe` with the evaluation's settings (ks, keys_b, head_chunk, tick).

    Args:
      index: the indexer's queries (per run of rows), compressed keys [B, W, DI], weights [B, T, HI].
      queries, compressed_bwd: the teacher, the main attention's queries (`RowQueries`, per run of
        rows) and compressed keys [B, W, D] (the teacher here is always "compressed").
      positions, segment_ids: int [B, T].
      rows: query rows per block (0: all T at once); divides T.
      ks: static k values. keys_b: one PRNG key per batch row (the random baseline's draws).
      head_chunk: heads per step of the teacher's and the indexer's logits (0: all).
      tick: called (from the device, `jax.debug.callback`) once the layer's sums are done.

    Returns:
      {"valid": int32 [], "informative": int32 [K], "sums": {"all" | "informative": {metric:
      float32 [K]}}}: counts of valid and informative rows, each metric summed over them.

    Shapes (per block of qc rows):
      1. visible_btw, indexer scores_btw                        [B, qc, W]
      2. psum_btw = teacher_rows over head groups              [B, qc, hc, W] logits per group
      3. random_btw, then `block_sums`; the sums accumulate over blocks
    """
    t, num_blocks = positions.shape[1], index.keys_bwd.shape[1]
    qc = resolve_chunk(rows, t, "rows", "query positions")
    seg_bw, last_bw = block_keys(positions, segment_ids, RATIO)
    kv_bwd = jax.lax.stop_gradient(compressed_bwd)
    dtype = compute_dtype(kv_bwd)
    kv_bwd = kv_bwd.astype(dtype)
    heads = jax.eval_shape(lambda q, pos: q.rows(0, 1, pos), queries, positions[:, :1]).shape[2]
    teacher_chunk = resolve_chunk(head_chunk, heads, "head_chunk", "query heads")
    heads_i = index.weights_bti.shape[2]
    index_chunk = resolve_chunk(head_chunk, heads_i, "head_chunk", "indexer heads")

    def block(acc, t0):
        pos_bt, seg_bt = slice_t(positions, t0, qc), slice_t(segment_ids, t0, qc)
        visible_btw = visible_rows(pos_bt, seg_bt, seg_bw, last_bw)
        q_btid = index.queries.rows(t0, qc, pos_bt)
        scores_btw = indexer_scores(q_btid, index.keys_bwd, slice_t(index.weights_bti, t0, qc), visible_btw,
                                    head_chunk=index_chunk)
        query_bthd = jax.lax.stop_gradient(queries.rows(t0, qc, pos_bt)).astype(dtype)
        psum_btw = teacher_rows(query_bthd, kv_bwd, visible_btw, head_chunk=teacher_chunk)
        sums = block_sums(psum_btw, scores_btw, visible_btw, random_rows(keys_b, t0, qc, num_blocks), ks)
        return jax.tree.map(jnp.add, acc, sums)

    zeros = jax.eval_shape(lambda: block_sums(jnp.zeros((1, 1, num_blocks), dtype), jnp.zeros((1, 1, num_blocks)),
                                              jnp.zeros((1, 1, num_blocks), bool), jnp.zeros((1, 1, num_blocks)), ks))
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
    sums = scan_blocks(block, init, t // qc, qc)
    if tick is not None:
        jax.debug.callback(lambda _: tick(), sums["valid"])
    return sums


def layer_probe(view, **settings) -> dict[str, Any]:
    """The evaluation's probe of a CSA layer (`Attention.__call__`'s `probe`, bound with `layer_sums`'
    keywords): {"observed": `layer_sums` of the indexer's and the teacher's inputs the layer's view
    gives (core.model.attention.IndexerView), its positions and segment ids and the streamed loss's rows}."""
    index, (queries, keys) = view.inputs()
    return {"observed": layer_sums(index, queries, keys.compressed_bwd, view.positions_bt, view.segment_ids_bt,
                                   view.rows, **settings)}
