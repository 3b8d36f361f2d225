"""Device meshes and multi-host start-up (DESIGN.md, "Scale").

- `make_mesh(cfg)`: a `jax.sharding.Mesh` with axes (data, fsdp, tensor, expert) from the config's
  MaxText keys. `ici_*` spans the devices of one granule (a TPU slice, else one process), `dcn_*`
  the granules; -1 fills the rest; the products must match the devices or a `ConfigError` says
  how to fix them (`plan_mesh` resolves the sizes without touching devices). Axes are
  `AxisType.Auto`: jit propagates shardings (GSPMD), the layers stay mesh-agnostic.
- Multi-host: `initialize_distributed` calls `jax.distributed.initialize` when flags or a cluster
  environment ask for it; `is_main_process()` gates printing and metrics; `wait_for_peers` and
  `exchange` meet the other processes through the coordination service; core/parallel/peers.py
  watches for a lost one.

core/parallel/sharding.py places arrays on the mesh.
"""

from __future__ import annotations

import math
import os
from typing import Mapping, Sequence

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from core.errors import ClusterError, ConfigError

MESH_AXES = ("data", "fsdp", "tensor", "expert")
# An axis a mesh holds only where its size is above 1 (every other mesh's programs stay as they were):
# the routed experts and the batch split over it as over `expert`, every other weight is replicated
# across it and its gradient all-reduced there (core/parallel/sharding.py). With expert_outer across
# hosts and expert within each, the other weights are sharded within a host and cross the hosts' network
# once a step, as a gradient; the tokens' exchange spans both.
EXPERT_OUTER_AXIS = "expert_outer"
CONFIG_AXES = ("data", "fsdp", "tensor", EXPERT_OUTER_AXIS, "expert")   # the ici_*/dcn_* keys, in mesh order


