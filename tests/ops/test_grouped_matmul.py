"""core/ops/grouped_matmul.py: the megablox gmm (Pallas interpret mode on the CPU) against lax.ragged_dot and a
float64 loop, per-pass tiles, rows outside every group, and the slot permutations' gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.ops.grouped_matmul import GmmTiling, SlotOrder, gmm, permute_rows


def _loop_f64(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, n in enumerate(sizes):
        out[start:start + n] = np.asarray(lhs, np.float64)[start:start + n] @ np.asarray(rhs[g], np.float64)
        start += n
    return out


@pytest.mark.parametrize("tiling", [GmmTiling((16, 32, 16), (16, 16, 32), (32, 32, 16)),
                                    GmmTiling((64, 64, 64), (8, 64, 32), (16, 32, 64))])
def test_gmm_equals_ragged_dot_and_the_f64_loop_in_value_and_gradient(tiling):
    """Groups of irregular sizes (one empty), 5 rows past the groups (0 out, 0 gradient), each pass its own tiles."""
    sizes = np.array([13, 0, 29, 40], np.int32)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k1, (87, 64))
    rhs = jax.random.normal(k2, (4, 64, 48))
    cot = jax.random.normal(k3, (87, 48))
    with jax.default_matmul_precision("highest"):
        out = gmm(lhs, rhs, jnp.asarray(sizes), tiling, jnp.float32, True)
        np.testing.assert_allclose(out, _loop_f64(lhs, rhs, sizes), atol=2e-4, rtol=1e-5)
        loss = lambda f: lambda a, b: jnp.sum(f(a, b) * cot)  # noqa: E731
        # each gradient one jitted program (eagerly, every operation around the kernels compiles on its own)
        ours = jax.jit(jax.grad(loss(lambda a, b: gmm(a, b, jnp.asarray(sizes), tiling, jnp.float32, True)),
                                (0, 1)))(lhs, rhs)
        ref = jax.jit(jax.grad(loss(lambda a, b: jax.lax.ragged_dot(a, b, jnp.asarray(sizes))), (0, 1)))(lhs, rhs)
    for a, b, name in zip(ours, ref, ("d lhs", "d rhs")):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-5, err_msg=f"{name}: max {float(jnp.max(jnp.abs(a - b)))}")
    assert np.all(np.asarray(out)[82:] == 0) and np.all(np.asarray(ours[0])[82:] == 0)
    assert np.all(np.asarray(ours[1])[1] == 0)  # the empty group's weights get exactly zero


def test_slot_order_sorts_by_expert_and_its_gradient_is_the_inverse_permutation():
    idx = jnp.asarray([[2, 0], [1, 2], [0, 1]], jnp.int32)
    slots = SlotOrder(idx, 3)
    x = jnp.arange(3 * 4, dtype=jnp.float32).reshape(3, 4)
    x_sm = slots.sort(x)
    np.testing.assert_array_equal(slots.group_sizes, [2, 2, 2])
    np.testing.assert_array_equal(x_sm[:, 0], [0, 8, 4, 8, 0, 4])   # experts 0, 0, 1, 1, 2, 2; tokens in order
    np.testing.assert_array_equal(slots.gather_sum(x_sm), 2 * x)  # each token's two copies back and summed
    cot = jax.random.normal(jax.random.key(1), (6, 4))
    grad = jax.grad(lambda v: jnp.sum(permute_rows(v, slots.order, slots.inverse) * cot))(x_sm)
    np.testing.assert_array_equal(grad, cot[slots.inverse])
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda v: jnp.sum(slots.sort(v))))(x))
    assert "scatter" not in jaxpr, "the slots' gradient is a gather, never a scatter-add"


def test_gather_sum_adds_each_tokens_slots_and_its_gradient_is_the_sort():
    """`SlotOrder.gather_sum` (the combine of moe_impl=ragged/gmm) against a float64 sum of each token's k
    rows, in bf16 (summed in float32) and float32; its gradient is `sort`'s gather, and `weights` puts
    [N, k] values in expert order with the inverse permutation as gradient. No scatter either way."""
    rng = np.random.default_rng(5)
    idx = jnp.asarray(rng.integers(0, 4, (7, 3)), jnp.int32)
    slots = SlotOrder(idx, 4)
    for dtype, tol in ((jnp.bfloat16, 1e-2), (jnp.float32, 1e-6)):
        y_sm = jnp.asarray(rng.normal(size=(21, 5)), dtype)
        ref = np.zeros((7, 5))
        for s, pos in enumerate(np.asarray(slots.order)):  # sorted position s holds slot pos = token * k + j
            ref[pos // 3] += np.asarray(y_sm[s], np.float64)
        out = slots.gather_sum(y_sm)
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
        cot = jnp.asarray(rng.normal(size=(7, 5)), jnp.float32)
        grad = jax.grad(lambda v: jnp.sum(slots.gather_sum(v) * cot))(y_sm)
        assert grad.dtype == dtype
        np.testing.assert_array_equal(grad, slots.sort(cot.astype(dtype)))
    w_nk = jnp.asarray(rng.normal(size=(7, 3)), jnp.float32)
    np.testing.assert_array_equal(slots.weights(w_nk), w_nk.reshape(-1)[slots.order])
    cot_s = jnp.asarray(rng.normal(size=(21,)), jnp.float32)
    np.testing.assert_array_equal(jax.grad(lambda w: jnp.sum(slots.weights(w) * cot_s))(w_nk),
                                  cot_s[slots.inverse].reshape(7, 3))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda v, w: jnp.sum(slots.gather_sum(v)) + jnp.sum(slots.weights(w)),
                                        (0, 1)))(y_sm, w_nk))
    assert "scatter" not in jaxpr


def test_ragged_dot_backward_runs_in_the_inputs_dtype():
    """bf16 inputs, float32 output: the gradients equal autodiff's to bf16 rounding, and the backward's
    matmuls take bf16 operands (no float32 ragged_dot in the gradient's program)."""
    from core.ops.grouped_matmul import ragged_dot

    sizes = jnp.asarray([5, 0, 11], jnp.int32)
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    lhs = jax.random.normal(k1, (16, 32)).astype(jnp.bfloat16)
    rhs = jax.random.normal(k2, (3, 32, 8)).astype(jnp.bfloat16)
    cot = jax.random.normal(k3, (16, 8))
    ours = lambda a, b: jnp.sum(ragged_dot(a, b, sizes, jnp.float32) * cot)  # noqa: E731
    xla = lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32) * cot)  # noqa: E731
    assert ours(lhs, rhs) == xla(lhs, rhs)
    for a, b in zip(jax.grad(ours, (0, 1))(lhs, rhs), jax.grad(xla, (0, 1))(lhs, rhs)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
    jaxpr = jax.make_jaxpr(jax.grad(ours, (0, 1)))(lhs, rhs)
    dots = [e for e in jaxpr.jaxpr.eqns if "ragged_dot" in e.primitive.name]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots[1:] for v in e.invars[:2]), dots
