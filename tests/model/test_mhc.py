"""core.model.block against the float64 loop references in tests/reference_moe.py, plus properties."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from core.model import block as mhc
from tests import reference_moe as ref

N, M, ITERS, EPS, NORM_EPS = 4, 8, 20, 1e-6, 1e-6


def _close(actual, expected, tol, what):
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    diff = float(np.max(np.abs(actual - expected)))
    assert diff <= tol, f"{what}: max |diff| = {diff:.3e} > {tol:.0e}"


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
    """Seeded NumPy N(0, scale^2) inputs (jax.random would compile a sampler per shape)."""
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, dtype)


sinkhorn = jax.jit(mhc.sinkhorn, static_argnums=(1, 2))


def _hc(dtype, seed=0, form="einsum", backward="autodiff"):
    """A HyperConnection with seeded NumPy weights (scales ~ 0.5 so every term matters)."""
    abstract = nnx.eval_shape(lambda: mhc.HyperConnection(M, N, ITERS, EPS, NORM_EPS, rngs=nnx.Rngs(0),
                                                          param_dtype=dtype, form=form, mixes_backward=backward))
    return ref.materialize(abstract, seed)


def _head(dtype, seed=0, form="einsum", backward="autodiff"):
    abstract = nnx.eval_shape(lambda: mhc.HeadCollapse(M, N, EPS, NORM_EPS, rngs=nnx.Rngs(0), param_dtype=dtype,
                                                       form=form, mixes_backward=backward))
    return ref.materialize(abstract, seed)


@nnx.jit
def _pre(hc, x):
    return hc.pre(x)


_post = jax.jit(mhc.HyperConnection.post, static_argnums=4)


@nnx.jit
def _collapse(head, x):
    return head(x)


def _stream(dtype, seed=1, shape=(2, 3)):
    return _normal(seed, (*shape, N, M), dtype, 2.0)


# ----------------------------------------------------------------------------- Sinkhorn


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_sinkhorn_matches_reference(x64, iters):
    logits = _normal(2, (2, 3, N, N), jnp.float64, 3.0)
    comb = sinkhorn(logits, iters, EPS)
    expected = np.stack([[ref.sinkhorn(np.asarray(logits[b, t]), iters, EPS) for t in range(3)]
                         for b in range(2)])
    _close(comb, expected, 1e-12, f"sinkhorn iters={iters}")


def test_sinkhorn_near_doubly_stochastic():
    # Unit-scale logits: 20 iterations converge the rows to ~1e-4 (much larger logits converge
    # slower; the official kernel has the same fixed iteration count).
    logits = _normal(3, (64, N, N))
    comb = np.asarray(sinkhorn(logits, ITERS, EPS))
    assert comb.min() > 0
    _close(comb.sum(-2), np.ones((64, N)), 1e-5, "column sums")       # the last step normalises columns
    _close(comb.sum(-1), np.ones((64, N)), 1e-3, "row sums")


def test_sinkhorn_gradients(x64):
    logits = _normal(4, (2, N, N), jnp.float64)
    check_grads(jax.jit(lambda z: mhc.sinkhorn(z, 5, EPS)), (logits,), order=1, modes=("rev",))


def _sinkhorn_autodiff(logits, iters, eps):
    """The plain formulation on [..., n, n] (reduces over the copy axes, a fori_loop, autodiff)."""
    def normalize(comb, axis):
        return comb / (jnp.sum(comb, axis=axis, keepdims=True) + eps)

    comb = normalize(jax.nn.softmax(logits, axis=-1) + eps, -2)
    return jax.lax.fori_loop(0, iters - 1, lambda _, c: normalize(normalize(c, -1), -2), comb)


@pytest.mark.parametrize("dtype, tol", [(jnp.float64, 1e-12), (jnp.float32, 2e-6)])
@pytest.mark.parametrize("iters, lead", [(1, (5,)), (20, (2, 3))])
def test_sinkhorn_custom_vjp_equals_autodiff(request, dtype, tol, iters, lead):
    # The token-minor layout and its analytic backward against autodiff of the plain loop.
    if dtype == jnp.float64:
        request.getfixturevalue("x64")
    logits = _normal(9 + iters, (*lead, N, N), dtype, 3.0)
    weights = _normal(10 + iters, (*lead, N, N), dtype)

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda z: jnp.sum(fn(z, iters, EPS) * weights)))(logits)

    (value, grad), (r_value, r_grad) = loss(mhc.sinkhorn), loss(_sinkhorn_autodiff)
    _close(sinkhorn(logits, iters, EPS), _sinkhorn_autodiff(logits, iters, EPS), tol, "comb")
    _close(value, r_value, tol * 10, "loss")
    _close(grad, r_grad, tol, "gradient")


def _mixes_autodiff(x, fn, norm_eps):
    """The mixes in their plain form, for autodiff: flatten, project, scale by the rsqrt."""
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    flat = x.reshape(*x.shape[:-2], -1)
    proj = flat @ fn.reshape(-1, fn.shape[-1]).astype(x.dtype)
    return proj * jax.lax.rsqrt(jnp.mean(jnp.square(flat), axis=-1, keepdims=True) + norm_eps)


@pytest.mark.parametrize("backward", mhc.MIXES_BACKWARDS)
@pytest.mark.parametrize("dtype, tol", [(jnp.float64, 1e-12), (jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("j", [N, (2 + N) * N])
def test_mixes_backwards_equal_autodiff_of_the_plain_form(request, dtype, tol, j, backward):
    # hc_mixes' backwards (the closed form: x's cotangent as slice products; autodiff of its einsum)
    # against autodiff of the plain form, for a layer's (2+n)n mixes and the head's n; the
    # cotangent of x comes in x's dtype.
    if dtype == jnp.float64:
        request.getfixturevalue("x64")
    fdt = jnp.float64 if dtype == jnp.float64 else jnp.float32
    x, fn = _stream(dtype, seed=21 + j), _normal(22 + j, (N, M, j), fdt, 0.5)
    weights = _normal(23 + j, (2, 3, j), fdt)

    def grads(f):
        return jax.jit(jax.value_and_grad(lambda x, fn: jnp.sum(f(x, fn, NORM_EPS) * weights), (0, 1)))(x, fn)

    mixes = functools.partial(mhc.hc_mixes, backward=backward)
    (value, (dx, dfn)), (r_value, (r_dx, r_dfn)) = grads(mixes), grads(_mixes_autodiff)
    assert dx.dtype == x.dtype and dfn.dtype == fn.dtype
    scale = float(np.max(np.abs(np.asarray(r_dx, np.float64))))
    _close(value, r_value, tol * 10 if dtype != jnp.bfloat16 else 2e-5, "mixes")
    _close(np.asarray(dx, np.float64) / scale, np.asarray(r_dx, np.float64) / scale, tol, "d x")
    _close(dfn, r_dfn, tol * 10 if dtype != jnp.bfloat16 else 2e-5, "d fn")
    with pytest.raises(ValueError, match="hc_mixes_backward='auto': one of autodiff, closed"):
        mhc.hc_mixes(x, fn, NORM_EPS, "auto")


# ----------------------------------------------------------------------------- modules


def _ref_pre(hc, x):
    fn = ref.fn_official(np.asarray(hc.fn[...]))
    scale, base = (np.asarray(v[...], np.float64) for v in (hc.scale, hc.base))
    xs = np.asarray(x, np.float64)
    out = [[ref.hc_pre(xs[b, t], fn, scale, base, ITERS, EPS, NORM_EPS) for t in range(xs.shape[1])]
           for b in range(xs.shape[0])]
    return tuple(np.array([[o[i] for o in row] for row in out]) for i in range(3))


@pytest.mark.parametrize("form", mhc.MIX_FORMS)
@pytest.mark.parametrize("dtype, tol", [(jnp.float64, 1e-10), (jnp.float32, 1e-5)])
def test_pre_and_post_match_reference(request, dtype, tol, form):
    if dtype == jnp.float64:
        request.getfixturevalue("x64")
    hc = _hc(dtype, form=form)
    x = _stream(dtype)
    y, post, comb = _pre(hc, x)
    r_y, r_post, r_comb = _ref_pre(hc, x)
    _close(post, r_post, tol, "post")
    _close(comb, r_comb, tol, "comb")
    _close(y, r_y, tol * 10, "y")
    out = _normal(5, y.shape, dtype)
    new = _post(out, x, post, comb, form)
    xs, outs = np.asarray(x, np.float64), np.asarray(out, np.float64)
    r_new = np.array([[ref.hc_post(outs[b, t], xs[b, t], r_post[b, t], r_comb[b, t])
                       for t in range(x.shape[1])] for b in range(x.shape[0])])
    _close(new, r_new, tol * 10, "post stream")
    assert new.dtype == x.dtype and y.dtype == x.dtype


@pytest.mark.parametrize("form", mhc.MIX_FORMS)
@pytest.mark.parametrize("dtype, tol", [(jnp.float64, 1e-10), (jnp.float32, 1e-5)])
def test_head_collapse_matches_reference(request, dtype, tol, form):
    if dtype == jnp.float64:
        request.getfixturevalue("x64")
    head = _head(dtype, form=form)
    x = _stream(dtype, seed=6)
    y = _collapse(head, x)
    fn = ref.fn_official(np.asarray(head.fn[...]))
    scale, base = (np.asarray(v[...], np.float64) for v in (head.scale, head.base))
    xs = np.asarray(x, np.float64)
    r_y = np.array([[ref.head_collapse(xs[b, t], fn, scale, base, EPS, NORM_EPS)
                     for t in range(x.shape[1])] for b in range(x.shape[0])])
    _close(y, r_y, tol * 10, "head collapse")


@pytest.mark.parametrize("form, backward", [("slices", "autodiff"), ("einsum", "closed"), ("slices", "closed")])
def test_the_mix_forms_agree_in_value_and_gradient(form, backward):
    """`slices` and the mixes' closed-form backward (a TPU's choices) against `einsum` with autodiff (a
    CPU's): a layer's pre, post and the head collapse, float32, on fresh seeded inputs; the gradients of
    every parameter and of the stream."""

    def loss(form, x, out, backward="autodiff"):
        hc, head = _hc(jnp.float32, form=form, backward=backward), _head(jnp.float32, form=form, backward=backward)

        def f(hc, head, x):
            y, post, comb = hc.pre(x)
            new = mhc.HyperConnection.post(out + y, x, post, comb, form)
            return jnp.sum(jnp.sin(head(new))) + jnp.sum(jnp.cos(new))

        return nnx.jit(nnx.value_and_grad(f, argnums=(0, 1, 2)))(hc, head, x)  # one program, not one per operation

    x, out = _stream(jnp.float32, seed=11, shape=(3, 5)), _normal(12, (3, 5, M))
    (v_e, g_e), (v_s, g_s) = loss("einsum", x, out), loss(form, x, out, backward)
    _close(v_s, v_e, 1e-5, "value")
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_e)):
        _close(a, b, 1e-4, "gradient")
    with pytest.raises(ValueError, match="hc_mix_form='dots': one of einsum, slices"):
        mhc.weighted_copies(x[..., 0], x, "dots")


def test_real_init_and_shapes():
    @nnx.jit
    def build(rngs):
        return (mhc.HyperConnection(M, N, ITERS, EPS, NORM_EPS, rngs=rngs),
                mhc.HeadCollapse(M, N, EPS, NORM_EPS, rngs=rngs))

    hc, head = build(nnx.Rngs(0))
    assert hc.fn.shape == (N, M, (2 + N) * N) and hc.base.shape == ((2 + N) * N,) and hc.scale.shape == (3,)
    assert head.fn.shape == (N, M, N) and head.base.shape == (N,) and head.scale.shape == (1,)
    paths = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(hc, nnx.Param))}
    assert paths == {"fn", "base", "scale"}
    _close(hc.scale[...], np.full(3, mhc.SCALE_INIT, np.float32), 0.0, "scale init")
    _close(hc.base[...], [-np.log(N - 1)] * N + [0.0] * (N + N * N), 1e-6, "base init")
    # The base alone (fn's input-dependent part removed) makes y the mean copy, post 1, comb uniform.
    hc.fn[...] = jnp.zeros_like(hc.fn[...])
    head.fn[...] = jnp.zeros_like(head.fn[...])
    x = mhc.expand(_normal(7, (2, 3, M)), N)
    y, post, comb = _pre(hc, x)
    _close(y, x[:, :, 0] * (1 + N * EPS), 1e-5, "init pre = mean of copies")
    _close(post, np.ones((2, 3, N)), 1e-5, "init post")
    _close(comb, np.full((2, 3, N, N), 1.0 / N), 1e-5, "init comb")
    _close(_collapse(head, x), x[:, :, 0] * (1 + N * EPS), 1e-5, "init collapse")


def test_expand_fills_every_copy():
    x = _normal(8, (2, 3, M))
    xs = mhc.expand(x, N)
    assert xs.shape == (2, 3, N, M)
    for i in range(N):
        _close(xs[:, :, i], x, 0.0, f"copy {i}")
