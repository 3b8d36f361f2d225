"""DeepSeek-V4's released weight formats as pure, jit-safe maths (DESIGN.md, "Frozen weights may stay
in their released format"; notes/checkpoint-format.md section 2).

  FP8 (linear weights): codes w [O, I] float8_e4m3fn, scales s [ceil(O/128), ceil(I/128)] float8_e8m0fnu
      W[r, c] = w[r, c] * s[r // 128, c // 128]
  FP4 (routed experts): codes p [O, I/2] int8, two e2m1 codes per byte along the input axis, LOW
      nibble = even column; scales s [O, I/32] e8m0
      W[r, c] = E2M1[nibble(r, c)] * s[r, c // 32]
  E2M1 = 0, .5, 1, 1.5, 2, 3, 4, 6 for codes 0-7, their negatives for 8-15 (bit 3 = sign);
  e8m0 byte b = 2^(b - 127).

Matrices are in the official [out, in] orientation; leading axes (stacked layers, experts) are
batch axes. Every e4m3 / e2m1 value times a power of two is a float32 (and a bfloat16) barring
exponent range, so `dequantize_*` in float32 is exact.

Quantisation (for planning, tests and quantising a float run): per block, the scale is the
smallest power of two with amax / scale <= the format's maximum (448 for e4m3, 6 for e2m1), as the
official `fast_round_scale`; codes are the values / scale rounded to nearest, ties to even. An
all-zero block gets scale 2^-127 (byte 0). Blocks of the edge may be partial.

`to_ours` / `to_official` map the official [*stack, O, I] matrices to dsv4's [in, out] parameter
layouts and back (the same maps as core/hf/names.py's LINEAR, heads(...) and GROUPED converters):
  ours = [*stack, (G,) I, *out]  <->  official [*stack, G * prod(out), I]
with G = `groups` output groups (attn.wo_a) and `out` the output axes (wq_b: heads, head_dim).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

FP8_BLOCK = 128
FP4_BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; 8-15 are their negatives
SCALE_MIN_EXP, SCALE_MAX_EXP = -127, 127  # e8m0 bytes 0..254 (255 is NaN)


# ----------------------------------------------------------------------------- scales


def _block_amax(w, rows: int, cols: int):
    """max |w| over blocks of rows x cols of the last two axes (edge blocks partial): [..., O/rows, I/cols]."""
    *lead, o, i = w.shape
    po, pi = -o % rows, -i % cols
    a = jnp.pad(jnp.abs(w), [(0, 0)] * len(lead) + [(0, po), (0, pi)])
    a = a.reshape(*lead, (o + po) // rows, rows, (i + pi) // cols, cols)
    return jnp.max(a, axis=(-3, -1))


def scale_exponent(amax, fmax: float):
    """int32 k of the e8m0 scales: the smallest 2^k (k in [-127, 126]) with amax / 2^k <= fmax; -127 for amax 0."""
    mant, exp = jnp.frexp(amax.astype(jnp.float32) / fmax)  # x = mant * 2^exp, mant in [0.5, 1)
    k = jnp.where(mant == 0.5, exp - 1, exp)                # ceil(log2 x), up to the division's rounding
    k = jnp.clip(jnp.where(amax > 0, k, SCALE_MIN_EXP), SCALE_MIN_EXP, SCALE_MAX_EXP - 1).astype(jnp.int32)
    return jnp.where(amax.astype(jnp.float32) * _inverse_power(k) > fmax, k + 1, k)  # exact test


def e8m0(k):
    """float8_e8m0fnu 2^k from int32 exponents k in [-127, 127] (byte k + 127)."""
    return jax.lax.bitcast_convert_type((k + 127).astype(jnp.uint8), jnp.float8_e8m0fnu)


def _inverse_power(k):
    """float32 2^-k for k in [-127, 126], built from its exponent bits: always a normal number, so
    x * 2^-k is exact even where the backend flushes subnormals (2^-127 itself is one)."""
    return jax.lax.bitcast_convert_type((127 - k) << 23, jnp.float32)


def _repeat_blocks(s, rows: int, cols: int, shape: Sequence[int]):
    """Per-element float32 scales of `shape` [..., O, I] from a block grid [..., O/rows, I/cols]."""
    s = s.astype(jnp.float32)
    s = jnp.repeat(jnp.repeat(s, rows, axis=-2), cols, axis=-1)
    return s[..., : shape[-2], : shape[-1]]


# ----------------------------------------------------------------------------- FP8 e4m3, 128 x 128 blocks


def quantize_fp8(w, block: int = FP8_BLOCK):
    """[..., O, I] float -> (codes float8_e4m3fn [..., O, I], scales float8_e8m0fnu [..., ceil(O/b), ceil(I/b)])."""
    w = w.astype(jnp.float32)
    k = scale_exponent(_block_amax(w, block, block), FP8_MAX)
    x = w * _repeat_blocks(_inverse_power(k), block, block, w.shape)  # exact: a power of two
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), e8m0(k)


def dequantize_fp8(codes, scales, dtype=jnp.float32, block: int = FP8_BLOCK):
    """W = codes * scales per block, in `dtype` (exact in float32): [..., O, I]."""
    w = codes.astype(jnp.float32) * _repeat_blocks(scales, block, block, codes.shape)
    return w.astype(dtype)


# ----------------------------------------------------------------------------- FP4 e2m1, per-32 scales


def e2m1_codes(x):
    """uint8 codes 0-15 of float32 values already in [-6, 6]: round to nearest, ties to the even code."""
    mag = jnp.abs(x)
    code = jnp.zeros(x.shape, jnp.uint8)
    for c in range(7):  # boundary between codes c and c + 1; a tie goes to the even one
        mid = (E2M1[c] + E2M1[c + 1]) / 2
        code = code + ((mag >= mid) if c % 2 else (mag > mid)).astype(jnp.uint8)
    return code | (jnp.signbit(x).astype(jnp.uint8) << 3)


def e2m1_values(code):
    """float32 values of uint8 e2m1 codes 0-15 (arithmetic decode, no table gather)."""
    code = code.astype(jnp.int32)
    e, m = (code >> 1) & 3, (code & 1).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m, jnp.ldexp(1.0 + 0.5 * m, e - 1))
    return jnp.where(code & 8, -mag, mag)


def quantize_fp4(w, block: int = FP4_BLOCK):
    """[..., O, I] float (I a multiple of `block`) -> (packed int8 [..., O, I/2], scales e8m0 [..., O, I/block])."""
    w = w.astype(jnp.float32)
    if w.shape[-1] % block:
        raise ValueError(f"FP4 needs the input width {w.shape[-1]} to be a multiple of {block}")
    k = scale_exponent(_block_amax(w, 1, block), FP4_MAX)
    code = e2m1_codes(jnp.clip(w * _repeat_blocks(_inverse_power(k), 1, block, w.shape), -FP4_MAX, FP4_MAX))
    code = code.reshape(*w.shape[:-1], w.shape[-1] // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)
    return jax.lax.bitcast_convert_type(packed, jnp.int8), e8m0(k)


def dequantize_fp4(packed, scales, dtype=jnp.float32, block: int = FP4_BLOCK):
    """W = E2M1[nibble] * scales, in `dtype` (exact in float32): [..., O, I] from packed [..., O, I/2]."""
    u = jax.lax.bitcast_convert_type(packed, jnp.uint8)
    pair = jnp.stack([e2m1_values(u & 15), e2m1_values(u >> 4)], axis=-1)
    q = pair.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return (q * _repeat_blocks(scales, 1, block, q.shape)).astype(dtype)


# ----------------------------------------------------------------------------- layouts


def to_ours(w, *, groups: int = 1, out: Sequence[int]):
    """Official [*stack, G * prod(out), I] -> ours [*stack, (G,) I, *out] (G only when groups > 1)."""
    *stack, o, i = w.shape
    w = jnp.swapaxes(w.reshape(*stack, groups, o // groups, i), -1, -2)
    return w.reshape(*stack, *((groups,) if groups > 1 else ()), i, *out)


def to_official(w, *, stack: int, groups: int = 1):
    """Ours [*stack, (G,) I, *out] -> official [*stack, G * prod(out), I] (the inverse of `to_ours`)."""
    lead = w.shape[:stack]
    i = w.shape[stack + (1 if groups > 1 else 0)]
    per_group = math.prod(w.shape[stack + (2 if groups > 1 else 1):])
    w = jnp.swapaxes(w.reshape(*lead, groups, i, per_group), -1, -2)
    return w.reshape(*lead, groups * per_group, i)
