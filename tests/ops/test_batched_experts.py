"""core/ops/batched_experts.py: the routed experts by batched matmuls over rows padded to a capacity per
expert, against a float64 loop and the dense MoE (value and gradient), with drops past the capacity and
empty slots; the slots' moves are gathers both ways."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.model import moe
from core.ops.batched_experts import ExpertRows, batched_experts, dropped_fraction, kept_first

B, T, M, F, E, K, LIMIT = 2, 7, 6, 5, 5, 2, 1.5


def _inputs(dtype):
    rng = np.random.default_rng(0)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(B * T)]).reshape(B, T, K)
    idx[0, 3, 1] = E  # an empty slot (the exchange's padding): adds 0
    arrays = [rng.normal(size=(B, T, M)), rng.uniform(size=(B, T, K)), rng.normal(size=(E, M, F)),
              rng.normal(size=(E, F, M)), rng.normal(size=(E, M, F))]
    return jnp.asarray(idx, jnp.int32), [jnp.asarray(a, dtype) for a in arrays]


def _kept(idx, capacity):
    """keep [B, T, K]: each expert's first `capacity` slots in slot order (token by token); empty slots not."""
    flat, seen = np.asarray(idx).reshape(-1), {}
    keep = np.zeros(flat.shape, bool)
    for s, e in enumerate(flat):
        seen[e] = seen.get(e, 0) + 1
        keep[s] = e < E and seen[e] <= capacity
    return keep.reshape(idx.shape)


def _loop_f64(idx, keep, x, w, w1, w2, w3):
    x, w, w1, w2, w3 = (np.asarray(a, np.float64) for a in (x, w, w1, w2, w3))
    y = np.zeros(x.shape)
    for b, t, j in zip(*np.nonzero(keep)):
        e = idx[b, t, j]
        gate, up = np.minimum(x[b, t] @ w1[e], LIMIT), np.clip(x[b, t] @ w3[e], -LIMIT, LIMIT)
        y[b, t] += w[b, t, j] * (gate / (1 + np.exp(-gate)) * up) @ w2[e]
    return y


def _dense(idx, keep, x, w, w1, w2, w3):
    combine = jnp.einsum("btk,btke->bte", w * keep, jax.nn.one_hot(idx, E, dtype=x.dtype))
    return moe.dense_experts(x, combine, w1, w2, w3, LIMIT)


@pytest.mark.parametrize("capacity", [None, 2])
def test_batched_experts_equal_the_f64_loop_and_the_dense_moe_in_value_and_gradient(x64, capacity):
    """Drop-free (C = B T) and C = 2 (each expert's later slots dropped, token by token): the output equals a
    float64 loop over the kept slots, and value and every gradient (x, combine weights, the three expert
    weights) equal the dense MoE's with the dropped slots' weights zeroed, in float64 to 1e-10."""
    idx, args = _inputs(jnp.float64)
    keep = _kept(idx, B * T if capacity is None else capacity)
    assert keep.sum() < idx.size - 1 if capacity else keep.sum() == idx.size - 1
    hidden = functools.partial(moe.swiglu_hidden, limit=LIMIT)
    ours = lambda *a: batched_experts(a[0], idx, *a[1:], capacity=capacity, hidden=hidden)  # noqa: E731
    ref = lambda *a: _dense(idx, jnp.asarray(keep), *a)  # noqa: E731
    np.testing.assert_allclose(ours(*args), _loop_f64(np.asarray(idx), keep, *args), atol=1e-10, rtol=1e-10)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, M)))
    grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cot), argnums=tuple(range(5)))(*args) for f in (ours, ref)]
    for name, a, b in zip(("x", "weights", "w1", "w2", "w3"), *grads):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-10 * max(1.0, float(jnp.max(jnp.abs(b)))), name
    assert np.all(np.asarray(grads[0][1])[~keep] == 0), "a dropped or empty slot's weight gets no gradient"
    real = np.asarray(idx) < E
    assert abs(float(dropped_fraction(idx, E, B * T if capacity is None else capacity)) - (real & ~keep).sum() / idx.size) < 1e-7


