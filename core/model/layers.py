"""What every layer is built of: parameters with logical axes, RMS normalisation, RoPE, the KV
compressor (the attention's and its indexer's) and the lightning indexer's parameters and projections
(`Indexer`, DESIGN.md "Lightning indexer"; what the attention does with them: core/model/attention.py).

Every parameter of the decoder is created through `param`, which attaches logical axis names
(embed, mlp, experts, heads, kv, vocab, norm, mhc, ...) as the variable's `out_sharding`
metadata without sharding anything eagerly: a mesh maps the names to device axes later
(`nnx.get_partition_spec` + logical rules), so the layers never know about devices.

RMSNorm follows DESIGN.md and the official DeepSeek-V4 code: normalise in float32,
x * rsqrt(mean(x^2) + eps), times a learned per-feature scale (init 1), cast back to the input
dtype. `rms_normalize` is the same without the scale (per-head query norm, mHC input norm).

RoPE: partial rotary position embedding with YaRN (DESIGN.md, "RoPE"; "Attention", last sentence).
It rotates only the last R = qk_rope_head_dim features of a vector; the leading features carry
no position. Those R features form interleaved pairs (2i, 2i+1), i.e. the official code's complex
view `x[..., -R:].unflatten(-1, (-1, 2))`, and pair i turns by the angle position * freq[i].
The inverse rotation (the conjugate) is applied to the attention output.

Per-layer frequencies, as in the official DeepSeek-V4 inference code:
  * sliding-window (SWA) layers: theta = rope_max_timescale, never YaRN;
  * compressed (CSA/HCA) layers and their indexer: theta = compressed_rope_max_timescale, with
    YaRN frequency interpolation when rope_type = yarn.
YaRN here is frequency interpolation only: dims whose wavelength is short against
original_max_position_embeddings (more than beta_fast rotations) keep their frequency, long ones
(fewer than beta_slow rotations) are divided by rope_factor, with a linear ramp in between. The
official V4 code applies no YaRN attention-temperature (mscale) correction: the softmax scale
stays head_dim^-1/2, and so does ours.

The KV compressor (DESIGN.md, "Compressor"): gated per-feature softmax pooling of token blocks.
Every m consecutive tokens become one compressed entry of width d:

  a = x W_kv, g = x W_gate + ape[slot]       (float32, width c*d; c = 2 when overlapping)
  plain (m = 128, HCA):   entry[w] = sum over the m slots of block w of softmax_slot(g) * a
  overlap (m = 4, CSA and the indexer): the features split into halves A | B and entry[w]
      pools 2m slots: the A-half of block w-1's tokens and the B-half of block w's tokens.
      Block w-1's slots are excluded for w = 0 and whenever block w does not continue block
      w-1's document (their first tokens' positions do not differ by exactly m).
  then RMSNorm (learned scale) and RoPE on the last R features at the block's first position.

The softmax runs over slots independently for every feature. Only complete blocks are
compressed: W = T // m, trailing tokens that do not fill a block are dropped (a query never sees
an incomplete block anyway). Deviation from the official inference code: no FP8/FP4
quantisation simulation and no Hadamard rotation of the indexer's keys (an orthogonal map applied
to both indexer queries and keys, which leaves their dot products unchanged).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from core import tree
from core.model.init_draws import FanInTruncatedNormal
from core.ops.chunked_attention import NEG, RowQueries, block_first_positions
from core.ops.placement import gather_weight
from core.ops.topk import IndexerInputs

Initializer = Callable[..., jax.Array]


def dense_init(in_axis: int | Sequence[int] = -2, out_axis: int | Sequence[int] = -1,
               batch_axis: Sequence[int] = ()) -> Initializer:
    """Fan-in scaled truncated normal (variance 1 / fan_in) for a weight of any rank.

    Args:
      in_axis: the contracted (input-feature) axis or axes.
      out_axis: the output-feature axis or axes.
      batch_axis: axes that index independent matrices (e.g. experts), excluded from fan-in.
    Returns:
      an initializer `init(key, shape, dtype)`: JAX's `variance_scaling(1, "fan_in",
      "truncated_normal")`, drawn from shared flat programs inside `bucketed_draws()`
      (core/model/init_draws.py; bitwise the same values).
    """
    return FanInTruncatedNormal(in_axis, out_axis, batch_axis)


def param(rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], axes: Sequence[str | None],
          dtype=jnp.float32) -> nnx.Param:
    """An `nnx.Param` of `shape` initialised by `init`, annotated with logical `axes`.

    Args:
      rngs: the module's random streams (the `params` stream is used).
      init: `init(key, shape, dtype) -> array`.
      shape: the parameter shape.
      axes: one logical axis name (or None = replicated) per dimension.
      dtype: storage dtype (config `weight_dtype`).
    Returns:
      the parameter; `nnx.get_partition_spec` reads `axes` back from its metadata.
    """
    shape = tuple(int(s) for s in shape)
    axes = tuple(axes)
    if len(axes) != len(shape):
        raise ValueError(f"param of shape {shape} needs one axis name per dimension, got {axes}")
    value = init(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def hold_frozen(model: nnx.Module, trainable: Callable[[str], bool], dtype) -> list[str]:
    """Cast every frozen nnx.Param of `model` to `dtype` (config `frozen_weight_dtype`), in place.

    Nothing updates a frozen parameter, so it needs no float32 master copy (docs/precision.md).

    Args:
      model: the decoder (concrete, or inside `nnx.eval_shape` / a jit).
      trainable: '/'-joined parameter path -> trained? (the config's masks).
      dtype: the storage dtype of the frozen parameters.
    Returns:
      the cast parameter paths.
    """
    cast = []
    for path, node in nnx.iter_graph(model):
        full = tree.join(path)
        if isinstance(node, nnx.Param) and node.dtype != dtype and not trainable(full):
            node.set_value(node.get_value().astype(dtype))
            cast.append(full)
    return cast


def upcast(x: jax.Array) -> jax.Array:
    """x in at least float32: bf16/f32 -> f32, f64 stays f64 (the float64 reference tests)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """Weightless RMS normalisation over the last axis, computed in (at least) float32.

    Args:
      x: [..., d] any float dtype.
      eps: added to the mean square.
    Returns:
      float32 [..., d] (float64 for float64 input): x / sqrt(mean(x^2) + eps).
    """
    x = upcast(x)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """RMS normalisation with a learned per-feature scale `weight` (init 1).

    Output dtype = input dtype; the normalisation itself runs in float32.
    """

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 axis_name: str = "norm"):
        self.eps = float(eps)
        self.weight = param(rngs, nnx.initializers.ones, (dim,), (axis_name,), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_normalize(x, self.eps) * upcast(self.weight[...])
        return y.astype(x.dtype)


# ----------------------------------------------------------------------------- rope

def rope_frequencies(rope_dim: int, theta: float, *, yarn_factor: float = 1.0, original_max_positions: int = 0,
                     beta_fast: float = 32.0, beta_slow: float = 1.0) -> tuple[float, ...]:
    """A layer's RoPE: the angular frequency of each of its R / 2 rotating pairs (float64 values, a
    hashable tuple, so it can live on a layer's spec; core.spec.resolve computes it per layer).

    rope_dim: R, the trailing features that rotate (even). theta: the base wavelength scale; YaRN
    (yarn_factor > 1 and original_max_positions > 0): the context-extension factor, the
    pre-training context (tokens) and the ramp's boundaries (rotations over that context).

    Base: freq[i] = theta^(-2i / R). With YaRN, pair i keeps freq[i] below the ramp, becomes
    freq[i] / factor above it, and interpolates linearly inside it; the ramp runs between the
    pair indices where a wavelength fits beta_fast and beta_slow times into the original context.
    """
    r = rope_dim
    freqs = theta ** (-np.arange(0, r, 2, dtype=np.float64) / r)
    if yarn_factor > 1.0 and original_max_positions > 0:
        def pair_of(rotations: float) -> float:  # the (fractional) dim where `rotations` fit
            return r * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(pair_of(beta_fast)), 0)
        high = min(math.ceil(pair_of(beta_slow)), r - 1)
        if low == high:
            high += 0.001  # the official code's guard against a zero-width ramp
        ramp = np.clip((np.arange(r // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        freqs = freqs / yarn_factor * ramp + freqs * (1.0 - ramp)
    return tuple(float(f) for f in freqs)


def apply_rope(x, positions, rope: tuple[float, ...], *, inverse: bool = False):
    """Rotate the last R features of `x` as interleaved pairs by position * freq.

    Args:
      x: [B, T, ..., F] any float dtype, F >= R; e.g. q_bthd, kv_btd, kv_bwd.
      positions: int [B, T] (one position per leading (B, T) entry, broadcast over the rest).
      rope: the layer's pair frequencies (`rope_frequencies`); R = 2 len(rope), () rotates nothing.
      inverse: rotate by -angle (the conjugate), undoing a forward rotation.

    Returns:
      x's shape and dtype; the leading F - R features unchanged.

    Shapes:
      1. angle_bt..r = positions * freq_r          (float32, float64 for float64 x)
      2. (x0, x1) pairs of x[..., F-R:]  ->  (x0 cos - x1 sin, x0 sin + x1 cos)
    """
    r = 2 * len(rope)
    if r == 0:
        return x
    acc = jnp.promote_types(x.dtype, jnp.float32)  # float32, or float64 in x64 references
    freq_r = jnp.asarray(np.asarray(rope, np.float64), acc)
    pos = positions.reshape(positions.shape + (1,) * (x.ndim - 1 - positions.ndim))
    angle = pos.astype(acc)[..., None] * freq_r
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if inverse:
        sin = -sin
    nope, rot = x[..., : x.shape[-1] - r], x[..., x.shape[-1] - r:]
    pairs = rot.astype(acc).reshape(rot.shape[:-1] + (r // 2, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    turned = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(rot.shape)
    return jnp.concatenate([nope, turned.astype(x.dtype)], axis=-1)


# ----------------------------------------------------------------------------- compressor

def compress(x_btm, wkv_mf, wgate_mf, ape_rf, norm_d, positions_bt, *, ratio: int, eps: float, rope: tuple[float, ...]):
    """Compress `x` into T // ratio entries (overlapping pooling when ratio == 4).

    Args:
      x_btm: [B, T, M] token features (the attention input).
      wkv_mf, wgate_mf: the value and gate projections [M, c*d] (c = 2 if ratio == 4 else 1).
      ape_rf: [ratio, c*d] learned position bias added to the gate per slot.
      norm_d: [d] RMSNorm scale.
      positions_bt: int [B, T], restarting at 0 per document.
      ratio: tokens per block m (static; 4 overlaps).
      eps: RMSNorm epsilon.
      rope: the layer's RoPE frequencies (applied at each block's first position).

    Returns:
      [B, T // ratio, d] in x's dtype (pooled in float32, or float64 for float64 inputs).

    Shapes:
      1. kv_bwrf, gate_bwrf = x W_kv, x W_gate + ape      (blocks of r = ratio slots)
      2. overlap: slots_bw(2r)d = [A-half of block w-1 | B-half of block w]
      3. pooled_bwd = sum_slot softmax_slot(gate) * kv
      4. kv_bwd = RoPE(RMSNorm(pooled), first position of block w)
    """
    b, t, _ = x_btm.shape
    w = t // ratio
    overlap = ratio == 4
    in_dtype = x_btm.dtype
    acc = jnp.promote_types(in_dtype, jnp.float32)
    x_btm = x_btm[:, : w * ratio].astype(acc)
    kv_btf = checkpoint_name(jnp.einsum("btm,mf->btf", x_btm, wkv_mf.astype(acc)), "compressor_proj")
    gate_btf = checkpoint_name(jnp.einsum("btm,mf->btf", x_btm, wgate_mf.astype(acc)), "compressor_proj")
    f = kv_btf.shape[-1]
    kv_bwrf = kv_btf.reshape(b, w, ratio, f)
    gate_bwrf = gate_btf.reshape(b, w, ratio, f) + ape_rf.astype(acc)
    first_bw = block_first_positions(positions_bt[:, : w * ratio], ratio)

    if overlap:
        d = f // 2
        # Block w-1's A-half, shifted one block later; a zero block stands in front of block 0.
        prev_kv = jnp.pad(kv_bwrf[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)))
        prev_gate = jnp.pad(gate_bwrf[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)))
        prev_first_bw = jnp.pad(first_bw[:, :-1], ((0, 0), (1, 0)))
        continues_bw = (first_bw - prev_first_bw == ratio) & (jnp.arange(w) > 0)
        prev_gate = jnp.where(continues_bw[:, :, None, None], prev_gate, NEG)
        kv_bwrf = jnp.concatenate([prev_kv, kv_bwrf[..., d:]], axis=2)
        gate_bwrf = jnp.concatenate([prev_gate, gate_bwrf[..., d:]], axis=2)

    probs_bwrf = jax.nn.softmax(gate_bwrf, axis=2)
    pooled_bwd = jnp.sum(probs_bwrf * kv_bwrf, axis=2)
    normed_bwd = rms_normalize(pooled_bwd, eps).astype(acc) * norm_d.astype(acc)
    return apply_rope(normed_bwd, first_bw, rope).astype(in_dtype)


class Compressor(nnx.Module):
    """Parameters of one compressor: wkv, wgate [M, c*d], ape [m, c*d] (init 0), norm [d]."""

    def __init__(self, emb: int, head_dim: int, ratio: int, rope: tuple[float, ...], eps: float, *,
                 rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32):
        self.ratio, self.rope, self.eps, self.dtype = ratio, rope, float(eps), dtype
        width = (2 if ratio == 4 else 1) * head_dim
        self.wkv = param(rngs, dense_init(), (emb, width), ("embed", "kv"), param_dtype)
        self.wgate = param(rngs, dense_init(), (emb, width), ("embed", "kv"), param_dtype)
        self.ape = param(rngs, nnx.initializers.zeros, (ratio, width), (None, "kv"), param_dtype)
        self.norm = RMSNorm(head_dim, eps, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x_btm, positions_bt):
        """[B, T, M] -> compressed entries [B, T // ratio, d] in the compute dtype."""
        kv_bwd = compress(x_btm, self.wkv[...], self.wgate[...], self.ape[...], self.norm.weight[...], positions_bt,
                          ratio=self.ratio, eps=self.eps, rope=self.rope)
        return kv_bwd.astype(self.dtype)


# ----------------------------------------------------------------------------- the lightning indexer
# Its inputs are detached, so neither its loss reaches other parameters nor (the selection being
# discrete) the LM loss the indexer; its scoring and top-k are core.ops.topk's pure functions.

def indexer_queries(c_q_btr, wq_b_rid, positions_bt, *, rope: tuple[float, ...], dtype):
    """q_btid = RoPE(c_q W_Iq) in `dtype`: [B, T, R] x [R, HI, DI] -> [B, T, HI, DI]."""
    q_btid = jnp.einsum("btr,rid->btid", c_q_btr.astype(dtype), wq_b_rid.astype(dtype))
    return apply_rope(q_btid, positions_bt, rope)


def local_gradient_loss(module: nnx.Module, loss_of):
    """`loss_of(module)` whose gradient w.r.t. the module's parameters is taken here, in the forward.

    For a loss that reaches nothing but `module`'s own nnx.Params (the indexer loss: the indexer's
    inputs and teacher are detached). Returns the surrogate

        stop_gradient(value) + sum over parameters p of  sum((p - stop_gradient(p)) * g_p),
        g = d loss / d p,

    equal to the loss in value and with gradient g for p, and no gradient for anything else. The
    outer backward then needs only g (named "indexer_local_grads", which every remat policy saves),
    not the layer's activations: no layer of the warm-up runs again in the backward, and no layer's
    input is kept for it (core/model/transformer.py).
    """
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    value, grads = jax.value_and_grad(lambda p: loss_of(nnx.merge(graphdef, p, rest)))(jax.lax.stop_gradient(params))
    return local_gradient_surrogate(params, value, grads)


def local_gradient_surrogate(params, value, grads):
    """`local_gradient_loss`'s surrogate of a loss `value` whose gradient `grads` w.r.t. `params`
    (an nnx.State of a module's Params, as `nnx.split` gives it) is already known:
    stop_gradient(value) + sum over p of sum((p - stop_gradient(p)) * g_p)."""
    sg = jax.lax.stop_gradient
    grads = jax.tree.map(lambda g: checkpoint_name(sg(g), "indexer_local_grads"), grads)

    def inner(p, g):  # in float32 (float64 for float64 parameters); its gradient is g, cast to p's dtype
        acc = jnp.promote_types(p.dtype, jnp.float32)
        return jnp.sum((p.astype(acc) - sg(p).astype(acc)) * g.astype(acc))

    inner = [inner(p, g) for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads))]
    return sg(value) + sum(inner)


WEIGHTS_INITS = ("fan_in", "zeros")  # IndexerSpec.weights_init: how weights_proj starts


@dataclasses.dataclass(frozen=True)
class IndexerSpec:
    """Static shape of one lightning indexer, passed down whole (built from the layer's AttentionSpec)."""

    emb: int            # model width M
    q_lora_rank: int    # width of the main attention's c_q, the queries' input
    heads: int          # HI
    head_dim: int       # DI, also the width of the indexer's compressor
    rope: tuple[float, ...]  # the layer's RoPE frequencies
    eps: float          # the compressor's RMSNorm epsilon
    weights_init: str = "fan_in"  # one of WEIGHTS_INITS


class Indexer(nnx.Module):
    """The lightning indexer of one CSA layer (official names, [in, out] layout).

    Parameters: wq_b [q_lora, HI, DI] (indexer queries from the main attention's c_q),
    weights_proj [M, HI] (per-head weights from x), compressor (its own overlapping m = 4
    compressor of width DI). Both inputs pass through `stop_gradient`, so no gradient leaves the
    indexer. The official code also applies a Hadamard rotation and FP4 quantisation to q_I and
    k_I; the rotation is orthogonal on both sides (dot products unchanged) and the quantisation is
    inference-only simulation, so both are omitted.

    spec.weights_init: "fan_in" (the default: weights_proj ~ variance 1/M) or "zeros" (weights_proj = 0:
    every score 0, a uniform student; the first step's gradient reaches weights_proj only, the next
    ones q and k too). The warm-up presets start from "zeros": a random start is a student worse
    than uniform (docs/benchmarks.md#why-the-defaults).
    """

    def __init__(self, spec: IndexerSpec, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32):
        s = spec
        if s.weights_init not in WEIGHTS_INITS:
            raise ValueError(f"weights_init={s.weights_init!r} is unknown: use one of {', '.join(WEIGHTS_INITS)}")
        self.heads, self.head_dim, self.rope, self.dtype = s.heads, s.head_dim, s.rope, dtype
        self.wq_b = param(rngs, dense_init(in_axis=0, out_axis=(1, 2)), (s.q_lora_rank, s.heads, s.head_dim),
                          ("q_lora", "indexer_heads", "kv"), param_dtype)
        # "zeros": every score 0, the student uniform (KL = KL_uniform) instead of a random one worse
        # than uniform; `param` draws its key either way, so every other parameter is unchanged.
        w_init = dense_init() if s.weights_init == "fan_in" else jax.nn.initializers.zeros
        self.weights_proj = param(rngs, w_init, (s.emb, s.heads), ("embed", "indexer_heads"), param_dtype)
        self.compressor = Compressor(s.emb, s.head_dim, 4, s.rope, s.eps, rngs=rngs,
                                     param_dtype=param_dtype, dtype=dtype)

    def inputs(self, x_btm, c_q_btr, positions_bt) -> IndexerInputs:
        """Detached inputs -> IndexerInputs(q_I per run of rows, k_bwd, weights_bti float32).

        Shapes:
          1. q_btid  = RoPE(stop_gradient(c_q) W_Iq)   at positions[t], built where consumed
          2. k_bwd   = compressor(x)           (m = 4, overlapping; RoPE at block starts)
          3. weights = x W_Iw * HI^-1/2 * DI^-1/2
        """
        queries = RowQueries(functools.partial(indexer_queries, rope=self.rope, dtype=self.dtype),
                             jax.lax.stop_gradient(c_q_btr), gather_weight(self.wq_b[...], heads_axis=1))
        return IndexerInputs(queries, *self.keys_and_weights(x_btm, positions_bt))

    def keys_and_weights(self, x_btm, positions_bt):
        """(k_bwd, weights_bti float32) of `inputs` from the detached x."""
        dt = self.dtype
        x_btm = jax.lax.stop_gradient(x_btm).astype(dt)
        k_bwd = self.compressor(x_btm, positions_bt)
        weights_bti = jnp.einsum("btm,mi->bti", x_btm, self.weights_proj[...].astype(dt))
        return k_bwd, weights_bti.astype(jnp.float32) * (self.heads ** -0.5 * self.head_dim ** -0.5)
