"""core.model.layers: parameter creation with logical axes, RMSNorm and the weightless RMS normalisation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.model import layers
from tests import reference_moe as ref


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
    """Seeded NumPy N(0, scale^2) inputs (jax.random would compile a sampler per shape)."""
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, dtype)


def _rows(x, weight, eps):
    flat = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    w = None if weight is None else np.asarray(weight, np.float64)
    return np.stack([ref.rms_norm(row, w, eps) for row in flat]).reshape(x.shape)


def test_rms_normalize_matches_reference(x64):
    x = _normal(0, (2, 3, 16), jnp.float64, 3.0)
    y = jax.jit(layers.rms_normalize, static_argnums=1)(x, 1e-6)
    diff = float(np.max(np.abs(np.asarray(y) - _rows(x, None, 1e-6))))
    assert diff < 1e-12, f"max |diff| = {diff:.3e}"


def test_rmsnorm_module_matches_reference_and_keeps_dtype():
    norm = layers.RMSNorm(16, 1e-6, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(norm.weight[...]), np.ones(16, np.float32))
    norm.weight[...] = _normal(1, (16,))
    x = _normal(2, (2, 3, 16), jnp.float32, 5.0)
    y = nnx.jit(lambda m, v: m(v))(norm, x)
    diff = float(np.max(np.abs(np.asarray(y) - _rows(x, norm.weight[...], 1e-6))))
    assert y.dtype == jnp.float32 and diff < 1e-5, f"max |diff| = {diff:.3e}"
    y16 = nnx.jit(lambda m, v: m(v))(norm, x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16


def test_param_axes_and_dtype():
    p = layers.param(nnx.Rngs(0), nnx.initializers.ones, (4, 8, 2), ("experts", "embed", "mlp"),
                     jnp.bfloat16)
    assert isinstance(p, nnx.Param) and p[...].dtype == jnp.bfloat16 and p[...].shape == (4, 8, 2)
    assert tuple(p.get_metadata()["out_sharding"]) == ("experts", "embed", "mlp")
    with pytest.raises(ValueError, match="one axis name per dimension"):
        layers.param(nnx.Rngs(0), layers.dense_init(), (8, 4), ("embed",))


def test_dense_init_fan_in_variance():
    init = jax.jit(layers.dense_init(batch_axis=(0,)), static_argnums=(1, 2))
    w = init(jax.random.key(3), (4, 256, 128), jnp.float32)
    ratio = float(np.std(np.asarray(w))) * np.sqrt(256)     # fan-in excludes the experts axis
    assert abs(ratio - 1.0) < 0.03, f"std * sqrt(fan_in) = {ratio:.4f}"


def test_upcast():
    assert layers.upcast(jnp.ones(2, jnp.bfloat16)).dtype == jnp.float32
    assert layers.upcast(jnp.ones(2, jnp.float32)).dtype == jnp.float32
