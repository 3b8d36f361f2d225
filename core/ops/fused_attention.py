"""`softmax_attention` for one layer as two Pallas TPU kernels (forward, backward) under a custom VJP
(DESIGN.md, "Attention").

Computes what `core.ops.masked_attention.softmax_attention` computes, window raw keys + allowed
compressed entries + a per-head sink in one softmax, without any [T, T] or [T, W] logits in HBM and
without the query-chunked path's layout copies: the kernels read q [B, T, H, D] and write
o [B, T, H, D] in place, a block of tq tokens at a time, their H heads folded into R = tq H rows
of D (MQA: every head meets the same keys, so one [R, D] x [D, K] product serves them all).

Per grid step (b, i), tokens [t0, t0 + tq), t0 = i tq, and j = t0 // KB:

  window      key blocks j - 1 (clamped at 0 and then masked) and j of KB rows, KB the least
              multiple of lcm(tq, 128) >= S: they hold every key of the block's windows when, as
              DESIGN.md states, positions count up by one inside a document (a query's window keys
              are then among its S - 1 predecessors). The mask is `window_rows`' rule on the keys'
              own positions and segment ids, so within those blocks it is exact
  compressed  the whole [W, D] of batch row b (one fetch per b), masked by `allowed` [tq, W], in
              chunks of 128 entries up to the step's reach (`entry_reach`: 1 + the last chunk any of
              its rows may attend, prefetched into SMEM): under causal visibility a step skips the
              entries completed after its last query, about half of them over a sequence
  sink        [H]; exp(sink) joins the denominator only

Forward: logits [R, 2 x KB] and, chunk by chunk into a VMEM scratch, [R, W] in float32, one max over
them and the sink, then p = exp(l - m), o = (p in the keys' dtype) . keys / (sum p + exp(sink - m))
as flash attention feeds its second matmul; it also writes the log-sum-exp lse [B, T, H] (float32)
for the backward. Backward (the query axis sequential), in two passes over the live chunks:
p = exp(l - lse) recomputed and dp = do . k into scratch, delta = rowsum(p dp) (= rowsum(do o):
every key of a row is in its step, so o is not kept for the backward); then ds = p (dp - delta);
dq = ds . k; dkv = ds^T q + p^T do (keys = values). The window part of dkv
accumulates in two float32 outputs resident while j holds: contributions to block j ("self") and to
block j - 1 ("prev", stored at j), summed outside with prev shifted one block; dckv [W, D] float32
is resident per batch row; the kernel writes delta [B, T, H], and dsink = -sum of exp(sink - lse)
delta over a head's rows (outside).

Assumptions and padding: T is padded up to a multiple of KB and W up to a multiple of 128 in the
wrapper (padding tokens are segment 0 and see nothing; padding entries are never allowed), then the
outputs are sliced back. On a TPU, D must be a multiple of 128 and H of 16 (the head fold is a
free reshape of the bf16 [tq, H, D] block only then); interpret mode takes any shape. `allowed`
travels as int8 when tq is a multiple of 32 (int8 blocks tile by 32 rows), else as int32.

VMEM, in bytes, with e the compute dtype's size and K = 2 x KB + W keys per step: the
double-buffered blocks take 2 (2 R D e + 2 x KB D e + W D e) in the forward (q, o, the two key
blocks, the compressed entries), and the backward adds do and dq, 2 (2 R D e), and the float32
accumulators, 2 (2 x KB D + W D) 4; the temporaries are a few [R, 2 x KB] and [R, 128] float32
arrays (logits, masks and exps; in the backward p, dp and ds), the scratch [R, W] float32 (the
forward's logits; the backward's p and dp) and [R, D] float32 ones. The [R, K] arrays dominate at
the target shapes (H = 64, D = 512, S = 128, W = 1024), so VMEM grows linearly with tq: the
forward fits the default scoped limit only for small tq, and `_vmem_limit` asks for twice the
backward's estimate within the bounds it names, below v5e's VMEM: enough for tq up to 64.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from core.ops.chunked_attention import NEG

_LANES = 128


class _Blocks(NamedTuple):
    """The static tiling: tq query tokens per step, KB raw keys per key block, the window S."""

    tq: int
    kb: int
    window: int
    interpret: bool


def key_block(block_q: int, window: int) -> int:
    """KB: the least multiple of lcm(block_q, 128) that is >= window (and >= 128)."""
    unit = math.lcm(block_q, _LANES)
    return unit * max(1, -(-window // unit))


def _ceil_to(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _pad_axis(x, axis: int, size: int):
    pad = size - x.shape[axis]
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


# ---- in-kernel helpers (2D arrays only: rows r = a H + h for token a of the block, head h) ----

def _rows(x_ak, h: int):
    """[tq, K] -> [R, K]: each token's row repeated for its h heads."""
    return jnp.concatenate([jnp.broadcast_to(x_ak[a:a + 1], (h, x_ak.shape[1])) for a in range(x_ak.shape[0])], axis=0)


