"""core.model.moe against the float64 loop references in tests/reference_moe.py, plus properties."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from core.model import moe
from tests import reference_moe as ref


def _close(actual, expected, tol, what):
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    diff = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
    assert diff <= tol, f"{what}: max |diff| = {diff:.3e} > {tol:.0e}"


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
    """Seeded NumPy N(0, scale^2) inputs (jax.random would compile a sampler per shape)."""
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, dtype)


def _logits(seed, shape, dtype=jnp.float64):
    return _normal(seed, shape, dtype, 2.0)


# Eager JAX compiles every primitive per new shape; jitting whole calls keeps the file fast.
route = jax.jit(moe.route, static_argnums=2, static_argnames=("scaling", "normalize"))
expert_load = jax.jit(moe.expert_load, static_argnums=2)
load_balance_loss = jax.jit(moe.load_balance_loss, static_argnums=(3, 4))


def _spec(hash_routed, *, impl="dense", shared=1, **kw):
    """The small MoE's spec: M=16, F=12, E=8, k=3, V=50, clamp 1.5 (overridden by `kw`)."""
    args = dict(emb=16, mlp=12, num_experts=8, k=3, shared=shared, hash_routed=hash_routed, vocab_size=50,
                scaling=1.5, normalize=True, use_bias=True, swiglu_limit=1.5, lb_weight=1e-2, impl=impl)
    return moe.MoESpec(**{**args, **kw})


def _moe(hash_routed, *, dtype=jnp.float32, seed=0, **kw):
    """A small MoE (`_spec`) with seeded NumPy weights (see ref.materialize)."""
    spec = _spec(hash_routed, **kw)
    abstract = nnx.eval_shape(lambda: moe.MoE(spec, seed_for_hash_table=7, rngs=nnx.Rngs(seed), param_dtype=dtype,
                                              dtype=dtype))
    table = _table(7, spec.vocab_size, spec.num_experts, spec.k)
    return ref.materialize(abstract, seed, {("gate", "tid2eid"): table})


_table = jax.jit(moe.hash_table, static_argnums=(0, 1, 2, 3))


@nnx.jit
def _call(m, x, tokens, valid):
    return m(x, tokens, valid)


def _grads(m, x, tokens, valid, cot):
    """(value, (d/dparams, d/dx)) of sum(y * cot) + lb_loss through the module."""
    def loss(model, x):
        y, aux = model(x, tokens, valid)
        return jnp.sum(y * cot) + aux["lb_loss"]

    return nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(m, x)


def _flat(grads):
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}


def _close_f32(actual, expected, what):
    """float32 rounding: 1e-5 relative to the larger of 1 and max |expected|."""
    _close(actual, expected, 1e-5 * max(1.0, float(np.max(np.abs(np.asarray(expected))))), what)


# ----------------------------------------------------------------------------- routing


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
def test_route_matches_reference(x64, with_bias, normalize):
    logits = _logits(0, (2, 5, 8))
    bias = _normal(1, (8,), jnp.float64, 0.5) if with_bias else None
    idx, w, s = route(logits, bias, 3, scaling=2.5, normalize=normalize)
    r_idx, r_w, r_s = ref.route(np.asarray(logits), None if bias is None else np.asarray(bias),
                                3, 2.5, normalize)
    assert idx.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(idx), r_idx)
    _close(w, r_w, 1e-10, "route weights")
    _close(s, r_s, 1e-10, "route scores")


def test_route_float32_matches_reference():
    logits = _logits(2, (3, 7, 8), jnp.float32)
    idx, w, _ = route(logits, None, 2, scaling=1.5, normalize=True)
    r_idx, r_w, _ = ref.route(np.asarray(logits, np.float64), None, 2, 1.5, True)
    np.testing.assert_array_equal(np.asarray(idx), r_idx)
    _close(w, r_w, 1e-5, "route weights f32")


def test_bias_changes_selection_only(x64):
    logits = _logits(3, (2, 6, 8))
    bias = np.zeros(8)
    bias[[0, 5]] = 100.0                                    # forces experts 0 and 5
    bias = jnp.asarray(bias, jnp.float64)
    idx0, w0, s0 = route(logits, None, 3, scaling=1.0, normalize=True)
    idx1, w1, s1 = route(logits, bias, 3, scaling=1.0, normalize=True)
    _close(s0, s1, 0.0, "scores do not depend on the bias")
    assert np.all(np.any(np.asarray(idx1) == 0, -1)) and np.all(np.any(np.asarray(idx1) == 5, -1))
    assert not np.array_equal(np.asarray(idx0), np.asarray(idx1)), "the bias should change selection"
    # The weights are the unbiased scores of whatever was chosen.
    expected = np.take_along_axis(np.asarray(s1), np.asarray(idx1), -1)
    _close(w1, expected / expected.sum(-1, keepdims=True), 1e-12, "weights from unbiased scores")


