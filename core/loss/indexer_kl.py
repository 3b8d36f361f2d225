"""The CSA indexer KL loss (DESIGN.md, "The indexer loss" and "Memory").

The lightning indexer is distilled from the main attention: per query row, the teacher P is the
L1-normalised sum over heads of each head's attention probability on the allowed compressed
blocks, the student is the log-softmax of the indexer scores over the same blocks, and the loss is
the KL(P || student) averaged over the rows that have anything allowed, times `scale`.

Two entry points, one maths:

- `csa_indexer_loss_streamed(index, queries, keys, positions, segment_ids, ...)`, here:
  computed from the indexer's and the teacher's inputs, each query block building its own
  queries, visibility, indexer scores, top-k selection, teacher rows and KL, so neither [B,T,W]
  nor [B,H,T,W] is ever materialised; peak memory grows with the chunk sizes, linearly in T.
- `csa_indexer_loss(index_scores, teacher, allowed, ...)` (core/loss/indexer_kl_direct.py): the
  scores [B,T,W] and the teacher's inputs (`WholeTeacher`) are given whole.

Both chunk the teacher over head groups (`head_chunk`) and query blocks (`query_chunk`) with
`lax.scan`; every combination equals the direct computation to float32 rounding. They share
the row machinery, first in this module: per query block of qc rows and head group of hc heads,
`teacher_rows` holds the [B, qc, hc, W] logits of one group at a time and `kl_rows` (its terms:
`kl_terms`) the [B, qc, W] rows of one block; `scan_blocks` runs a block function over the query
blocks with `lax.scan` (a plain call for a single block). The streamed loss builds its target from
the main attention's own queries (per run of rows) and keys, as the attention takes them
(core.ops.chunked_attention's `RowQueries` and `Keys`). `csa_indexer_loss_tap` is the dense streamed loss run block by block inside the chunked
attention's scan, its teacher rows read off the attention's own logits, its gradient taken in the
forward.

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
from jax.ad_checkpoint import checkpoint_name

from core.ops.chunked_attention import (ChunkTap, Keys, NEG, RowQueries, block_last_positions, block_segment_ids,
                                        visible_rows, window_rows)
from core.ops.topk import IndexerInputs, indexer_scores, topk_mask

TEACHERS = ("compressed", "joint")
EPS = 1e-8  # DESIGN.md's epsilon in the teacher normalisation and in log(P + eps)


def resolve_chunk(chunk: int, size: int, name: str, what: str) -> int:
    """The chunk size to scan with: `size` for 0 (off), else `chunk`, which must divide `size`."""
    if chunk < 0 or (chunk and size % chunk):
        raise ValueError(f"{name}={chunk} must be 0 (off) or divide the {size} {what}")
    return chunk or size


def check_teacher(teacher: str, raw_kv, sink, third, third_name: str) -> bool:
    """Whether `teacher` is the joint one; ValueError for an unknown teacher or missing joint inputs."""
    if teacher not in TEACHERS:
        raise ValueError(f"teacher={teacher!r} is unknown: use one of {', '.join(TEACHERS)}")
    joint = teacher == "joint"
    if joint and (raw_kv is None or sink is None or not third):
        raise ValueError(f"teacher='joint' needs raw_kv, sink and {third_name}")
    return joint


def slice_t(x, t0, size):
    """Rows [t0, t0 + size) of a [B, T, ...] array (t0 may be traced)."""
    return jax.lax.dynamic_slice_in_dim(x, t0, size, axis=1)


def scan_blocks(block_fn, init, num_blocks: int, block: int):
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


def teacher_rows(q_bthd, kv_bwd, allowed_btw, raw_kv_bsd=None, window_bts=None, sink_h=None, *, head_chunk: int = 0):
    """sum_h P_h[t, :] over all heads, scanning over head groups of `head_chunk` heads (0: all at once;
    it divides H).

    Shapes:
      1. per group g: logits_bthw = q[:, :, g] . kv     [B, T, hc, W]  (hc = head_chunk)
      2. masked softmax over allowed w (joint: normaliser over window keys and sink too)
      3. acc_btw += sum over the group's heads
    """
    heads = q_bthd.shape[2]
    hc = head_chunk or heads
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


def kl_terms(scores_btw, psum_btw, allowed_btw):
    """The KL's terms P (log(P + eps) - log Q) [B, t, W], 0 off the allowed entries with P > 0,
    and what the gradient reuses: (terms_btw, p_btw, exp_btw, z_bt1). A row's sum is its KL."""
    p_btw = psum_btw / (jnp.sum(psum_btw, axis=-1, keepdims=True) + EPS)
    s_btw = jnp.where(allowed_btw, scores_btw.astype(psum_btw.dtype), NEG)
    max_bt1 = jnp.max(s_btw, axis=-1, keepdims=True)
    exp_btw = jnp.where(allowed_btw, jnp.exp(s_btw - max_bt1), 0.0)
    z_bt1 = jnp.sum(exp_btw, axis=-1, keepdims=True)
    z_bt1 = jnp.where(z_bt1 > 0, z_bt1, 1.0)
    log_q_btw = s_btw - max_bt1 - jnp.log(z_bt1)
    keep_btw = allowed_btw & (p_btw > 0)
    return jnp.where(keep_btw, p_btw * (jnp.log(p_btw + EPS) - log_q_btw), 0.0), p_btw, exp_btw, z_bt1


