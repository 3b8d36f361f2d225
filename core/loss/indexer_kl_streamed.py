"""The streamed CSA indexer KL loss: `csa_indexer_loss_streamed` (DESIGN.md, "The indexer loss" and "Memory").

"Streamed" means one thing here: the loss is computed from the indexer's and the teacher's inputs
one query block at a time. Each block builds its own indexer and teacher queries (`RowQueries`),
visibility, indexer scores, top-k selection, teacher rows and KL, so neither [B,T,W] nor
[B,H,T,W] is ever materialised; peak memory grows with the chunk sizes, linearly in T. It equals
core/loss/indexer_kl.py's `csa_indexer_loss` (the direct path) on the scores the indexer would
give, to float32 rounding in value and gradient, and shares its teacher and KL rows
(core/loss/indexer_kl_rows.py). Gradients (custom VJP): the forward pass of the differentiated call
pulls the closed-form d loss / d scores of each block back through that block's indexer scores
and queries, so the backward pass is one multiply; exactly zero reaches the teacher inputs.
`csa_indexer_loss_tap` is the same dense loss run block by block inside the chunked attention's
scan, its teacher rows read off the attention's own logits, its gradient taken in the forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from core.loss.indexer_kl_rows import (TEACHERS, Spec, Teacher, check_teacher, compute_dtype, kl_rows,
                                       per_valid_row, resolve_chunk, scan_blocks, slice_t, teacher_input,
                                       teacher_rows)
from core.ops.chunked_attention import ChunkTap, RowQueries
from core.ops.masks import Packing, block_last_positions, block_segment_ids, visible_rows, window_rows
from core.ops.topk import IndexerInputs, indexer_scores, topk_mask


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


def _stream_block(spec: Spec, t0, inputs, block_masks, with_grad: bool, psum_btw=None):
    """One query block: visibility, scores, selection, teacher rows (unless given: `psum_btw`, the
    attention's), KL (and its pull-back to the block's indexer queries, k_I and w_I).
    """
    (queries_i, k_idx, w_idx), (query, kv, raw_kv, sink), positions, segment_ids = inputs
    seg_bw, last_bw = block_masks
    qc = spec.query_chunk
    pos_bt, seg_bt = slice_t(positions, t0, qc), slice_t(segment_ids, t0, qc)
    w_blk = slice_t(w_idx, t0, qc)
    q_blk = queries_i.rows(t0, qc, pos_bt)
    visible_btw = visible_rows(pos_bt, seg_bt, seg_bw, last_bw)
    pull = None
    if with_grad and spec.index_chunk == q_blk.shape[2]:  # one group: keep its residuals, no recompute
        scores_btw, pull = jax.vjp(lambda q, k, w: indexer_scores(q, k, w, visible_btw), q_blk, k_idx, w_blk)
    else:
        scores_btw = indexer_scores(q_blk, k_idx, w_blk, visible_btw, head_chunk=spec.index_chunk)
    allowed_btw = visible_btw
    if spec.topk is not None:
        allowed_btw = topk_mask(scores_btw, visible_btw, spec.topk)  # visible only
    if psum_btw is None:
        window_bts = None
        if spec.joint:
            window_bts = window_rows(pos_bt, seg_bt, positions, segment_ids, spec.window)
        query_btd = query.rows(t0, qc, pos_bt).astype(kv.dtype)
        psum_btw = teacher_rows(spec, query_btd, kv, allowed_btw, raw_kv, window_bts, sink)
    kl, n, grad_btw = kl_rows(scores_btw, psum_btw, allowed_btw, with_grad)
    if not with_grad:
        return kl, n, None
    grad_btw = grad_btw.astype(scores_btw.dtype)
    if pull is not None:
        grads = pull(grad_btw)
    else:
        grads = _indexer_vjp(q_blk, k_idx, w_blk, visible_btw, grad_btw, spec.index_chunk)
    return kl, n, grads


def _block_masks(positions, segment_ids, num_blocks: int):
    """(segment id, last position) of each of the W blocks: int [B, W] each."""
    ratio = positions.shape[1] // num_blocks
    return block_segment_ids(segment_ids, ratio), block_last_positions(positions, ratio)


def _init(index, positions, dtype, with_grad: bool):
    """The pass's carry before the first block: (KL sum, valid rows, gradients or None): zeros of
    d q_I [B, T, HI, DI] in the queries' dtype (each row written once), d k_idx in (at least)
    float32 (summed over blocks) and d w_idx."""
    queries_i, k_idx, w_idx = index
    zeros = lambda x: jnp.zeros(x.shape, compute_dtype(x))  # noqa: E731
    grads = None
    if with_grad:
        q = jax.eval_shape(lambda q, pos: q.of(q.inputs, pos), queries_i, positions)
        grads = (jnp.zeros(q.shape, q.dtype), zeros(k_idx), zeros(w_idx))
    return jnp.zeros((), dtype), jnp.int32(0), grads


def _accumulate(spec: Spec, inputs, block_masks, with_grad: bool, carry, t0, psum_btw=None):
    """`carry` after the block at row t0 (`_stream_block`): sums, and each block's rows put in place."""
    kl, n, grads = carry
    kl_j, n_j, grads_j = _stream_block(spec, t0, inputs, block_masks, with_grad, psum_btw)
    if with_grad:  # accumulate in (at least) float32 whatever the inputs' dtype
        grads_j = jax.tree.map(lambda g, z: g.astype(z.dtype), grads_j, grads)
        dq, dk, dw = grads
        put = lambda acc, g: jax.lax.dynamic_update_slice_in_dim(acc, g, t0, axis=1)  # noqa: E731
        grads = (put(dq, grads_j[0]), dk + grads_j[1], put(dw, grads_j[2]))
    return kl + kl_j, n + n_j, grads


