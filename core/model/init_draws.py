"""Fan-in truncated-normal initialisers that share a few XLA programs across parameter shapes.

Eagerly, `jax.random.truncated_normal(key, -2, 2, shape)` is one jitted program per distinct
(shape, key batch) pair, and compiling those programs was most of the model build's share of the
time to step 0 (docs/benchmarks.md#why-the-defaults). With the partitionable threefry
(`jax_threefry_partitionable`, JAX's default) the random bits of element i of a draw are a
function of the key and of i, the element's row-major flat index, alone; uniform -> erf_inv ->
clip is elementwise. So the draw of `shape` equals the first prod(shape) elements of a flat draw of
any larger size, reshaped: inside `bucketed_draws()` a parameter of n elements is cut from a flat
draw of `bucket(n)` elements (a power of two, at least 2**16): a handful of draw programs serve
every parameter, and one small cut-and-scale program per distinct shape remains. The scale by the
standard deviation is the same float32 multiply as JAX's `variance_scaling`.
tests/model/test_init_draws.py proves the built model bitwise equal to the per-shape draws, parameter by
parameter.

Outside the context (the default, every traced build, `create_sharded`), above `MAX_BUCKETED`
elements, or for a shape of rank < 2, the initialiser is JAX's
`variance_scaling(1, "fan_in", "truncated_normal")` itself.
The context is per thread (a contextvar): core/train/program.py's compile thread traces the step
without it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp

MIN_BUCKET = 1 << 16
MAX_BUCKETED = 1 << 24  # larger parameters (per layer) keep their own program: the transient draw
# is at most 2x a parameter's elements (times the layers of a scanned segment, under nnx.vmap)
TRUNC_STD = .87962566103423978  # stddev of a standard normal truncated to (-2, 2), JAX's constant
_BUCKETED: contextvars.ContextVar[bool] = contextvars.ContextVar("dsv4_bucketed_draws", default=False)


@contextlib.contextmanager
def bucketed_draws() -> Iterator[None]:
    """Within the block (this thread), `FanInTruncatedNormal` draws from flat buckets."""
    token = _BUCKETED.set(True)
    try:
        yield
    finally:
        _BUCKETED.reset(token)


def bucket(n: int) -> int:
    """The flat draw size serving a parameter of n elements: the next power of two, >= 2**16."""
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


def _size(shape: Sequence[int], axes: int | Sequence[int]) -> int:
    return shape[axes] if isinstance(axes, int) else math.prod(shape[i] for i in axes)


def fan_in(shape: Sequence[int], in_axis, out_axis, batch_axis) -> float:
    """JAX's fan-in (`jax.nn.initializers`' rule, same float arithmetic): in_size times the
    receptive field, the axes outside in_axis, out_axis and batch_axis."""
    in_size, out_size, batch = _size(shape, in_axis), _size(shape, out_axis), _size(shape, batch_axis)
    return in_size * (math.prod(shape) / in_size / out_size / batch)


@functools.partial(jax.jit, static_argnums=2)
def _cut(flat: jax.Array, stddev: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The first prod(shape) elements of `flat`, reshaped, times `stddev` (float32 multiply)."""
    return flat[:math.prod(shape)].reshape(shape) * stddev


def _is_threefry(key: jax.Array) -> bool:
    """Whether `key` (typed, or a raw uint32 key of the default implementation) is threefry2x32:
    the prefix property above is threefry's; rbg keys draw differently."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(key)) == "threefry2x32"
    return jax.config.jax_default_prng_impl == "threefry2x32"


class FanInTruncatedNormal:
    """`init(key, shape, dtype)`: truncated normal on (-2, 2) scaled to variance 1 / fan_in.

    Args (constructor):
      in_axis, out_axis, batch_axis: as `jax.nn.initializers.variance_scaling`'s.
    """

    def __init__(self, in_axis: int | Sequence[int] = -2, out_axis: int | Sequence[int] = -1,
                 batch_axis: Sequence[int] = ()):
        self.axes = (in_axis, out_axis, tuple(batch_axis))
        self.reference = jax.nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis, batch_axis=tuple(batch_axis))

    def __call__(self, key: jax.Array, shape: Sequence[int], dtype=jnp.float32) -> jax.Array:
        """Shapes: key [] (or batched under vmap) -> `shape` in `dtype`."""
        shape = tuple(int(s) for s in shape)
        n = math.prod(shape)
        if (not _BUCKETED.get() or n > MAX_BUCKETED or len(shape) < 2
                or not jax.config.jax_threefry_partitionable or not _is_threefry(key)):
            return self.reference(key, shape, dtype)
        variance = jnp.array(1.0 / fan_in(shape, *self.axes), dtype=dtype)
        stddev = jnp.sqrt(variance) / jnp.array(TRUNC_STD, dtype)
        flat = jax.random.truncated_normal(key, -2, 2, (bucket(n),), dtype)
        return _cut(flat, stddev, shape)
