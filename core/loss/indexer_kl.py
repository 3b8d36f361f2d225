"""The CSA indexer KL loss (DESIGN.md, "The indexer loss" and "Memory").

The lightning indexer is distilled from the main attention: per query row, the teacher P is the
L1-normalised sum over heads of each head's attention probability on the allowed compressed
blocks, the student is the log-softmax of the indexer scores over the same blocks, and the loss is
the KL(P || student) averaged over the rows that have anything allowed, times `scale`.

Two entry points, one maths:

- `csa_indexer_loss(index_scores, teacher, allowed, ...)`: the scores [B,T,W] and the teacher's
  inputs (`WholeTeacher`) are given whole.
- `csa_indexer_loss_streamed(index, teacher, packing, ...)` (core/loss/indexer_kl_streamed.py):
  computed from the indexer's and the teacher's inputs, each query block building its own
  queries, visibility, indexer scores, top-k selection, teacher rows and KL, so neither [B,T,W]
  nor [B,H,T,W] is ever materialised; peak memory grows with the chunk sizes, linearly in T.

Both chunk the teacher over head groups (`head_chunk`) and query blocks (`query_chunk`) with
`lax.scan`; every combination equals the direct computation to float32 rounding. The teacher
rows, KL rows and block scans they share live in core/loss/indexer_kl_rows.py.

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

import jax
import jax.numpy as jnp

from core.loss.indexer_kl_rows import (Spec, WholeTeacher, check_teacher, compute_dtype, kl_rows, per_valid_row,
                                       resolve_chunk, scan_blocks, slice_t, teacher_input, teacher_rows)


# ----------------------------------------------------------------------------- given scores


def _scores_pass(spec: Spec, scores, allowed, window, teacher, with_grad: bool):
    """(mean KL over valid rows, its gradient w.r.t. the scores or None), scanning query blocks.

    teacher = (q, kv, raw_kv, sink), the detached teacher inputs (raw_kv, sink None unless joint).
    """
    q, kv, raw_kv, sink = teacher
    b, t, w = scores.shape
    qc = spec.query_chunk

    def block(carry, t0):
        kl, n, grad_btw = carry
        allowed_blk = slice_t(allowed, t0, qc)
        win_blk = None if window is None else slice_t(window, t0, qc)
        psum = teacher_rows(spec, slice_t(q, t0, qc), kv, allowed_blk, raw_kv, win_blk, sink)
        kl_j, n_j, grad_j = kl_rows(slice_t(scores, t0, qc), psum, allowed_blk, with_grad)
        if with_grad:
            grad_btw = jax.lax.dynamic_update_slice_in_dim(grad_btw, grad_j, t0, axis=1)
        return kl + kl_j, n + n_j, grad_btw

    dtype = q.dtype
    init = (jnp.zeros((), dtype), jnp.int32(0), jnp.zeros((b, t, w), dtype) if with_grad else None)
    kl, n, grad_btw = scan_blocks(block, init, t // qc, qc)
    inv = per_valid_row(n, dtype)
    return kl * inv, (None if grad_btw is None else grad_btw * inv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mean_kl(spec, scores, allowed, window, q, kv, raw_kv, sink):
    return _scores_pass(spec, scores, allowed, window, (q, kv, raw_kv, sink), with_grad=False)[0]


def _mean_kl_fwd(spec, scores, allowed, window, q, kv, raw_kv, sink):
    loss, grad_btw = _scores_pass(spec, scores, allowed, window, (q, kv, raw_kv, sink), with_grad=True)
    return loss, (grad_btw.astype(scores.dtype), (q, kv, raw_kv, sink))


def _mean_kl_bwd(spec, res, g):
    grad_btw, teacher_inputs = res
    zeros = jax.tree.map(jnp.zeros_like, teacher_inputs)
    return (g.astype(grad_btw.dtype) * grad_btw, None, None, *zeros)


_mean_kl.defvjp(_mean_kl_fwd, _mean_kl_bwd)


def csa_indexer_loss(index_scores, teacher: WholeTeacher, allowed, *, scale=1.0, head_chunk: int = 0,
                     query_chunk: int = 0):
    """KL(teacher || softmax(index_scores)) over allowed blocks, mean over valid rows, times scale.

    Args:
      index_scores: indexer scores I [B, T, W] (values outside `allowed` are ignored).
      teacher: the main attention's inputs, built whole (detached here): queries [B, T, H, D]
        already scaled by D^-1/2, compressed keys [B, W, D], and for kind "joint" the raw window
        keys [B, T, D] shared by all heads, the per-head sink logits [H] and the bool window mask
        [B, T, T]. kind "compressed": softmax over allowed blocks; "joint": each head's normaliser
        is the log-sum-exp over window keys, allowed blocks and its sink.
      allowed: bool [B, T, W]: visible (dense) or visible & selected (sparse).
      scale: indexer_loss_scaling_factor.
      head_chunk: heads per scan step (0 = all; must divide H).
      query_chunk: query positions per scan step (0 = all; must divide T).

    Returns:
      A float32 scalar (float64 for float64 inputs under jax_enable_x64); gradient only to
      `index_scores` (exactly zero to every teacher input).

    Shapes (per query block of qc rows, per head group of hc heads):
      1. logits_bthw = query . compressed_kv      [B, qc, hc, W]
      2. psum_btw += per-head softmax over allowed blocks, summed over the group's heads
      3. P = psum / (sum_w psum + 1e-8); KL rows vs log_softmax(I) over allowed   [B, qc, W]
      4. loss = scale * sum KL / max(#valid, 1)
    """
    query, compressed_kv = teacher.query_bthd, teacher.compressed_bwd
    raw_kv, window_mask, sink = teacher.raw_bsd, teacher.window_bts, teacher.sink_h
    t = index_scores.shape[1]
    joint = check_teacher(teacher.kind, raw_kv, sink, window_mask is not None, "window_bts")
    spec = Spec(
        head_chunk=resolve_chunk(head_chunk, query.shape[2], "head_chunk", "query heads"),
        query_chunk=resolve_chunk(query_chunk, t, "query_chunk", "query positions"),
        joint=joint,
    )
    if not joint:
        raw_kv, window_mask, sink = None, None, None
    dtype = compute_dtype(index_scores, query, compressed_kv, raw_kv, sink)
    teacher_inputs = [teacher_input(x, dtype) for x in (query, compressed_kv, raw_kv, sink)]
    window_mask = None if window_mask is None else window_mask.astype(bool)
    loss = _mean_kl(spec, index_scores, allowed.astype(bool), window_mask, *teacher_inputs)
    return jnp.asarray(scale, dtype) * loss
