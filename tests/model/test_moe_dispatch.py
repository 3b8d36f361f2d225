"""core.model.moe.tiled_experts: the tiled drop-free dispatch equals the dense path in value and gradient."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.model import moe
from tests.model.test_moe import _call, _close, _flat, _grads, _inputs, _moe, _normal, _ref_moe_output

_layout = jax.jit(moe.tile_layout, static_argnums=(1, 2))


@pytest.mark.parametrize("tile", [1, 3, 8, 64])
@pytest.mark.parametrize("routing", ["random", "one expert set"])
def test_tile_layout_is_drop_free(tile, routing):
    """Every slot gets its own row, in a tile of its expert; each expert's rows start at a tile edge."""
    rng = np.random.default_rng(tile)
    if routing == "random":
        idx = np.stack([rng.permutation(8)[:3] for _ in range(40)])
    else:  # the worst case for padding: every token picks experts 0, 1, 2
        idx = np.tile(np.arange(3), (40, 1))
    dest, expert_g, tiles = _layout(jnp.asarray(idx), 8, tile)
    dest, expert_g = np.asarray(dest), np.asarray(expert_g)
    assert tiles == -(-(120 + 8 * (tile - 1)) // tile) and expert_g.shape == (tiles,)
    assert len(set(dest.tolist())) == 120 and dest.min() >= 0 and dest.max() < tiles * tile
    np.testing.assert_array_equal(expert_g[dest // tile], idx.reshape(-1))
    for e in np.unique(idx):
        rows = np.sort(dest[idx.reshape(-1) == e])
        assert rows[0] % tile == 0 and np.all(np.diff(rows) == 1), (e, rows)


@pytest.mark.parametrize("hash_routed, tile", [(False, 1), (True, 5), (False, 64)])
def test_tiled_equals_dense_value_and_gradient_f64(x64, hash_routed, tile):
    """float64: the tiled path equals the dense one and the loop reference, gradients included, with padding."""
    dense = _moe(hash_routed, dtype=jnp.float64)
    tiled = _moe(hash_routed, dtype=jnp.float64, impl="tiled", tile_size=tile)
    x, tokens, _ = _inputs(jnp.float64)
    valid = np.arange(6)[None, :] < np.array([[4], [6]])
    cot = _normal(3, x.shape, jnp.float64)
    y, _ = _call(tiled, x, tokens, valid)
    _close(y, _ref_moe_output(tiled, x, tokens), 1e-10, "tiled vs reference")
    (v_d, (gm_d, gx_d)), (v_t, (gm_t, gx_t)) = _grads(dense, x, tokens, valid, cot), _grads(tiled, x, tokens, valid, cot)
    _close(v_t, v_d, 1e-10, "loss")
    _close(gx_t, gx_d, 1e-10, "d x")
    flat_d, flat_t = _flat(gm_d), _flat(gm_t)
    assert set(flat_d) == set(flat_t)
    for path in flat_d:
        _close(flat_t[path], flat_d[path], 1e-10, f"d {path}")


def test_tiled_equals_dense_f32_and_unchosen_experts_get_exactly_zero():
    """float32 rounding between the two paths; an expert no token chose gets exactly zero gradient."""
    dense, tiled = _moe(True, shared=0), _moe(True, impl="tiled", tile_size=4, shared=0)
    table = jnp.asarray(np.random.default_rng(0).permuted(np.tile(np.arange(1, 8), (50, 1)), axis=1)[:, :3], jnp.int32)
    for m in (dense, tiled):
        m.gate.tid2eid[...] = table                          # expert 0 is never chosen
    x, tokens, valid = _inputs(jnp.float32)
    cot = _normal(4, x.shape)
    (v_d, (gm_d, gx_d)), (v_t, (gm_t, gx_t)) = _grads(dense, x, tokens, valid, cot), _grads(tiled, x, tokens, valid, cot)
    _close(v_t, v_d, 1e-5 * max(1.0, abs(float(v_d))), "loss f32")
    _close(gx_t, gx_d, 1e-5 * max(1.0, float(jnp.max(jnp.abs(gx_d)))), "d x f32")
    flat_d, flat_t = _flat(gm_d), _flat(gm_t)
    for path in flat_d:
        _close(flat_t[path], flat_d[path], 1e-5 * max(1.0, float(np.max(np.abs(flat_d[path])))), f"d {path} f32")
    for w in ("w1", "w2", "w3"):
        assert np.all(flat_t[f"experts/{w}"][0] == 0) and np.any(flat_t[f"experts/{w}"][1:] != 0), w


def test_auto_tile_and_bad_impl():
    assert [moe.auto_tile(n, 16, 4) for n in (16, 256, 4096)] == [8, 32, 128]
    # the local experts under expert parallelism: V4-Flash's 24,576 slots a device receives over 32 or 4 of
    # them (expert 8, expert 64) take tiles of 512 rows; deepseek4-tiny's few keep their small tiles
    assert [moe.auto_tile(24576, e, 1, most=512) for e in (32, 4)] == [512, 512]
    assert moe.auto_tile(48, 2, 1, most=512) == 16
    with pytest.raises(ValueError, match="impl"):
        _moe(False, impl="nosuch")


# ----------------------------------------------------------------------------- chunks of tiles (scan)

_E, _K, _M, _F = 8, 3, 16, 12
_hidden = functools.partial(moe.swiglu_hidden, limit=1.5)


def _routing(kind, k=_K, n=12, seed=0):
    """int32 [1, n, k]: distinct experts per token; 'one' sends every token to expert 3 (k = 1) or
    gives every token expert 1 and never expert 0."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        idx = np.stack([rng.permutation(_E)[:k] for _ in range(n)])
    elif k == 1:
        idx = np.full((n, 1), 3)
    else:
        idx = np.stack([np.concatenate([[1], rng.permutation(np.arange(2, _E))[:k - 1]]) for _ in range(n)])
    return jnp.asarray(idx[None], jnp.int32)


def _operands(k, n=12, dtype=jnp.float64):
    x = _normal(20, (1, n, _M), dtype, 3.0)                     # large: the clamp engages
    weights = jnp.asarray(np.random.default_rng(21).random((1, n, k)), dtype)
    ws = [_normal(22 + i, s, dtype, 0.3) for i, s in enumerate(((_E, _M, _F), (_E, _F, _M), (_E, _M, _F)))]
    return x, weights, ws, _normal(25, (1, n, _M), dtype)


def _value_and_grads(fn, x, weights, ws, cot):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=(0, 1, 2, 3, 4)))(x, weights, *ws)


def _dense(idx, x, weights, w1, w2, w3):
    combine = jnp.einsum("btk,btke->bte", weights, jax.nn.one_hot(idx, _E, dtype=weights.dtype))
    return moe.dense_experts(x, combine, w1, w2, w3, 1.5)


@pytest.mark.parametrize("per_step", [1, 3, 5, 0, 1000])
@pytest.mark.parametrize("routing, k", [("random", 3), ("one", 1), ("one", 3)])
def test_chunked_tiles_equal_dense_value_and_gradient_f64(x64, per_step, routing, k):
    """float64: every chunking (1 tile, counts that do not divide G = 22 for k = 3, 10 for k = 1, auto, all at once) equals the
    dense path in value and in the gradients of x, the combine weights and the expert weights."""
    idx = _routing(routing, k)
    x, weights, ws, cot = _operands(k)

    def tiled(x, weights, w1, w2, w3):
        return moe.tiled_experts(x, idx, weights, w1, w2, w3, tile=2, per_step=per_step,
                                          hidden=_hidden)

    (v, g), (v_d, g_d) = _value_and_grads(tiled, x, weights, ws, cot), _value_and_grads(
        functools.partial(_dense, idx), x, weights, ws, cot)
    _close(v, v_d, 1e-10, "value")
    for name, a, b in zip(("x", "weights", "w1", "w2", "w3"), g, g_d):
        _close(a, b, 1e-10, f"d {name}")


def test_chunked_tiles_equal_one_chunk_f32():
    """float32: a chunk of one tile and the auto chunking equal one chunk of all tiles (the unchunked path)."""
    idx = _routing("random", n=40)
    x, weights, ws, cot = _operands(_K, n=40, dtype=jnp.float32)
    results = {}
    for per_step in (1, 0, 10 ** 6):
        fn = functools.partial(lambda ps, x, w, w1, w2, w3: moe.tiled_experts(
            x, idx, w, w1, w2, w3, tile=4, per_step=ps, hidden=_hidden), per_step)
        results[per_step] = _value_and_grads(fn, x, weights, ws, cot)
    (v_all, g_all) = results[10 ** 6]
    for per_step in (1, 0):
        v, g = results[per_step]
        _close(v, v_all, 1e-5 * max(1.0, abs(float(v_all))), f"value, {per_step} tiles per step")
        for name, a, b in zip(("x", "weights", "w1", "w2", "w3"), g, g_all):
            _close(a, b, 1e-5 * max(1.0, float(jnp.max(jnp.abs(b)))), f"d {name}, {per_step} tiles per step")


@pytest.mark.parametrize("per_step", [1, 4])
def test_empty_slots_add_nothing_and_empty_chunks_are_skipped(x64, per_step):
    """Slots with expert id E add exactly nothing (whatever their weight) and get no gradient; chunks of only
    empty slots are skipped, chunks that mix them with real slots are not; all empty gives exactly 0."""
    idx = np.asarray(_routing("random"))
    empty = np.random.default_rng(3).random(idx.shape) < 0.5
    x, weights, ws, cot = _operands(_K)

    def tiled(idx):
        return lambda x, w, w1, w2, w3: moe.tiled_experts(
            x, idx, w, w1, w2, w3, tile=2, per_step=per_step, empty_slots=True, hidden=_hidden)

    v, g = _value_and_grads(tiled(jnp.asarray(np.where(empty, _E, idx), jnp.int32)), x, weights, ws, cot)
    kept = jnp.asarray(np.where(empty, 0.0, 1.0))
    v_d, g_d = _value_and_grads(lambda x, w, *ws_: _dense(jnp.asarray(idx), x, w * kept, *ws_), x, weights, ws, cot)
    _close(v, v_d, 1e-10, "value")
    for name, a, b in zip(("x", "weights", "w1", "w2", "w3"), g, g_d):
        _close(a, b, 1e-10, f"d {name}")
    v0, g0 = _value_and_grads(tiled(jnp.full(idx.shape, _E, jnp.int32)), x, weights, ws, cot)
    assert float(v0) == 0.0 and all(float(jnp.max(jnp.abs(a))) == 0.0 for a in g0)


def test_chunked_tiles_hold_no_per_tile_copy_of_all_weights():
    """Compiled fwd + bwd temp (XLA memory analysis): one chunk of all G tiles holds the three [G, M, F]
    weight copies; the auto chunking holds less by at least the copies of the tiles outside its chunk,
    and less than a single [G, M, F] copy."""
    e, k, m, f, n, tile = 32, 2, 128, 128, 256, 8
    tiles = -(-(n * k + e * (tile - 1)) // tile)
    per_step = moe.tiles_per_step(tiles, tile, f)
    copy = tiles * m * f * 4                                  # one float32 [G, M, F]
    s = jax.ShapeDtypeStruct

    def temp(steps):
        def loss(x, w, w1, w2, w3, idx):
            y = moe.tiled_experts(x, idx, w, w1, w2, w3, tile=tile, per_step=steps,
                                           hidden=_hidden)
            return jnp.sum(y ** 2)

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
        args = [s((1, n, m), jnp.float32), s((1, n, k), jnp.float32), s((e, m, f), jnp.float32),
                s((e, f, m), jnp.float32), s((e, m, f), jnp.float32), s((1, n, k), jnp.int32)]
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    whole, auto = temp(tiles), temp(0)
    assert whole >= 3 * copy, f"all tiles at once: temp {whole} < the three [G, M, F] copies {3 * copy}"
    assert auto + 3 * (tiles - per_step) * m * f * 4 <= whole, f"auto ({per_step} tiles/step) {auto} vs all {whole}"
    assert auto < copy, f"auto temp {auto} >= one [G, M, F] copy {copy}"