def _finish(spec: Spec, carry, index, positions):
    """(mean KL over valid rows, its gradients as `IndexerInputs` or None) from the last carry.

    d q_I's rows reach the queries' params (and, unless `spec.inputs_grad` is false, their
    per-token inputs) through one pull-back over every row: the params' gradient is one sum over
    T, not one per block (under a mesh, one reduction over the devices' rows, not one per block)."""
    kl, n, grads = carry
    queries_i, k_idx, w_idx = index
    inv = per_valid_row(n, kl.dtype)
    if grads is None:
        return kl * inv, None
    dq_btid, dk, dw = grads
    fn = lambda per_token, params: queries_i.fn(per_token, params, positions)  # noqa: E731
    if spec.inputs_grad:
        dq_in, dq_params = jax.vjp(fn, queries_i.inputs, queries_i.params)[1](dq_btid)
    else:
        dq_in = jnp.zeros_like(queries_i.inputs)
        dq_params = jax.vjp(functools.partial(fn, queries_i.inputs), queries_i.params)[1](dq_btid)[0]
    primal = ((queries_i.inputs, queries_i.params), k_idx, w_idx)
    (dq_in, dq_params), dk, dw = jax.tree.map(lambda g, x: (g * inv.astype(compute_dtype(g))).astype(x.dtype),
                                              ((dq_in, dq_params), dk, dw), primal)
    return kl * inv, IndexerInputs(RowQueries(queries_i.fn, dq_in, dq_params), dk, dw)


