"""core/parallel/chips.py: each device's peak FLOP/s and its source, shared with the planner's targets."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import pytest

from core.parallel import chips
from core.plan.targets import parse_target


@pytest.mark.parametrize("kind, chip, peak", [
    ("TPU v5 lite", "v5e", 197e12), ("TPU v5", "v5p", 459e12), ("TPU v4", "v4", 275e12), ("TPU v6 lite", "v6e", 918e12),
    ("NVIDIA H100 80GB HBM3", "h100", 989e12), ("NVIDIA H200", "h200", 989e12), ("NVIDIA B200", "b200", 2250e12),
])
def test_device_kinds_map_to_the_published_peaks(kind, chip, peak):
    device = SimpleNamespace(platform="gpu" if "NVIDIA" in kind else "tpu", device_kind=kind)
    assert chips.chip_of(kind) == chip
    flops, source = chips.peak_flops(device)
    assert flops == peak and source.endswith("published dense bf16 peak"), source


def test_the_planner_reads_the_same_peaks():
    for name, chip in (("v5e-1", "v5e"), ("v5p-8", "v5p"), ("v4-8", "v4"), ("v6e-4", "v6e"), ("h200x8", "h200"),
                       ("b200x8", "b200"), ("h100x8", "h100")):
        if name.startswith(("h", "b")):
            from core.plan.targets import GPUS

            assert GPUS[chip][1] == chips.PEAK_BF16_FLOPS[chip]
        else:
            assert parse_target(name).chip.peak_flops == chips.PEAK_BF16_FLOPS[chip]


def test_a_cpu_peak_is_its_measured_matmul_ceiling_and_says_so():
    flops, source = chips.peak_flops(jax.devices("cpu")[0], "float32")
    assert flops > 1e8 and source == "CPU: measured f32 matmul ceiling", (flops, source)
    assert chips.peak_flops(jax.devices("cpu")[0], "float32") == (flops, source)  # measured once per process
    unknown = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 PCIe")
    assert chips.chip_of(unknown.device_kind) is None


def test_utilization():
    u = chips.utilization(4e12, 2.0, 4, 1e12)
    assert u == {"tflops_per_device": 0.5, "mfu": 0.5}
