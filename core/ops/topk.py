"""Indexer scoring and top-k block selection: pure, jit-safe maths (DESIGN.md, "Lightning indexer").

`indexer_scores` is I[t,w] = sum_i weights[t,i] * ReLU(q_I[t,i] . k_I[w]) over visible blocks;
`select_topk` keeps the k best visible blocks per row (k_eff = min(k, #visible), ties to the lower
index) as a selection, (indices int32 [B, T, k], validity bool [B, T, k]); `topk_mask` gives the same
blocks as a mask bool [B, T, W], the other form a selection takes (core.ops.masked_attention's
`selected` reads either as a mask, `selection_mask` turns indices into one);
`select_topk_chunked` does scoring and selection per query chunk, so [B, T, W] scores never live
at once. Scores and selection are float32 whatever the compute dtype. The model's `Indexer`, the
losses and the evaluation all call these.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from core.ops.chunked_attention import (NEG, RowQueries, block_keys, from_chunks, num_chunks, to_chunks,
                                        visible_rows)


class IndexerInputs(NamedTuple):
    """What `indexer_scores` needs of one CSA layer: its queries, compressed keys and head weights."""

    queries: RowQueries   # q_I [B, T, HI, DI] (RoPE applied), per run of rows
    keys_bwd: Any         # k_I [B, W, DI]
    weights_bti: Any      # [B, T, HI], already scaled by HI^-1/2 * DI^-1/2


def indexer_scores(q_btid, k_bwd, weights_bti, visible_btw, *, head_chunk: int = 0):
    """I[t, w] = sum_i weights[t, i] * ReLU(q[t, i] . k[w]), masked to visible blocks.

    Args:
      q_btid: indexer queries [B, T, HI, DI] (RoPE applied).
      k_bwd: indexer compressed keys [B, W, DI].
      weights_bti: per-head weights [B, T, HI], already scaled by HI^-1/2 * DI^-1/2.
      visible_btw: bool [B, T, W].
      head_chunk: indexer heads per scan step (0 = all at once; must divide HI). The [B,T,W,HI]
        intermediate then shrinks to [B,T,W,head_chunk]; the result is identical.

    Returns:
      float32 [B, T, W], NEG where not visible.

    Shapes:
      1. logits_btwi = q_btid . k_bwd        (per head chunk)
      2. scores_btw  = sum_i weights_bti * ReLU(logits_btwi)
      3. mask invisible blocks with NEG
    """
    q_btid = q_btid.astype(jnp.float32)
    k_bwd = k_bwd.astype(jnp.float32)
    weights_bti = weights_bti.astype(jnp.float32)
    heads = q_btid.shape[2]
    chunk = head_chunk or heads
    if heads % chunk:
        raise ValueError(f"head_chunk={head_chunk} must divide the {heads} indexer heads")

    def chunk_scores(q_c, w_c):
        logits_btwi = jnp.einsum("btid,bwd->btwi", q_c, k_bwd)
        return jnp.einsum("btwi,bti->btw", jax.nn.relu(logits_btwi), w_c)

    if chunk == heads:
        scores_btw = chunk_scores(q_btid, weights_bti)
    else:
        b, t, _, d = q_btid.shape
        groups = heads // chunk
        q_gbtid = q_btid.reshape(b, t, groups, chunk, d).transpose(2, 0, 1, 3, 4)
        w_gbti = weights_bti.reshape(b, t, groups, chunk).transpose(2, 0, 1, 3)

        def body(acc_btw, xs):
            return acc_btw + chunk_scores(*xs), None

        zeros = jnp.zeros((b, t, k_bwd.shape[1]), jnp.float32)
        scores_btw, _ = jax.lax.scan(body, zeros, (q_gbtid, w_gbti))
    return jnp.where(visible_btw, scores_btw, NEG)


def _ranked(scores_btw, visible_btw):
    """float32 scores, -inf where a block is not visible: what both selections rank."""
    return jnp.where(visible_btw, scores_btw.astype(jnp.float32), -jnp.inf)


def select_topk(scores_btw, visible_btw, k: int):
    """Top-k visible blocks per query; k_eff = min(k, #visible), ties to the lower index.

    Args:
      scores_btw: float [B, T, W].
      visible_btw: bool [B, T, W].
      k: static number of blocks to select (clipped to W).

    Returns:
      (idx_btk int32 [B, T, min(k, W)], valid_btk bool [B, T, min(k, W)]). Slots beyond the visible
      count are marked invalid; an invisible block is never a valid selection.
    """
    k = min(k, scores_btw.shape[-1])
    ranked_btw = _ranked(scores_btw, visible_btw)
    top_btk, idx_btk = jax.lax.top_k(ranked_btw, k)  # lax.top_k puts the lower index first on ties
    # a selected slot is valid iff its block is visible, i.e. ranked above -inf: no gather of the mask
    return idx_btk.astype(jnp.int32), top_btk > -jnp.inf


def topk_mask(scores_btw, visible_btw, k: int):
    """bool [B, T, W]: exactly `selection_mask(*select_topk(scores, visible, k), W)`, without a scatter.

    The k-th largest ranked score is the threshold; every visible block above it is selected, and of
    the blocks equal to it the lowest-indexed ones until k are taken (lax.top_k's ties to the lower
    index). With fewer than k visible blocks the threshold is -inf and every visible block is taken.

    Shapes:
      1. ranked_btw = scores where visible, else -inf;  thr_bt = k-th largest ranked value
      2. above_btw = ranked > thr;  tied_btw = visible & ranked == thr
      3. mask = above | (tied & cumsum_w(tied) <= k - #above)
    """
    k = min(k, scores_btw.shape[-1])
    ranked_btw = _ranked(scores_btw, visible_btw)
    top_btk, _ = jax.lax.top_k(ranked_btw, k)
    thr_bt1 = top_btk[..., k - 1:]
    above_btw = ranked_btw > thr_bt1
    tied_btw = visible_btw & (ranked_btw == thr_bt1)
    need_bt1 = k - jnp.sum(above_btw, axis=-1, keepdims=True, dtype=jnp.int32)
    return above_btw | (tied_btw & (jnp.cumsum(tied_btw, axis=-1, dtype=jnp.int32) <= need_bt1))


def select_topk_chunked(index: IndexerInputs, positions_bt, segment_ids_bt, *, ratio: int, k: int, chunk: int,
                        head_chunk: int = 0, as_mask: bool = False):
    """`select_topk(indexer_scores(...), visible, k)` one query chunk at a time.

    Never holds [B, T, W, HI] nor the [B, T, W] scores: each chunk of C queries builds its own indexer
    queries, visibility rows, scores and selection (only the `as_mask` result is [B, T, W], a
    boolean per block: auto chooses it while W <= 2k, core/spec/platform.py). No gradient flows (the selection is discrete;
    the indexer loss recomputes its own scores), so the inputs are detached and nothing is kept
    for a backward.

    Args:
      index: the indexer's queries (built per chunk), compressed keys and head weights.
      positions_bt, segment_ids_bt: int [B, T] (DESIGN.md, "Visibility").
      ratio: tokens per block (4; W = T // ratio complete blocks).
      k: blocks to select (static, clipped to W).
      chunk: query positions per scan step C (static; T need not be a multiple).
      head_chunk: indexer heads per scoring step, as in `indexer_scores`.
      as_mask: return the selection as a mask bool [B, T, W] (`topk_mask`) instead of indices.

    Returns:
      (idx_btk int32 [B, T, min(k, W)], valid_btk bool [B, T, min(k, W)]), equal to `select_topk` of
      the dense scores (ties to the lower index); with `as_mask` the same blocks as mask_btw bool
      [B, T, W].

    Shapes (per chunk of c queries):
      1. q_bcid = the chunk's indexer queries; visible_bcw from positions / segment ids  [B, c, W]
      2. scores_bcw = indexer_scores(q, k, w[chunk])        [B, c, W, head_chunk] live
      3. idx_bck, valid_bck = select_topk(scores_bcw, visible_bcw, k)
    """
    queries, k_bwd, weights_bti = jax.lax.stop_gradient(index)
    t = positions_bt.shape[1]
    c, n = num_chunks(t, chunk)
    seg_bw, last_bw = block_keys(positions_bt, segment_ids_bt, ratio)

    def body(_, xs):
        q_in, w_c, pos_c, seg_c = xs
        visible_bcw = visible_rows(pos_c, seg_c, seg_bw, last_bw)
        scores_bcw = indexer_scores(queries.of(q_in, pos_c), k_bwd, w_c, visible_bcw, head_chunk=head_chunk)
        if as_mask:
            return None, (topk_mask(scores_bcw, visible_bcw, k),)
        return None, select_topk(scores_bcw, visible_bcw, k)

    xs = tuple(to_chunks(x, c, n) for x in (queries.inputs, weights_bti, positions_bt, segment_ids_bt))
    if n == 1:
        out = tuple(o[None] for o in body(None, tuple(x[0] for x in xs))[1])
    else:
        _, out = jax.lax.scan(body, None, xs)
    if as_mask:
        return checkpoint_name(from_chunks(out[0], t), "topk_mask")
    idx, valid = out
    return checkpoint_name(from_chunks(idx, t), "topk_idx"), checkpoint_name(from_chunks(valid, t), "topk_valid")
