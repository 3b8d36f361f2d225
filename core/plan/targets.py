"""What `dsv4 plan` compiles for: TPU topologies, NVIDIA GPUs and fake CPU devices (DESIGN.md, "Planning").

A `Target` is parsed from its name (`parse_target`) without touching JAX, so bad input fails before
any process starts:

- `v4-N`, `v5e-N`, `v5p-N`, `v6e-N`: TPU slices by MaxText's names (`accelerator_to_spec_map.py`).
  v4 and v5p count TensorCores and pair them into one megacore chip (N / 2 chips); v5e and v6e
  have one core per chip (N chips). The topology string and `chips_per_host_bounds` are MaxText's;
  libtpu (the `tpu` extra) compiles for them without a TPU.
- `h100xN`, `h200xN`, `b200xN`: NVIDIA GPUs, 8 per host, from XLA's GpuTargetConfigProto text specs
  shipped in specs/; the CUDA plugin (the `cuda` extra) compiles for them without a GPU.
- `cpu:N`: N fake host devices (XLA's --xla_force_host_platform_device_count); always available,
  and its memory figures are approximate (the host's RAM shared by N devices).

`child_env(target)` is the environment of the process that compiles: the platform is fixed
there (JAX_PLATFORMS=cpu: compile-only TPU and GPU devices need no attached accelerator), so an
installed extra neither probes for hardware nor prints in any other command. `compile_devices`
runs in that process and returns the target's compile-only devices.

Peak FLOP/s (core/parallel/chips.py, which MFU reads too) and HBM bandwidth are the vendors' published
figures per chip, dense bf16; they feed the step-time estimate (core/plan/cost.py) only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path

from core.errors import ConfigError, DsvError
from core.parallel.chips import PEAK_BF16_FLOPS

GIB = 1 << 30
SPECS = Path(__file__).resolve().parent / "specs"
GPUS_PER_HOST = 8


class MissingExtraError(DsvError):
    """A target whose optional dependency (the `tpu` or `cuda` extra) is not installed."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator kind: its memory and the step-time model's ceilings."""

    hbm_bytes: int          # per chip
    peak_flops: float       # dense bf16 FLOP/s per chip
    hbm_bandwidth: float    # bytes/s per chip
    link_bandwidth: float   # bytes/s one direction: per ICI link on a TPU, per GPU into NVLink's switch
    network_bandwidth: float = 0.0  # bytes/s one direction per GPU across hosts (its NIC); 0 on a TPU (unpriced)


# TPU generation -> (topology prefix, cores per chip (megacore), chip); HBM as the compiler reports it,
# v5e's as a chip's allocator limits it (its memory_stats' bytes_limit: docs/planning.md#on-a-chip);
# a link's bandwidth one way is the chip's bidirectional ICI bandwidth over 2 x its links (4 on a 2-D
# torus, 6 on a 3-D one; v5e's and v5p's sources: docs/step-time-model.md).
TPU_CHIPS = {
    "v4": ("v4", 2, Chip(32 * GIB, PEAK_BF16_FLOPS["v4"], 1.2e12, 4.5e10)),
    "v5e": ("v5e", 1, Chip(16_909_336_064, PEAK_BF16_FLOPS["v5e"], 8.19e11, 5.0e10)),
    "v5p": ("v5", 2, Chip(int(95.74 * GIB), PEAK_BF16_FLOPS["v5p"], 2.765e12, 1.0e11)),
    "v6e": ("v6e", 1, Chip(32 * GIB, PEAK_BF16_FLOPS["v6e"], 1.64e12, 1.125e11)),
}
# chips -> topology of the slice (MaxText's accelerator_to_spec_map); 3-D for v4/v5p, 2-D for v5e/v6e
TPU_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 192: "4x4x12",
          256: "4x8x8", 384: "4x8x12", 512: "8x8x8", 768: "8x8x12", 1024: "8x8x16", 2048: "8x16x16",
          4096: "16x16x16"}
