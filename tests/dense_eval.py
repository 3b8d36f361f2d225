"""The dense indexer evaluation: the tests' reference for the streamed one (core/eval/metrics.py).

The formulation `dsv4 eval-indexer` used before it streamed, kept as the reference it must equal to
float32 rounding: every CSA layer's teacher queries, scores and visibility whole ([B, T, H, D],
[B, T, W]), the per-head probabilities [B, H, T, W], and the LM loss from whole [B, T, V] logits.
The definitions are core/eval/metrics.py's; `dense_step` runs the model with the `collect` probe and
returns what `core.eval.evaluate.make_eval_step` does, from the same random draws.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from core.eval.metrics import METRICS, random_rows
from core.eval.rows import row_keys
from core.model.attention import collect
from core.ops.chunked_attention import NEG
from core.ops.masked_attention import selection_mask
from core.ops.topk import select_topk

EPS = 1e-8  # the indexer loss's normaliser / log epsilon (DESIGN.md)


# ----------------------------------------------------------------------------- pure maths


def _upcast(x):
    """float32 for bf16/f32 inputs; float64 stays float64 (the float64 reference tests)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def dense_teacher(q_bthd, kv_bwd, visible_btw):
    """The dense teacher distribution over compressed blocks (DESIGN.md, "The indexer loss").

    Args:
      q_bthd: teacher queries [B, T, H, D], already scaled by D^-1/2.
      kv_bwd: the layer's main compressed keys [B, W, D].
      visible_btw: bool [B, T, W].

    Returns:
      float32 [B, T, W]: sum over heads of per-head softmaxes over visible blocks, divided by
      (its row sum + 1e-8); 0 on invisible blocks and on rows with nothing visible.

    Shapes:
      1. logits_bhtw = q_bthd . kv_bwd, NEG where invisible
      2. probs_bhtw  = softmax over w, zeroed where invisible
      3. p_btw       = sum_h probs_bhtw / (sum_w + 1e-8)
    """
    q_bthd, kv_bwd = _upcast(q_bthd), _upcast(kv_bwd)
    logits_bhtw = jnp.einsum("bthd,bwd->bhtw", q_bthd, kv_bwd)
    vis_b1tw = visible_btw[:, None]
    probs_bhtw = jax.nn.softmax(jnp.where(vis_b1tw, logits_bhtw, NEG), axis=-1)
    p_btw = jnp.einsum("bhtw->btw", jnp.where(vis_b1tw, probs_bhtw, 0.0))
    return p_btw / (jnp.sum(p_btw, axis=-1, keepdims=True) + EPS)


def row_kl(p_btw, scores_btw, visible_btw):
    """KL(P || softmax(I)) per row over visible blocks, as the indexer loss computes it.

    Args:
      p_btw: teacher distribution [B, T, W] (from `dense_teacher`).
      scores_btw: indexer scores [B, T, W] (any value where invisible).
      visible_btw: bool [B, T, W].

    Returns:
      float32 [B, T]: sum over visible w with P > 0 of P (log(P + 1e-8) - log_softmax(I));
      0 on rows with nothing visible.
    """
    p_btw = _upcast(p_btw)
    logq_btw = jax.nn.log_softmax(jnp.where(visible_btw, _upcast(scores_btw), NEG), axis=-1)
    keep_btw = visible_btw & (p_btw > 0)
    terms_btw = jnp.where(keep_btw, p_btw * (jnp.log(p_btw + EPS) - logq_btw), 0.0)
    return jnp.sum(terms_btw, axis=-1)


def topk_blocks(scores_btw, visible_btw, k: int):
    """bool [B, T, W]: the top-k_eff visible blocks of each row by `scores` (ties: lower index)."""
    idx_btk, valid_btk = select_topk(scores_btw, visible_btw, k)
    return selection_mask(idx_btk, valid_btk, scores_btw.shape[-1])


def recency_scores(visible_btw):
    """float32 [B, T, W]: the block index, so a top-k picks the k most recent visible blocks."""
    w = visible_btw.shape[-1]
    return jnp.broadcast_to(jnp.arange(w, dtype=jnp.float32), visible_btw.shape)


