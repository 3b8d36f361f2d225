"""Small shared building blocks: parameter creation with logical axes, RMS normalisation.

Every parameter of the decoder is created through `param`, which attaches logical axis names
(embed, mlp, experts, heads, kv, vocab, norm, mhc, ...) as the variable's `out_sharding`
metadata without sharding anything eagerly: a mesh maps the names to device axes later
(`nnx.get_partition_spec` + logical rules), so the layers never know about devices.

RMSNorm follows DESIGN.md and the official DeepSeek-V4 code: normalise in float32,
x * rsqrt(mean(x^2) + eps), times a learned per-feature scale (init 1), cast back to the input
dtype. `rms_normalize` is the same without the scale (per-head query norm, mHC input norm).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from core import tree
from core.model.init_draws import FanInTruncatedNormal

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