TPU_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
# GPU name -> (spec file in specs/, dense bf16 FLOP/s, NVLink bytes/s one direction, network bytes/s one
# direction per GPU: one 400 Gb/s ConnectX-7 per GPU in DGX H100, H200 and B200 hosts; docs/step-time-model.md)
GPUS = {"h100": ("h100_sxm", PEAK_BF16_FLOPS["h100"], 4.5e11, 5.0e10),
        "h200": ("h200", PEAK_BF16_FLOPS["h200"], 4.5e11, 5.0e10),
        "b200": ("b200", PEAK_BF16_FLOPS["b200"], 9.0e11, 5.0e10)}
JAX_PREALLOCATE_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION's default: what a JAX process may use


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target.

    Attributes:
      name: as the user typed it (v5p-128, h200x8, cpu:8).
      platform: "tpu" | "cuda" | "cpu": the compiler that runs.
      devices: JAX devices (TPU chips, GPUs, fake CPU devices).
      slices: TPU slices (granules over DCN); 1 elsewhere (a GPU target's granules are its hosts).
      chip: memory and ceilings per device; None for cpu (approximate memory, no step-time estimate).
      topology: TPU topology ("v5:4x4x4") or GPU topology ("1x2x8": slices x hosts x GPUs).
      chip_config: "megacore" | "default" on TPU.
      host_bounds: TPU chips per host in each dimension (MaxText's chips_per_host_bounds).
      spec_file: the GpuTargetConfigProto text spec on GPU.
      extra: the pip extra that brings the compiler ("tpu", "cuda"), None for cpu.
    """

    name: str
    platform: str
    devices: int
    slices: int = 1
    chip: Chip | None = None
    topology: str = ""
    chip_config: str = "default"
    host_bounds: tuple[int, int, int] = (2, 2, 1)
    spec_file: str = ""
    extra: str | None = None

    @property
    def approximate(self) -> bool:
        return self.platform == "cpu"

    @property
    def torus(self) -> tuple[tuple[int, int], ...]:
        """(chips, links per chip) along each axis of a TPU slice longer than 1: 2 on a ring (a v4 or
        v5p slice of whole 4x4x4 cubes wraps around each axis; a v5e or v6e one, an axis of 16), 1 on
        a line; () off a TPU (a GPU's NVLink is a switch)."""
        if self.platform != "tpu":
            return ()
        dims = [int(d) for d in self.topology.split(":")[1].split("x")]
        cubes = len(dims) == 3 and self.devices >= 64
        return tuple((d, 2 if d > 2 and (cubes or d == 16) else 1) for d in dims if d > 1)

    @property
    def granules(self) -> int:
        """Granules over DCN as `make_mesh` counts them on this target's compile-only devices: TPU
        slices; GPU hosts of 8 (each device carries its host's process index); 1 for cpu:N."""
        if self.platform == "cuda":
            return max(self.devices // GPUS_PER_HOST, 1)
        return self.slices


def ceilings(target: Target, hosts: tuple[int, ...] = ()):
    """The step-time model's ceilings (core.plan.cost.Ceilings) of a target with a chip; `hosts`: the
    host (process index) of each device of the program, in the mesh's order (the replica groups' ids),
    so that a GPU collective across hosts is priced at the network's rate."""
    from core.plan import cost

    chip = target.chip
    return cost.Ceilings(chip.peak_flops, chip.hbm_bandwidth, chip.link_bandwidth, target.torus,
                         chip.network_bandwidth, tuple(hosts) if chip.network_bandwidth else ())


def efficiency(target: Target):
    """The step-time model's constants (core.plan.cost.Efficiency) of a target with a chip."""
    from core.plan import cost

    return cost.gpu_efficiency(target.chip.hbm_bandwidth) if target.platform == "cuda" else cost.V5E


def parse_target(name: str) -> Target:
    """The Target of `name`; ConfigError (exit 2) naming the accepted forms if it is none of them."""
    text = name.strip().lower()
    if m := re.fullmatch(r"cpu:(\d+)", text):
        if int(m.group(1)) < 1:
            raise ConfigError(f"--target {name}: cpu:N needs N >= 1 fake devices.")
        return Target(name, "cpu", int(m.group(1)))
    if m := re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", text):
        return _tpu_target(name, m.group(1), int(m.group(2)))
    if m := re.fullmatch(r"(h100|h200|b200)x(\d+)", text):
        return _gpu_target(name, m.group(1), int(m.group(2)))
    raise ConfigError(f"--target {name!r} is not a known target: use a TPU slice (v4-8, v5e-16, v5p-128, v6e-64), "
                      "NVIDIA GPUs (h100x8, h200x16, b200x8) or fake CPU devices (cpu:8).")


def _tpu_target(name: str, generation: str, size: int) -> Target:
    prefix, cores, chip = TPU_CHIPS[generation]
    table = TPU_3D if cores == 2 else TPU_2D
    chips = size // cores if size % cores == 0 else 0
    if chips not in table:
        sizes = ", ".join(f"{generation}-{c * cores}" for c in sorted(table))
        raise ConfigError(f"--target {name}: no such {generation} slice; known sizes: {sizes}.")
    return Target(name, "tpu", chips, chip=chip, topology=f"{prefix}:{table[chips]}",
                  chip_config="megacore" if cores == 2 else "default", host_bounds=(1, 1, 1) if chips == 1 else (2, 2, 1),
                  extra="tpu")


def _gpu_target(name: str, kind: str, count: int) -> Target:
    spec, flops, link, network = GPUS[kind]
    if count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
        raise ConfigError(f"--target {name}: {kind} targets hold 1 to {GPUS_PER_HOST} GPUs or whole hosts of "
                          f"{GPUS_PER_HOST} (e.g. {kind}x8, {kind}x16).")
    fields = gpu_spec_fields(spec)
    chip = Chip(fields["device_memory_size"], flops, fields["memory_bandwidth"], link, network)
    hosts, per_host = max(count // GPUS_PER_HOST, 1), min(count, GPUS_PER_HOST)
    return Target(name, "cuda", count, chip=chip, topology=f"1x{hosts}x{per_host}", spec_file=spec, extra="cuda")


def gpu_spec_text(spec: str) -> str:
    """The GpuTargetConfigProto text of specs/<spec>.txtpb."""
    return (SPECS / f"{spec}.txtpb").read_text()


def gpu_spec_fields(spec: str) -> dict[str, int]:
    """device_memory_size and memory_bandwidth (bytes, bytes/s) read from a spec's text."""
    text = gpu_spec_text(spec)
    return {key: int(re.search(rf"\b{key}: (\d+)", text).group(1)) for key in ("device_memory_size", "memory_bandwidth")}


# ----------------------------------------------------------------------------- extras


def extra_installed(target: Target) -> bool:
    """Whether the compiler of `target` is importable (libtpu for tpu, the CUDA plugin for cuda)."""
    if target.extra == "tpu":
        return importlib.util.find_spec("libtpu") is not None
    if target.extra == "cuda":
        return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    return True


def require_extra(target: Target) -> None:
    """MissingExtraError (one line, exit 2) naming the pip command when the target's extra is missing."""
    if not extra_installed(target):
        what = "libtpu" if target.extra == "tpu" else "the CUDA plugin"
        raise MissingExtraError(f"--target {target.name} needs {what}: pip install \"dsv4[{target.extra}]\"")


def child_env(target: Target, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The compiling process's environment: CPU as JAX's platform (compile-only devices need no
    accelerator), cpu:N's fake device count, and libtpu's start-up messages silenced."""
    env = dict(os.environ if environ is None else environ)
    env["JAX_PLATFORMS"] = "cpu"
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
    if target.platform == "cpu":
        flags.append(f"--xla_force_host_platform_device_count={target.devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # no TPU VM metadata to look up
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # plans beside each other (and beside a live TPU process)
    return env


def compile_devices(target: Target) -> list:
    """The target's devices, in the process that `child_env` set up (compile-only on TPU and GPU)."""
    import jax

    if target.platform == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < target.devices:
            raise ConfigError(f"--target {target.name}: this process has {len(devices)} CPU devices; set "
                              f"XLA_FLAGS=--xla_force_host_platform_device_count={target.devices} before JAX starts.")
        return devices[:target.devices]
    from jax.experimental import topologies

    if target.platform == "tpu":
        topology = topologies.get_topology_desc(topology_name=target.topology, platform="tpu",
                                                chip_config_name=target.chip_config, chips_per_host_bounds=target.host_bounds,
                                                num_slices=target.slices)
    else:
        topology = topologies.get_topology_desc(platform="cuda", topology=target.topology,
                                                target_config=gpu_spec_text(target.spec_file))
    return list(topology.devices)