def kl_rows(scores_btw, psum_btw, allowed_btw, with_grad: bool):
    """Sum of KL over the valid rows, number of valid rows, and d(sum KL)/d scores (or None).

    Rows with nothing allowed are not valid: they add 0 to both sums and get a 0 gradient.
    """
    terms_btw, p_btw, exp_btw, z_bt1 = kl_terms(scores_btw, psum_btw, allowed_btw)
    kl_sum = jnp.sum(terms_btw)
    n_valid = jnp.sum(jnp.any(allowed_btw, axis=-1), dtype=jnp.int32)
    if not with_grad:
        return kl_sum, n_valid, None
    p_mass_bt1 = jnp.sum(p_btw, axis=-1, keepdims=True)
    grad_btw = jnp.where(allowed_btw, exp_btw / z_bt1 * p_mass_bt1 - p_btw, 0.0)
    return kl_sum, n_valid, grad_btw


def per_valid_row(n_valid, dtype):
    """1 / max(#valid rows, 1): the mean's factor, finite when no row is valid."""
    return 1.0 / jnp.maximum(n_valid, 1).astype(dtype)


def compute_dtype(*arrays):
    """float32 whatever the inputs' dtype; float64 only for float64 inputs (x64 reference tests)."""
    return functools.reduce(jnp.promote_types, [x.dtype for x in arrays if x is not None], jnp.float32)


def teacher_input(x, dtype):
    """A teacher input (array or pytree, or None) in the compute dtype, detached."""
    return None if x is None else jax.tree.map(lambda a: jax.lax.stop_gradient(jnp.asarray(a, dtype)), x)


# ----------------------------------------------------------------------------- streamed from the indexer's inputs

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


