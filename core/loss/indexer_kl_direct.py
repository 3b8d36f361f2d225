"""The CSA indexer KL loss on given scores: the direct path (DESIGN.md, "The indexer loss").

`csa_indexer_loss(index_scores, teacher, allowed, ...)` takes the indexer scores [B, T, W] and the
teacher's inputs built whole (`WholeTeacher`: the main attention's queries [B, T, H, D], its
compressed keys and, for the joint teacher, its raw keys, sinks and window mask), where the
streamed loss (core/loss/indexer_kl.py `csa_indexer_loss_streamed`) builds each query block's own
from the attention's `RowQueries` and `Keys`; `whole_teacher` builds one from the other. A layer
takes this path where its loss does not stream (T not a multiple of the W blocks, or the masked
mode without csa_query_chunk_size: core/model/attention.py `loss_rows`); the tests hold the
streamed loss against it.

It shares the streamed loss's row machinery (core/loss/indexer_kl.py: `teacher_rows` per head
group, `kl_rows` per query block, `scan_blocks`), so every head and query chunking equals the
direct computation to float32 rounding. What lives at once: the [B, T, W] scores and their
gradient, and per query block of qc rows and head group of hc heads the [B, qc, hc, W] teacher
logits. Gradients (custom VJP): the closed form d loss / d I of core/loss/indexer_kl.py's
docstring, computed in the forward pass block by block; exactly zero reaches the teacher inputs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from core.loss.indexer_kl import (check_teacher, compute_dtype, kl_rows, per_valid_row, resolve_chunk, scan_blocks,
                                  slice_t, teacher_input, teacher_rows)
from core.ops.chunked_attention import Keys, RowQueries
from core.ops.masked_attention import sliding_window_mask


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["query_bthd", "compressed_bwd", "raw_bsd", "sink_h", "window_bts"],
                   meta_fields=["kind"])
@dataclasses.dataclass(frozen=True)
class WholeTeacher:
    """The teacher's inputs built whole, as the direct loss takes them (detached there).

    The direct loss is given arrays, and an arbitrary window mask, where the streamed loss builds
    its queries and window rows per block from the attention's `RowQueries` and `Keys`
    (`whole_teacher` builds one from those). kind "joint" needs raw_bsd, sink_h and window_bts; the
    compressed teacher ignores them.
    """

    query_bthd: Any            # main-attention queries [B, T, H, D], scaled by D^-1/2
    compressed_bwd: Any        # main compressed keys [B, W, D]
    raw_bsd: Any = None        # joint: raw window keys [B, T, D], shared by all heads
    sink_h: Any = None         # joint: per-head sink logit [H]
    kind: str = "compressed"
    window_bts: Any = None     # joint: bool [B, T, S=T], raw key s in query t's window


def whole_teacher(queries: RowQueries, keys: Keys, kind: str, positions_bt, segment_ids_bt) -> WholeTeacher:
    """The streamed loss's teacher (the attention's queries per run of rows, its keys) built whole:
    every row's queries and, for the joint teacher, the window mask of the batch."""
    joint = kind == "joint"
    window_bts = sliding_window_mask(positions_bt, segment_ids_bt, keys.window) if joint else None
    return WholeTeacher(queries.whole(positions_bt).inputs, keys.compressed_bwd, keys.raw_bsd if joint else None,
                        keys.sink_h if joint else None, kind, window_bts)


def _scores_pass(rows: int, head_chunk: int, scores, allowed, window, teacher, with_grad: bool):
    """(mean KL over valid rows, its gradient w.r.t. the scores or None), scanning query blocks.

    teacher = (q, kv, raw_kv, sink), the detached teacher inputs (raw_kv, sink None unless joint).
    """
    q, kv, raw_kv, sink = teacher
    b, t, w = scores.shape
    qc = rows

    def block(carry, t0):
        kl, n, grad_btw = carry
        allowed_blk = slice_t(allowed, t0, qc)
        win_blk = None if window is None else slice_t(window, t0, qc)
        psum = teacher_rows(slice_t(q, t0, qc), kv, allowed_blk, raw_kv, win_blk, sink, head_chunk=head_chunk)
        kl_j, n_j, grad_j = kl_rows(slice_t(scores, t0, qc), psum, allowed_blk, with_grad)
        if with_grad:
            grad_btw = jax.lax.dynamic_update_slice_in_dim(grad_btw, grad_j, t0, axis=1)
        return kl + kl_j, n + n_j, grad_btw

    dtype = q.dtype
    init = (jnp.zeros((), dtype), jnp.int32(0), jnp.zeros((b, t, w), dtype) if with_grad else None)
    kl, n, grad_btw = scan_blocks(block, init, t // qc, qc)
    inv = per_valid_row(n, dtype)
    return kl * inv, (None if grad_btw is None else grad_btw * inv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mean_kl(rows, head_chunk, scores, allowed, window, q, kv, raw_kv, sink):
    return _scores_pass(rows, head_chunk, scores, allowed, window, (q, kv, raw_kv, sink), with_grad=False)[0]


def _mean_kl_fwd(rows, head_chunk, scores, allowed, window, q, kv, raw_kv, sink):
    loss, grad_btw = _scores_pass(rows, head_chunk, scores, allowed, window, (q, kv, raw_kv, sink), with_grad=True)
    return loss, (grad_btw.astype(scores.dtype), (q, kv, raw_kv, sink))


def _mean_kl_bwd(rows, head_chunk, res, g):
    del rows, head_chunk
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
    teacher_chunk = resolve_chunk(head_chunk, query.shape[2], "head_chunk", "query heads")
    rows = resolve_chunk(query_chunk, t, "query_chunk", "query positions")
    if not joint:
        raw_kv, window_mask, sink = None, None, None
    dtype = compute_dtype(index_scores, query, compressed_kv, raw_kv, sink)
    teacher_inputs = [teacher_input(x, dtype) for x in (query, compressed_kv, raw_kv, sink)]
    window_mask = None if window_mask is None else window_mask.astype(bool)
    loss = _mean_kl(rows, teacher_chunk, index_scores, allowed.astype(bool), window_mask, *teacher_inputs)
    return jnp.asarray(scale, dtype) * loss
