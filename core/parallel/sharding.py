"""Logical-axis rules and sharded state and batches (DESIGN.md, "Scale").

The same program runs on one CPU, a multi-device host and many hosts through JAX's own SPMD
machinery; this module only decides *where* arrays live. The device mesh and multi-host start-up
(`make_mesh`, `plan_mesh`, `describe_mesh`, `initialize_distributed`, `is_main_process`, ...) live
in core/parallel/mesh.py.

- `LOGICAL_AXIS_RULES`: the parameters' logical axis names (set by `core.model.layers.param`) -> mesh
  axes, resolved with flax's `nn.logical_to_mesh_axes` (first free mesh axis wins, so a mesh axis
  is never used twice in one array; unknown names are replicated).
- `create_sharded(make, mesh)` builds a model or an optimizer directly into its shardings under
  jit (nothing full-size is materialised on one device); optimizer moments carry their
  parameter's metadata (`nnx.Optimizer`), so they follow the parameters; step counters and other
  unannotated values are replicated. `shard_state` reshards an existing object, `abstract_state`
  gives Orbax restore targets for the current mesh (a checkpoint saved on 8 devices restores on 1).
- Batches: axis 0 is split over `BATCH_AXES`; each process feeds only its own rows
  (`local_batch_slice`, `shard_batch` -> `jax.make_array_from_process_local_data`).

Deviations from MaxText: `batch` also spans `expert` (MaxText's `activation_batch` does too),
so expert-parallel devices split the batch instead of repeating the attention work, and every
weight but the routed experts shards its `embed` (or LoRA rank) over `expert` as over `fsdp`
(MaxText's `embed` rule), so a mesh of expert devices holds one copy of the model; the experts and
the batch also split over `expert_outer` (core/parallel/mesh.py), which every other weight is
replicated across (hybrid sharding: sharded within a host, replicated across hosts); and a
dimension that its mesh axes do not divide is replicated along them instead of rejected (the
single shared K=V head, a 4-head toy on tensor=8): correct, only less memory-frugal.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence, TypeVar

import jax
import numpy as np
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from core.errors import ConfigError
from core.ops.placement import BATCH_AXES, divisible_prefix

T = TypeVar("T")


# Logical axis -> mesh axis (or axes, or None = replicated); flax's rule format.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("experts", ("expert_outer", "expert")),  # before embed's, which would otherwise take `expert` from an expert weight
    ("embed", ("fsdp", "expert")),  # every other weight over the expert devices too (MaxText's embed rule)
    ("embed", "fsdp"),  # an expert weight's embed, its experts already on `expert`
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("indexer_heads", "tensor"),
    ("kv", "tensor"),
    ("mlp", "tensor"),
    ("q_lora", ("fsdp", "expert")),  # wq_b [q_lora, H, D] has no embed axis; where embed holds them (wq_a) none
    ("q_lora", None),
    ("o_lora", ("fsdp", "expert")),  # wo_a [G, H/G * D, o_lora] likewise
    ("o_lora", None),
    ("layers", None),
    ("norm", None),
    ("mhc", None),
)


# ----------------------------------------------------------------------------- parameters and state


def logical_to_spec(axes: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh,
                    rules=LOGICAL_AXIS_RULES) -> PartitionSpec:
    """The PartitionSpec of an array with logical `axes` and `shape` on `mesh`.

    Args:
      axes: one logical name (or None) per dimension; None or () = replicated.
      shape: the array's shape (a dimension its mesh axes do not divide stays replicated).
      mesh: the device mesh.
      rules: (logical, mesh axes) pairs, earlier wins (flax's format).
    Returns:
      a PartitionSpec with one entry per dimension.
    """
    if not axes:
        return PartitionSpec()
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match the array's shape {tuple(shape)}: one name per dimension.")
    spec = nn.logical_to_mesh_axes(tuple(axes), rules)
    names = [() if entry is None else (entry,) if isinstance(entry, str) else tuple(entry) for entry in spec]
    # an axis the mesh leaves out (expert_outer) is dropped first: the experts' rule on a mesh without it is
    # `expert`'s alone, as it was; then a weight's mesh axis of size 1 splits nothing: left out, the rule
    # (fsdp, expert) on a mesh without expert devices gives `fsdp`'s spec (the batch keeps its axes, as
    # batch_sharding spells them)
    names = [entry if logical == "batch" else tuple(a for a in entry if a in mesh.shape) for logical, entry in zip(axes, names)]
    names = [entry if logical == "batch" or len(entry) < 2 else tuple(a for a in entry if mesh.shape.get(a, 1) > 1)
             for logical, entry in zip(axes, names)]
    entries = [divisible_prefix(dim, entry, mesh) for dim, entry in zip(shape, names)]
    return PartitionSpec(*entries)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(tree: Any, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> Any:
    """NamedShardings for every array of an nnx object or State, by its variables' logical axes.

    Args:
      tree: an nnx Module / Optimizer (concrete or from `nnx.eval_shape`) or an `nnx.State`.
      mesh: the device mesh.
      rules: logical-axis rules.
    Returns:
      the State with each array replaced by its NamedSharding (same tree structure, so it can
      be passed to `jax.device_put`, `jax.jit(out_shardings=...)` or zipped with the state).
    """
    state = tree if isinstance(tree, nnx.State) else nnx.state(tree)

    def one(x):
        value = x.get_value() if _is_variable(x) else x
        if not hasattr(value, "shape"):
            return x
        axes = x.get_metadata().get("out_sharding") if _is_variable(x) else None
        try:
            sharding = NamedSharding(mesh, logical_to_spec(axes, value.shape, mesh, rules))
        except ValueError as e:
            raise ValueError(f"{type(x).__name__} of shape {value.shape}: {e}") from None
        return x.replace(sharding) if _is_variable(x) else sharding

    return jax.tree.map(one, state, is_leaf=_is_variable)


def constrain(mesh: Mesh, *objs: Any) -> None:
    """Pin nnx objects' arrays to their rule shardings; call inside jit, after updating them.

    Without it a jitted train step lets the compiler choose the updated parameters' and moments'
    layouts, which then drift from the rules (and force recompiles on the next call).

    Args:
      mesh: the device mesh.
      objs: nnx objects (model, optimizer) updated in place with sharding constraints.
    """
    for obj in objs:
        state = nnx.state(obj)
        nnx.update(obj, jax.lax.with_sharding_constraint(state, state_shardings(state, mesh)))


def create_sharded(make: Callable[..., T], mesh: Mesh, *args: Any) -> T:
    """`make(*args)` built under jit directly into its shardings (no full copy on one device).

    Use it for the model (`create_sharded(lambda: Model(cfg, rngs=nnx.Rngs(seed)), mesh)`) and
    for the optimizer (`create_sharded(lambda m: nnx.Optimizer(m, tx, wrt=...), mesh, model)`),
    whose moments then follow their parameters. Random initialisation is identical on every
    mesh (JAX's threefry is partitionable), so a run starts from the same weights anywhere.

    `args` are only read: their arrays enter the program as plain arrays and `make` gets copies of
    them rebuilt inside it. Given to nnx.jit as nnx objects, they would come back out of it as new
    arrays, a second copy of each beside the first (of every parameter, for the optimizer:
    docs/planning.md#on-a-chip).

    Args:
      make: builds an nnx object from `args`.
      mesh: the device mesh.
    Returns:
      the object, every array a global jax.Array with its rule-given NamedSharding.
    """
    graphdef, state = nnx.split(args)
    arrays, treedef = jax.tree.flatten(state)

    @nnx.jit
    def build(arrays):
        obj = make(*nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays)))
        constrain(mesh, obj)
        return obj

    return build(arrays)


def shard_state(obj: T, mesh: Mesh) -> T:
    """Move an existing nnx object's arrays onto `mesh` by the rules, in place (one process).

    Returns:
      `obj`, for chaining. Prefer `create_sharded` for new objects and on many hosts.
    """
    state = nnx.state(obj)
    nnx.update(obj, jax.device_put(state, state_shardings(state, mesh)))
    return obj


def abstract_state(tree: Any, mesh: Mesh) -> Any:
    """Orbax restore targets: the State with ShapeDtypeStructs that carry this mesh's shardings.

    Args:
      tree: an nnx object or State, concrete or abstract (`nnx.eval_shape`).
    Returns:
      the State with each array replaced by `jax.ShapeDtypeStruct(shape, dtype, sharding=...)`.
    """
    state = tree if isinstance(tree, nnx.State) else nnx.state(tree)
    shardings = state_shardings(state, mesh)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def shard_bytes(x: Any) -> int:
    """Bytes of one device's shard of an abstract (or concrete) array with a sharding: the largest
    shard, so uneven and replicated arrays count in full; the whole array without a sharding."""
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    return math.prod(shape) * x.dtype.itemsize


# ----------------------------------------------------------------------------- batches


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch rows (axis 0) split over BATCH_AXES; every other axis replicated."""
    return NamedSharding(mesh, PartitionSpec(tuple(a for a in BATCH_AXES if a in mesh.axis_names)))


def _batch_shards(mesh: Mesh) -> int:
    return math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)


def local_batch_slice(mesh: Mesh, global_batch: int) -> slice:
    """The rows of a global batch that this process must feed (contiguous by construction).

    Args:
      mesh: the device mesh.
      global_batch: rows of the whole step's batch (per_device_batch_size * devices).
    Returns:
      slice(start, stop) into the global batch.
    """
    shards = _batch_shards(mesh)
    if global_batch % shards:
        raise ConfigError(f"the global batch of {global_batch} rows does not split over {shards} data/fsdp/expert shards: "
                          f"make per_device_batch_size * devices a multiple of {shards}.")
    index = batch_sharding(mesh).addressable_devices_indices_map((global_batch,))
    spans = sorted({(s[0].start or 0, global_batch if s[0].stop is None else s[0].stop) for s in index.values()})
    start, stop = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != stop - start:
        raise ConfigError("this process's devices hold non-contiguous batch rows: order the mesh so that each "
                          "process owns whole data/fsdp/expert shards (keep dcn_* on the outer axes).")
    return slice(start, stop)


def shard_batch(batch: Mapping[str, Any], mesh: Mesh, *, process_local: bool = False) -> dict[str, jax.Array]:
    """Global, batch-sharded arrays from host NumPy arrays.

    Args:
      batch: name -> array [rows, ...]. By default every process passes the same global batch and
        keeps its own rows; with `process_local=True` each passes only its rows
        (`local_batch_slice`), which is what a per-process data loader yields.
      mesh: the device mesh.
    Returns:
      name -> jax.Array of the global shape, sharded by `batch_sharding(mesh)`.
    """
    sharding = batch_sharding(mesh)
    out = {}
    for name, value in batch.items():
        value = np.asarray(value)
        if process_local:
            distinct = len({(s[0].start, s[0].stop) for s in
                            sharding.addressable_devices_indices_map((_batch_shards(mesh),)).values()})
            global_rows = value.shape[0] * _batch_shards(mesh) // distinct
            local = value
        else:
            global_rows = value.shape[0]
            local = value[local_batch_slice(mesh, global_rows)]
        out[name] = jax.make_array_from_process_local_data(sharding, local, (global_rows,) + value.shape[1:])
    return out