def _stream_block(inputs, block_masks, t0, psum_btw=None, *, with_grad: bool, rows: int, index_chunk: int,
                  head_chunk: int = 0, topk: int | None = None, joint_window: int = 0):
    """One query block of `rows` rows at t0: visibility, scores, selection (the block's own top-`topk`, or
    every visible block for None), teacher rows (unless given: `psum_btw`, the attention's; the joint
    teacher's over its window of `joint_window` tokens, 0 for the compressed teacher; `head_chunk`
    heads at a time), KL (and its pull-back to the block's indexer queries, k_I and w_I, `index_chunk`
    indexer heads at a time).
    """
    (queries_i, k_idx, w_idx), (query, kv, raw_kv, sink), positions, segment_ids = inputs
    seg_bw, last_bw = block_masks
    qc = rows
    pos_bt, seg_bt = slice_t(positions, t0, qc), slice_t(segment_ids, t0, qc)
    w_blk = slice_t(w_idx, t0, qc)
    q_blk = queries_i.rows(t0, qc, pos_bt)
    visible_btw = visible_rows(pos_bt, seg_bt, seg_bw, last_bw)
    pull = None
    if with_grad and index_chunk == q_blk.shape[2]:  # one group: keep its residuals, no recompute
        scores_btw, pull = jax.vjp(lambda q, k, w: indexer_scores(q, k, w, visible_btw), q_blk, k_idx, w_blk)
    else:
        scores_btw = indexer_scores(q_blk, k_idx, w_blk, visible_btw, head_chunk=index_chunk)
    allowed_btw = visible_btw
    if topk is not None:
        allowed_btw = topk_mask(scores_btw, visible_btw, topk)  # visible only
    if psum_btw is None:
        window_bts = None
        if joint_window:
            window_bts = window_rows(pos_bt, seg_bt, positions, segment_ids, joint_window)
        query_btd = query.rows(t0, qc, pos_bt).astype(kv.dtype)
        psum_btw = teacher_rows(query_btd, kv, allowed_btw, raw_kv, window_bts, sink, head_chunk=head_chunk)
    kl, n, grad_btw = kl_rows(scores_btw, psum_btw, allowed_btw, with_grad)
    if not with_grad:
        return kl, n, None
    grad_btw = grad_btw.astype(scores_btw.dtype)
    if pull is not None:
        grads = pull(grad_btw)
    else:
        grads = _indexer_vjp(q_blk, k_idx, w_blk, visible_btw, grad_btw, index_chunk)
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


def _accumulate(block, carry, t0, psum_btw=None):
    """`carry` after the block at row t0 (`block`: `_stream_block` bound to its inputs and settings):
    sums, and each block's rows put in place."""
    kl, n, grads = carry
    kl_j, n_j, grads_j = block(t0, psum_btw)
    if grads is not None:  # accumulate in (at least) float32 whatever the inputs' dtype
        grads_j = jax.tree.map(lambda g, z: g.astype(z.dtype), grads_j, grads)
        dq, dk, dw = grads
        put = lambda acc, g: jax.lax.dynamic_update_slice_in_dim(acc, g, t0, axis=1)  # noqa: E731
        grads = (put(dq, grads_j[0]), dk + grads_j[1], put(dw, grads_j[2]))
    return kl + kl_j, n + n_j, grads


def _finish(carry, index, positions, *, inputs_grad: bool = True):
    """(mean KL over valid rows, its gradients as `IndexerInputs` or None) from the last carry.

    d q_I's rows reach the queries' params (and, unless `inputs_grad` is false, their
    per-token inputs) through one pull-back over every row: the params' gradient is one sum over
    T, not one per block (under a mesh, one reduction over the devices' rows, not one per block)."""
    kl, n, grads = carry
    queries_i, k_idx, w_idx = index
    inv = per_valid_row(n, kl.dtype)
    if grads is None:
        return kl * inv, None
    dq_btid, dk, dw = grads
    fn = lambda per_token, params: queries_i.fn(per_token, params, positions)  # noqa: E731
    if inputs_grad:
        dq_in, dq_params = jax.vjp(fn, queries_i.inputs, queries_i.params)[1](dq_btid)
    else:
        dq_in = jnp.zeros_like(queries_i.inputs)
        dq_params = jax.vjp(functools.partial(fn, queries_i.inputs), queries_i.params)[1](dq_btid)[0]
    primal = ((queries_i.inputs, queries_i.params), k_idx, w_idx)
    (dq_in, dq_params), dk, dw = jax.tree.map(lambda g, x: (g * inv.astype(compute_dtype(g))).astype(x.dtype),
                                              ((dq_in, dq_params), dk, dw), primal)
    return kl * inv, IndexerInputs(RowQueries(queries_i.fn, dq_in, dq_params), dk, dw)