def _eye(h: int):
    return jax.lax.broadcasted_iota(jnp.int32, (h, h), 0) == jax.lax.broadcasted_iota(jnp.int32, (h, h), 1)


def _column(x_ah, h: int):
    """[tq, H] -> [R, 1] (row a H + h holds x[a, h]); a masked reduce, no relayout."""
    eye = _eye(h)
    return jnp.concatenate([jnp.sum(jnp.where(eye, x_ah[a:a + 1], 0.0), axis=1, keepdims=True)
                            for a in range(x_ah.shape[0])], axis=0)


def _by_head(x_r1, tq: int, h: int):
    """[R, 1] -> [tq, H], the inverse of `_column`."""
    eye = _eye(h)
    return jnp.concatenate([jnp.sum(jnp.where(eye, x_r1[a * h:(a + 1) * h], 0.0), axis=0, keepdims=True)
                            for a in range(tq)], axis=0)


def _nt(a, b):
    """a [M, C] . b [N, C]^T -> [M, N] float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _tn(a, b):
    """a [C, M]^T . b [C, N] -> [M, N] float32."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _nn(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _window_parts(blk: _Blocks, h: int, qi_ref, kpi_ref, kci_ref, kp_ref, kc_ref):
    """The window's keys [KB, D] of this step and their masks bool [R, KB]: the previous key block
    and the current one."""
    j = jax.lax.div(pl.program_id(1), jnp.int32(blk.kb // blk.tq))  # lax: jnp's // lowers through sign
    qi = qi_ref[...]
    qpos, qseg = qi[:, 0:1], qi[:, 1:2]

    def window(ki, limit):  # `window_rows`' rule: same real document, 0 <= pos[t] - pos[s] < limit
        dist = qpos - ki[0:1]
        ok = (qseg == ki[1:2]) & (qseg >= 1) & (dist >= 0) & (dist < limit)
        return _rows(jnp.where(ok, 1.0, 0.0), h) > 0.5

    # block j - 1 is clamped to 0 at j = 0: a limit of 0 masks the duplicate away
    return [(kp_ref[...], window(kpi_ref[...], jnp.where(j > 0, blk.window, 0))),
            (kc_ref[...], window(kci_ref[...], blk.window))]


def _each_live_chunk(reach_ref, ckv_ref, al_ref, h: int, body) -> None:
    """`body(cols, keys [128, D], mask bool [R, 128])` for each chunk of 128 compressed entries that
    some row of this step may attend: those before the step's reach (`entry_reach`); the chunks past it,
    under causal visibility the entries completed after the step's last query, are skipped."""
    reach = reach_ref[pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)]
    for c in range(ckv_ref.shape[0] // _LANES):
        cols = slice(c * _LANES, (c + 1) * _LANES)

        @pl.when(c < reach)
        def _(cols=cols):
            body(cols, ckv_ref[cols, :], _rows(al_ref[:, cols].astype(jnp.float32), h) > 0.5)


def _fwd_kernel(reach_ref, qi_ref, kpi_ref, kci_ref, sink_ref, q_ref, kp_ref, kc_ref, *rest, blk: _Blocks,
                compressed: bool):
    ckv_ref, al_ref = rest[:2] if compressed else (None, None)
    o_ref, lse_ref = rest[2:4] if compressed else rest[:2]
    tq, h, d = q_ref.shape
    q_rd = q_ref[...].reshape(tq * h, d)
    parts = _window_parts(blk, h, qi_ref, kpi_ref, kci_ref, kp_ref, kc_ref)
    logits = [jnp.where(mask, _nt(q_rd, k), NEG) for k, mask in parts]
    mx_r1 = jnp.concatenate([sink_ref[...]] * tq, axis=0)
    denom_r1 = mx_r1  # the sink's logit, its exp taken below
    for l_rk in logits:
        mx_r1 = jnp.maximum(mx_r1, jnp.max(l_rk, axis=1, keepdims=True))
    if compressed:  # pass 1: the live chunks' logits into scratch, and the rows' max
        logit_ref, max_ref, den_ref, acc_ref = rest[4:]
        max_ref[...] = mx_r1

        def logits_of(cols, k, mask):
            l_rk = jnp.where(mask, _nt(q_rd, k), NEG)
            logit_ref[:, cols] = l_rk
            max_ref[...] = jnp.maximum(max_ref[...], jnp.max(l_rk, axis=1, keepdims=True))

        _each_live_chunk(reach_ref, ckv_ref, al_ref, h, logits_of)
        mx_r1 = max_ref[...]
    denom_r1 = jnp.exp(denom_r1 - mx_r1)
    o_rd = jnp.zeros((tq * h, d), jnp.float32)
    for l_rk, (k, mask) in zip(logits, parts):
        e_rk = jnp.where(mask, jnp.exp(l_rk - mx_r1), 0.0)
        denom_r1 = denom_r1 + jnp.sum(e_rk, axis=1, keepdims=True)
        o_rd = o_rd + _nn(e_rk.astype(k.dtype), k)
    if compressed:  # pass 2: the live chunks' exps into the denominator and the output
        den_ref[...], acc_ref[...] = denom_r1, o_rd

        def output_of(cols, k, mask):
            e_rk = jnp.where(mask, jnp.exp(logit_ref[:, cols] - mx_r1), 0.0)
            den_ref[...] += jnp.sum(e_rk, axis=1, keepdims=True)
            acc_ref[...] += _nn(e_rk.astype(k.dtype), k)

        _each_live_chunk(reach_ref, ckv_ref, al_ref, h, output_of)
        denom_r1, o_rd = den_ref[...], acc_ref[...]
    o_ref[...] = (o_rd / denom_r1).astype(o_ref.dtype).reshape(tq, h, d)
    lse_ref[...] = _by_head(mx_r1 + jnp.log(denom_r1), tq, h)


def _bwd_kernel(reach_ref, qi_ref, kpi_ref, kci_ref, q_ref, kp_ref, kc_ref, *rest, blk: _Blocks, compressed: bool):
    ckv_ref, al_ref = rest[:2] if compressed else (None, None)
    rest = rest[2:] if compressed else rest
    do_ref, lse_ref, dq_ref, delta_ref, dself_ref, dprev_ref = rest[:6]
    dckv_ref, p_ref, dp_ref, sum_ref, dqacc_ref = rest[6:] if compressed else (None,) * 5
    tq, h, d = q_ref.shape
    i = pl.program_id(1)

    @pl.when(jax.lax.rem(i, jnp.int32(blk.kb // blk.tq)) == 0)  # the first query block of key block j
    def _():
        dself_ref[...] = jnp.zeros_like(dself_ref)
        dprev_ref[...] = jnp.zeros_like(dprev_ref)

    if compressed:
        @pl.when(i == 0)
        def _():
            dckv_ref[...] = jnp.zeros_like(dckv_ref)

    q_rd = q_ref[...].reshape(tq * h, d)
    do_rd = do_ref[...].reshape(tq * h, d)
    lse_r1 = _column(lse_ref[...], h)
    parts = _window_parts(blk, h, qi_ref, kpi_ref, kci_ref, kp_ref, kc_ref)
    # every key of these rows is in this step: delta = rowsum(do o) = sum over keys of p dp, so o need not be kept
    p_dp = [(jnp.where(mask, jnp.exp(_nt(q_rd, k) - lse_r1), 0.0), _nt(do_rd, k)) for k, mask in parts]
    delta_r1 = sum(jnp.sum(p_rk * dp_rk, axis=1, keepdims=True) for p_rk, dp_rk in p_dp)
    if compressed:  # pass 1: the live chunks' p and dp into scratch, and their share of delta
        sum_ref[...] = delta_r1

        def p_dp_of(cols, k, mask):
            p_rk = jnp.where(mask, jnp.exp(_nt(q_rd, k) - lse_r1), 0.0)
            dp_rk = _nt(do_rd, k)
            p_ref[:, cols], dp_ref[:, cols] = p_rk, dp_rk
            sum_ref[...] += jnp.sum(p_rk * dp_rk, axis=1, keepdims=True)

        _each_live_chunk(reach_ref, ckv_ref, al_ref, h, p_dp_of)
        delta_r1 = sum_ref[...]
    dq_rd = jnp.zeros((tq * h, d), jnp.float32)
    for (k, _), (p_rk, dp_rk), acc_ref in zip(parts, p_dp, [dprev_ref, dself_ref]):
        ds_rk = p_rk * (dp_rk - delta_r1)
        dq_rd = dq_rd + _nn(ds_rk.astype(k.dtype), k)
        acc_ref[...] += _tn(ds_rk.astype(q_rd.dtype), q_rd) + _tn(p_rk.astype(do_rd.dtype), do_rd)
    if compressed:  # pass 2: the live chunks' gradients
        dqacc_ref[...] = dq_rd

        def gradients_of(cols, k, _):
            p_rk = p_ref[:, cols]
            ds_rk = p_rk * (dp_ref[:, cols] - delta_r1)
            dqacc_ref[...] += _nn(ds_rk.astype(k.dtype), k)
            dckv_ref[cols, :] += _tn(ds_rk.astype(q_rd.dtype), q_rd) + _tn(p_rk.astype(do_rd.dtype), do_rd)

        _each_live_chunk(reach_ref, ckv_ref, al_ref, h, gradients_of)
        dq_rd = dqacc_ref[...]
    dq_ref[...] = dq_rd.astype(dq_ref.dtype).reshape(tq, h, d)
    delta_ref[...] = _by_head(delta_r1, tq, h)


def _vmem_limit(blk: _Blocks, h: int, d: int, w: int, itemsize: int) -> int:
    """Twice the backward's estimate (the module's docstring), within the bounds below."""
    r = blk.tq * h
    blocks = 2 * (4 * r * d * itemsize + 2 * blk.kb * d * (itemsize + 4) + w * d * (itemsize + 4))
    temps = 4 * r * (2 * blk.kb + _LANES) * 4 + 2 * r * w * 4 + 3 * r * d * 4  # window and chunk temporaries, scratch
    return int(min(100 << 20, max(32 << 20, 2 * (blocks + temps))))


def entry_reach(allowed_btw, block_q: int):
    """int32 [B * T / tq]: per grid step, 1 + the last chunk of 128 entries that any of its rows may
    attend (0 for none): the kernels skip the chunks past it."""
    b, t, w = allowed_btw.shape
    live = jnp.any(allowed_btw.reshape(b, t // block_q, block_q, w // _LANES, _LANES) != 0, axis=(2, 4))
    return jnp.max(jnp.where(live, jnp.arange(1, w // _LANES + 1, dtype=jnp.int32), 0), axis=-1).reshape(-1)


def _causal_entries(blk: _Blocks, t: int, w: int) -> int:
    """Entries the steps of one batch row attend under causal visibility, T/W tokens an entry, in
    whole chunks of 128 (what `entry_reach` lets through for a sequence without packing)."""
    if not w:
        return 0
    ratio = max(1, t // w)
    return sum(min(w, _ceil_to(-(-(i + 1) * blk.tq // ratio), _LANES)) for i in range(t // blk.tq))


def _cost(blk: _Blocks, q, w: int, mask_bytes: int, backward: bool):
    """The kernel's work for the compiler and the planner (`pl.CostEstimate`; core/plan/hlo.py reads
    its FLOPs): per step R = tq H rows meet the window's 2 x KB keys and the entries up to the step's
    reach (`_causal_entries`), the forward's two products 4 R D K FLOPs, the backward's five 10 R D K;
    one exponential per row and key in each."""
    b, t, h, d = q.shape
    e, steps = q.dtype.itemsize, b * (t // blk.tq)
    rows = b * t * h
    keys_x_rows = b * blk.tq * h * ((t // blk.tq) * 2 * blk.kb + _causal_entries(blk, t, w))
    reads = steps * 2 * blk.kb * d * e + b * w * d * e + b * t * w * mask_bytes + rows * 4  # keys, entries, mask, lse
    if backward:  # q, do, dq; the float32 key and entry gradients; delta
        moved = reads + 3 * rows * d * e + 2 * b * t * d * 4 + b * w * d * 4 + rows * 4
    else:  # q, o
        moved = reads + 2 * rows * d * e
    return pl.CostEstimate(flops=(10 if backward else 4) * d * keys_x_rows, transcendentals=keys_x_rows,
                           bytes_accessed=moved)


def _specs(blk: _Blocks, h: int, d: int, w: int):
    """BlockSpecs of (qinfo, kinfo prev, kinfo cur, q-shaped, kv prev, kv cur, ckv, allowed, lse-shaped,
    key-block-shaped, sink); their index maps also receive the prefetched reach, unused."""
    tq, kb = blk.tq, blk.kb
    per = kb // tq
    cur = lambda i: jax.lax.div(i, jnp.int32(per))  # int32 also under jax_enable_x64
    prev = lambda i: jnp.maximum(cur(i) - 1, 0)
    return dict(
        qi=pl.BlockSpec((None, tq, 2), lambda b, i, *_: (b, i, 0)),
        kpi=pl.BlockSpec((None, 2, kb), lambda b, i, *_: (b, 0, prev(i))),
        kci=pl.BlockSpec((None, 2, kb), lambda b, i, *_: (b, 0, cur(i))),
        q=pl.BlockSpec((None, tq, h, d), lambda b, i, *_: (b, i, 0, 0)),
        kp=pl.BlockSpec((None, kb, d), lambda b, i, *_: (b, prev(i), 0)),
        kc=pl.BlockSpec((None, kb, d), lambda b, i, *_: (b, cur(i), 0)),
        ckv=pl.BlockSpec((None, w, d), lambda b, i, *_: (b, 0, 0)),
        al=pl.BlockSpec((None, tq, w), lambda b, i, *_: (b, i, 0)),
        row=pl.BlockSpec((None, tq, h), lambda b, i, *_: (b, i, 0)),
        kd=pl.BlockSpec((None, kb, d), lambda b, i, *_: (b, cur(i), 0)),
        sink=pl.BlockSpec((h, 1), lambda b, i, *_: (0, 0)),
    )


def _reach_of(allowed, blk: _Blocks):
    return jnp.zeros((1,), jnp.int32) if allowed is None else entry_reach(allowed, blk.tq)


def _forward(blk: _Blocks, q, kv, sink, qinfo, kinfo, ckv, allowed, reach):
    b, t, h, d = q.shape
    w = 0 if ckv is None else ckv.shape[1]
    sp = _specs(blk, h, d, w)
    in_specs = [sp["qi"], sp["kpi"], sp["kci"], sp["sink"], sp["q"], sp["kp"], sp["kc"]]
    args = [qinfo, kinfo, kinfo, sink.reshape(h, 1), q, kv, kv]
    scratch = []
    if ckv is not None:
        in_specs += [sp["ckv"], sp["al"]]
        args += [ckv, allowed]
        r = blk.tq * h  # the live chunks' logits, the rows' max, denominator and output
        scratch = [pltpu.VMEM((r, w), jnp.float32), pltpu.VMEM((r, 1), jnp.float32), pltpu.VMEM((r, 1), jnp.float32),
                   pltpu.VMEM((r, d), jnp.float32)]
    grid = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(b, t // blk.tq), in_specs=in_specs,
                                        out_specs=[sp["q"], sp["row"]], scratch_shapes=scratch)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, blk=blk, compressed=ckv is not None),
        grid_spec=grid,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, t, h), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=_vmem_limit(blk, h, d, w, q.dtype.itemsize)),
        interpret=blk.interpret,
        cost_estimate=_cost(blk, q, w, 0 if allowed is None else allowed.dtype.itemsize, backward=False),
        name="fused_attention_fwd",
    )(reach, *args)


def _backward(blk: _Blocks, q, kv, qinfo, kinfo, ckv, allowed, reach, do, lse):
    b, t, h, d = q.shape
    w = 0 if ckv is None else ckv.shape[1]
    sp = _specs(blk, h, d, w)
    in_specs = [sp["qi"], sp["kpi"], sp["kci"], sp["q"], sp["kp"], sp["kc"]]
    args = [qinfo, kinfo, kinfo, q, kv, kv]
    if ckv is not None:
        in_specs += [sp["ckv"], sp["al"]]
        args += [ckv, allowed]
    in_specs += [sp["q"], sp["row"]]
    args += [do, lse]
    out_specs = [sp["q"], sp["row"], sp["kd"], sp["kd"]]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse.shape, jnp.float32)]
    out_shape += [jax.ShapeDtypeStruct(kv.shape, jnp.float32)] * 2
    scratch = []
    if ckv is not None:
        out_specs.append(pl.BlockSpec((None, w, d), lambda b, i, *_: (b, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct(ckv.shape, jnp.float32))
        r = blk.tq * h  # the live chunks' p and dp, delta's sum, dq's
        scratch = [pltpu.VMEM((r, w), jnp.float32), pltpu.VMEM((r, w), jnp.float32), pltpu.VMEM((r, 1), jnp.float32),
                   pltpu.VMEM((r, d), jnp.float32)]
    grid = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(b, t // blk.tq), in_specs=in_specs,
                                        out_specs=out_specs, scratch_shapes=scratch)
    outs = pl.pallas_call(
        functools.partial(_bwd_kernel, blk=blk, compressed=ckv is not None),
        grid_spec=grid,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=_vmem_limit(blk, h, d, w, q.dtype.itemsize)),
        interpret=blk.interpret,
        cost_estimate=_cost(blk, q, w, 0 if allowed is None else allowed.dtype.itemsize, backward=True),
        name="fused_attention_bwd",
    )(reach, *args)
    dq, delta, dself, dprev = outs[:4]
    # prev at block j holds block j - 1's share: shift it down one block (block 0's share is empty)
    dkv = dself + jnp.pad(dprev[:, blk.kb:], ((0, 0), (0, blk.kb), (0, 0)))
    return dq, delta, dkv, (outs[4] if ckv is not None else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(blk: _Blocks, q, kv, sink, qinfo, kinfo, ckv, allowed):
    return _forward(blk, q, kv, sink, qinfo, kinfo, ckv, allowed, _reach_of(allowed, blk))[0]


def _attend_fwd(blk, q, kv, sink, qinfo, kinfo, ckv, allowed):
    reach = _reach_of(allowed, blk)  # once per call: the backward skips the same chunks
    o, lse = _forward(blk, q, kv, sink, qinfo, kinfo, ckv, allowed, reach)
    lse = checkpoint_name(lse, "attn_lse")  # kept by remat_policy=projections, with the output (core.model.attention)
    return o, (q, kv, sink, qinfo, kinfo, ckv, allowed, reach, lse)  # not o: the backward finds delta without it


def _attend_bwd(blk, res, do):
    q, kv, sink, qinfo, kinfo, ckv, allowed, reach, lse = res
    dq, delta_bth, dkv, dckv = _backward(blk, q, kv, qinfo, kinfo, ckv, allowed, reach, do, lse)
    dsink_h = -jnp.sum(jnp.exp(sink.astype(jnp.float32) - lse) * delta_bth, axis=(0, 1))
    return (dq, dkv.astype(kv.dtype), dsink_h.astype(sink.dtype), None, None,
            None if ckv is None else dckv.astype(ckv.dtype), None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def fused_attention(q_bthd, kv_bsd, sink_h, positions_bt, segment_ids_bt, window: int, ckv_bwd=None,
                    allowed_btw=None, *, block_q: int = 16, interpret: bool = False):
    """`softmax_attention` with the window mask `sliding_window_mask(positions, segment_ids, window)`,
    as Pallas kernels (the module's docstring has the blocks and what they assume).

    Args:
      q_bthd: queries [B, T, H, D] (compute dtype), RoPE applied and already scaled by D^-1/2.
      kv_bsd: raw keys = values [B, S=T, D].
      sink_h: per-head sink logit [H] (float32): exp(sink) joins the denominator only.
      positions_bt, segment_ids_bt: int [B, T]; positions count up by one inside a document.
      window: the sliding window S (static).
      ckv_bwd: compressed entries [B, W, D] (keys = values), or None (SWA).
      allowed_btw: bool [B, T, W], which entries query t attends (visibility & selection); required
        with ckv_bwd.
      block_q: query tokens per grid step tq (static, a multiple of 8).
      interpret: run the kernels in Pallas' interpret mode (any backend).

    Returns:
      o_bthd [B, T, H, D] in q's dtype; a row with nothing allowed gives 0. Differentiable in q, kv,
      sink and ckv.

    Shapes (per step of tq tokens, R = tq H rows, K = 2 x KB + W keys):
      1. logits [R, K] = q [R, D] . [kv block j - 1; kv block j; ckv]^T, masked (float32)
      2. m = max(logits, sink); p = exp(logits - m); o [R, D] = p . keys / (sum p + exp(sink - m))
      3. lse [R] = m + log(denominator), kept for the backward as [B, T, H]
    """
    b, t, h, d = q_bthd.shape
    if block_q % 8:
        raise ValueError(f"fused_attention: block_q={block_q} must be a multiple of 8")
    if (ckv_bwd is None) != (allowed_btw is None):
        raise ValueError("fused_attention: ckv_bwd and allowed_btw come together (allowed is the caller's "
                         "visibility & selection)")
    kb = key_block(block_q, window)
    tp = _ceil_to(t, kb)
    q = _pad_axis(q_bthd, 1, tp)
    kv = _pad_axis(kv_bsd.astype(q_bthd.dtype), 1, tp)
    pos, seg = (_pad_axis(x.astype(jnp.int32), 1, tp) for x in (positions_bt, segment_ids_bt))  # padding: segment 0
    qinfo_bt2 = jnp.stack([pos, seg], axis=-1)
    kinfo_b2t = jnp.stack([pos, seg], axis=1)
    ckv, allowed = None, None
    if ckv_bwd is not None:
        wp = _ceil_to(max(ckv_bwd.shape[1], 1), _LANES)
        ckv = _pad_axis(ckv_bwd.astype(q_bthd.dtype), 1, wp)
        # int8 blocks tile by 32 rows on a TPU: narrower query blocks take the mask as int32
        mask_dtype = jnp.int8 if block_q % 32 == 0 else jnp.int32
        allowed = _pad_axis(_pad_axis(allowed_btw.astype(mask_dtype), 1, tp), 2, wp)
    blk = _Blocks(block_q, kb, window, interpret)
    o = _attend(blk, q, kv, sink_h.astype(jnp.float32), qinfo_bt2, kinfo_b2t, ckv, allowed)
    return o[:, :t]


def check_kernel_shapes(heads: int, head_dim: int) -> None:
    """ConfigError unless a TPU compiles the kernels for `heads` per device of `head_dim` features
    (the head fold of the module's docstring)."""
    if head_dim % _LANES or heads % 16:
        from core.errors import ConfigError

        raise ConfigError(f"attention=fused on a TPU needs head_dim a multiple of {_LANES} and a multiple of 16 "
                          f"heads per device (head_dim={head_dim}, {heads} heads per device): use attention=chunked.")


def fused_layer_attention(queries, keys, positions_bt, segment_ids_bt, selection=None, out_fn=None, *,
                          block_q: int = 16):
    """`masked_attention`'s contract (core.ops.masked_attention) through `fused_attention`: the
    `attention: fused` implementation of a layer.

    Args:
      queries: a `RowQueries`, built whole here ([B, T, H, D]; the kernels read them in place).
      keys: the layer's `Keys` (raw keys, sink, compressed entries and their visibility rule).
      positions_bt, segment_ids_bt: int [B, T].
      selection: CSA's top-k as a mask bool [B, T, W] or as (indices, validity) (its mask:
        core.ops.masked_attention.selected), or None for every visible entry.
      out_fn: (o [B, T, H, D], positions [B, T]) -> per-token output, run once; None keeps o.
      block_q: query tokens per grid step.

    On a mesh of several devices the kernels run inside `jax.shard_map` (XLA cannot partition a
    Mosaic kernel): each device on its own rows, split over the batch's mesh axes, and its own heads,
    split over `tensor`, where those divide (`core.ops.placement.divisible_prefix`); the keys are
    whole per row. Off a TPU the kernels run in Pallas' interpret mode.
    """
    from jax.sharding import PartitionSpec as P

    from core.ops.masked_attention import compressed_visibility, selected
    from core.ops.placement import BATCH_AXES, HEADS_AXIS, divisible_prefix, mesh_platform_of

    q_bthd = queries.of(queries.inputs, positions_bt)
    ckv, allowed = keys.compressed_bwd, None
    if ckv is not None:
        allowed = compressed_visibility(positions_bt, segment_ids_bt, keys.ratio)
        if selection is not None:
            allowed = allowed & selected(selection, allowed.shape[-1])
    mesh = jax.sharding.get_abstract_mesh()
    on_tpu = mesh_platform_of(mesh) == "tpu"
    attend = functools.partial(fused_attention, window=keys.window, block_q=block_q, interpret=not on_tpu)
    if mesh is None or mesh.empty or mesh.size == 1:
        if on_tpu:
            check_kernel_shapes(q_bthd.shape[2], q_bthd.shape[3])
        o = attend(q_bthd, keys.raw_bsd, keys.sink_h, positions_bt, segment_ids_bt, ckv_bwd=ckv, allowed_btw=allowed)
    else:
        rows = divisible_prefix(q_bthd.shape[0], BATCH_AXES, mesh)
        heads = divisible_prefix(q_bthd.shape[2], (HEADS_AXIS,), mesh)
        if on_tpu:
            check_kernel_shapes(q_bthd.shape[2] // (mesh.shape[HEADS_AXIS] if heads else 1), q_bthd.shape[3])
        per_row = P(rows, None, None)

        def per_device(q, kv, sink, pos, seg, ckv=None, allowed=None):
            return attend(q, kv, sink, pos, seg, ckv_bwd=ckv, allowed_btw=allowed)

        specs = (P(rows, None, heads, None), per_row, P(heads), P(rows, None), P(rows, None))
        args = (q_bthd, keys.raw_bsd, keys.sink_h, positions_bt, segment_ids_bt)
        if ckv is not None:
            specs, args = specs + (per_row, per_row), args + (ckv, allowed)
        # check_vma off: a Pallas kernel's output type says nothing of how it varies over the mesh's axes
        o = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P(rows, None, heads, None),
                          check_vma=False)(*args)
    return o if out_fn is None else out_fn(o, positions_bt)
