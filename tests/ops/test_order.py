"""core.ops.placement: the ties that order collectives change no value and no gradient, bit for bit.

That they do order the collectives of a program under a mesh (at-risk pairs without them, none
with them) is tested on eight devices in tests/parallel/test_sharding.py (`_order_report`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import contextlib

import pytest

from core.ops.placement import after, backward_after_cotangent, cotangent_after_value, einsum_after_cotangent, read_after, tied

# signed zeros, infinities and subnormals in the value that passes through
X = jnp.array([[-0.0, 0.0, 1.5, -2.25], [np.inf, -np.inf, 1e-40, -3.0]], jnp.float32)


@pytest.fixture(autouse=True)
def _tied(request):
    """The helpers tie (as in a step traced for a CPU mesh of several devices), but in the test of the switch."""
    with contextlib.nullcontext() if request.node.name == "test_ties_are_traced_only_where_asked" else tied(True):
        yield


def _same(a, b) -> bool:
    """Bit for bit (so -0.0 differs from 0.0), leaf by leaf."""
    return all(np.array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_after_returns_x_bitwise_and_passes_its_gradient():
    dep = jnp.array([3.0, -0.0, np.inf, -1e30], jnp.float32)
    for d in (dep, dep[:1].reshape(()), jnp.ones_like(X) * -7.0):  # another shape, a scalar, the same shape
        assert _same(jax.jit(after)(X, d), X)
    f = lambda x, d: jnp.sum(jnp.sin(after(x, d)) * jnp.arange(4.0))
    x = jnp.where(jnp.isfinite(X), X, 0.5)
    gx, gd = jax.grad(f, argnums=(0, 1))(x, dep)
    assert _same(gx, jax.grad(lambda x: jnp.sum(jnp.sin(x) * jnp.arange(4.0)))(x))
    assert np.all(np.asarray(gd) == 0)
    # dep's cotangent adds exactly nothing to the cotangent dep already has
    g_dep = jax.grad(lambda d: jnp.sum(after(x, d)) + jnp.sum(d * -0.0))(dep)
    assert _same(g_dep, jax.grad(lambda d: jnp.sum(d * -0.0))(dep))


def test_tied_functions_equal_the_plain_ones_in_value_and_gradient():
    k = jax.random.split(jax.random.key(0), 3)
    a, w = jax.random.normal(k[0], (2, 3, 4)), jax.random.normal(k[1], (4, 5))
    plain = lambda a, w: jnp.sum(jnp.tanh(jnp.einsum("btm,mf->btf", a, w)) ** 2)
    tied = lambda a, w: jnp.sum(cotangent_after_value(jnp.tanh(einsum_after_cotangent("btm,mf->btf", a, w))) ** 2)
    body = lambda a, w: jnp.sum(jnp.tanh(a @ w) ** 2)
    remat = lambda a, w: backward_after_cotangent(jax.checkpoint(lambda a: jnp.tanh(a @ w)))(a)
    wrapped = lambda a, w: jnp.sum(remat(a, w) ** 2)  # w closed over: a differentiated constant
    for f, g in ((tied, plain), (wrapped, body)):
        want = jax.jit(jax.value_and_grad(g, argnums=(0, 1)))(a, w)
        assert _same(jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(a, w), want)


def test_ties_are_traced_only_where_asked():
    """Outside `tied(True)` (which a step traced for a CPU mesh of several devices enters: accelerators
    and one device need no tie) every helper is a plain pass-through: no NaN flag in the program."""
    def program(x, d):
        y = cotangent_after_value(after(x, d))
        z = einsum_after_cotangent("ij,jk->ik", y, y.T)
        return backward_after_cotangent(lambda a: jnp.sin(a))(z)

    def flags(on=None):
        def traced(x, d):
            with contextlib.nullcontext() if on is None else tied(on):
                return jax.grad(lambda x: jnp.sum(program(x, d)))(x)
        return str(jax.make_jaxpr(traced)(X, X[0])).count(" = ne ")  # isnan(v) is `ne v v`

    assert flags() == flags(False) == 0
    assert flags(True) > 0
    # read_after ties whatever the switch (an order for memory, not for collectives)
    assert str(jax.make_jaxpr(read_after)(X, X[0])).count(" = ne ") == 1
