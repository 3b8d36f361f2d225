"""The CSA indexer KL loss (DESIGN.md, "The indexer loss" and "Memory").

The lightning indexer is distilled from the main attention: per query row, the teacher P is the
L1-normalised sum over heads of each head's attention probability on the allowed compressed
blocks, the student is the log-softmax of the indexer scores over the same blocks, and the loss is
the KL(P || student) averaged over the rows that have anything allowed, times `scale`.

Two entry points, one maths:

- `csa_indexer_loss(index_scores, ...)`: the scores [B,T,W] are given.
- `csa_indexer_loss_streamed(q_idx, k_idx, w_idx, ...)`: each query block computes its own
  visibility, indexer scores, top-k selection, teacher rows and KL, so neither [B,T,W] nor
  [B,H,T,W] is ever materialised; peak memory grows with the chunk sizes, linearly in T.

Both chunk the teacher over head groups (`head_chunk`) and query blocks (`query_chunk`) with
`lax.scan`; every combination equals the direct computation to float32 rounding.

Gradients (custom VJP). The loss is a function of the scores alone (the teacher is detached), and
d loss / d I = scale / #valid * (softmax(I) * sum_w P - P) on allowed entries, 0 elsewhere. The
forward pass of the differentiated call computes this closed form block by block (the streamed
path also pulls it back through the block's indexer scores), so the backward pass is one
multiply and nothing of size T x W x H is ever stored. sum_w P = S / (S + 1e-8) with S the heads'
total block mass, so this is DESIGN.md's `softmax(I) - P` to within 1e-8 / S; we keep the factor
so the gradient is the exact derivative of the value. Exactly zero reaches the teacher inputs
(query, compressed kv, raw kv, sink). Deviations: forward-mode autodiff is not supported.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from core.indexer import indexer_scores, select_topk, selection_mask
from core.masks import NEG, block_last_positions, block_segment_ids, visible_rows, window_rows

TEACHERS = ("compressed", "joint")
EPS = 1e-8  # DESIGN.md's epsilon in the teacher normalisation and in log(P + eps)


class _Spec(NamedTuple):
    """Static (hashable) settings of one loss call."""

    head_chunk: int    # heads per scan step (already resolved: divides H and HI)
    query_chunk: int   # query positions per scan step (already resolved: divides T)
    joint: bool        # joint teacher: softmax normaliser includes window keys and the sink
    topk: int | None = None   # streamed only: sparse selection
    window: int = 0           # streamed only: sliding window S for the joint teacher
    index_chunk: int = 0      # streamed only: indexer heads per scan step (divides HI)
    query_fn: Any = None      # streamed only: builds each block's teacher queries (see below)
    index_query_fn: Any = None  # streamed only: builds each block's indexer queries


def _resolve_chunk(chunk: int, size: int, name: str, what: str) -> int:
    if chunk < 0 or (chunk and size % chunk):
        raise ValueError(f"{name}={chunk} must be 0 (off) or divide the {size} {what}")
    return chunk or size


def _check_teacher(teacher: str, raw_kv, sink, third, third_name: str) -> bool:
    if teacher not in TEACHERS:
        raise ValueError(f"teacher={teacher!r} is unknown: use one of {', '.join(TEACHERS)}")
    joint = teacher == "joint"
    if joint and (raw_kv is None or sink is None or not third):
        raise ValueError(f"teacher='joint' needs raw_kv, sink and {third_name}")
    return joint


def _slice_t(x, t0, size):
    """Rows [t0, t0 + size) of a [B, T, ...] array (t0 may be traced)."""
    return jax.lax.dynamic_slice_in_dim(x, t0, size, axis=1)


def _scan_blocks(block_fn, init, num_blocks: int, block: int):
    """carry = block_fn(carry, t0) for t0 = 0, block, ...; a plain call when there is one block."""
    if num_blocks == 1:
        return block_fn(init, 0)
    carry, _ = jax.lax.scan(lambda c, j: (block_fn(c, j * block), None), init, jnp.arange(num_blocks))
    return carry


# ----------------------------------------------------------------------------- teacher and KL


def _head_group_probs(q_bthd, kv_bwd, allowed_btw, raw_kv_bsd, window_bts, sink_h):
    """sum over this head group of each head's probability on the allowed blocks, [B,T,W].

    Three fusible passes over the logits (max, sum of exp, exp(logit - lse) summed over heads),
    so no [B,T,hc,W] probability tensor is written besides the logits themselves.
    """
    logits_bthw = jnp.einsum("bthd,bwd->bthw", q_bthd, kv_bwd)
    mask_bthw = allowed_btw[:, :, None, :]
    max_bth = jnp.max(jnp.where(mask_bthw, logits_bthw, NEG), axis=-1)
    if window_bts is not None:  # joint: the normaliser also covers the window keys and the sink
        win_bths = jnp.einsum("bthd,bsd->bths", q_bthd, raw_kv_bsd)
        win_mask_bths = window_bts[:, :, None, :]
        max_bth = jnp.maximum(max_bth, jnp.max(jnp.where(win_mask_bths, win_bths, NEG), axis=-1))
        max_bth = jnp.maximum(max_bth, sink_h)
    # The where()s keep masked entries at exactly 0, also in rows where max_bth is NEG.
    denom_bth = jnp.sum(jnp.where(mask_bthw, jnp.exp(logits_bthw - max_bth[..., None]), 0.0), axis=-1)
    if window_bts is not None:
        win_exp_bths = jnp.where(win_mask_bths, jnp.exp(win_bths - max_bth[..., None]), 0.0)
        denom_bth = denom_bth + jnp.sum(win_exp_bths, axis=-1) + jnp.exp(sink_h - max_bth)
    lse_bth = max_bth + jnp.log(jnp.where(denom_bth > 0, denom_bth, 1.0))
    return jnp.sum(jnp.where(mask_bthw, jnp.exp(logits_bthw - lse_bth[..., None]), 0.0), axis=2)


def _teacher_rows(spec: _Spec, q_bthd, kv_bwd, allowed_btw, raw_kv_bsd=None, window_bts=None, sink_h=None):
    """sum_h P_h[t, :] over all heads, scanning over head groups of `spec.head_chunk`.

    Shapes:
      1. per group g: logits_bthw = q[:, :, g] . kv     [B, T, hc, W]  (hc = head_chunk)
      2. masked softmax over allowed w (joint: normaliser over window keys and sink too)
      3. acc_btw += sum over the group's heads
    """
    heads = q_bthd.shape[2]
    hc = spec.head_chunk
    if hc == heads:
        return _head_group_probs(q_bthd, kv_bwd, allowed_btw, raw_kv_bsd, window_bts, sink_h)

    def body(acc_btw, g):
        q_g = jax.lax.dynamic_slice_in_dim(q_bthd, g * hc, hc, axis=2)
        sink_g = None if sink_h is None else jax.lax.dynamic_slice_in_dim(sink_h, g * hc, hc)
        return acc_btw + _head_group_probs(q_g, kv_bwd, allowed_btw, raw_kv_bsd, window_bts, sink_g), None

    b, t, _, _ = q_bthd.shape
    zeros_btw = jnp.zeros((b, t, kv_bwd.shape[1]), q_bthd.dtype)
    acc_btw, _ = jax.lax.scan(body, zeros_btw, jnp.arange(heads // hc))
    return acc_btw


def _kl_rows(scores_btw, psum_btw, allowed_btw, with_grad: bool):
    """Sum of KL over the valid rows, number of valid rows, and d(sum KL)/d scores (or None).

    Rows with nothing allowed are not valid: they add 0 to both sums and get a 0 gradient.
    """
    p_btw = psum_btw / (jnp.sum(psum_btw, axis=-1, keepdims=True) + EPS)
    s_btw = jnp.where(allowed_btw, scores_btw.astype(psum_btw.dtype), NEG)
    max_bt1 = jnp.max(s_btw, axis=-1, keepdims=True)
    exp_btw = jnp.where(allowed_btw, jnp.exp(s_btw - max_bt1), 0.0)
    z_bt1 = jnp.sum(exp_btw, axis=-1, keepdims=True)
    z_bt1 = jnp.where(z_bt1 > 0, z_bt1, 1.0)
    log_q_btw = s_btw - max_bt1 - jnp.log(z_bt1)
    keep_btw = allowed_btw & (p_btw > 0)
    kl_sum = jnp.sum(jnp.where(keep_btw, p_btw * (jnp.log(p_btw + EPS) - log_q_btw), 0.0))
    n_valid = jnp.sum(jnp.any(allowed_btw, axis=-1), dtype=jnp.int32)
    if not with_grad:
        return kl_sum, n_valid, None
    p_mass_bt1 = jnp.sum(p_btw, axis=-1, keepdims=True)
    grad_btw = jnp.where(allowed_btw, exp_btw / z_bt1 * p_mass_bt1 - p_btw, 0.0)
    return kl_sum, n_valid, grad_btw


def _per_valid_row(n_valid, dtype):
    return 1.0 / jnp.maximum(n_valid, 1).astype(dtype)


def _compute_dtype(*arrays):
    """float32 whatever the inputs' dtype; float64 only for float64 inputs (x64 reference tests)."""
    return functools.reduce(jnp.promote_types, [x.dtype for x in arrays if x is not None], jnp.float32)


