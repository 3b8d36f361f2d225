"""Multi-process start-up: the CPU runtime's settings, and per-device questions asked of local devices only.

The localhost multi-process training runs live in tests/parallel/test_sharding.py (they share its compiles).
"""

from __future__ import annotations

import os
import types

import jax
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
    assert f"--xla_cpu_collective_timeout_seconds={mesh_lib.CPU_COLLECTIVE_PEER_TIMEOUT_S}" in flags
    assert mesh_lib.prepare_cpu_runtime(env) == {}, "a second call adds nothing"
    assert env["XLA_FLAGS"].split() == flags


def test_cpu_runtime_keeps_what_the_user_set():
    env = {"PJRT_NPROC": "3", "XLA_FLAGS": "--xla_cpu_collective_call_terminate_timeout_seconds=5"}
    added = mesh_lib.prepare_cpu_runtime(env)
    assert env["PJRT_NPROC"] == "3" and "PJRT_NPROC" not in added
    assert "--xla_cpu_collective_call_terminate_timeout_seconds=5" in env["XLA_FLAGS"].split()
    assert "terminate_timeout_seconds=900" not in env["XLA_FLAGS"]


def test_a_timed_out_gloo_collective_becomes_one_line(monkeypatch):
    """A gloo collective that waited `--xla_cpu_collective_timeout_seconds` for a peer raises a
    ValueError (message as measured with jaxlib's gloo); the run says so in one line, naming the step."""
    from core.errors import ClusterError
    from core.train.run import Trainer

    def timed_out(_):
        raise ValueError("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                         "Timed out waiting 600000ms for recv operation to complete\nmore detail")

    monkeypatch.setattr(jax, "device_get", timed_out)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ClusterError) as info:
        Trainer._fetch(types.SimpleNamespace(last_saved=None), 0, {"total_loss": 0.0})
    message = str(info.value)
    assert "\n" not in message and "step 0 failed" in message and "Timed out waiting 600000ms" in message
    assert "docs/scaling.md#collective-order-on-the-cpu" in message


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


# ----------------------------------------------------------------------------- SIGTERM (one process)

SMALL = ("compress_ratios=[0,4]", "base_num_decoder_layers=2", "first_num_hash_layers=1", "vocab_size=512",
         "max_target_length=64", "per_device_batch_size=1", "checkpoint_period=2", "learning_rate_schedule_steps=6")
KEYS = ("total_loss", "indexer_loss", "moe_lb_loss", "grad_norm", "learning_rate")


def _warmup(run, steps, *extra):
    from typer.testing import CliRunner

    from dsv4cli.main import app

    return CliRunner().invoke(app, ["warmup", "--steps", str(steps), "--output", str(run), *SMALL, *extra])


def test_sigterm_saves_the_current_step_and_the_rerun_is_bitwise(tmp_path, monkeypatch):
    """Checkpoints every 3 steps (2, 5). Step 3's row is logged while step 4 runs (metrics are read one step
    late, core/train/run.py), so a SIGTERM then stops after step 4, which the stop itself must save with the
    data position after step 4's batch, not the position of the batches read ahead."""
    import signal

    from core.checkpoint import run_files
    from core.checkpoint import store as ckpt
    from core.config.schema import load_config
    from core.data.batches import train_batches

    straight = _warmup(tmp_path / "straight", 6, "checkpoint_period=3")
    assert straight.exit_code == 0, straight.output
    append = run_files.append_metrics

    def append_then_sigterm(run_dir, row):  # the scheduler's SIGTERM arrives while step 4 runs
        append(run_dir, row)
        if row["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(run_files, "append_metrics", append_then_sigterm)
    run = tmp_path / "preempted"
    stopped = _warmup(run, 6, "checkpoint_period=3")
    lines = [line for line in stopped.stderr.splitlines() if line.strip()]
    assert stopped.exit_code == 143 and len(lines) == 1 and "Traceback" not in stopped.output, stopped.output
    assert "SIGTERM after step 4" in lines[0] and "checkpoint step 4 is saved" in lines[0], lines[0]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    import jax

    data = train_batches(load_config("deepseek4-tiny", SMALL, stage="warmup"), jax.device_count())
    for _ in range(5):  # steps 0..4 consumed five batches
        next(data)
    assert ckpt.read_data_state(run / "checkpoints", 4) == json_round_trip(data.state())
    monkeypatch.setattr(run_files, "append_metrics", append)
    resumed = _warmup(run, 6, "checkpoint_period=3")
    assert resumed.exit_code == 0 and "resuming from checkpoint step 4" in resumed.output, resumed.output
    want, got = run_files.read_metrics(tmp_path / "straight"), run_files.read_metrics(run)
    assert [r["step"] for r in got] == list(range(6))
    assert [[r[k] for k in KEYS] for r in got] == [[r[k] for k in KEYS] for r in want]


def json_round_trip(value):
    import json

    return json.loads(json.dumps(value))


def test_the_most_severe_stop_reason_wins():
    from core.train.stop import StopRequest

    stop = StopRequest(last_step=9)
    assert stop.agreed(0) is None
    stop.request("interrupted")
    stop.request("write", "cannot write metrics")
    stop.request("preempted")  # milder than a write error: kept out
    assert stop.agreed(1) == ("write", "cannot write metrics")
