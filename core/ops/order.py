"""Data dependencies that fix the order of collectives (docs/scaling.md#collective-order-on-the-cpu).

XLA:CPU may start a collective that follows a loop holding collectives before the loop's own have
run, unless the collective reads the loop's output. `after(x, dep)` returns `x` unchanged but reads
`dep`, so everything computed from its result (collectives included) runs after `dep` is complete:
a real data dependency, which XLA keeps where it drops an optimization barrier. Its gradient mirrors
it: the cotangent of `x` passes through unchanged, and `dep` gets a zero cotangent read from it, so
the backward of `dep`'s producer runs after the backward of what used `x`. The other helpers build
on it: `cotangent_after_value` (a value's cotangent waits for the value), `einsum_after_cotangent`
(an einsum whose backward reads its operands after its cotangent) and `backward_after_cotangent` (a
function whose backward reads what it saved after its cotangent and after every saved value).

Exactness: the result is `where(isnan(dep), nan, x)`: `x` bit for bit, no arithmetic on it, unless
`dep` holds a NaN (then the step's loss is NaN anyway). A `dep` of another shape than `x` is reduced
to one flag first (on a mesh a small all-reduce, itself after `dep`). `dep`'s cotangent is -0 (NaN
where the incoming cotangent is), which adds nothing to a cotangent but flushes a subnormal one to
zero, as the arithmetic after it would.

Only a program with collectives on XLA:CPU needs them: the GPU and TPU compilers run a device's
collectives in one scheduled order, and one device has none. So the helpers tie only inside
`tied(True)`, which core/train/program.py `with_mesh` enters while it traces a step for a CPU mesh
of several devices; elsewhere (accelerators, one device, outside a step) they pass their input
through, and the program carries no flag. `read_after` is `after` without that switch, for an
order that serves memory rather than collectives (core/loss/lm.py).
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.extend
import jax.numpy as jnp

_STATE = threading.local()  # .on: whether the trace in this thread ties (unset: no)


@contextlib.contextmanager
def tied(on: bool):
    """Within it, this thread's traces tie collectives if `on` (module docstring)."""
    before = getattr(_STATE, "on", False)
    _STATE.on = bool(on)
    try:
        yield
    finally:
        _STATE.on = before


def _on() -> bool:
    return getattr(_STATE, "on", False)


def _nan_in(ref, shape):
    """Bool of `shape` read from `ref`: where `ref` is NaN (elementwise when the shapes agree, else
    whether any element is)."""
    nan = jnp.isnan(ref) if jnp.issubdtype(ref.dtype, jnp.floating) else ref != ref
    return nan if ref.shape == tuple(shape) else jnp.broadcast_to(jnp.any(nan), shape)


def _read(x, flag):
    """`x` where `flag` is False (everywhere but after a NaN), NaN where it is True."""
    return jnp.where(flag, jnp.array(jnp.nan, x.dtype), x)


def after(x, dep):
    """`x`, bit for bit, computed after `dep` (module docstring); a float array `x`, any array `dep`.

    Args:
      x: the value whose users must wait for `dep`.
      dep: the value they wait for (e.g. a loop's output).
    Returns:
      `x` (same shape, dtype, value); its gradient is the identity, `dep`'s an exact zero.
    """
    return read_after(x, dep) if _on() else x


def read_after(x, dep):
    """`after`, whether or not this trace ties collectives (`tied`)."""
    shape, dtype = dep.shape, dep.dtype

    @jax.custom_vjp
    def tie(x, dep):
        return _read(x, _nan_in(dep, x.shape))

    def fwd(x, dep):
        return tie(x, dep), None

    def bwd(_, g):
        return g, _read(jnp.full(shape, -0.0, dtype), _nan_in(g, shape))

    tie.defvjp(fwd, bwd)
    return tie(x, dep)


@jax.custom_vjp
def _cotangent_after_value(y):
    return y


def _cav_fwd(y):
    return y, y


