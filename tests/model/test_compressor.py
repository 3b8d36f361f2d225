"""The compressor (overlapping m=4 and plain m=128, packed documents) vs the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.model.layers import Compressor, compress as compress_eager, rope_frequencies
from tests import reference as ref


compress = jax.jit(compress_eager, static_argnames=("ratio", "eps", "rope"))


def _packed(lengths, t):
    """positions/segment ids of documents of `lengths` packed into one row, padded to t."""
    pos, seg = np.zeros(t, np.int64), np.zeros(t, np.int64)
    start = 0
    for i, n in enumerate(lengths):
        pos[start:start + n] = np.arange(n)
        seg[start:start + n] = i + 1
        start += n
    return pos, seg


def _inputs(rng, b, t, m, d, ratio):
    c = 2 if ratio == 4 else 1
    return (rng.standard_normal((b, t, m)), rng.standard_normal((m, c * d)) / np.sqrt(m),
            rng.standard_normal((m, c * d)) / np.sqrt(m), rng.standard_normal((ratio, c * d)),
            1.0 + 0.1 * rng.standard_normal(d))


CASES = [  # (ratio, rows of document lengths, T); lengths that are not multiples of m included
    (4, [[24]], 24),
    (4, [[8, 6, 10], [13, 7]], 24),
    (4, [[5, 12, 7]], 24),
    (128, [[256]], 256),
    (128, [[128, 128], [100, 156]], 256),
]


@pytest.mark.parametrize("ratio,docs,t", CASES)
def test_compress_matches_reference(x64, ratio, docs, t):
    rng = np.random.default_rng(ratio + t + len(docs))
    d, rope_dim = 8, 4
    x, wkv, wg, ape, norm = _inputs(rng, len(docs), t, 6, d, ratio)
    pos = np.stack([_packed(row, t)[0] for row in docs])
    spec = rope_frequencies(rope_dim, 160000.0)
    weights = map(jnp.asarray, (wkv, wg, ape, norm))
    got = compress(jnp.asarray(x), *weights, jnp.asarray(pos), ratio=ratio, eps=1e-6, rope=spec)
    want = ref.compress(x, wkv, wg, ape, norm, pos, ratio, 1e-6, ref.rope_freqs(rope_dim, 160000.0))
    assert got.shape == want.shape == (len(docs), t // ratio, d)
    err = float(np.max(np.abs(np.asarray(got) - want)))
    assert err < 1e-10, f"max diff {err}"


def test_packed_documents_equal_each_alone():
    """Blocks of a document packed after another equal the blocks of that document alone."""
    rng = np.random.default_rng(3)
    d = 8
    x, wkv, wg, ape, norm = _inputs(rng, 1, 24, 6, d, 4)
    x = x.astype(np.float32)
    f = lambda xx, pp: np.asarray(compress(jnp.asarray(xx), wkv, wg, ape, norm, jnp.asarray(pp),
                                           ratio=4, eps=1e-6, rope=rope_frequencies(4, 1e4)))
    pos = _packed([8, 16], 24)[0][None]
    packed = f(x, pos)
    alone_a = f(x[:, :8], pos[:, :8])
    alone_b = f(x[:, 8:], pos[:, 8:])
    np.testing.assert_allclose(packed[:, :2], alone_a, atol=1e-6)
    np.testing.assert_allclose(packed[:, 2:], alone_b, atol=1e-6)


def test_overlap_uses_previous_block():
    """Changing a token of block w-1 changes entry w (A-half overlap) unless a document starts at w."""
    rng = np.random.default_rng(4)
    x, wkv, wg, ape, norm = _inputs(rng, 1, 16, 6, 8, 4)
    f = lambda xx, pp: np.asarray(compress(jnp.asarray(xx, jnp.float32), wkv, wg, ape, norm,
                                           jnp.asarray(pp), ratio=4, eps=1e-6, rope=rope_frequencies(4, 1e4)))
    x2 = x.copy()
    x2[0, 5] += 1.0  # block 1
    one_doc = np.arange(16)[None]
    two_docs = _packed([8, 8], 16)[0][None]
    diff = np.abs(f(x, one_doc) - f(x2, one_doc)).max(-1)[0]
    assert diff[1] > 1e-3 and diff[2] > 1e-3 and diff[0] == 0 and diff[3] == 0
    diff = np.abs(f(x, two_docs) - f(x2, two_docs)).max(-1)[0]
    assert diff[1] > 1e-3 and diff[2] == 0  # block 2 starts a new document


def test_module_matches_pure_function_and_reference_and_trailing_tokens_dropped(x64):
    """The module (random weights, a non-zero ape) = `compress` of its parameters, bitwise, = the
    float64 reference; tokens past the last whole block change nothing."""
    rope = rope_frequencies(4, 1e4)
    comp = Compressor(12, 8, 4, rope, 1e-6, rngs=nnx.Rngs(0), param_dtype=jnp.float64, dtype=jnp.float64)
    assert comp.wkv.shape == (12, 16) and comp.ape.shape == (4, 16) and comp.norm.weight.shape == (8,)
    np.testing.assert_array_equal(np.asarray(comp.ape[...]), 0.0)  # initialised to zero
    rng = np.random.default_rng(5)
    x, wkv, wg, ape, norm = _inputs(rng, 2, 10, 12, 8, 4)
    assert np.min(np.abs(ape)) > 0
    for var, value in ((comp.wkv, wkv), (comp.wgate, wg), (comp.ape, ape), (comp.norm.weight, norm)):
        var[...] = jnp.asarray(value)
    pos = np.tile(np.arange(10), (2, 1))
    run = nnx.jit(lambda c, *a: c(*a))
    out = np.asarray(run(comp, jnp.asarray(x), jnp.asarray(pos)))
    assert out.shape == (2, 2, 8)
    weights = map(jnp.asarray, (wkv, wg, ape, norm))
    pure = compress(jnp.asarray(x), *weights, jnp.asarray(pos), ratio=4, eps=1e-6, rope=rope)
    np.testing.assert_array_equal(out, np.asarray(pure))
    want = ref.compress(x, wkv, wg, ape, norm, pos, 4, 1e-6, ref.rope_freqs(4, 1e4))
    err = float(np.max(np.abs(out - want)))
    assert err < 1e-10, f"module vs reference: max diff {err}"
    np.testing.assert_array_equal(out, np.asarray(run(comp, jnp.asarray(x[:, :8]), jnp.asarray(pos[:, :8]))))
