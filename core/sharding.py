"""Device meshes, logical-axis rules and sharded state (DESIGN.md, "Scale").

The same program runs on one CPU, a multi-device host and many hosts through JAX's own SPMD
machinery; this module only decides *where* arrays live:

- `make_mesh(cfg)`: a `jax.sharding.Mesh` with axes (data, fsdp, tensor, expert) from the config's
  MaxText keys. `ici_*` spans the devices of one granule (a TPU slice, else one process), `dcn_*`
  the granules; -1 fills the rest; the products must match the devices or a `ConfigError` says
  how to fix them. Axes are `AxisType.Auto`: jit propagates shardings (GSPMD), the layers stay
  mesh-agnostic.
- `LOGICAL_AXIS_RULES`: the parameters' logical axis names (set by `core.layers.param`) -> mesh
  axes, resolved with flax's `nn.logical_to_mesh_axes` (first free mesh axis wins, so a mesh axis
  is never used twice in one array; unknown names are replicated).
- `create_sharded(make, mesh)` builds a model or an optimizer directly into its shardings under
  jit (nothing full-size is materialised on one device); optimizer moments carry their
  parameter's metadata (`nnx.Optimizer`), so they follow the parameters; step counters and other
  unannotated values are replicated. `shard_state` reshards an existing object, `abstract_state`
  gives Orbax restore targets for the current mesh (a checkpoint saved on 8 devices restores on 1).
- Batches: axis 0 is split over `BATCH_AXES`; each process feeds only its own rows
  (`local_batch_slice`, `shard_batch` -> `jax.make_array_from_process_local_data`).
- Multi-host: `initialize_distributed` calls `jax.distributed.initialize` when flags or a cluster
  environment ask for it; `is_main_process()` gates printing and metrics.

Deviations from MaxText: `batch` also spans `expert` (MaxText's `activation_batch` does too),
so expert-parallel devices split the batch instead of repeating the attention work; and a
dimension that its mesh axes do not divide is replicated along them instead of rejected (the
single shared K=V head, a 4-head toy on tensor=8): correct, only less memory-frugal.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Mapping, Sequence, TypeVar

import jax
import numpy as np
from flax import linen as nn
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from core.errors import ConfigError

T = TypeVar("T")

MESH_AXES = ("data", "fsdp", "tensor", "expert")
BATCH_AXES = ("data", "fsdp", "expert")

# Logical axis -> mesh axis (or axes, or None = replicated); flax's rule format.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("indexer_heads", "tensor"),
    ("kv", "tensor"),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("q_lora", None),
    ("o_lora", None),
    ("layers", None),
    ("norm", None),
    ("mhc", None),
)

# Environment variables that ask for a multi-process run without command-line flags.
DISTRIBUTED_ENV = "DSV4_DISTRIBUTED"


# ----------------------------------------------------------------------------- mesh


def _fill(prefix: str, values: Mapping[str, int], target: int, unit: str, where: str) -> dict[str, int]:
    """Resolve the (at most one) -1 in `values` so that their product is `target`, else ConfigError."""
    fixed_keys = ", ".join(f"{prefix}{a}_parallelism={v}" for a, v in values.items() if v not in (1, -1))
    fixed = math.prod(v for v in values.values() if v != -1)
    free = [a for a, v in values.items() if v == -1]
    if free:
        if target % fixed:
            raise ConfigError(
                f"the fixed {prefix}* values ({fixed_keys}) need {fixed} {unit}, which does not divide the {target} {unit} {where}, so "
                f"{prefix}{free[0]}_parallelism=-1 cannot fill the rest: choose {prefix}* values whose product divides {target}.")
        return {a: (target // fixed if v == -1 else v) for a, v in values.items()}
    if fixed != target:
        raise ConfigError(
            f"the {prefix}* parallelism values multiply to {fixed} ({fixed_keys or 'all 1'}) but there are {target} {unit} {where}: "
            f"make them multiply to {target}, or set one of them to -1 to fill the rest.")
    return dict(values)


def plan_mesh(cfg, num_devices: int, num_granules: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """The (ici, dcn) axis sizes for `num_devices` devices split into `num_granules` granules.

    Args:
      cfg: a Config (its ici_* and dcn_* parallelism keys).
      num_devices: all devices of the run.
      num_granules: TPU slices, else processes; devices within one talk over ICI/NVLink.
    Returns:
      (ici, dcn): dicts over MESH_AXES; the mesh axis size is ici[a] * dcn[a].
    Raises:
      ConfigError: when the products cannot match the devices.
    """
    if num_devices % num_granules:
        raise ConfigError(f"{num_devices} devices do not split evenly over {num_granules} hosts/slices: give every process the same number of devices.")
    per_granule = num_devices // num_granules
    ici = _fill("ici_", {a: getattr(cfg, f"ici_{a}_parallelism") for a in MESH_AXES}, per_granule, "devices",
                "in this run" if num_granules == 1 else f"in each of the {num_granules} processes or TPU slices")
    dcn = _fill("dcn_", {a: getattr(cfg, f"dcn_{a}_parallelism") for a in MESH_AXES}, num_granules,
                "processes or TPU slices", "in this run (dcn_* spans hosts, ici_* the devices within one)")
    return ici, dcn


def _granules(devices: Sequence[jax.Device]) -> tuple[int, bool]:
    """(number of granules, process_is_granule): TPU slices when known, else processes."""
    if devices[0].platform == "tpu" and hasattr(devices[0], "slice_index"):
        return len({d.slice_index for d in devices}), False
    return len({d.process_index for d in devices}), True


def make_mesh(cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The run's device mesh over `devices` (default: every device of every process).

    Args:
      cfg: a Config with the ici_* / dcn_* parallelism keys.
      devices: the devices to use (tests pass a subset, e.g. one device).
    Returns:
      a Mesh with axes MESH_AXES (all `AxisType.Auto`).
    """
    devices = list(jax.devices() if devices is None else devices)
    granules, process_is_granule = _granules(devices)
    ici, dcn = plan_mesh(cfg, len(devices), granules)
    ici_shape = [ici[a] for a in MESH_AXES]
    if granules > 1:
        array = mesh_utils.create_hybrid_device_mesh(
            ici_shape, [dcn[a] for a in MESH_AXES], devices, process_is_granule=process_is_granule,
            allow_split_physical_axes=True)
    else:
        array = mesh_utils.create_device_mesh(ici_shape, devices, allow_split_physical_axes=True)
    return Mesh(array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe_mesh(mesh: Mesh) -> str:
    """One line for table headers, e.g. 'fsdp 4 x tensor 2 (8 cpu devices, 1 process)'."""
    axes = " x ".join(f"{a} {n}" for a, n in mesh.shape.items() if n > 1) or "single device"
    platform = mesh.devices.flat[0].platform
    procs = len({d.process_index for d in mesh.devices.flat})
    return f"{axes} ({mesh.size} {platform} device{'s' * (mesh.size > 1)}, {procs} process{'es' * (procs > 1)})"


# ----------------------------------------------------------------------------- multi-host


def cluster_environment() -> str | None:
    """The launcher that asks for a multi-process run through the environment, if any."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if "SLURM_JOB_ID" in env and (_env_int("SLURM_NTASKS") or _env_int("SLURM_NPROCS") or 1) > 1:
        return "slurm"
    if (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "openmpi"
    if env.get(DISTRIBUTED_ENV, "").lower() in ("1", "true", "yes", "auto"):
        return DISTRIBUTED_ENV
    return None


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, timeout_s: int = 300) -> bool:
    """Join a multi-process run (`jax.distributed.initialize`) when asked; call before any JAX work.

    Asked = any argument given (the command's --coordinator-address / --num-processes /
    --process-id), or `cluster_environment()` finds a launcher (SLURM or Open MPI with more than
    one task, JAX_COORDINATOR_ADDRESS, or DSV4_DISTRIBUTED=1 for JAX's own detection, e.g. on TPU
    pods). Missing values come from JAX_NUM_PROCESSES / JAX_PROCESS_ID or JAX's detection.

    Returns:
      True when this process is part of a multi-process run, False for a plain single process.
    Raises:
      ConfigError: incomplete or inconsistent flags, or JAX already started.
    """
    if jax.distributed.is_initialized():
        return True
    env = os.environ
    num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    given = any(v is not None for v in (coordinator_address, num_processes, process_id))
    launcher = cluster_environment()
    if not given and launcher is None:
        return False
    if launcher in (None, "JAX_COORDINATOR_ADDRESS"):
        address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
        missing = [flag for flag, v in (("--coordinator-address", address), ("--num-processes", num_processes),
                                        ("--process-id", process_id)) if v is None]
        if missing:
            raise ConfigError(f"multi-host run without {', '.join(missing)}: give --coordinator-address HOST:PORT, "
                              "--num-processes N and --process-id I on every process (or launch under SLURM / Open MPI).")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id {process_id} is outside 0..{num_processes - 1}: number the processes 0 to --num-processes - 1.")
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   initialization_timeout=timeout_s)
    except RuntimeError as e:
        if "before any JAX" in str(e) or "must be called before" in str(e):
            raise ConfigError("jax.distributed.initialize ran after JAX had started: initialise the distributed "
                              "system first thing in the command.") from e
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"cannot join the multi-host run ({e}): check --coordinator-address, --num-processes and --process-id.") from e
    return True


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer: set it to a whole number.") from None


def is_main_process() -> bool:
    """True on process 0: the one that prints tables and writes metrics (all processes checkpoint)."""
    return jax.process_index() == 0


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
    entries = []
    for dim, entry in zip(shape, spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept, size = [], 1
        for name in names:  # keep the longest prefix of mesh axes that divides the dimension
            if dim % (size * mesh.shape[name]):
                break
            kept.append(name)
            size *= mesh.shape[name]
        entries.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
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

    Args:
      make: builds an nnx object from `args` (nnx objects among them are passed through nnx.jit).
      mesh: the device mesh.
    Returns:
      the object, every array a global jax.Array with its rule-given NamedSharding.
    """
    @nnx.jit
    def build(*inner):
        obj = make(*inner)
        constrain(mesh, obj)
        return obj

    return build(*args)


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


# ----------------------------------------------------------------------------- batches


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch rows (axis 0) split over BATCH_AXES; every other axis replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def _batch_shards(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


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
