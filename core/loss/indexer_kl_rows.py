"""The indexer loss's row machinery: teacher rows, KL rows and block scans (DESIGN.md, "The indexer loss").

Shared by both entry points of core/loss/indexer_kl.py (given scores) and core/loss/indexer_kl_streamed.py
(streamed from the indexer's inputs); the maths and its gradient are described there. Per query
block of qc rows and head group of hc heads, `teacher_rows` holds the [B, qc, hc, W] logits of one
group at a time and `kl_rows` (its terms: `kl_terms`) the [B, qc, W] rows of one block; `scan_blocks` runs a block function
over the query blocks with `lax.scan` (a plain call for a single block). `Teacher` groups the
main attention's inputs that the streamed loss builds its target from, per run of rows;
`WholeTeacher` holds the same inputs built whole, as the direct loss takes them, and
`Teacher.whole(packing)` builds one from the other.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from core.ops.chunked_attention import NEG, Packing, RowQueries, sliding_window_mask

TEACHERS = ("compressed", "joint")
EPS = 1e-8  # DESIGN.md's epsilon in the teacher normalisation and in log(P + eps)


class Spec(NamedTuple):
    """Static (hashable) settings of one loss call."""

    head_chunk: int    # heads per scan step (already resolved: divides H and HI)
    query_chunk: int   # query positions per scan step (already resolved: divides T)
    joint: bool        # joint teacher: softmax normaliser includes window keys and the sink
    topk: int | None = None   # streamed only: sparse selection
    window: int = 0           # streamed only: sliding window S for the joint teacher
    index_chunk: int = 0      # streamed only: indexer heads per scan step (divides HI)
    inputs_grad: bool = True  # streamed only: the gradient reaches the indexer queries' per-token inputs


@functools.partial(jax.tree_util.register_dataclass, data_fields=["queries", "compressed_bwd", "raw_bsd", "sink_h"],
                   meta_fields=["kind", "window"])
@dataclasses.dataclass(frozen=True)
class Teacher:
    """The main attention's inputs the streamed loss builds its target from (detached there).

    kind "compressed": softmax over the allowed blocks; "joint": each head's normaliser also covers
    the raw window keys (within `window` tokens) and its sink, so raw_bsd, sink_h and window > 0
    are needed.
    """

    queries: RowQueries        # main-attention queries [B, T, H, D], scaled by D^-1/2, per run of rows
    compressed_bwd: Any        # main compressed keys [B, W, D]
    raw_bsd: Any = None        # joint: raw window keys [B, T, D], shared by all heads
    sink_h: Any = None         # joint: per-head sink logit [H]
    kind: str = "compressed"
    window: int = 0            # joint: sliding window S (tokens)

    def whole(self, packing: Packing) -> "WholeTeacher":
        """The same teacher built whole: every row's queries and, joint, the window mask of `packing`."""
        positions_bt, segment_ids_bt = packing
        window_bts = sliding_window_mask(positions_bt, segment_ids_bt, self.window) if self.kind == "joint" else None
        return WholeTeacher(self.queries.whole(positions_bt).inputs, self.compressed_bwd, self.raw_bsd,
                            self.sink_h, self.kind, window_bts)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["query_bthd", "compressed_bwd", "raw_bsd", "sink_h", "window_bts"],
                   meta_fields=["kind"])
@dataclasses.dataclass(frozen=True)
class WholeTeacher:
    """`Teacher`'s inputs built whole, as the direct loss takes them (detached there).

    A sibling of `Teacher` rather than a use of it: the direct loss is given arrays, and an
    arbitrary window mask, where the streamed loss builds its queries and window rows per block
    from `RowQueries` and a window size. kind "joint" needs raw_bsd, sink_h and window_bts; the
    compressed teacher ignores them.
    """

    query_bthd: Any            # main-attention queries [B, T, H, D], scaled by D^-1/2
    compressed_bwd: Any        # main compressed keys [B, W, D]
    raw_bsd: Any = None        # joint: raw window keys [B, T, D], shared by all heads
    sink_h: Any = None         # joint: per-head sink logit [H]
    kind: str = "compressed"
    window_bts: Any = None     # joint: bool [B, T, S=T], raw key s in query t's window


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


def teacher_rows(spec: Spec, q_bthd, kv_bwd, allowed_btw, raw_kv_bsd=None, window_bts=None, sink_h=None):
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