def _teacher_input(x, dtype):
    return None if x is None else jax.tree.map(lambda a: jax.lax.stop_gradient(jnp.asarray(a, dtype)), x)


# ----------------------------------------------------------------------------- given scores


def _scores_pass(spec: _Spec, scores, allowed, window, q, kv, raw_kv, sink, with_grad: bool):
    """(mean KL over valid rows, its gradient w.r.t. the scores or None), scanning query blocks."""
    b, t, w = scores.shape
    qc = spec.query_chunk

    def block(carry, t0):
        kl, n, grad_btw = carry
        allowed_blk = _slice_t(allowed, t0, qc)
        win_blk = None if window is None else _slice_t(window, t0, qc)
        psum = _teacher_rows(spec, _slice_t(q, t0, qc), kv, allowed_blk, raw_kv, win_blk, sink)
        kl_j, n_j, grad_j = _kl_rows(_slice_t(scores, t0, qc), psum, allowed_blk, with_grad)
        if with_grad:
            grad_btw = jax.lax.dynamic_update_slice_in_dim(grad_btw, grad_j, t0, axis=1)
        return kl + kl_j, n + n_j, grad_btw

    dtype = q.dtype
    init = (jnp.zeros((), dtype), jnp.int32(0), jnp.zeros((b, t, w), dtype) if with_grad else None)
    kl, n, grad_btw = _scan_blocks(block, init, t // qc, qc)
    inv = _per_valid_row(n, dtype)
    return kl * inv, (None if grad_btw is None else grad_btw * inv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mean_kl(spec, scores, allowed, window, q, kv, raw_kv, sink):
    return _scores_pass(spec, scores, allowed, window, q, kv, raw_kv, sink, with_grad=False)[0]


def _mean_kl_fwd(spec, scores, allowed, window, q, kv, raw_kv, sink):
    loss, grad_btw = _scores_pass(spec, scores, allowed, window, q, kv, raw_kv, sink, with_grad=True)
    return loss, (grad_btw.astype(scores.dtype), (q, kv, raw_kv, sink))


def _mean_kl_bwd(spec, res, g):
    grad_btw, teacher_inputs = res
    zeros = jax.tree.map(jnp.zeros_like, teacher_inputs)
    return (g.astype(grad_btw.dtype) * grad_btw, None, None, *zeros)


_mean_kl.defvjp(_mean_kl_fwd, _mean_kl_bwd)


def csa_indexer_loss(index_scores, query, compressed_kv, allowed, *, scale=1.0, head_chunk: int = 0,
                     query_chunk: int = 0, teacher: str = "compressed", raw_kv=None, window_mask=None,
                     sink=None):
    """KL(teacher || softmax(index_scores)) over allowed blocks, mean over valid rows, times scale.

    Args:
      index_scores: indexer scores I [B, T, W] (values outside `allowed` are ignored).
      query: main-attention queries [B, T, H, D], already scaled by D^-1/2 (detached here).
      compressed_kv: main compressed keys [B, W, D] (detached here).
      allowed: bool [B, T, W]: visible (dense) or visible & selected (sparse).
      scale: indexer_loss_scaling_factor.
      head_chunk: heads per scan step (0 = all; must divide H).
      query_chunk: query positions per scan step (0 = all; must divide T).
      teacher: "compressed" (softmax over allowed blocks) or "joint" (each head's normaliser is the
        log-sum-exp over window keys, allowed blocks and its sink).
      raw_kv: joint only: raw window keys [B, T, D], shared by all heads.
      window_mask: joint only: bool [B, T, T], raw key s in query t's window.
      sink: joint only: per-head sink logit [H].

    Returns:
      A float32 scalar (float64 for float64 inputs under jax_enable_x64); gradient only to
      `index_scores` (exactly zero to every teacher input).

    Shapes (per query block of qc rows, per head group of hc heads):
      1. logits_bthw = query . compressed_kv      [B, qc, hc, W]
      2. psum_btw += per-head softmax over allowed blocks, summed over the group's heads
      3. P = psum / (sum_w psum + 1e-8); KL rows vs log_softmax(I) over allowed   [B, qc, W]
      4. loss = scale * sum KL / max(#valid, 1)
    """
    t = index_scores.shape[1]
    joint = _check_teacher(teacher, raw_kv, sink, window_mask is not None, "window_mask")
    spec = _Spec(
        head_chunk=_resolve_chunk(head_chunk, query.shape[2], "head_chunk", "query heads"),
        query_chunk=_resolve_chunk(query_chunk, t, "query_chunk", "query positions"),
        joint=joint,
    )
    if not joint:
        raw_kv, window_mask, sink = None, None, None
    dtype = _compute_dtype(index_scores, query, compressed_kv, raw_kv, sink)
    teacher_inputs = [_teacher_input(x, dtype) for x in (query, compressed_kv, raw_kv, sink)]
    window_mask = None if window_mask is None else window_mask.astype(bool)
    loss = _mean_kl(spec, index_scores, allowed.astype(bool), window_mask, *teacher_inputs)
    return jnp.asarray(scale, dtype) * loss


# ----------------------------------------------------------------------------- streamed


def _indexer_vjp(q_btid, k_bwd, w_bti, visible_btw, grad_btw, head_chunk: int):
    """Pull d/d scores back to (q, k, w) of `indexer_scores`, one head group at a time.

    Each group recomputes its logits [B,t,W,hc], so nothing of size [B,t,W,HI] is kept when
    head_chunk < HI (the single-group case uses the residuals of the forward call instead).
    """
    heads = q_btid.shape[2]

    def group(q_g, w_g):
        _, pull = jax.vjp(lambda q, k, w: indexer_scores(q, k, w, visible_btw), q_g, k_bwd, w_g)
        return pull(grad_btw)

    def body(carry, g):
        dq_btid, dk_bwd, dw_bti = carry
        q_g = jax.lax.dynamic_slice_in_dim(q_btid, g * head_chunk, head_chunk, axis=2)
        w_g = jax.lax.dynamic_slice_in_dim(w_bti, g * head_chunk, head_chunk, axis=2)
        dq_g, dk_g, dw_g = group(q_g, w_g)
        dq_btid = jax.lax.dynamic_update_slice_in_dim(dq_btid, dq_g, g * head_chunk, axis=2)
        dw_bti = jax.lax.dynamic_update_slice_in_dim(dw_bti, dw_g, g * head_chunk, axis=2)
        return (dq_btid, dk_bwd + dk_g, dw_bti), None

    init = (jnp.zeros_like(q_btid), jnp.zeros_like(k_bwd), jnp.zeros_like(w_bti))
    grads, _ = jax.lax.scan(body, init, jnp.arange(heads // head_chunk))
    return grads


def _block_query(spec: _Spec, query, t0, pos_bt):
    """The teacher queries of one block: a slice of `query`, or `spec.query_fn` of its inputs."""
    if spec.query_fn is None:
        return _slice_t(query, t0, spec.query_chunk)
    per_token, params = query
    return spec.query_fn(_slice_t(per_token, t0, spec.query_chunk), params, pos_bt)


def _stream_block(spec: _Spec, t0, inputs, block_masks, with_grad: bool):
    """One query block: visibility, scores, selection, teacher rows, KL (and its pull-back)."""
    q_idx, k_idx, w_idx, query, kv, raw_kv, sink, positions, segment_ids = inputs
    seg_bw, last_bw = block_masks
    qc, num_blocks = spec.query_chunk, k_idx.shape[1]
    pos_bt, seg_bt = _slice_t(positions, t0, qc), _slice_t(segment_ids, t0, qc)
    w_blk, q_pull = _slice_t(w_idx, t0, qc), None
    if spec.index_query_fn is None:
        q_blk = _slice_t(q_idx, t0, qc)
    else:  # the block's indexer queries from their inputs; the pull-back goes to those inputs
        fn = lambda per_token, params: spec.index_query_fn(per_token, params, pos_bt)
        q_args = (_slice_t(q_idx[0], t0, qc), q_idx[1])
        q_blk, q_pull = jax.vjp(fn, *q_args) if with_grad else (fn(*q_args), None)
    heads_i = q_blk.shape[2]
    visible_btw = visible_rows(pos_bt, seg_bt, seg_bw, last_bw)
    pull = None
    if with_grad and spec.index_chunk == heads_i:  # one group: keep its residuals, no recompute
        scores_btw, pull = jax.vjp(lambda q, k, w: indexer_scores(q, k, w, visible_btw), q_blk, k_idx, w_blk)
    else:
        scores_btw = indexer_scores(q_blk, k_idx, w_blk, visible_btw, head_chunk=spec.index_chunk)
    allowed_btw = visible_btw
    if spec.topk is not None:
        idx_btk, valid_btk = select_topk(scores_btw, visible_btw, spec.topk)
        allowed_btw = visible_btw & selection_mask(idx_btk, valid_btk, num_blocks)
    window_bts = None
    if spec.joint:
        window_bts = window_rows(pos_bt, seg_bt, positions, segment_ids, spec.window)
    query_btd = _block_query(spec, query, t0, pos_bt).astype(kv.dtype)
    psum_btw = _teacher_rows(spec, query_btd, kv, allowed_btw, raw_kv, window_bts, sink)
    kl, n, grad_btw = _kl_rows(scores_btw, psum_btw, allowed_btw, with_grad)
    if not with_grad:
        return kl, n, None
    grad_btw = grad_btw.astype(scores_btw.dtype)
    if pull is not None:
        grads = pull(grad_btw)
    else:
        grads = _indexer_vjp(q_blk, k_idx, w_blk, visible_btw, grad_btw, spec.index_chunk)
    if q_pull is not None:
        grads = (q_pull(grads[0]), *grads[1:])
    return kl, n, grads


def _streamed_pass(spec: _Spec, inputs, with_grad: bool):
    """(mean KL over valid rows, its gradients w.r.t. (q_idx, k_idx, w_idx) or None)."""
    q_idx, k_idx, w_idx, _, _, _, _, positions, segment_ids = inputs
    t, ratio = positions.shape[1], positions.shape[1] // k_idx.shape[1]
    block_masks = (block_segment_ids(segment_ids, ratio), block_last_positions(positions, ratio))
    qc = spec.query_chunk

    def block(carry, t0):
        kl, n, grads = carry
        kl_j, n_j, grads_j = _stream_block(spec, t0, inputs, block_masks, with_grad)
        if with_grad:  # accumulate in (at least) float32 whatever the inputs' dtype
            grads_j = jax.tree.map(lambda g, z: g.astype(z.dtype), grads_j, grads)
            dq, dk, dw = grads
            put = lambda acc, g: jax.lax.dynamic_update_slice_in_dim(acc, g, t0, axis=1)
            if spec.index_query_fn is None:
                dq = put(dq, grads_j[0])
            else:  # per-token inputs get their rows, the parameters a sum over blocks
                dq = (put(dq[0], grads_j[0][0]), jax.tree.map(jnp.add, dq[1], grads_j[0][1]))
            dw = put(dw, grads_j[2])
            grads = (dq, dk + grads_j[1], dw)
        return kl + kl_j, n + n_j, grads

    primal = (q_idx, k_idx, w_idx)
    dtype = inputs[4].dtype  # the teacher's compute dtype
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, _compute_dtype(x)), primal) if with_grad else None
    kl, n, grads = _scan_blocks(block, (jnp.zeros((), dtype), jnp.int32(0), zeros), t // qc, qc)
    inv = _per_valid_row(n, dtype)
    if grads is None:
        return kl * inv, None
    return kl * inv, jax.tree.map(lambda g, x: (g * inv).astype(x.dtype), grads, primal)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _streamed_mean_kl(spec, q_idx, k_idx, w_idx, query, kv, raw_kv, sink, positions, segment_ids):
    inputs = (q_idx, k_idx, w_idx, query, kv, raw_kv, sink, positions, segment_ids)
    return _streamed_pass(spec, inputs, with_grad=False)[0]


def _streamed_fwd(spec, *inputs):
    loss, grads = _streamed_pass(spec, inputs, with_grad=True)
    return loss, (grads, inputs[3:7])


def _streamed_bwd(spec, res, g):
    grads, teacher_inputs = res
    zeros = jax.tree.map(jnp.zeros_like, teacher_inputs)
    return (*jax.tree.map(lambda x: (g * x).astype(x.dtype), grads), *zeros, None, None)


_streamed_mean_kl.defvjp(_streamed_fwd, _streamed_bwd)


def csa_indexer_loss_streamed(q_idx, k_idx, w_idx, query, compressed_kv, positions, segment_ids, *,
                              topk: int | None = None, scale=1.0, head_chunk: int = 0,
                              query_chunk: int = 0, teacher: str = "compressed", raw_kv=None,
                              window: int = 0, sink=None, query_fn=None, index_query_fn=None):
    """`csa_indexer_loss` computed from the indexer's inputs, one query block at a time.

    Equals `csa_indexer_loss(indexer_scores(q_idx, k_idx, w_idx, visible), query, compressed_kv,
    allowed)` with visible = csa_visible(positions, segment_ids, T // W) and allowed = visible
    (dense) or visible & top-k selected (sparse), but neither the [B,T,W] scores nor the
    [B,T,H,W] teacher logits ever exist whole.

    Args:
      q_idx: indexer queries [B, T, HI, DI]; k_idx: indexer compressed keys [B, W, DI];
        w_idx: indexer head weights [B, T, HI] (already scaled).
      query, compressed_kv: the teacher, as in `csa_indexer_loss` (detached here).
      positions, segment_ids: int [B, T] (DESIGN.md, "Visibility"); the ratio is T // W.
      topk: None = dense (all visible blocks); k = sparse (the block's own top-k selection).
      scale, teacher, sink: as in `csa_indexer_loss`; raw_kv [B, T, D] and window (the sliding
        window size S, in tokens) feed the joint teacher.
      head_chunk: heads per scan step (0 = all; must divide H and HI). With a head chunk the
        indexer's backward recomputes its logits per head group instead of storing [B,qc,W,HI].
      query_chunk: query positions per scan step (0 = all; must divide T).
      query_fn: None, or a pure function (per_token [B, qc, ...], params, positions [B, qc]) ->
        teacher queries [B, qc, H, D]; `query` is then the pair (per_token [B, T, ...], params)
        (e.g. the main attention's c_q and W_qb), so the [B, T, H, D] queries never exist whole.
      index_query_fn: the same for the indexer queries: `q_idx` is then (per_token, params) and
        index_query_fn(per_token [B, qc, ...], params, positions [B, qc]) -> [B, qc, HI, DI]; the
        gradient reaches per_token and params (params summed over blocks).

    Returns:
      A float32 scalar (as in `csa_indexer_loss`); gradient to q_idx, k_idx, w_idx only (exactly
      zero to the teacher inputs). The scores are float32 (`indexer_scores`) in every case.

    Shapes (per query block of qc rows):
      1. visible_btw, scores_btw = indexer_scores(q_idx[blk], k_idx, w_idx[blk])   [B, qc, W]
      2. allowed_btw = visible (& top-k of the scores)
      3. psum_btw from the teacher's head groups; KL rows and d KL / d scores       [B, qc, W]
      4. d KL / d (q_idx[blk], k_idx, w_idx[blk]) through indexer_scores (differentiated calls)
    """
    t = positions.shape[1]
    heads_i = q_idx.shape[2] if index_query_fn is None else jax.eval_shape(
        index_query_fn, q_idx[0][:, :1], q_idx[1], positions[:, :1]).shape[2]
    num_blocks = k_idx.shape[1]
    if num_blocks == 0 or t % num_blocks:
        raise ValueError(f"T={t} must be a multiple of the W={num_blocks} compressed blocks")
    joint = _check_teacher(teacher, raw_kv, sink, window > 0, "window > 0")
    heads = query.shape[2] if query_fn is None else jax.eval_shape(
        query_fn, query[0][:, :1], query[1], positions[:, :1]).shape[2]
    spec = _Spec(
        head_chunk=_resolve_chunk(head_chunk, heads, "head_chunk", "query heads"),
        query_chunk=_resolve_chunk(query_chunk, t, "query_chunk", "query positions"),
        joint=joint, topk=topk, window=window if joint else 0,
        index_chunk=_resolve_chunk(head_chunk, heads_i, "head_chunk", "indexer heads"),
        query_fn=query_fn, index_query_fn=index_query_fn,
    )
    if not joint:
        raw_kv, sink = None, None
    dtype = _compute_dtype(*jax.tree.leaves(query), compressed_kv, raw_kv, sink)
    teacher_inputs = [_teacher_input(x, dtype) for x in (query, compressed_kv, raw_kv, sink)]
    loss = _streamed_mean_kl(spec, q_idx, k_idx, w_idx, *teacher_inputs, positions, segment_ids)
    return jnp.asarray(scale, loss.dtype) * loss
