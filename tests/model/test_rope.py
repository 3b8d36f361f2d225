"""Partial interleaved RoPE, its inverse, YaRN and per-layer theta vs the float64 reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from core.config.schema import load_config
from core.spec.resolve import layer_rope
from core.model.layers import apply_rope, rope_frequencies
from tests import reference as ref


SPECS = [  # (rope_dim, theta, yarn_factor, original_max_positions, beta_fast, beta_slow)
    (8, 10000.0, 1.0, 0, 32.0, 1.0),
    (16, 160000.0, 16.0, 4096, 32, 1),
]


def frequencies(spec):
    r, theta, factor, original, fast, slow = spec
    return rope_frequencies(r, theta, yarn_factor=factor, original_max_positions=original, beta_fast=fast,
                            beta_slow=slow)


@pytest.mark.parametrize("spec", SPECS)
def test_frequencies_match_reference(x64, spec):
    want = ref.rope_freqs(*spec)
    got = frequencies(spec)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)


def test_yarn_keeps_fast_and_slows_long_wavelengths():
    plain = np.asarray(rope_frequencies(64, 160000.0))
    yarn = np.asarray(rope_frequencies(64, 160000.0, yarn_factor=16.0, original_max_positions=65536))
    assert yarn[0] == plain[0]  # highest frequency untouched
    np.testing.assert_allclose(yarn[-1], plain[-1] / 16.0, rtol=1e-12)
    assert np.all(yarn <= plain) and np.any((yarn < plain) & (yarn > plain / 16.0))


@pytest.mark.parametrize("spec", SPECS)
def test_apply_rope_matches_reference_and_inverts(x64, spec):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 24))
    pos = rng.integers(0, 5000, (2, 5))
    freqs = ref.rope_freqs(*spec)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), frequencies(spec)))
    want = ref.rope(x, pos, freqs)
    err = np.max(np.abs(got - want))
    assert err < 1e-10, f"max diff {err}"
    np.testing.assert_array_equal(got[..., :24 - spec[0]], x[..., :24 - spec[0]])
    back = np.asarray(apply_rope(jnp.asarray(got), jnp.asarray(pos), frequencies(spec), inverse=True))
    assert np.max(np.abs(back - x)) < 1e-10


def test_float32_rank3_and_relative_property():
    spec = frequencies(SPECS[1])
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
    assert swa == rope_frequencies(64, 10000.0)  # no YaRN in sliding-window layers (official code)
    assert csa == hca == rope_frequencies(64, 160000.0, yarn_factor=16.0, original_max_positions=65536,
                                          beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow)
    assert csa != rope_frequencies(64, 160000.0)
    tiny = load_config("deepseek4-tiny")
    r = tiny.qk_rope_head_dim
    assert layer_rope(tiny, 4) == rope_frequencies(r, 160000.0) and layer_rope(tiny, 0) == rope_frequencies(r, 10000.0)
