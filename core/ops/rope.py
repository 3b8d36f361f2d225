"""Partial rotary position embedding with YaRN (DESIGN.md, "RoPE"; "Attention", last sentence).

RoPE rotates only the last R = qk_rope_head_dim features of a vector; the leading features carry
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
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Static RoPE settings of one layer (hashable, so it can live on a module).

    rope_dim: R, the trailing features that rotate (even).
    theta: base wavelength scale.
    yarn_factor: YaRN context-extension factor; <= 1 disables YaRN.
    original_max_positions: YaRN's pre-training context (tokens).
    beta_fast / beta_slow: YaRN ramp boundaries (rotations over the original context).
    """

    rope_dim: int
    theta: float
    yarn_factor: float = 1.0
    original_max_positions: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    @property
    def uses_yarn(self) -> bool:
        return self.yarn_factor > 1.0 and self.original_max_positions > 0


def rope_frequencies(spec: RopeSpec) -> np.ndarray:
    """Angular frequency of each rotating pair, float64 [R / 2] (a static constant).

    Base: freq[i] = theta^(-2i / R). With YaRN, pair i keeps freq[i] below the ramp, becomes
    freq[i] / factor above it, and interpolates linearly inside it; the ramp runs between the
    pair indices where a wavelength fits beta_fast and beta_slow times into the original context.
    """
    r = spec.rope_dim
    freqs = spec.theta ** (-np.arange(0, r, 2, dtype=np.float64) / r)
    if not spec.uses_yarn:
        return freqs

    def pair_of(rotations: float) -> float:  # the (fractional) dim where `rotations` fit
        return r * math.log(spec.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low = max(math.floor(pair_of(spec.beta_fast)), 0)
    high = min(math.ceil(pair_of(spec.beta_slow)), r - 1)
    if low == high:
        high += 0.001  # the official code's guard against a zero-width ramp
    ramp = np.clip((np.arange(r // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return freqs / spec.yarn_factor * ramp + freqs * (1.0 - ramp)


def apply_rope(x, positions, spec: RopeSpec, *, inverse: bool = False):
    """Rotate the last R features of `x` as interleaved pairs by position * freq.

    Args:
      x: [B, T, ..., F] any float dtype, F >= R; e.g. q_bthd, kv_btd, kv_bwd.
      positions: int [B, T] (one position per leading (B, T) entry, broadcast over the rest).
      spec: the layer's RoPE settings.
      inverse: rotate by -angle (the conjugate), undoing a forward rotation.

    Returns:
      x's shape and dtype; the leading F - R features unchanged.

    Shapes:
      1. angle_bt..r = positions * freq_r          (float32, float64 for float64 x)
      2. (x0, x1) pairs of x[..., F-R:]  ->  (x0 cos - x1 sin, x0 sin + x1 cos)
    """
    r = spec.rope_dim
    if r == 0:
        return x
    acc = jnp.promote_types(x.dtype, jnp.float32)  # float32, or float64 in x64 references
    freq_r = jnp.asarray(rope_frequencies(spec), acc)
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
