"""Multi-process start-up: the CPU runtime's settings, and per-device questions asked of local devices only.

The localhost multi-process training runs live in tests/parallel/test_sharding.py (they share its compiles).
"""

from __future__ import annotations

import os

import pytest

from core.errors import ConfigError
from core.parallel import mesh as mesh_lib
from tests.conftest import tiny_config


def test_cpu_runtime_gets_threads_per_device_and_long_collective_time_outs():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"}
    added = mesh_lib.prepare_cpu_runtime(env)
    want = max(os.cpu_count() or 1, mesh_lib.CPU_THREADS_PER_DEVICE * 8)
    assert env["PJRT_NPROC"] == str(want) and added["PJRT_NPROC"] == str(want)
    flags = env["XLA_FLAGS"].split()
    assert "--xla_backend_optimization_level=0" in flags
    assert f"--xla_cpu_collective_call_terminate_timeout_seconds={mesh_lib.CPU_COLLECTIVE_TERMINATE_S}" in flags
    assert mesh_lib.prepare_cpu_runtime(env) == {}, "a second call adds nothing"
    assert env["XLA_FLAGS"].split() == flags


def test_cpu_runtime_keeps_what_the_user_set():
    env = {"PJRT_NPROC": "3", "XLA_FLAGS": "--xla_cpu_collective_call_terminate_timeout_seconds=5"}
    added = mesh_lib.prepare_cpu_runtime(env)
    assert env["PJRT_NPROC"] == "3" and "PJRT_NPROC" not in added
    assert "--xla_cpu_collective_call_terminate_timeout_seconds=5" in env["XLA_FLAGS"].split()
    assert "terminate_timeout_seconds=900" not in env["XLA_FLAGS"]


def test_a_single_process_passes_barriers_at_once():
    mesh_lib.wait_for_peers("test-barrier", timeout_s=1)  # no coordination service: nothing to wait for


class _Gpu:
    """A GPU as jax describes it; another process's device refuses memory statistics, as XLA's GPU client does."""

    platform, device_kind = "gpu", "fake"

    def __init__(self, process_index: int, bytes_limit: int):
        self.process_index, self.bytes_limit = process_index, bytes_limit

    def memory_stats(self):
        if self.process_index != 0:
            raise RuntimeError("FAILED_PRECONDITION: memory_stats of a non-addressable device")
        return {"bytes_limit": self.bytes_limit}


def test_the_state_check_asks_only_this_process_devices_for_memory(monkeypatch):
    """Process 1 of a GPU run: jax.devices()[0] belongs to process 0 (issue 34). The check must read its own
    device's limit (here too small for the model, so it raises the one-line ConfigError) instead of failing."""
    import jax

    from core.model import transformer
    from core.train import precompile

    cfg = tiny_config(None)
    model = transformer.abstract(cfg)
    cpu_mesh = mesh_lib.make_mesh(cfg, jax.local_devices()[:1])
    monkeypatch.setattr(mesh_lib, "make_mesh", lambda cfg, devices=None: cpu_mesh)
    monkeypatch.setattr(jax, "devices", lambda *a: [_Gpu(1, 2**40), _Gpu(0, 1024)])
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [_Gpu(0, 1024)])
    monkeypatch.setattr(jax, "local_device_count", lambda *a: 1)
    with pytest.raises(ConfigError, match="a device has 0.0 GiB"):
        precompile.check_state_fits(cfg, "sparse", model)