def test_batched_experts_equal_the_tiled_dispatch_in_float32():
    idx, args = _inputs(jnp.float32)
    hidden = functools.partial(moe.swiglu_hidden, limit=LIMIT)
    ours = batched_experts(args[0], idx, *args[1:], capacity=None, hidden=hidden)
    tiled = moe.tiled_experts(args[0], idx, *args[1:], tile=4, empty_slots=True, hidden=hidden)
    assert float(jnp.max(jnp.abs(ours - tiled))) <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(tiled))))


def test_expert_rows_place_slots_by_expert_in_slot_order_and_move_by_gathers():
    """Expert e's slots fill rows e C + 0, 1, ... in slot order; past C a slot has no row; the rows' gradient
    (both ways) is a gather, never a scatter-add."""
    idx = jnp.asarray([[2, 0], [0, 2], [0, 1]], jnp.int32)   # slots: 2 0 | 0 2 | 0 1
    rows = ExpertRows(idx, 3, 2)
    np.testing.assert_array_equal(rows.valid_s, [True, True, True, True, False, True])  # expert 0's third dropped
    np.testing.assert_array_equal(np.where(rows.valid_s, rows.row_s, -1), [4, 0, 1, 5, -1, 2])
    np.testing.assert_array_equal(rows.valid_r, [True, True, True, False, True, True])
    x = jnp.arange(3.0 * 4).reshape(3, 4)
    np.testing.assert_array_equal(rows.rows(x, 2)[:, :, 0], [[0, 4], [8, 0], [0, 4]])
    for f in (lambda v: rows.rows(v, 2), lambda v: rows.tokens(rows.rows(v, 2))):
        assert "scatter" not in str(jax.make_jaxpr(jax.grad(lambda v, f=f: jnp.sum(f(v))))(x))


def test_a_gpus_experts_remat_keeps_the_rows_and_a_tpus_does_not():
    """`experts` on a GPU keeps the rows the batched matmuls read (their exchange is not run again); on a TPU
    and a CPU it recomputes them, as it does the grouped matmuls' rows."""
    from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' list, public in name only

    from core.model.transformer import remat_policy

    idx, args = _inputs(jnp.float32)
    hidden = functools.partial(moe.swiglu_hidden, limit=LIMIT)
    f = lambda *a: jnp.sum(batched_experts(a[0], idx, *a[1:], capacity=None, hidden=hidden))  # noqa: E731
    for platform, kept in (("gpu", True), ("tpu", False), ("cpu", False)):
        saved = saved_residuals(jax.checkpoint(f, policy=remat_policy("experts", platform)), *args)
        assert any("named 'moe_rows'" in what for _, what in saved) == kept, platform
        assert any("named 'moe_gate'" in what for _, what in saved), platform


def test_kept_first_moves_each_destinations_kept_slots_to_the_front_of_its_block():
    """Two destinations of two local experts; sorted slots per expert 3, 1 | 2, 2; destination 0 keeps 1 of
    expert 0 and 1 of expert 1, destination 1 all of expert 2 and none of expert 3: each block starts with its
    kept slots, local expert by local expert, in their order, then the dropped ones, in theirs."""
    sizes = jnp.asarray([3, 1, 2, 2], jnp.int32)
    kept = jnp.asarray([[1, 1], [2, 0]], jnp.int32)
    position = np.asarray(kept_first(sizes, kept, 2, 8))
    # sorted: e0 e0 e0 e1 | e2 e2 e3 e3  ->  block 0: e0(kept) e1(kept) e0 e0; block 1: e2 e2 e3 e3
    np.testing.assert_array_equal(position, [0, 2, 3, 1, 4, 5, 6, 7])