def row_metrics(p_btw, scores_btw, visible_btw, random_btw, k: int) -> dict[str, Any]:
    """Per-row metrics of one CSA layer at one k (definitions in the module docstring).

    Args:
      p_btw: dense teacher [B, T, W] (from `dense_teacher`).
      scores_btw: indexer scores [B, T, W].
      visible_btw: bool [B, T, W].
      random_btw: float [B, T, W] random scores whose top-k is the random baseline.
      k: static top-k.

    Returns:
      dict of [B, T] arrays: every name in METRICS (float32), "valid" and "informative" (bool).
      Metric values on invalid rows are 0. kl_uniform is `row_kl` with equal scores.

    Shapes:
      1. four selections sel_btw: indexer, teacher, recency, random (top-k_eff of visible)
      2. recall_bt  = sum_w P * sel / sum_w P * visible
      3. overlap_bt = |sel_index & sel_teacher| / k_eff
    """
    p_btw = _upcast(p_btw)
    n_vis_bt = jnp.sum(visible_btw, axis=-1)
    valid_bt = n_vis_bt > 0
    k_eff_bt = jnp.minimum(n_vis_bt, k)
    mass_bt = jnp.sum(jnp.where(visible_btw, p_btw, 0.0), axis=-1)
    safe_mass_bt = jnp.where(valid_bt, mass_bt, 1.0)

    def recall(sel_btw):
        return jnp.where(valid_bt, jnp.sum(jnp.where(sel_btw, p_btw, 0.0), axis=-1) / safe_mass_bt, 0.0)

    sel_index = topk_blocks(scores_btw, visible_btw, k)
    sel_teacher = topk_blocks(p_btw, visible_btw, k)
    shared_bt = jnp.sum(sel_index & sel_teacher, axis=-1)
    return {
        "kl": row_kl(p_btw, scores_btw, visible_btw),
        "kl_uniform": row_kl(p_btw, jnp.zeros_like(p_btw), visible_btw),
        "recall": recall(sel_index),
        "overlap": jnp.where(valid_bt, shared_bt / jnp.maximum(k_eff_bt, 1), 0.0).astype(p_btw.dtype),
        "recall_oracle": recall(sel_teacher),
        "recall_recent": recall(topk_blocks(recency_scores(visible_btw), visible_btw, k)),
        "recall_random": recall(topk_blocks(random_btw, visible_btw, k)),
        "valid": valid_bt,
        "informative": n_vis_bt > k,
    }


def layer_sums(q_bthd, kv_bwd, scores_btw, visible_btw, random_btw, ks: Sequence[int]) -> dict[str, Any]:
    """Row sums of every metric for one CSA layer, for each k in `ks` (jit-safe, ks static).

    Returns:
      {"valid": int32 [], "informative": int32 [K], "sums": {"all" | "informative": {metric:
      float32 [K]}}}: counts of valid and informative rows, and each metric summed over them.
    """
    p_btw = dense_teacher(q_bthd, kv_bwd, visible_btw)
    per_k = [row_metrics(p_btw, scores_btw, visible_btw, random_btw, k) for k in ks]
    valid_bt = per_k[0]["valid"]

    def sums(mask_key):
        return {m: jnp.stack([jnp.sum(jnp.where(r[mask_key], r[m], 0.0)) for r in per_k]) for m in METRICS}

    return {
        "valid": jnp.sum(valid_bt, dtype=jnp.int32),
        "informative": jnp.stack([jnp.sum(r["informative"], dtype=jnp.int32) for r in per_k]),
        "sums": {"all": sums("valid"), "informative": sums("informative")},
    }


def batch_sums(aux: dict[str, Any], random_lbtw, ks: Sequence[int]) -> dict[str, Any]:
    """`layer_sums` for every CSA layer of a collected aux (leading layer axis L).

    Args:
      aux: the model's collected aux with "teacher_query" [L,B,T,H,D], "compressed_kv" [L,B,W,D],
        "index_scores" [L,B,T,W] and "visible" [L,B,T,W].
      random_lbtw: float [L, B, T, W] random scores for the random baseline.
      ks: static tuple of k values.

    Returns:
      `layer_sums`' dict with a leading L axis on every array.
    """
    fn = lambda q, kv, s, v, r: layer_sums(q, kv, s, v, r, ks)  # noqa: E731
    return jax.vmap(fn)(aux["teacher_query"], aux["compressed_kv"], aux["index_scores"], aux["visible"], random_lbtw)


def token_nll(logits_btv, targets_bt, weights_bt):
    """(sum over weighted tokens of -log softmax(logits)[target], sum of weights), float32.

    Computed as logsumexp - target logit, so no [B, T, V] log-probability array is kept.
    """
    logits_btv = _upcast(logits_btv)
    target_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
    nll_bt = jax.nn.logsumexp(logits_btv, axis=-1) - target_bt
    w_bt = weights_bt.astype(logits_btv.dtype)
    return jnp.sum(nll_bt * w_bt), jnp.sum(w_bt)


def dense_step(model, batch, ks: Sequence[int], seed: int):
    """`make_eval_step`'s outputs the dense way: (sums [L, ...], nll dense, nll top-k, target weight).

    The random baseline draws are `random_rows` of the whole rows, as every streamed block draws them.
    """
    tokens, positions, segment_ids = batch["tokens"], batch["positions"], batch["segment_ids"]
    targets, loss_mask, keys_b = batch["targets"], batch["loss_mask"], row_keys(seed, batch["rows"])
    logits_dense, aux = model(tokens, positions, segment_ids, mode="eval_dense", probe=collect)
    logits_topk, _ = model(tokens, positions, segment_ids, mode="eval")
    layers, _, t, w = aux["visible"].shape
    random_btw = random_rows(keys_b, 0, t, w)
    sums = batch_sums(aux, jnp.broadcast_to(random_btw, (layers,) + random_btw.shape), ks)
    nll_dense, weight = token_nll(logits_dense, targets, loss_mask)
    nll_topk, _ = token_nll(logits_topk, targets, loss_mask)
    return sums, nll_dense, nll_topk, weight
