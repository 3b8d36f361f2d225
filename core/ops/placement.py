"""Where an activation lives on the mesh of the trace, and in what order its collectives run (docs/scaling.md).

The compiler propagates shardings from a step's inputs and weights; an activation built from a weight
sharded one way and rows sharded another can come out replicated, and then every device holds and
computes the whole batch's. `pin_rows` states the split the rules give an activation of rows:
core.parallel.sharding's `batch` rule (BATCH_AXES) on its first axis and `heads` (`tensor`) on one
more, on the abstract mesh a step is traced under (core/train/program.py `with_mesh`); `gather_weight`
states that a weight read in a loop is whole (but its heads) before the loop.
`mesh_platform_of` names the platform that mesh's trace is for (where a Pallas kernel compiles).

The mesh axes named here are the sharding rules' own (core/parallel/sharding.py takes BATCH_AXES from
here; ops may not import parallel): the batch's, which the loss, the MoE's exchange, the attention's
kernels, the plan's report and the rules share, and the experts'.

Order. XLA:CPU may start a collective that follows a loop holding collectives before the loop's own have
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
import math
import threading

import jax
import jax.extend
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

BATCH_AXES = ("data", "fsdp", "expert_outer", "expert")   # the `batch` rule's mesh axes: a batch's rows, and the MoE's tokens
EXPERT_AXIS = "expert"                    # the experts' leading axis ("experts" -> "expert")
# expert_outer: the experts and the batch split over it, every other weight replicated (a mesh holds it
# only where it is above 1); experts' leading axis over EXPERT_AXES, outer-major
EXPERT_AXES = ("expert_outer", EXPERT_AXIS)
MLP_AXIS = "tensor"                       # the experts' hidden axis ("mlp" -> "tensor")
HEADS_AXIS = MLP_AXIS  # the `heads` rule's mesh axis ("heads" -> "tensor"), as the experts' hidden axis


def token_shards(mesh) -> int:
    """Devices a batch's rows (and so the tokens) split over: the product of the mesh's BATCH_AXES sizes."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.axis_names)


def expert_axes(mesh) -> tuple[str, ...]:
    """The mesh axes the routed experts split over: EXPERT_AXES that `mesh` holds above 1 (none on one device)."""
    if mesh is None or mesh.empty:
        return ()
    return tuple(a for a in EXPERT_AXES if a in mesh.axis_names and mesh.shape[a] > 1)


def expert_axis_size(mesh) -> int:
    """Devices the routed experts split over: the product of the mesh's EXPERT_AXES (1 without a mesh)."""
    return math.prod(mesh.shape[a] for a in expert_axes(mesh))


def platform_name(platform: str) -> str:
    """A JAX device platform ("cpu", "gpu", "cuda", "rocm", "tpu") as one of "cpu", "gpu", "tpu"."""
    return "gpu" if platform in ("cuda", "rocm") else platform


def divisible_prefix(size: int, names, mesh):
    """The longest prefix of mesh axes `names` whose sizes multiply to a divisor of `size`: None for none,
    a name for one, else a tuple (a PartitionSpec entry). The rule every sharding here follows: a
    dimension its mesh axes do not divide stays replicated over them (core.parallel.sharding)."""
    kept, ways = [], 1
    for name in names:
        if name not in mesh.shape:  # an axis the mesh leaves out (expert_outer) splits nothing
            continue
        if size % (ways * mesh.shape[name]):
            break
        kept.append(name)
        ways *= mesh.shape[name]
    return None if not kept else kept[0] if len(kept) == 1 else tuple(kept)


def _constrain(x: jax.Array, rows: bool, heads_axis: int | None) -> jax.Array:
    """`x` with its first axis over the batch's mesh axes (if `rows`) and `heads_axis` over `tensor`, where
    they divide, the rest whole, on the trace's abstract mesh; unchanged without one or on one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return x
    spec = [None] * x.ndim
    if rows:
        spec[0] = divisible_prefix(x.shape[0], BATCH_AXES, mesh)
    if heads_axis is not None:
        spec[heads_axis] = divisible_prefix(x.shape[heads_axis], (HEADS_AXIS,), mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def pin_rows(x: jax.Array, heads_axis: int | None = None) -> jax.Array:
    """`x` [B, ...] with B split over the batch's mesh axes and `heads_axis` (if given) over `tensor`,
    where they divide, on the trace's abstract mesh; unchanged without one or on one device."""
    return _constrain(x, True, heads_axis)


def gather_weight(w: jax.Array, heads_axis: int | None = None) -> jax.Array:
    """`w` whole on every device of the trace's abstract mesh, but for `heads_axis` (if given) split
    over `tensor` where it divides; unchanged without a mesh or on one device.

    For a weight that a loop reads at every step (a query projection in the indexer's top-k chunks
    and the streamed loss's blocks): gathered once before the loop. Left sharded, XLA gathers it
    again in each step (an all-reduce of the whole weight per block on a TPU).

    On a GPU its gradient is left free (`gathered_free_cotangent`): XLA:GPU otherwise all-reduces
    the whole weight gradient over every device (across hosts) before slicing the weight's shard."""
    # GPU only: on a TPU (libtpu, v5p-128) the free form compiles to the same whole all-reduce, no reduce-scatter
    if mesh_platform_of(jax.sharding.get_abstract_mesh()) == "gpu":
        return gathered_free_cotangent(w, heads_axis)
    return _constrain(w, False, heads_axis)


def gathered_free_cotangent(w: jax.Array, heads_axis: int | None = None) -> jax.Array:
    """`gather_weight`'s value with its cotangent unconstrained: the gradient reaches the weight's own
    sharding by a reduce-scatter (within a host, then across hosts over a 1/n shard) instead of an
    all-reduce of the whole gradient over every device. Values and gradients are `gather_weight`'s."""

    @jax.custom_vjp
    def gather(w):
        return _constrain(w, False, heads_axis)

    def fwd(w):
        return gather(w), None

    def bwd(_, g):
        return (g,)

    gather.defvjp(fwd, bwd)
    return gather(w)


def mesh_platform_of(mesh) -> str:
    """The platform a trace is for ("cpu", "gpu", "tpu"): `mesh`'s (an abstract mesh, e.g.
    `jax.sharding.get_abstract_mesh()`) devices', else JAX's default backend. A Pallas TPU kernel runs
    compiled where it is "tpu" and in interpret mode elsewhere."""
    device = getattr(mesh, "abstract_device", None) if mesh is not None and not mesh.empty else None
    return platform_name(device.platform) if device is not None else platform_name(jax.default_backend())


# ----------------------------------------------------------------------------- order

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