def test_weights_sum_to_scaling_factor():
    _, w, _ = route(_logits(4, (4, 9, 8), jnp.float32), np.ones(8, np.float32), 3, scaling=2.5,
                    normalize=True)
    _close(np.asarray(w).sum(-1), np.full((4, 9), 2.5), 1e-5, "sum of weights")


def test_route_weight_gradients(x64):
    bias = _normal(6, (8,), jnp.float64)

    def weights(logits):
        return moe.route(logits, bias, 3, scaling=1.5, normalize=True)[1]

    check_grads(jax.jit(weights), (_logits(5, (2, 3, 8)),), order=1, modes=("rev",))


# ----------------------------------------------------------------------------- load balance


def test_expert_load_and_lb_loss_match_reference(x64):
    logits = _logits(7, (3, 10, 8))
    valid = np.ones((3, 10), bool)
    valid[1, 6:] = False
    valid[2, :] = False                                   # a row of padding only
    idx, _, s = route(logits, None, 3, scaling=1.0, normalize=True)
    load = expert_load(idx, jnp.asarray(valid), 8)
    _close(load, ref.expert_load(np.asarray(idx), valid, 8), 1e-12, "expert load")
    _close(np.sum(load), 3.0, 1e-12, "load sums to k")
    lb = load_balance_loss(s, idx, jnp.asarray(valid), 8, 1e-3)
    _close(lb, ref.load_balance_loss(np.asarray(s), np.asarray(idx), valid, 8, 1e-3), 1e-12, "lb")


def test_lb_loss_at_perfect_balance_is_weight_times_k():
    # 8 tokens x k=2 over E=4: every expert chosen 4 times in each row; equal scores.
    idx = np.array([[[0, 1], [2, 3]] * 4] * 2, np.int32)
    scores = np.ones((2, 8, 4), np.float32)
    lb = load_balance_loss(scores, idx, np.ones((2, 8), bool), 4, 1e-4)
    _close(lb, 1e-4 * 2, 1e-10, "perfect balance")


def test_padding_is_excluded_from_load_and_lb(x64):
    logits = _logits(8, (2, 8, 8))
    valid = np.arange(8)[None, :] < np.array([[5], [8]])
    noise = np.where(valid[..., None], 0.0, np.asarray(_logits(9, (2, 8, 8))) * 10)
    results = []
    for lg in (logits, logits + noise):
        idx, _, s = route(lg, None, 3, scaling=1.0, normalize=True)
        results.append((expert_load(idx, valid, 8), load_balance_loss(s, idx, valid, 8, 1.0)))
    _close(results[0][0], results[1][0], 0.0, "load ignores padding")
    _close(results[0][1], results[1][1], 1e-12, "lb ignores padding")


def test_update_router_bias_direction():
    update = jax.jit(moe.update_router_bias, static_argnums=2)
    bias = np.zeros(4, np.float32)
    load = np.array([0.5, 0.25, 0.25, 0.0], np.float32) * 4        # mean 1.0
    new = update(bias, load, 1e-3)
    _close(new, ref.update_bias(np.zeros(4), np.asarray(load), 1e-3), 1e-9, "bias update")
    assert new[0] < 0 < new[3], "overloaded experts lose bias, idle ones gain"
    stacked = update(np.zeros((2, 4), np.float32), np.stack([load, load[::-1]]), 1e-3)
    _close(stacked, np.stack([new, new[::-1]]), 0.0, "per-layer update of a layer stack")


# ----------------------------------------------------------------------------- modules


def _ref_moe_output(m, x, tokens):
    x64, spec = np.asarray(x, np.float64), m.spec
    logits = np.einsum("btm,me->bte", x64, np.asarray(m.gate.weight[...], np.float64))
    if spec.hash_routed:
        idx, w = ref.hash_route(logits, np.asarray(m.gate.tid2eid[...]), np.asarray(tokens), spec.scaling,
                                spec.normalize)
    else:
        bias = None if m.gate.bias is None else np.asarray(m.gate.bias[...], np.float64)
        idx, w, _ = ref.route(logits, bias, spec.k, spec.scaling, spec.normalize)
    ex = m.experts
    shared = None
    if m.shared_experts is not None:
        se = m.shared_experts
        shared = tuple(np.asarray(v[...], np.float64) for v in (se.w1, se.w2, se.w3))
    return ref.moe(x64, idx, w, *(np.asarray(v[...], np.float64) for v in (ex.w1, ex.w2, ex.w3)),
                   shared, spec.swiglu_limit)


