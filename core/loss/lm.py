"""The LM loss: mean next-token cross-entropy, direct from logits or chunked from hidden states.

DESIGN.md, "Memory": the LM loss never keeps [B, T, V] float32 logits for the backward pass.
`lm_loss` is the direct formula on given logits (the reference, and what evaluation uses);
`chunked_lm_loss` computes the same value from the final hidden states and the head weight,
C tokens at a time (the analogue of MaxText's vocab tiling, `num_vocab_tiling`), with a custom
VJP in closed form: d logits = (softmax - onehot) * weight per chunk. The loss is a scalar, so its
cotangent only scales that: under differentiation the forward scan computes each chunk's
d hidden and accumulates d head while its logits are live, and the backward multiplies them by
the cotangent. What lives at once: one chunk's [C, V] logits and their softmax, never [B, T, V];
the residuals are d hidden [B*T, M] and d head [M, V]. The head's matmuls are those of the direct
path (logits, d hidden, d head: 3 x 2*B*T*M*V FLOPs), with no recomputation.

Deviation from MaxText: the chunk is a size in tokens (`lm_loss_chunk_size`), not a number of
tiles, so it need not divide B * T (the positions are zero-padded to a multiple of the chunk's; the
padding carries weight 0) and the live memory does not grow with B or T.

Under a mesh the batch rows are split over the batch axes (core/ops/placement.py `token_shards`), so
each scan step takes C / (rows per device) positions of every row: each device runs the chunks of
its own rows, C tokens a step. Chunking the flattened B * T tokens instead would scan over chunks
that are split across devices, and XLA would run every device through every chunk of the global
batch (the logits summed over the head's sharded `embed`, an all-reduce per chunk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from core.ops.placement import read_after, token_shards


def lm_loss(logits_btv, targets_bt, mask_bt):
    """Mean next-token cross-entropy over the positions where mask_bt is nonzero.

    Computed in at least float32 (bfloat16 logits are upcast; float64 stays float64 for tests),
    as logsumexp - target logit, so no [B, T, V] log-probabilities are materialised.
    Shapes: 1. lse_bt = logsumexp_v(logits)  2. nll_bt = lse_bt - logits[targets]  3. sum(nll * mask) / max(#mask, 1)
    """
    dtype = jnp.promote_types(logits_btv.dtype, jnp.float32)
    logits_btv = logits_btv.astype(dtype)
    target_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
    nll_bt = jax.nn.logsumexp(logits_btv, axis=-1) - target_bt
    mask_bt = mask_bt.astype(dtype)
    return jnp.sum(nll_bt * mask_bt) / jnp.maximum(jnp.sum(mask_bt), 1.0)


def head_logits(h_btm, head_mv):
    """float32 (or float64) logits [B, T, V] = h @ head, both upcast (the model's head)."""
    dtype = jnp.promote_types(jnp.promote_types(h_btm.dtype, head_mv.dtype), jnp.float32)
    return jnp.einsum("btm,mv->btv", h_btm.astype(dtype), head_mv.astype(dtype))


def compute_head(head_mv, dtype):
    """The head as a step of compute dtype `dtype` multiplies it: rounded to `dtype` where that is
    narrower (as the training step casts it), else as stored: the matmuls accumulate in at least
    float32, so widening it first would change no value, only copy it."""
    return head_mv.astype(dtype) if jnp.promote_types(head_mv.dtype, dtype) == head_mv.dtype else head_mv


def chunked_lm_loss(h_btm, head_mv, targets_bt, mask_bt, *, chunk: int):
    """`lm_loss(head_logits(h, head), targets, mask)` without the [B, T, V] logits.

    Args:
      h_btm: final hidden states [B, T, M] (after the final norm), any float dtype.
      head_mv: the head weight [M, V].
      targets_bt: int [B, T] next-token ids.
      mask_bt: [B, T], nonzero where the token counts (no gradient).
      chunk: tokens per scan step C (static, >= 1); need not divide B * T.

    Returns:
      Scalar loss in float32 (float64 for float64 inputs); 0.0 when nothing is masked in.

    Shapes (R rows per device: B over the mesh's batch shards; P = max(1, C / R) positions a chunk):
      1. positions zero-padded to a multiple of P: [B, T, M] -> [T / P, B, P, M] (chunk-major);
         weight = mask / max(#mask, 1)
      2. per chunk (its B*P tokens as rows c): logits [c, V] = h_c @ head; nll_c = lse_c -
         logits[target]; loss += sum(nll_c * w_c)
      3. under differentiation, in the same step: d logits = (e / sum_v e - onehot) * w with
         e = exp(logits - max) computed once for the log-sum-exp and the softmax;
         dh_c = d logits @ head^T, dhead += h_c^T @ d logits; the backward returns g * (dh, dhead)
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    dtype = jnp.promote_types(jnp.promote_types(h_btm.dtype, head_mv.dtype), jnp.float32)
    b, t, m = h_btm.shape
    # The mesh the step is traced under (core/train/program.py `with_mesh` sets it around the whole trace, this
    # loss included), so its batch axes are the ones h's rows were split over by the batch's sharding.
    shards = token_shards(mesh) if not (mesh := jax.sharding.get_abstract_mesh()).empty else 1
    rows = b // shards if b % shards == 0 else b
    positions = max(1, min(chunk // rows, t))  # a chunk larger than the batch would only pad
    pad = -t % positions
    mask_bt = mask_bt.astype(dtype)
    weight_bt = jax.lax.stop_gradient(mask_bt / jnp.maximum(jnp.sum(mask_bt), 1.0))

    def chunks(a_bt_):  # [B, T, ...] -> [T / P, B, P, ...], each chunk the same positions of every row
        a_bt_ = jnp.pad(a_bt_, ((0, 0), (0, pad)) + ((0, 0),) * (a_bt_.ndim - 2))
        return jnp.moveaxis(a_bt_.reshape(b, -1, positions, *a_bt_.shape[2:]), 1, 0)

    # h and the head stay in their dtypes and the matmuls accumulate in `dtype` (a bfloat16 product
    # is exact in float32), so no float32 copy of the head [M, V] is made where the backend
    # multiplies bfloat16 itself (`_late`)
    return _weighted_nll(chunks(h_btm), head_mv, chunks(targets_bt.astype(jnp.int32)), chunks(weight_bt),
                         (h_btm.dtype, head_mv.dtype))


def _chunk_stats(h_cm, head_mv, targets_c, dtype):
    """(exp [C, V], its row sums [C], lse [C], target logit [C]) of one chunk, in `dtype`.

    exp(logits - max) serves the log-sum-exp and the softmax alike; the target logits come from h
    and the targets' head columns, not gathered from the logits, so the logits are dead once the
    exponentials exist and those take their buffer (one [C, V] live, not two).
    """
    logits_cv = jnp.einsum("cm,mv->cv", h_cm, head_mv, preferred_element_type=dtype)
    max_c = jnp.max(logits_cv, axis=-1)
    exp_cv = jnp.exp(logits_cv - max_c[:, None])
    sum_c = jnp.sum(exp_cv, axis=-1)
    target_c = jnp.einsum("cm,mc->c", h_cm, jnp.asarray(head_mv)[:, targets_c], preferred_element_type=dtype)
    return exp_cv, sum_c, max_c + jnp.log(sum_c), target_c


def _late(head_mv, h_ncm, dtype):
    """head_mv, read after h_ncm (core/ops/placement.py `read_after`) when it is narrower than `dtype`.

    XLA:CPU multiplies bfloat16 by converting the operands to float32, and hoists the head's convert
    out of the chunk loop; the scheduler may then convert the head [M, V] first thing, and its
    float32 copy lives beside every activation of the forward. Made after h, the copy can only exist
    once the final hidden states do (an optimization barrier would not do: XLA:CPU removes them
    first). A head already in `dtype` is used as it is (a select would copy it).
    """
    if head_mv.dtype == dtype:
        return head_mv
    return read_after(head_mv, h_ncm[(0,) * h_ncm.ndim])


def _rows(h_bpm, targets_bp, weight_bp):
    """One chunk's [B, P, ...] as rows c = B * P."""
    return h_bpm.reshape(-1, h_bpm.shape[-1]), targets_bp.reshape(-1), weight_bp.reshape(-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _weighted_nll(h_ncm, head_mv, targets_nc, weight_nc, dtypes):
    """sum over chunks and tokens of weight * (lse - target logit), in weight's dtype; see chunked_lm_loss.
    dtypes: (h's, the head's), the dtypes of their cotangents."""
    dtype = weight_nc.dtype
    head_mv = _late(head_mv, h_ncm, dtype)

    def body(total, xs):
        h_cm, targets_c, weight_c = _rows(*xs)
        _, _, lse_c, target_c = _chunk_stats(h_cm, head_mv, targets_c, dtype)
        return total + jnp.sum((lse_c - target_c) * weight_c), None

    return jax.lax.scan(body, jnp.zeros((), dtype), (h_ncm, targets_nc, weight_nc))[0]


def _weighted_nll_fwd(h_ncm, head_mv, targets_nc, weight_nc, dtypes):
    dtype = weight_nc.dtype

    def body(carry, xs):
        total, dhead_mv = carry
        h_cm, targets_c, weight_c = _rows(*xs)
        exp_cv, sum_c, lse_c, target_c = _chunk_stats(h_cm, head_mv, targets_c, dtype)
        onehot_cv = jax.nn.one_hot(targets_c, head_mv.shape[-1], dtype=dtype)
        dlogits_cv = exp_cv * (weight_c / sum_c)[:, None] - onehot_cv * weight_c[:, None]
        dh_cm = jnp.einsum("cv,mv->cm", dlogits_cv, head_mv, preferred_element_type=dtype)
        dhead_mv = dhead_mv + jnp.einsum("cm,cv->mv", h_cm, dlogits_cv, preferred_element_type=dtype)
        return (total + jnp.sum((lse_c - target_c) * weight_c), dhead_mv), dh_cm.reshape(xs[0].shape)

    init = (jnp.zeros((), dtype), jnp.zeros(head_mv.shape, dtype))
    (total, dhead_mv), dh_ncm = jax.lax.scan(body, init, (h_ncm, targets_nc, weight_nc))
    return total, (dh_ncm, dhead_mv)


def _weighted_nll_bwd(dtypes, res, g):  # scaled in float32, then rounded to the inputs' dtypes as a cast would
    dh_ncm, dhead_mv = res
    return (g * dh_ncm).astype(dtypes[0]), (g * dhead_mv).astype(dtypes[1]), None, None


_weighted_nll.defvjp(_weighted_nll_fwd, _weighted_nll_bwd)


def lm_loss_from_hidden(h_btm, head_mv, targets_bt, mask_bt, *, chunk: int):
    """The step's LM loss: chunked when chunk >= 1, else the direct head + `lm_loss`."""
    if chunk:
        return chunked_lm_loss(h_btm, head_mv, targets_bt, mask_bt, chunk=chunk)
    return lm_loss(head_logits(h_btm, head_mv), targets_bt, mask_bt)