def _cav_bwd(y, g):
    return (_read(g, _nan_in(y, g.shape)),)


_cotangent_after_value.defvjp(_cav_fwd, _cav_bwd)


def cotangent_after_value(y):
    """`y` unchanged; its cotangent is read after `y` itself (exact, as `after`): under remat the
    backward of everything that used `y` then waits for `y`'s recomputation."""
    return _cotangent_after_value(y) if _on() else y


def einsum_after_cotangent(subscripts: str, a, b):
    """`jnp.einsum(subscripts, a, b)` whose backward reads `a` and `b` after the cotangent of its
    result (exact, as `after`): the gathers of forward values that its gradients need run after
    what made the cotangent."""
    if not _on():
        return jnp.einsum(subscripts, a, b)

    @jax.custom_vjp
    def dot(a, b):
        return jnp.einsum(subscripts, a, b)

    def fwd(a, b):
        return dot(a, b), (a, b)

    def bwd(res, g):
        tied = (_read(r, _nan_in(g, r.shape)) for r in res)
        return jax.vjp(lambda a, b: jnp.einsum(subscripts, a, b), *tied)[1](g)

    dot.defvjp(fwd, bwd)
    return dot(a, b)


def _floating(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _nan_flag(values, first=None):
    """One bool: whether a floating leaf of `values` holds a NaN; each leaf's reduction also reads
    `first` (a flag made before), so that it runs after what made `first`."""
    flags = [jnp.any(jnp.isnan(v) if first is None else jnp.isnan(v) | first)
             for v in jax.tree.leaves(values) if _floating(v)]
    return jnp.any(jnp.array(flags)) if flags else jnp.array(False)


def backward_after_cotangent(f):
    """`f` whose result is read after every value it saves for the backward, and whose backward
    reads those values (its residuals; under `jax.checkpoint` the inputs of its recompute) after the
    cotangent of its result and after each other (one flag read from all of them, as `after` reads
    `dep`): the saved values are computed before what follows `f`, and the backward's recompute, and
    the gathers of forward values that its gradients need, run after what made the cotangent.
    Values and gradients are `f`'s."""

    def wrapped(*args):
        if not _on():
            return f(*args)
        leaves, tree = jax.tree.flatten(args)
        # every traced value `f` closes over (integer ones too) becomes an explicit input: a custom_vjp
        # may not close over one (jax.closure_convert hoists the floating ones alone)
        closed, shapes = jax.make_jaxpr(lambda *xs: f(*jax.tree.unflatten(tree, xs)), return_shape=True)(*leaves)
        traced = [i for i, c in enumerate(closed.consts) if isinstance(c, jax.core.Tracer)]
        consts = [closed.consts[i] for i in traced]

        def conv(*xs):
            values = list(closed.consts)
            for i, c in zip(traced, xs[len(leaves):]):
                values[i] = c
            out = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(closed.jaxpr, values))(*xs[:len(leaves)])
            return jax.tree.unflatten(jax.tree.structure(shapes), out)

        @jax.custom_vjp
        def run(*inputs):
            return conv(*inputs)

        def fwd(*inputs):
            # the result is read after every saved value: a value computed for the backward alone is
            # then computed before the layers (and loops) that follow, not beside them
            out, vjp = jax.vjp(conv, *inputs)
            flag = _nan_flag(out)
            flag = flag | _nan_flag(vjp, flag)
            return jax.tree.map(lambda o: _read(o, flag) if _floating(o) else o, out), vjp

        def bwd(vjp, ct):
            # a flag read from the cotangent, then from every saved value after it: a saved value that the
            # forward computed late (used by the backward alone) is then read before any recompute
            flag = _nan_flag(ct)
            flag = flag | _nan_flag(vjp, flag)
            return jax.tree.map(lambda r: _read(r, flag) if _floating(r) else r, vjp)(ct)

        run.defvjp(fwd, bwd)
        return run(*leaves, *consts)

    return wrapped
