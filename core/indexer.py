"""The lightning indexer (DESIGN.md, "Lightning indexer"): scores, top-k selection, the module.

Pure, jit-safe functions of arrays and static ints (`indexer_scores`, `select_topk`,
`selection_mask`), then the `Indexer` nnx.Module that owns the indexer's parameters. Scores,
selection and everything downstream are float32 whatever the compute dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from core.compressor import Compressor
from core.layers import dense_init, param
from core.masks import NEG
from core.rope import RopeSpec, apply_rope


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
    """bool [B, T, W]: True at the valid selected blocks.

    A scatter of the top-k indices (distinct per row, so invalid slots never clear a valid one):
    a one-hot formulation would materialise [B, T, k, W], 128 GiB at T = 32K, k = 512.
    """
    b, t, _ = idx_btk.shape
    rows_btw = jnp.zeros((b, t, num_blocks), jnp.bool_)
    return rows_btw.at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], idx_btk].set(valid_btk)


def select_topk_chunked(q_in_bt_, k_bwd, weights_bti, positions_bt, segment_ids_bt, *, ratio: int,
                        k: int, chunk: int, head_chunk: int = 0, q_fn=None):
    """`select_topk(indexer_scores(...), visible, k)` one query chunk at a time.

    Never holds [B, T, W, HI] nor [B, T, W]: each chunk of C queries builds its own visibility
    rows, scores and selection. No gradient flows (the selection is discrete; the indexer loss
    recomputes its own scores), so the inputs are detached and nothing is kept for a backward.

    Args:
      q_in_bt_: the indexer queries q_btid [B, T, HI, DI] of `indexer_scores`, or, with `q_fn`,
        its per-token inputs (e.g. c_q [B, T, R]), so the queries too exist one chunk at a time.
      k_bwd, weights_bti: as in `indexer_scores`.
      positions_bt, segment_ids_bt: int [B, T] (DESIGN.md, "Visibility").
      ratio: tokens per block (4; W = T // ratio complete blocks).
      k: blocks to select (static, clipped to W).
      chunk: query positions per scan step C (static; T need not be a multiple).
      head_chunk: indexer heads per scoring step, as in `indexer_scores`.
      q_fn: (inputs [B, C, ...], positions [B, C]) -> q_bcid [B, C, HI, DI], run per chunk.

    Returns:
      (idx_btk int32 [B, T, min(k, W)], valid_btk bool [B, T, min(k, W)]), equal to `select_topk`
      of the dense scores (ties to the lower index).

    Shapes (per chunk of c queries):
      1. q_bcid = q_fn(q_in[chunk]); visible_bcw from positions / segment ids      [B, c, W]
      2. scores_bcw = indexer_scores(q[chunk], k, w[chunk])     [B, c, W, head_chunk] live
      3. idx_bck, valid_bck = select_topk(scores_bcw, visible_bcw, k)
    """
    from core.masks import visible_rows
    from core.sparse_attention import block_keys, from_chunks, num_chunks, to_chunks

    sg = jax.lax.stop_gradient
    q_in_bt_, k_bwd, weights_bti = sg(q_in_bt_), sg(k_bwd), sg(weights_bti)
    t = positions_bt.shape[1]
    c, n = num_chunks(t, chunk)
    seg_bw, last_bw = block_keys(positions_bt, segment_ids_bt, ratio)

    def body(_, xs):
        q_c, w_c, pos_c, seg_c = xs
        q_c = q_c if q_fn is None else q_fn(q_c, pos_c)
        visible_bcw = visible_rows(pos_c, seg_c, seg_bw, last_bw)
        scores_bcw = indexer_scores(q_c, k_bwd, w_c, visible_bcw, head_chunk=head_chunk)
        return None, select_topk(scores_bcw, visible_bcw, k)

    xs = tuple(to_chunks(x, c, n) for x in (q_in_bt_, weights_bti, positions_bt, segment_ids_bt))
    if n == 1:
        idx, valid = body(None, tuple(x[0] for x in xs))[1]
        idx, valid = idx[None], valid[None]
    else:
        _, (idx, valid) = jax.lax.scan(body, None, xs)
    return (checkpoint_name(from_chunks(idx, t), "topk_idx"),
            checkpoint_name(from_chunks(valid, t), "topk_valid"))


def indexer_queries(c_q_btr, wq_b_rid, positions_bt, *, rope: RopeSpec, dtype):
    """q_btid = RoPE(c_q W_Iq) in `dtype`: [B, T, R] x [R, HI, DI] -> [B, T, HI, DI]."""
    q_btid = jnp.einsum("btr,rid->btid", c_q_btr.astype(dtype), wq_b_rid.astype(dtype))
    return apply_rope(q_btid, positions_bt, rope)


# ----------------------------------------------------------------------------- module

WEIGHTS_INITS = ("fan_in", "zeros")  # Indexer(weights_init=...): how weights_proj starts


class Indexer(nnx.Module):
    """The lightning indexer of one CSA layer (official names, [in, out] layout).

    Parameters: wq_b [q_lora, HI, DI] (indexer queries from the main attention's c_q),
    weights_proj [M, HI] (per-head weights from x), compressor (its own overlapping m = 4
    compressor of width DI). Both inputs pass through `stop_gradient`, so no gradient leaves the
    indexer. The official code also applies a Hadamard rotation and FP4 quantisation to q_I and
    k_I; the rotation is orthogonal on both sides (dot products unchanged) and the quantisation is
    inference-only simulation, so both are omitted.

    weights_init: "fan_in" (the default: weights_proj ~ variance 1/M) or "zeros" (weights_proj = 0:
    every score 0, a uniform student; the first step's gradient reaches weights_proj only, the next
    ones q and k too). Measured on deepseek4-tiny (docs/benchmarks.md, issue 11): a 100-step warm-up
    from a pre-trained model reaches gain@16 0.85 / kl_captured 0.72 from "zeros" against 0.68 /
    0.51 from "fan_in", whose random start is worse than uniform and whose shrinking leaves rows
    with every ReLU off (65% of layer 28's rows).
    """

    def __init__(self, emb: int, q_lora_rank: int, heads: int, head_dim: int, rope: RopeSpec,
                 eps: float, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32,
                 weights_init: str = "fan_in"):
        if weights_init not in WEIGHTS_INITS:
            raise ValueError(f"weights_init={weights_init!r} is unknown: use one of {', '.join(WEIGHTS_INITS)}")
        self.heads, self.head_dim, self.rope, self.dtype = heads, head_dim, rope, dtype
        self.wq_b = param(rngs, dense_init(in_axis=0, out_axis=(1, 2)), (q_lora_rank, heads, head_dim),
                          ("q_lora", "indexer_heads", "kv"), param_dtype)
        # "zeros": every score 0, the student uniform (KL = KL_uniform) instead of a random one worse
        # than uniform; `param` draws its key either way, so every other parameter is unchanged.
        w_init = dense_init() if weights_init == "fan_in" else jax.nn.initializers.zeros
        self.weights_proj = param(rngs, w_init, (emb, heads), ("embed", "indexer_heads"), param_dtype)
        self.compressor = Compressor(emb, head_dim, 4, rope, eps, rngs=rngs,
                                     param_dtype=param_dtype, dtype=dtype)

    def project(self, x_btm, c_q_btr, positions_bt):
        """Detached inputs -> (q_btid, k_bwd, weights_bti float32, scaled by HI^-1/2 DI^-1/2).

        Shapes:
          1. q_btid  = RoPE(c_q W_Iq)          at positions[t]
          2. k_bwd   = compressor(x)           (m = 4, overlapping; RoPE at block starts)
          3. weights = x W_Iw * HI^-1/2 * DI^-1/2
        """
        return (self.queries(c_q_btr, positions_bt), *self.keys_and_weights(x_btm, positions_bt))

    def queries(self, c_q_btr, positions_bt):
        """q_btid = RoPE(stop_gradient(c_q) W_Iq) for any run of positions (a chunk's q_fn)."""
        return self.query_fn()(jax.lax.stop_gradient(c_q_btr), self.wq_b[...], positions_bt)

    def query_fn(self):
        """`indexer_queries` with this indexer's static settings: (c_q, wq_b, positions) -> q."""
        return functools.partial(indexer_queries, rope=self.rope, dtype=self.dtype)

    def keys_and_weights(self, x_btm, positions_bt):
        """(k_bwd, weights_bti float32) of `project` from the detached x."""
        dt = self.dtype
        x_btm = jax.lax.stop_gradient(x_btm).astype(dt)
        k_bwd = self.compressor(x_btm, positions_bt)
        weights_bti = jnp.einsum("btm,mi->bti", x_btm, self.weights_proj[...].astype(dt))
        return k_bwd, weights_bti.astype(jnp.float32) * (self.heads ** -0.5 * self.head_dim ** -0.5)

    @staticmethod
    def score(q_btid, k_bwd, weights_bti, visible_btw, *, head_chunk: int = 0):
        """`indexer_scores` of the projected inputs: float32 [B, T, W], NEG where invisible."""
        return indexer_scores(q_btid, k_bwd, weights_bti, visible_btw, head_chunk=head_chunk)

    def __call__(self, x_btm, c_q_btr, positions_bt, visible_btw, *, head_chunk: int = 0):
        """Scores of every block for every query: float32 [B, T, W]."""
        q_btid, k_bwd, weights_bti = self.project(x_btm, c_q_btr, positions_bt)
        return self.score(q_btid, k_bwd, weights_bti, visible_btw, head_chunk=head_chunk)
