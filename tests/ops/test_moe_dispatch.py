"""core.ops.moe_dispatch: the tiled drop-free dispatch equals the dense path in value and gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.model import moe
from core.ops import moe_dispatch
from tests.model.test_moe import _call, _close, _flat, _grads, _inputs, _moe, _normal, _ref_moe_output

_layout = jax.jit(moe_dispatch.tile_layout, static_argnums=(1, 2))


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
    with pytest.raises(ValueError, match="impl"):
        _moe(False, impl="nosuch")