def mesh_axes(sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The axis names of a mesh of `sizes` (over CONFIG_AXES): MESH_AXES, and expert_outer where above 1."""
    return tuple(a for a in CONFIG_AXES if a in MESH_AXES or sizes.get(a, 1) > 1)

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
      (ici, dcn): dicts over CONFIG_AXES; the mesh axis size is ici[a] * dcn[a].
    Raises:
      ConfigError: when the products cannot match the devices.
    """
    if num_devices % num_granules:
        raise ConfigError(f"{num_devices} devices do not split evenly over {num_granules} hosts/slices: give every process the same number of devices.")
    per_granule = num_devices // num_granules
    ici = _fill("ici_", {a: getattr(cfg, f"ici_{a}_parallelism") for a in CONFIG_AXES}, per_granule, "devices",
                "in this run" if num_granules == 1 else f"in each of the {num_granules} processes or TPU slices")
    dcn = _fill("dcn_", {a: getattr(cfg, f"dcn_{a}_parallelism") for a in CONFIG_AXES}, num_granules,
                "processes or TPU slices", "in this run (dcn_* spans hosts, ici_* the devices within one)")
    return ici, dcn


def _granules(devices: Sequence[jax.Device]) -> tuple[int, bool]:
    """(number of granules, process_is_granule): TPU slices, else processes.

    On TPU the granule is the slice, whatever hosts it spans. Compile-only devices of a single-slice
    topology (`dsv4 plan`) carry no `slice_index`: they are one slice, not one granule per host.
    """
    if devices[0].platform == "tpu":
        return len({getattr(d, "slice_index", 0) for d in devices}), False
    return len({d.process_index for d in devices}), True


def make_mesh(cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The run's device mesh over `devices` (default: every device of every process).

    Args:
      cfg: a Config with the ici_* / dcn_* parallelism keys.
      devices: the devices to use (tests pass a subset, e.g. one device).
    Returns:
      a Mesh with axes `mesh_axes` (MESH_AXES, and expert_outer where above 1; all `AxisType.Auto`).
    """
    devices = list(jax.devices() if devices is None else devices)
    granules, process_is_granule = _granules(devices)
    ici, dcn = plan_mesh(cfg, len(devices), granules)
    names = mesh_axes({a: ici[a] * dcn[a] for a in CONFIG_AXES})
    ici_shape = [ici[a] for a in names]
    if granules > 1:
        array = mesh_utils.create_hybrid_device_mesh(
            ici_shape, [dcn[a] for a in names], devices, process_is_granule=process_is_granule,
            allow_split_physical_axes=True)
    else:
        array = mesh_utils.create_device_mesh(ici_shape, devices, allow_split_physical_axes=True)
    return Mesh(array, names, axis_types=(AxisType.Auto,) * len(names))


def mesh_platform(mesh: Mesh) -> str:
    """The platform of `mesh`'s devices ("cpu", "gpu", "tpu"): the compiler a step on it is traced for."""
    return mesh.devices.flat[0].platform


def describe_mesh(mesh: Mesh) -> str:
    """One line for table headers, e.g. 'fsdp 4 x tensor 2 (8 cpu devices, 1 process)'."""
    axes = " x ".join(f"{a} {n}" for a, n in mesh.shape.items() if n > 1) or "single device"
    platform = mesh_platform(mesh)
    procs = len({d.process_index for d in mesh.devices.flat})
    return f"{axes} ({mesh.size} {platform} device{'s' * (mesh.size > 1)}, {procs} process{'es' * (procs > 1)})"


# ----------------------------------------------------------------------------- the CPU runtime

# XLA:CPU runs a device's collectives on a shared intra-op thread pool (PJRT_NPROC threads; XLA's
# default: max(cores, devices)). Its thunk executor orders collectives by scheduling edges only: a
# loop (`lax.scan`) or conditional whose body holds collectives may still be running when the next
# collective starts, so one device can block in a later collective while a peer waits for it in the
# loop's. Each blocked collective holds a pool thread; with as many threads as devices the pool
# runs dry and the step never completes (docs/scaling.md#collective-order-on-the-cpu). A few
# threads per device keep a thread free for the lagging device; idle threads cost nothing.
CPU_THREADS_PER_DEVICE = 4
# Seconds a device waits in a collective rendezvous before XLA aborts the process (XLA's default:
# 40 s, shorter than a loaded machine's lag) and before it logs that it may be stuck.
CPU_COLLECTIVE_TERMINATE_S = 900
CPU_COLLECTIVE_WARN_S = 120
# Seconds a device of a multi-process run waits for a peer in a gloo collective before the collective
# fails (XLA's default: 30 min). Across processes the reordering above left two devices waiting for
# each other in different collectives for ever (the model's ties, core/ops/placement.py, now prevent it);
# this bounds any such wait, and the failure becomes one line (`Trainer._fetch`) instead of a hang
# (docs/scaling.md#collective-order-on-the-cpu).
CPU_COLLECTIVE_PEER_TIMEOUT_S = 600


def _flag_value(flags: str, name: str) -> str | None:
    for token in flags.split():
        if token.startswith(f"--{name}="):
            return token.split("=", 1)[1]
    return None


def prepare_cpu_runtime(env: dict[str, str] | None = None) -> dict[str, str]:
    """Set the XLA:CPU runtime's thread pool and collective time-outs before JAX starts (module
    constants above); values the user set win. A no-op for other platforms (the variables are read by
    the CPU client only). Returns what was set.

    Args:
      env: the environment to update (default `os.environ`).
    """
    env = os.environ if env is None else env
    flags = env.get("XLA_FLAGS", "")
    devices = int(_flag_value(flags, "xla_force_host_platform_device_count") or 1)
    added = {}
    if "PJRT_NPROC" not in env and "NPROC" not in env:
        added["PJRT_NPROC"] = str(max(os.cpu_count() or 1, CPU_THREADS_PER_DEVICE * devices))
    extra = [f"--{name}={value}" for name, value in (
        ("xla_cpu_collective_call_terminate_timeout_seconds", CPU_COLLECTIVE_TERMINATE_S),
        ("xla_cpu_collective_call_warn_stuck_timeout_seconds", CPU_COLLECTIVE_WARN_S),
        ("xla_cpu_collective_timeout_seconds", CPU_COLLECTIVE_PEER_TIMEOUT_S)) if f"--{name}=" not in flags]
    if extra:
        added["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
    env.update(added)
    return added


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


# How long the processes wait for each other at a named barrier (`wait_for_peers`): one process can
# compile or restore far slower than another on a loaded host.
BARRIER_TIMEOUT_S = 3600
_BARRIERS: dict[str, int] = {}


def wait_for_peers(name: str, timeout_s: int = BARRIER_TIMEOUT_S) -> None:
    """Block until every process of a multi-process run reaches the barrier `name` (the coordination
    service's barrier, not a device collective: no gloo or NCCL time-out applies); a no-op for one
    process. Call it where processes may drift apart (after compiling the step) so that their first
    collectives start together.

    Raises:
      ClusterError: a peer did not arrive within `timeout_s` (lost, or stuck).
    """
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the client jax.distributed.initialize made (no public handle)

    _BARRIERS[name] = _BARRIERS.get(name, 0) + 1  # a barrier id serves once: every process counts alike
    try:
        distributed.global_state.client.wait_at_barrier(f"{name}-{_BARRIERS[name]}", timeout_in_ms=timeout_s * 1000)
    except Exception as e:  # noqa: BLE001  (the client raises XlaRuntimeError / JaxRuntimeError)
        from core.parallel import peers

        peers.await_verdict()  # a peer lost meanwhile cancels the barrier: the watch's line names it, alone
        raise ClusterError(f"process {jax.process_index()} waited {timeout_s} s at {name!r} for the other "
                           f"{jax.process_count() - 1} process(es) and gave up ({first_line(e)}): check that "
                           "every process runs and can reach the coordinator, then rerun the same command on all of "
                           "them.") from None


def exchange(name: str, value: str) -> list[str]:
    """Every process's `value` (in process order), through the coordination service's key-value store
    and a `wait_for_peers` barrier (no device collective); `[value]` for one process. Every process
    must call it, with the same `name`, the same number of times."""
    if jax.process_count() == 1:
        return [value]
    from jax._src import distributed

    client = distributed.global_state.client
    _BARRIERS[f"kv/{name}"] = round_ = _BARRIERS.get(f"kv/{name}", 0) + 1  # a key serves once
    prefix = f"dsv4/{name}/{round_}/"
    client.key_value_set(f"{prefix}{jax.process_index()}", value)
    wait_for_peers(name)
    return [v for _, v in sorted(client.key_value_dir_get(prefix), key=lambda kv: int(kv[0].rsplit("/", 1)[1]))]


def first_line(error: BaseException) -> str:
    """The first non-empty line of an error's message, without XLA's status prefix noise."""
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return text if len(text) <= 200 else text[:197] + "..."


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
    prepare_cpu_runtime()
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
    from core.parallel import peers

    # a lost process is reported to the others' watch (core/parallel/peers.py), not fatal to them
    jax.config.update("jax_enable_recoverability", True)
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   initialization_timeout=timeout_s, heartbeat_timeout_seconds=peers.heartbeat_timeout_s(),
                                   shutdown_timeout_seconds=peers.SHUTDOWN_TIMEOUT_S)
    except RuntimeError as e:
        if "before any JAX" in str(e) or "must be called before" in str(e):
            raise ConfigError("jax.distributed.initialize ran after JAX had started: initialise the distributed "
                              "system first thing in the command.") from e
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"cannot join the multi-host run ({e}): check --coordinator-address, --num-processes and --process-id.") from e
    peers.joined()
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
