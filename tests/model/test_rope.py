"""Partial interleaved RoPE, its inverse, YaRN and per-layer theta vs the float64 reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from core.config.schema import load_config
from core.spec.resolve import layer_rope
from core.model.layers import RopeSpec, apply_rope, rope_frequencies
from tests import reference as ref


SPECS = [
    RopeSpec(8, 10000.0),
    RopeSpec(16, 160000.0, yarn_factor=16.0, original_max_positions=4096, beta_fast=32, beta_slow=1),
]


@pytest.mark.parametrize("spec", SPECS)
def test_frequencies_match_reference(x64, spec):
    want = ref.rope_freqs(spec.rope_dim, spec.theta, spec.yarn_factor, spec.original_max_positions,
                          spec.beta_fast, spec.beta_slow)
    got = rope_frequencies(spec)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)


def test_yarn_keeps_fast_and_slows_long_wavelengths():
    plain = rope_frequencies(RopeSpec(64, 160000.0))
    yarn = rope_frequencies(RopeSpec(64, 160000.0, yarn_factor=16.0, original_max_positions=65536))
    assert yarn[0] == plain[0]  # highest frequency untouched
    np.testing.assert_allclose(yarn[-1], plain[-1] / 16.0, rtol=1e-12)
    assert np.all(yarn <= plain) and np.any((yarn < plain) & (yarn > plain / 16.0))


@pytest.mark.parametrize("spec", SPECS)
def test_apply_rope_matches_reference_and_inverts(x64, spec):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 24))
    pos = rng.integers(0, 5000, (2, 5))
    freqs = ref.rope_freqs(spec.rope_dim, spec.theta, spec.yarn_factor, spec.original_max_positions,
                           spec.beta_fast, spec.beta_slow)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), spec))
    want = ref.rope(x, pos, freqs)
    err = np.max(np.abs(got - want))
    assert err < 1e-10, f"max diff {err}"
    np.testing.assert_array_equal(got[..., :24 - spec.rope_dim], x[..., :24 - spec.rope_dim])
    back = np.asarray(apply_rope(jnp.asarray(got), jnp.asarray(pos), spec, inverse=True))
    assert np.max(np.abs(back - x)) < 1e-10


def test_float32_rank3_and_relative_property():
    spec = SPECS[1]
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 16)).astype(np.float32)

    def dot(pq, pk):
        rq = apply_rope(jnp.asarray(q), jnp.asarray([[pq]]), spec)
        rk = apply_rope(jnp.asarray(k), jnp.asarray([[pk]]), spec)
        return float(jnp.sum(rq * rk))

    assert abs(dot(10, 3) - dot(107, 100)) < 1e-4  # depends on the offset only


def test_layer_theta_and_yarn_from_config():
    cfg = load_config("deepseek4-284b")
    swa, csa, hca = (layer_rope(cfg, r) for r in (0, 4, 128))
    assert swa == RopeSpec(64, 10000.0)  # no YaRN in sliding-window layers (official code)
    assert csa == hca and csa.theta == 160000.0 and csa.uses_yarn
    assert csa.yarn_factor == 16.0 and csa.original_max_positions == 65536
    tiny = load_config("deepseek4-tiny")
    assert not layer_rope(tiny, 4).uses_yarn
    assert layer_rope(tiny, 4).theta == 160000.0 and layer_rope(tiny, 0).theta == 10000.0