def _streamed_pass(spec: Spec, inputs, with_grad: bool):
    """(mean KL over valid rows, its gradients ((d q inputs, d q params), d k_idx, d w_idx) or None)."""
    index, teacher, positions, segment_ids = inputs
    t = positions.shape[1]
    block_masks = _block_masks(positions, segment_ids, index[1].shape[1])
    qc = spec.query_chunk
    block = lambda carry, t0: _accumulate(spec, inputs, block_masks, with_grad, carry, t0)  # noqa: E731
    carry = scan_blocks(block, _init(index, positions, teacher[1].dtype, with_grad), t // qc, qc)
    return _finish(spec, carry, index, positions)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _streamed_mean_kl(spec, index, teacher, positions, segment_ids):
    return _streamed_pass(spec, (index, teacher, positions, segment_ids), with_grad=False)[0]


def _streamed_fwd(spec, index, teacher, positions, segment_ids):
    loss, grads = _streamed_pass(spec, (index, teacher, positions, segment_ids), with_grad=True)
    grads = jax.tree.map(lambda g: checkpoint_name(g, "indexer_loss_grads"), grads)
    return loss, (grads, teacher)


def _streamed_bwd(spec, res, g):
    grads, teacher = res
    zeros = jax.tree.map(jnp.zeros_like, teacher)
    return jax.tree.map(lambda x: (g * x).astype(x.dtype), grads), zeros, None, None


_streamed_mean_kl.defvjp(_streamed_fwd, _streamed_bwd)


def _heads(queries: RowQueries, positions_bt) -> int:
    """The number of heads `queries` builds (traced abstractly for one row)."""
    return jax.eval_shape(lambda q, pos: q.rows(0, 1, pos), queries, positions_bt[:, :1]).shape[2]


def csa_indexer_loss_streamed(index: IndexerInputs, teacher: Teacher, packing: Packing, *,
                              topk: int | None = None, scale=1.0, head_chunk: int = 0, query_chunk: int = 0):
    """`csa_indexer_loss` computed from the indexer's inputs, one query block at a time.

    Equals `csa_indexer_loss(indexer_scores(q_I, k_I, w_I, visible), teacher.whole(packing), allowed)`
    with visible = csa_visible(positions, segment_ids, T // W) and allowed = visible (dense) or
    visible & top-k selected (sparse), but neither the [B,T,W] scores nor the [B,T,H,W] teacher
    logits ever exist whole.

    Args:
      index: the indexer's queries q_I (`RowQueries`, built per block), compressed keys k_I
        [B, W, DI] and head weights [B, T, HI] (already scaled). The gradient reaches all three:
        the queries' per-token inputs and params (params summed over blocks).
      teacher: the main attention's queries (`RowQueries`, per block), compressed keys, and for
        the joint teacher the raw window keys, sinks and window (detached here).
      packing: positions and segment ids [B, T] (DESIGN.md, "Visibility"); the ratio is T // W.
      topk: None = dense (all visible blocks); k = sparse (the block's own top-k selection).
      scale: indexer_loss_scaling_factor.
      head_chunk: heads per scan step (0 = all; must divide H and HI). With a head chunk the
        indexer's backward recomputes its logits per head group instead of storing [B,qc,W,HI].
      query_chunk: query positions per scan step (0 = all; must divide T).

    Returns:
      A float32 scalar (as in `csa_indexer_loss`); gradient to `index` only (exactly zero to the
      teacher inputs). The scores are float32 (`indexer_scores`) in every case.

    Shapes (per query block of qc rows):
      1. q_I of the block; visible_btw, scores_btw = indexer_scores(q_I, k_I, w_I[blk])   [B, qc, W]
      2. allowed_btw = visible (& top-k of the scores)
      3. psum_btw from the teacher's head groups; KL rows and d KL / d scores       [B, qc, W]
      4. d KL / d (q_I inputs, k_I, w_I[blk]) through indexer_scores and q_I (differentiated calls)
    """
    positions, segment_ids = packing
    t = positions.shape[1]
    heads_i = _heads(index.queries, positions)
    num_blocks = index.keys_bwd.shape[1]
    if num_blocks == 0 or t % num_blocks:
        raise ValueError(f"T={t} must be a multiple of the W={num_blocks} compressed blocks")
    joint = check_teacher(teacher.kind, teacher.raw_bsd, teacher.sink_h, teacher.window > 0, "window > 0")
    spec = Spec(
        head_chunk=resolve_chunk(head_chunk, _heads(teacher.queries, positions), "head_chunk", "query heads"),
        query_chunk=resolve_chunk(query_chunk, t, "query_chunk", "query positions"),
        joint=joint, topk=topk, window=teacher.window if joint else 0,
        index_chunk=resolve_chunk(head_chunk, heads_i, "head_chunk", "indexer heads"),
    )
    raw_kv, sink = (teacher.raw_bsd, teacher.sink_h) if joint else (None, None)
    dtype = compute_dtype(*jax.tree.leaves(teacher.queries), teacher.compressed_bwd, raw_kv, sink)
    teacher_inputs = tuple(teacher_input(x, dtype) for x in (teacher.queries, teacher.compressed_bwd, raw_kv, sink))
    loss = _streamed_mean_kl(spec, index, teacher_inputs, positions, segment_ids)
    return jnp.asarray(scale, loss.dtype) * loss


def csa_indexer_loss_tap(index: IndexerInputs, packing: Packing, *, teacher: str, scale=1.0, head_chunk: int = 0,
                         query_chunk: int):
    """The dense streamed loss fed by the attention: its teacher rows read off the attention's own
    block logits, one query block per chunk of `core.ops.chunked_attention.chunked_attention` (its
    `tap`), where `csa_indexer_loss_streamed` builds the teacher's queries and logits a second time.

    The same loss as `csa_indexer_loss_streamed(index, teacher, packing, topk=None, ...)`, its
    gradient taken in the forward (the closed form of each block, summed over blocks), for
    detached query inputs: the gradient reaches the queries' params, k_I and w_I.

    Args:
      index: as `csa_indexer_loss_streamed`'s; its queries' per-token inputs are detached.
      packing: positions and segment ids [B, T]; the ratio is T // W.
      teacher: "compressed" | "joint" (the rows the attention reads off its logits).
      scale, head_chunk: as `csa_indexer_loss_streamed`'s (head_chunk must divide HI).
      query_chunk: the attention's chunk C, one loss block each (must divide T).

    Returns:
      (ChunkTap for `chunked_attention`, finish): finish(the tap's last carry) -> (the scaled loss, a
      float32 scalar; d it / d `index` as IndexerInputs, zero for the queries' per-token inputs).
    """
    positions, segment_ids = packing
    t, num_blocks = positions.shape[1], index.keys_bwd.shape[1]
    if num_blocks == 0 or t % num_blocks:
        raise ValueError(f"T={t} must be a multiple of the W={num_blocks} compressed blocks")
    if teacher not in TEACHERS:
        raise ValueError(f"teacher={teacher!r} is unknown: use one of {', '.join(TEACHERS)}")
    spec = Spec(head_chunk=0, query_chunk=resolve_chunk(query_chunk, t, "query_chunk", "query positions"),
                joint=teacher == "joint", index_chunk=resolve_chunk(head_chunk, _heads(index.queries, positions),
                                                                    "head_chunk", "indexer heads"),
                inputs_grad=False)
    inputs = (index, (None,) * 4, positions, segment_ids)
    masks = _block_masks(positions, segment_ids, num_blocks)
    dtype = compute_dtype(index.keys_bwd, index.weights_bti)

    def step(carry, t0, psum_btw):
        return _accumulate(spec, inputs, masks, True, carry, t0, psum_btw.astype(dtype))

    def finish(carry):
        loss, grads = _finish(spec, carry, index, positions)
        factor = jnp.asarray(scale, loss.dtype)
        return factor * loss, jax.tree.map(lambda g: (factor * g).astype(g.dtype), grads)

    return ChunkTap(teacher, _init(index, positions, dtype, True), step), finish