def _inputs(dtype, seed=11):
    x = _normal(seed, (2, 6, 16), dtype, 3.0)   # large: clamps engage
    tokens = jnp.asarray(np.random.default_rng(seed + 1).integers(0, 50, (2, 6)), jnp.int32)
    return x, tokens, np.ones((2, 6), bool)


@pytest.mark.parametrize("hash_routed, impl", [(False, "dense"), (True, "dense"), (False, "ragged"),
                                               (False, "tiled"), (True, "tiled")])
def test_moe_module_matches_reference_f64(x64, hash_routed, impl):
    m = _moe(hash_routed, dtype=jnp.float64, impl=impl)   # random (float32) bias when learned
    x, tokens, valid = _inputs(jnp.float64)
    y, aux = _call(m, x, tokens, valid)
    _close(y, _ref_moe_output(m, x, tokens), 1e-10, f"MoE {impl} hash={hash_routed}")
    assert aux["load"].shape == (8,)


@pytest.mark.parametrize("impl", ["dense", "ragged", "tiled", "gmm"])
def test_moe_module_matches_reference_f32(impl):
    m = _moe(False, impl=impl, shared=2)
    x, tokens, valid = _inputs(jnp.float32)
    y, _ = _call(m, x, tokens, valid)
    expected = _ref_moe_output(m, x, tokens)
    _close(y, expected, 1e-4 * max(1.0, float(np.max(np.abs(expected)))), f"MoE f32 {impl}")


def test_clamp_is_active_in_the_reference_inputs(x64):
    m = _moe(False, dtype=jnp.float64)
    x, tokens, valid = _inputs(jnp.float64)
    y_clamped, _ = _call(m, x, tokens, valid)
    m.spec = dataclasses.replace(m.spec, swiglu_limit=0.0)
    y_free, _ = _call(m, x, tokens, valid)
    assert float(jnp.max(jnp.abs(y_clamped - y_free))) > 1e-3, "inputs should exercise the clamp"


def test_real_init_hash_table_and_bias():
    def build(rngs):
        return tuple(moe.router(_spec(h), seed_for_hash_table=7, rngs=rngs) for h in (True, False))

    hashed, learned = nnx.jit(build)(nnx.Rngs(0))
    table = np.asarray(hashed.tid2eid[...])
    assert table.dtype == np.int32 and table.shape == (50, 3)
    np.testing.assert_array_equal(table, np.asarray(_table(7, 50, 8, 3)))   # from the seed alone
    assert not np.array_equal(table, np.asarray(_table(8, 50, 8, 3)))
    assert all(len(set(row)) == 3 for row in table.tolist()) and table.min() >= 0 and table.max() < 8
    assert hashed.bias is None and learned.tid2eid is None
    np.testing.assert_array_equal(np.asarray(learned.bias[...]), np.zeros(8, np.float32))
    assert hashed.weight.shape == learned.weight.shape == (16, 8)


def test_hash_routing_follows_the_token_ids_only():
    """Hash layers take table[token] whatever the hidden state (the float64 reference routes by the
    table); learned routing, the control, follows the hidden state."""
    hashed, learned = _moe(True), _moe(False)
    x, tokens, valid = _inputs(jnp.float32)
    other_x = _normal(21, x.shape, scale=3.0)                # other hidden states, the same tokens
    other_tokens = (tokens + 1) % 50                         # other tokens, the same hidden states
    table = np.asarray(hashed.gate.tid2eid[...])
    for xs, ts in ((x, tokens), (other_x, tokens), (x, other_tokens)):
        y, aux = _call(hashed, xs, ts, valid)
        expected = _ref_moe_output(hashed, xs, ts)
        _close(y, expected, 1e-4 * max(1.0, float(np.max(np.abs(expected)))), "hash MoE vs reference")
        _close(aux["load"], ref.expert_load(table[np.asarray(ts)], np.ones((2, 6), bool), 8), 1e-6, "hash load")
        assert float(aux["lb_loss"]) == 0.0
    loads = [np.asarray(_call(learned, xs, tokens, valid)[1]["load"]) for xs in (x, other_x)]
    assert not np.array_equal(*loads), "learned routing should depend on the hidden state"


