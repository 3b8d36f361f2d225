"""Accelerator chips' peak matmul throughput: the denominator of MFU and the planner's compute ceiling.

`PEAK_BF16_FLOPS` holds the vendors' published dense bf16 FLOP/s per chip under the planner's chip
names (core/plan/targets.py builds its targets from it); `chip_of` maps JAX's `device_kind` strings
onto those names. `peak_flops(device, dtype)` is a device's peak with its source: the published
figure of a chip in the table; on a CPU, which has no published peak, or on an accelerator the
table does not know, the measured ceiling of one square matmul in the compute dtype, and the
source says so. `utilization` turns a step's model FLOPs and time into TFLOP/s per device and MFU.
"""

from __future__ import annotations

import functools
import time

# chip name (the planner's) -> dense bf16 FLOP/s per chip, as the vendors publish them
PEAK_BF16_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12,
                   "h100": 989e12, "h200": 989e12, "b200": 2250e12}
CHIP_TITLES = {"v4": "TPU v4", "v5e": "TPU v5e", "v5p": "TPU v5p", "v6e": "TPU v6e",
               "h100": "H100", "h200": "H200", "b200": "B200"}
# JAX's device_kind -> chip name. GPUs by their SXM names only: the PCIe and NVL parts have lower peaks.
DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
                "TPU v6 lite": "v6e", "TPU v6e": "v6e", "NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200",
                "NVIDIA B200": "b200"}
SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}


def chip_of(device_kind: str) -> str | None:
    """The chip name of a JAX `device_kind` ("TPU v5 lite" -> "v5e"); None when the table has none."""
    return DEVICE_KINDS.get(device_kind.strip())


def peak_flops(device=None, dtype: str = "float32") -> tuple[float, str]:
    """Peak FLOP/s of one device and where the figure comes from.

    Args:
      device: a jax.Device (default the first local one).
      dtype: the compute dtype (config `dtype`); the measured ceiling multiplies in it.
    Returns:
      (FLOP/s, source): a chip of `PEAK_BF16_FLOPS` gives its published dense bf16 peak
      ("TPU v5e: published dense bf16 peak"); a CPU, or an accelerator not in the table, the
      measured ceiling of `matmul_ceiling` ("CPU: measured f32 matmul ceiling"), computed once
      per device and dtype in a process.
    """
    import jax

    device = device or jax.local_devices()[0]
    chip = chip_of(device.device_kind) if device.platform != "cpu" else None
    if chip is not None:
        return PEAK_BF16_FLOPS[chip], f"{CHIP_TITLES[chip]}: published dense bf16 peak"
    what = "CPU" if device.platform == "cpu" else f"{device.device_kind} (not in the chip table)"
    return _measured(device, str(dtype)), f"{what}: measured {SHORT_DTYPES.get(str(dtype), str(dtype))} matmul ceiling"


@functools.lru_cache(maxsize=None)
def _measured(device, dtype: str) -> float:
    return matmul_ceiling(device, dtype, size=1024 if device.platform == "cpu" else 8192, repeats=10)


def matmul_ceiling(device=None, dtype: str = "float32", *, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` [size, size] matmuls in `dtype` on `device` (default the
    first local one), after one untimed call that compiles it: a ceiling, so the fastest; on a
    shared CPU a median drops with every process that competes while it is measured, and a step
    measured later, alone, could then exceed it."""
    import jax
    import jax.numpy as jnp

    device = device or jax.local_devices()[0]
    a = jax.device_put(jax.random.normal(jax.random.key(0), (size, size), jnp.dtype(dtype)), device)
    matmul = jax.jit(lambda x: x @ x)
    jax.block_until_ready(matmul(a))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a))
        times.append(time.perf_counter() - start)
    return 2.0 * size**3 / min(times)


def utilization(flops_per_step: float, step_time_s: float, devices: int, peak: float) -> dict[str, float]:
    """{"tflops_per_device": model TFLOP/s per device, "mfu": that over `peak` FLOP/s}, for a step
    of `flops_per_step` (all devices together) that took `step_time_s` on `devices` devices."""
    per_device = flops_per_step / step_time_s / devices
    return {"tflops_per_device": per_device / 1e12, "mfu": per_device / peak}
