"""The lightning indexer's maths (DESIGN.md, "Lightning indexer"): scores and top-k selection.

Pure, jit-safe functions of arrays and static ints. Scores, selection and everything downstream
are float32 whatever the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from core.masks import NEG


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


def select_topk(scores_btw, visible_btw, k: int):
    """Top-k visible blocks per query; k_eff = min(k, #visible), ties to the lower index.

    Args:
      scores_btw: float [B, T, W].
      visible_btw: bool [B, T, W].
      k: static number of blocks to select (clipped to W).

    Returns:
      (idx_btk int32 [B, T, min(k, W)], valid_btk bool [B, T, min(k, W)]). Slots beyond the
      visible count are marked invalid; an invisible block is never a valid selection.
    """
    k = min(k, scores_btw.shape[-1])
    ranked_btw = jnp.where(visible_btw, scores_btw.astype(jnp.float32), -jnp.inf)
    _, idx_btk = jax.lax.top_k(ranked_btw, k)  # lax.top_k puts the lower index first on ties
    valid_btk = jnp.take_along_axis(visible_btw, idx_btk, axis=-1)
    return idx_btk.astype(jnp.int32), valid_btk


def selection_mask(idx_btk, valid_btk, num_blocks: int):
    """bool [B, T, W]: True at the valid selected blocks."""
    onehot_btkw = jax.nn.one_hot(idx_btk, num_blocks, dtype=jnp.bool_) & valid_btk[..., None]
    return jnp.any(onehot_btkw, axis=-2)