def test_lb_loss_module_and_padding():
    m = _moe(False)
    x, tokens, _ = _inputs(jnp.float32)
    valid = np.arange(6)[None, :] < np.array([[4], [6]])
    _, aux = _call(m, x, tokens, valid)
    x2 = np.where(valid[..., None], x, -np.asarray(x) * 5)      # change only padding tokens
    _, aux2 = _call(m, x2, tokens, valid)
    _close(aux["lb_loss"], aux2["lb_loss"], 1e-7, "module lb ignores padding")
    _close(aux["load"], aux2["load"], 0.0, "module load ignores padding")
    assert 0 < float(aux["lb_loss"])


def test_bias_and_table_are_not_params():
    learned, hashed = _moe(False), _moe(True)
    for m in (learned, hashed):
        paths = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(m, nnx.Param))}
        assert "gate/weight" in paths and not any("bias" in p or "tid2eid" in p for p in paths), paths
        assert not any("indexer" in p for p in paths)
    assert isinstance(learned.gate.bias, nnx.BatchStat) and not isinstance(learned.gate.bias, nnx.Param)
    assert isinstance(hashed.gate.tid2eid, moe.HashTable) and not isinstance(hashed.gate.tid2eid, nnx.Param)
    # Gradients w.r.t. the parameters reach the router weight in hash layers too.
    x, tokens, valid = _inputs(jnp.float32)

    def loss(model):
        y, _ = model(x, tokens, valid)
        return jnp.sum(y ** 2)

    grads = nnx.jit(nnx.grad(loss))(hashed)
    assert float(jnp.max(jnp.abs(grads.gate.weight[...]))) > 0


def test_param_axes_annotated():
    m = _moe(False)
    specs = nnx.get_partition_spec(nnx.state(m, nnx.Param))
    flat = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(specs)}
    assert tuple(flat["experts/w1"].get_value()) == ("experts", "embed", "mlp")
    assert tuple(flat["experts/w2"].get_value()) == ("experts", "mlp", "embed")
    assert tuple(flat["shared_experts/w1"].get_value()) == ("embed", "mlp")


@pytest.mark.parametrize("k", [1, 3])
def test_ragged_equals_dense_and_tiled_in_value_and_gradient(k):
    """float32: the ragged path's loss and gradients equal the dense, the tiled and the megablox (gmm, Pallas
    interpret mode here) path's,
    with one expert that every token chooses and experts that no token chooses (exactly zero
    gradient there); its output equals the float64 reference."""
    rng = np.random.default_rng(k)
    if k == 1:
        table = np.full((50, 1), 3)                          # every token to expert 3 alone
    else:                                                    # expert 1 for every token, never expert 0
        table = np.stack([np.concatenate([[1], rng.permutation(np.arange(2, 8))[:2]]) for _ in range(50)])
    models = {impl: _moe(True, impl=impl, k=k, shared=0) for impl in ("ragged", "dense", "tiled", "gmm")}
    for m in models.values():
        m.gate.tid2eid[...] = jnp.asarray(table, jnp.int32)
    x, tokens, _ = _inputs(jnp.float32)
    valid = np.arange(6)[None, :] < np.array([[4], [6]])
    cot = _normal(5, x.shape)
    y, _ = _call(models["ragged"], x, tokens, valid)
    expected = _ref_moe_output(models["ragged"], x, tokens)
    _close(y, expected, 1e-4 * max(1.0, float(np.max(np.abs(expected)))), "ragged vs reference")
    v_r, (gm_r, gx_r) = _grads(models["ragged"], x, tokens, valid, cot)
    flat_r = _flat(gm_r)
    for impl in ("dense", "tiled", "gmm"):
        v, (gm, gx) = _grads(models[impl], x, tokens, valid, cot)
        _close_f32(v_r, v, f"loss ragged vs {impl}")
        _close_f32(gx_r, gx, f"d x ragged vs {impl}")
        flat = _flat(gm)
        assert set(flat) == set(flat_r)
        for path in flat:
            _close_f32(flat_r[path], flat[path], f"d {path} ragged vs {impl}")
    chosen = np.unique(table[np.asarray(tokens)])
    unused = sorted(set(range(8)) - set(chosen.tolist()))
    assert unused and (k > 1 or chosen.tolist() == [3])
    for w in ("w1", "w2", "w3"):
        g = flat_r[f"experts/{w}"]
        assert np.all(g[unused] == 0) and np.all(np.any(g[chosen] != 0, axis=(1, 2))), w
    if k > 1:  # with k = 1 the normalised weight is the constant scaling: no router gradient
        assert float(np.max(np.abs(flat_r["gate/weight"]))) > 1e-3, "the router weight gets a gradient"
