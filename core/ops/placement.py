"""Where an activation lives on the mesh of the trace (docs/scaling.md).

The compiler propagates shardings from a step's inputs and weights; an activation built from a weight
sharded one way and rows sharded another can come out replicated, and then every device holds and
computes the whole batch's. `pin_rows` states the split the rules give an activation of rows:
core.parallel.sharding's `batch` rule (BATCH_AXES) on its first axis and `heads` (`tensor`) on one
more, on the abstract mesh a step is traced under (core/train/program.py `with_mesh`); `gather_weight`
states that a weight read in a loop is whole (but its heads) before the loop.
`mesh_platform_of` names the platform that mesh's trace is for (where a Pallas kernel compiles).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from core.ops.expert_parallel import MLP_AXIS, TOKEN_AXES

HEADS_AXIS = MLP_AXIS  # the `heads` rule's mesh axis ("heads" -> "tensor"), as the experts' hidden axis


def platform_name(platform: str) -> str:
    """A JAX device platform ("cpu", "gpu", "cuda", "rocm", "tpu") as one of "cpu", "gpu", "tpu"."""
    return "gpu" if platform in ("cuda", "rocm") else platform


def divisible_prefix(size: int, names, mesh):
    """The longest prefix of mesh axes `names` whose sizes multiply to a divisor of `size`: None for none,
    a name for one, else a tuple (a PartitionSpec entry). The rule every sharding here follows: a
    dimension its mesh axes do not divide stays replicated over them (core.parallel.sharding)."""
    kept, ways = [], 1
    for name in names:
        if name not in mesh.shape or size % (ways * mesh.shape[name]):
            break
        kept.append(name)
        ways *= mesh.shape[name]
    return None if not kept else kept[0] if len(kept) == 1 else tuple(kept)


def pin_rows(x: jax.Array, heads_axis: int | None = None) -> jax.Array:
    """`x` [B, ...] with B split over the batch's mesh axes and `heads_axis` (if given) over `tensor`,
    where they divide, on the trace's abstract mesh; unchanged without one or on one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return x
    spec = [None] * x.ndim
    spec[0] = divisible_prefix(x.shape[0], TOKEN_AXES, mesh)
    if heads_axis is not None:
        spec[heads_axis] = divisible_prefix(x.shape[heads_axis], (HEADS_AXIS,), mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def gather_weight(w: jax.Array, heads_axis: int | None = None) -> jax.Array:
    """`w` whole on every device of the trace's abstract mesh, but for `heads_axis` (if given) split
    over `tensor` where it divides; unchanged without a mesh or on one device.

    For a weight that a loop reads at every step (a query projection in the indexer's top-k chunks
    and the streamed loss's blocks): gathered once before the loop. Left sharded, XLA gathers it
    again in each step (an all-reduce of the whole weight per block on a TPU)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return w
    spec = [None] * w.ndim
    if heads_axis is not None:
        spec[heads_axis] = divisible_prefix(w.shape[heads_axis], (HEADS_AXIS,), mesh)
    return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, PartitionSpec(*spec)))


def mesh_platform_of(mesh) -> str:
    """The platform a trace is for ("cpu", "gpu", "tpu"): `mesh`'s (an abstract mesh, e.g.
    `jax.sharding.get_abstract_mesh()`) devices', else JAX's default backend. A Pallas TPU kernel runs
    compiled where it is "tpu" and in interpret mode elsewhere."""
    device = getattr(mesh, "abstract_device", None) if mesh is not None and not mesh.empty else None
    return platform_name(device.platform) if device is not None else platform_name(jax.default_backend())