def _streamed_pass(inputs, with_grad: bool, *, rows: int, head_chunk: int, index_chunk: int, topk: int | None,
                   joint_window: int):
    """(mean KL over valid rows, its gradients ((d q inputs, d q params), d k_idx, d w_idx) or None)."""
    index, teacher, positions, segment_ids = inputs
    t = positions.shape[1]
    block_masks = _block_masks(positions, segment_ids, index[1].shape[1])
    block = functools.partial(_stream_block, inputs, block_masks, with_grad=with_grad, rows=rows,
                              index_chunk=index_chunk, head_chunk=head_chunk, topk=topk, joint_window=joint_window)
    carry = scan_blocks(functools.partial(_accumulate, block), _init(index, positions, teacher[1].dtype, with_grad),
                        t // rows, rows)
    return _finish(carry, index, positions)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _streamed_mean_kl(rows, head_chunk, index_chunk, topk, joint_window, index, teacher, positions, segment_ids):
    return _streamed_pass((index, teacher, positions, segment_ids), False, rows=rows, head_chunk=head_chunk,
                          index_chunk=index_chunk, topk=topk, joint_window=joint_window)[0]


def _streamed_fwd(rows, head_chunk, index_chunk, topk, joint_window, index, teacher, positions, segment_ids):
    loss, grads = _streamed_pass((index, teacher, positions, segment_ids), True, rows=rows, head_chunk=head_chunk,
                                 index_chunk=index_chunk, topk=topk, joint_window=joint_window)
    grads = jax.tree.map(lambda g: checkpoint_name(g, "indexer_loss_grads"), grads)
    return loss, (grads, teacher)


def _streamed_bwd(rows, head_chunk, index_chunk, topk, joint_window, res, g):
    del rows, head_chunk, index_chunk, topk, joint_window
    grads, teacher = res
    zeros = jax.tree.map(jnp.zeros_like, teacher)
    return jax.tree.map(lambda x: (g * x).astype(x.dtype), grads), zeros, None, None


_streamed_mean_kl.defvjp(_streamed_fwd, _streamed_bwd)


def _heads(queries: RowQueries, positions_bt) -> int:
    """The number of heads `queries` builds (traced abstractly for one row)."""
    return jax.eval_shape(lambda q, pos: q.rows(0, 1, pos), queries, positions_bt[:, :1]).shape[2]


def csa_indexer_loss_streamed(index: IndexerInputs, queries: RowQueries, keys: Keys, positions, segment_ids, *,
                              teacher: str = "compressed", topk: int | None = None, scale=1.0, head_chunk: int = 0,
                              query_chunk: int = 0):
    """`csa_indexer_loss` computed from the indexer's inputs, one query block at a time.

    Equals `csa_indexer_loss(indexer_scores(q_I, k_I, w_I, visible), whole_teacher(queries, keys, teacher, positions,
    segment_ids), allowed)`
    with visible = csa_visible(positions, segment_ids, T // W) and allowed = visible (dense) or
    visible & top-k selected (sparse), but neither the [B,T,W] scores nor the [B,T,H,W] teacher
    logits ever exist whole.

    Args:
      index: the indexer's queries q_I (`RowQueries`, built per block), compressed keys k_I
        [B, W, DI] and head weights [B, T, HI] (already scaled). The gradient reaches all three:
        the queries' per-token inputs and params (params summed over blocks).
      queries, keys: the teacher, the main attention's queries (`RowQueries`, per block) and keys:
        its compressed entries, and for the joint teacher its raw window keys, sinks and window
        (detached here; the compressed teacher reads the compressed entries alone).
      positions, segment_ids: int [B, T] (DESIGN.md, "Visibility"); the ratio is T // W.
      teacher: "compressed" | "joint" (DESIGN.md, "The indexer loss").
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
    t = positions.shape[1]
    heads_i = _heads(index.queries, positions)
    num_blocks = index.keys_bwd.shape[1]
    if num_blocks == 0 or t % num_blocks:
        raise ValueError(f"T={t} must be a multiple of the W={num_blocks} compressed blocks")
    joint = check_teacher(teacher, keys.raw_bsd, keys.sink_h, keys.window > 0, "window > 0")
    teacher_chunk = resolve_chunk(head_chunk, _heads(queries, positions), "head_chunk", "query heads")
    rows = resolve_chunk(query_chunk, t, "query_chunk", "query positions")
    index_chunk = resolve_chunk(head_chunk, heads_i, "head_chunk", "indexer heads")
    raw_kv, sink = (keys.raw_bsd, keys.sink_h) if joint else (None, None)
    dtype = compute_dtype(*jax.tree.leaves(queries), keys.compressed_bwd, raw_kv, sink)
    teacher_inputs = tuple(teacher_input(x, dtype) for x in (queries, keys.compressed_bwd, raw_kv, sink))
    loss = _streamed_mean_kl(rows, teacher_chunk, index_chunk, topk, keys.window if joint else 0, index, teacher_inputs,
                             positions, segment_ids)
    return jnp.asarray(scale, loss.dtype) * loss


def csa_indexer_loss_tap(index: IndexerInputs, positions, segment_ids, *, teacher: str, scale=1.0,
                         head_chunk: int = 0, query_chunk: int):
    """The dense streamed loss fed by the attention: its teacher rows read off the attention's own
    block logits, one query block per chunk of `core.ops.chunked_attention.chunked_attention` (its
    `tap`), where `csa_indexer_loss_streamed` builds the teacher's queries and logits a second time.

    The same loss as `csa_indexer_loss_streamed(index, queries, keys, positions, segment_ids, topk=None, ...)`, its
    gradient taken in the forward (the closed form of each block, summed over blocks), for
    detached query inputs: the gradient reaches the queries' params, k_I and w_I.

    Args:
      index: as `csa_indexer_loss_streamed`'s; its queries' per-token inputs are detached.
      positions, segment_ids: int [B, T]; the ratio is T // W.
      teacher: "compressed" | "joint" (the rows the attention reads off its logits).
      scale, head_chunk: as `csa_indexer_loss_streamed`'s (head_chunk must divide HI).
      query_chunk: the attention's chunk C, one loss block each (must divide T).

    Returns:
      (ChunkTap for `chunked_attention`, finish): finish(the tap's last carry) -> (the scaled loss, a
      float32 scalar; d it / d `index` as IndexerInputs, zero for the queries' per-token inputs).
    """
    t, num_blocks = positions.shape[1], index.keys_bwd.shape[1]
    if num_blocks == 0 or t % num_blocks:
        raise ValueError(f"T={t} must be a multiple of the W={num_blocks} compressed blocks")
    if teacher not in TEACHERS:
        raise ValueError(f"teacher={teacher!r} is unknown: use one of {', '.join(TEACHERS)}")
    rows = resolve_chunk(query_chunk, t, "query_chunk", "query positions")
    index_chunk = resolve_chunk(head_chunk, _heads(index.queries, positions), "head_chunk", "indexer heads")
    inputs = (index, (None,) * 4, positions, segment_ids)
    block = functools.partial(_stream_block, inputs, _block_masks(positions, segment_ids, num_blocks), with_grad=True,
                              rows=rows, index_chunk=index_chunk)  # the teacher rows given: the attention's
    dtype = compute_dtype(index.keys_bwd, index.weights_bti)

    def step(carry, t0, psum_btw):
        return _accumulate(block, carry, t0, psum_btw.astype(dtype))

    def finish(carry):
        loss, grads = _finish(carry, index, positions, inputs_grad=False)
        factor = jnp.asarray(scale, loss.dtype)
        return factor * loss, jax.tree.map(lambda g: (factor * g).astype(g.dtype), grads)

    return ChunkTap(teacher, _init(index, positions, dtype, True), step), finish
