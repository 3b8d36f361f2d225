"""Multi-process start-up: the CPU runtime's settings, and per-device questions asked of local devices only.

The localhost multi-process training runs live in tests/parallel/test_sharding.py (they share its compiles).
"""

from __future__ import annotations

import os
import threading
import types

import jax
import pytest

from core.errors import ClusterError, ConfigError
from core.parallel import mesh as mesh_lib
from core.spec.resolve import data_spec, resolve
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


def test_the_suite_runs_with_the_commands_cpu_flags_from_its_start():
    """tests/conftest.py sets the XLA flags a command adds, so an in-process command adds none and
    leaves the persistent cache's keys (which include XLA_FLAGS) as they were."""
    flags = os.environ["XLA_FLAGS"]
    assert "XLA_FLAGS" not in mesh_lib.prepare_cpu_runtime(dict(os.environ))
    assert f"--xla_cpu_collective_timeout_seconds={mesh_lib.CPU_COLLECTIVE_PEER_TIMEOUT_S}" in flags.split()


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


class _Service:
    """The coordination service as the watch sees it: live processes and goodbyes."""

    def __init__(self, live, goodbyes=()):
        self.live, self.goodbyes, self.asked = live, dict(goodbyes), 0

    def get_live_nodes(self, ids):
        self.asked += 1
        return {p: 1 for p in self.live}

    def key_value_dir_get(self, prefix):
        return [(f"{prefix}{p}", how) for p, how in self.goodbyes.items()]


@pytest.mark.parametrize("goodbyes,line", [
    ({}, "process 2 of 3 was lost: it sent no heartbeat for 100 s"),
    ({2: "done"}, None),  # gone after an agreed end: not lost
    ({1: "error"}, "process 1 of 3 stopped with an error"),
])
def test_the_watch_names_a_lost_process_once(monkeypatch, goodbyes, line):
    import threading

    from core.parallel import peers

    service = _Service(live=[0, 1] if 1 not in goodbyes else [0, 1, 2], goodbyes=goodbyes)
    lines, exits = [], []
    monkeypatch.setattr(peers, "WATCH_PERIOD_S", 0.01)
    monkeypatch.setattr(peers, "_client", lambda: service)
    monkeypatch.setattr(peers, "_disconnect", lambda: None)
    monkeypatch.setattr(peers.os, "_exit", exits.append)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    monkeypatch.delenv(peers.HEARTBEAT_ENV, raising=False)
    _fresh_peers_state(monkeypatch, peers, lines)
    if line is None:  # the watch keeps asking until this process leaves
        watch = threading.Thread(target=peers._watch)
        watch.start()
        while service.asked < 3:
            pass
        peers._State.stopped.set()
        watch.join()
        assert lines == [] and exits == []
        return
    peers._watch()
    assert len(lines) == 1 and line in lines[0] and "checkpoint step 7 is the last complete one" in lines[0], lines
    assert exits == [5]


def _fresh_peers_state(monkeypatch, peers, lines):
    monkeypatch.setattr(peers._State, "stopped", threading.Event())
    monkeypatch.setattr(peers._State, "ending", threading.Event())
    monkeypatch.setattr(peers._State, "claimed", False)
    monkeypatch.setattr(peers._State, "left", None)
    monkeypatch.setattr(peers._State, "report", lines.append)
    monkeypatch.setattr(peers._State, "progress", staticmethod(lambda: "checkpoint step 7 is the last complete one"))


@pytest.mark.parametrize("first", ["collective", "watch"])
def test_one_line_whoever_comes_first_the_failed_collective_or_the_watch(monkeypatch, first):
    """A failed collective waits for the watch's verdict (`await_verdict`), but on a loaded host the watch
    may see the lost peer only after that wait: then the collective's line is the one, and the watch's
    late verdict says nothing. A watch that came first ends the process alone: the wait never returns."""
    from core.parallel import peers

    lines, exits = [], []
    monkeypatch.setattr(peers, "WATCH_PERIOD_S", 0.01)
    monkeypatch.setattr(peers, "_disconnect", lambda: None)
    monkeypatch.setattr(peers.os, "_exit", exits.append)
    monkeypatch.setattr(jax, "process_count", lambda: 1)  # leave() tells no service
    monkeypatch.setenv(peers.HEARTBEAT_ENV, "1")
    _fresh_peers_state(monkeypatch, peers, lines)
    if first == "collective":
        peers.await_verdict()  # the deadline passes with no verdict: the caller's line is the one
        peers._end("process 1 of 2 was lost")
        assert lines == [] and exits == []
        return
    peers._end("process 1 of 2 was lost")
    assert len(lines) == 1 and "process 1 of 2 was lost" in lines[0] and exits == [5]
    waiting = threading.Thread(target=peers.await_verdict, daemon=True)
    waiting.start()
    waiting.join(1.5)  # past the deadline (1 s + 2 watch periods)
    assert waiting.is_alive()  # the process is the watch's to end (os._exit), not the caller's to report


def test_a_single_process_passes_barriers_at_once():
    mesh_lib.wait_for_peers("test-barrier", timeout_s=1)  # no coordination service: nothing to wait for


def test_a_failed_barrier_waits_for_the_watchs_verdict_before_its_own_line(monkeypatch):
    """A peer killed while the others wait at a barrier cancels it at once: the barrier's error must give
    the watch the time to end the process with the one line naming the lost peer, as a failed step does."""
    from jax._src import distributed

    from core.parallel import peers

    class _Client:
        def wait_at_barrier(self, name, timeout_in_ms):
            raise RuntimeError("CANCELLED: Stale barrier invocation is cancelled because:  task disconnected")

    asked = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed.global_state, "client", _Client())
    monkeypatch.setattr(peers, "await_verdict", lambda: asked.append("verdict"))
    with pytest.raises(ClusterError, match="gave up") as info:
        mesh_lib.wait_for_peers("test-barrier", timeout_s=1)
    assert asked == ["verdict"] and "\n" not in str(info.value)


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
    from core.train import preflight

    cfg = tiny_config(None)
    model = transformer.abstract(resolve(cfg, "cpu").model)
    cpu_mesh = mesh_lib.make_mesh(cfg, jax.local_devices()[:1])
    monkeypatch.setattr(jax, "devices", lambda *a: [_Gpu(1, 2**40), _Gpu(0, 1024)])
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [_Gpu(0, 1024)])
    monkeypatch.setattr(jax, "local_device_count", lambda *a: 1)
    with pytest.raises(ConfigError, match="a device has 0.0 GiB"):
        preflight.check_fits(cfg, "sparse", cpu_mesh, model)


# ----------------------------------------------------------------------------- SIGTERM (one process)

# One layer (a CSA layer, hash-routed), 64 tokens: what is tested here is the processes (their stops, signals,
# checkpoints and data positions), which no layer changes; each process traces, lowers and compiles the
# smallest warm-up step.
SMALL = ("compress_ratios=[4]", "base_num_decoder_layers=1", "first_num_hash_layers=1", "vocab_size=512",
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

    data = train_batches(data_spec(load_config("deepseek4-tiny", SMALL, stage="warmup")), jax.device_count())
    for _ in range(5):  # steps 0..4 consumed five batches
        next(data)
    assert ckpt.read_checkpoint(run / "checkpoints", 4, items=()).data == json_round_trip(data.state())
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


# ----------------------------------------------------------------------------- several processes (localhost)

# Two processes, one CPU device each, `dsv4 warmup` as a user runs it (the subject here is the processes: their
# stops, signals and losses; two processes x 4 devices train in tests/parallel/test_sharding.py, and one device
# per process starts and steps faster). One uninterrupted reference run
# serves every comparison: the Ctrl-C run, resumed and then stopped by SIGTERM, resumed again to the
# end, must log the reference's metrics bitwise. Two more runs lose a process to kill -9.
MULTI_STEPS = 160  # JAX's preemption sync point comes seconds after SIGTERM (tens of the one-layer model's
# steps), later under load; and a signal sent once step 0 is logged must find the run still going on a loaded machine
MULTI = (*SMALL[:-2], "checkpoint_period=1000", f"learning_rate_schedule_steps={MULTI_STEPS}",
         "async_checkpointing=false")
# The kill -9 runs compare with nothing and never reach their end: steps enough that the run is still going
# when the kill comes, however late it comes on a loaded machine. Their schedule is the reference's (fixed,
# whatever --steps says), so their step is the reference's program, read from the compilation cache.
LOST_STEPS = 1000
LOST = (*SMALL[:-2], "checkpoint_period=100", f"learning_rate_schedule_steps={MULTI_STEPS}", "async_checkpointing=false")
# DSV4_HEARTBEAT_TIMEOUT_S of the kill -9 run: a heartbeat RPC that misses it ends a process, so a few
# seconds are too few on a heavily loaded machine; the wait overlaps the other runs.
MULTI_HEARTBEAT_S = 30
_CLUSTER_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "DSV4_DISTRIBUTED",
                 "SLURM_JOB_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _launch(run, name: str, heartbeat_s: int | None = None, steps: int = MULTI_STEPS, options=MULTI) -> list:
    """Both processes of a localhost run of `steps` steps into `run` (their output: <run>.<name>.<id>.out|err)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from tests.conftest import FAST_COMPILE

    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")])),
               XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {FAST_COMPILE}")
    if heartbeat_s is not None:
        from core.parallel import peers

        env[peers.HEARTBEAT_ENV] = str(heartbeat_s)
    procs = []
    for pid in range(2):
        out, err = (open(f"{run}.{name}.{pid}.{kind}", "w") for kind in ("out", "err"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "dsv4cli.main", "warmup", "--steps", str(steps), "--output", str(run),
             "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid), *options],
            env=env, stdout=out, stderr=err))
    return procs


def _logged(run) -> list[dict]:
    import json

    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _when_logged(run, procs, step: int, timeout: float = 600) -> None:
    """Block until step `step` is in metrics.jsonl (both processes still running)."""
    import time

    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in _logged(run)):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
            f"the run ended or stalled before step {step}: exit codes {[p.poll() for p in procs]}"
        time.sleep(0.05)


def _ended(run, name: str, procs, timeout: float = 600) -> list[dict]:
    """Wait for both processes; their exit codes and error lines."""
    import subprocess

    out = []
    for pid, p in enumerate(procs):
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{name}: process {pid} hangs") from None
        err = open(f"{run}.{name}.{pid}.err").read()
        out.append({"rc": p.returncode, "err": err, "lines": [line for line in err.splitlines() if line.startswith("error:")]})
    return out


def _checkpoints(run) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def cluster_runs(tmp_path_factory):
    """The reference starts first; every other run once the reference's step is compiled (they read it from
    the compilation cache: started together, each process would compile it): the kill -9 run, then the run
    that loses process 0 and the Ctrl-C -> SIGTERM -> resumed chain."""
    import signal
    import threading
    import time

    root = tmp_path_factory.mktemp("cluster")
    straight, lost, lost0, chain = root / "straight", root / "lost", root / "lost0", root / "chain"
    started = time.monotonic()
    reference = _launch(straight, "straight")
    launched = [*reference]

    def kill_and_time(procs, victim: int) -> list:  # kill -9 of procs[victim]; [when the other ended - when killed]
        procs[victim].kill()
        killed, ended = time.monotonic(), []
        threading.Thread(target=lambda: ended.append(procs[1 - victim].wait() is not None and time.monotonic() - killed),
                         daemon=True).start()
        return ended

    try:
        _when_logged(straight, reference, 0)
        launched += (dying := _launch(lost, "lost", MULTI_HEARTBEAT_S, LOST_STEPS, LOST))
        _when_logged(lost, dying, 1)
        survivor_ended = kill_and_time(dying, 1)
        launched += (leaderless := _launch(lost0, "lost0", MULTI_HEARTBEAT_S, LOST_STEPS, LOST))  # kill -9 of process 0, the service's host
        launched += (procs := _launch(chain, "ctrl_c"))  # Ctrl-C on process 1 alone
        _when_logged(lost0, leaderless, 1)
        process_1_ended = kill_and_time(leaderless, 0)
        _when_logged(chain, procs, 0)
        procs[1].send_signal(signal.SIGINT)
        out = {"ctrl_c": _ended(chain, "ctrl_c", procs)}
        out["ctrl_c_rows"], out["ctrl_c_checkpoints"] = _logged(chain), _checkpoints(chain)
        launched += (procs := _launch(chain, "sigterm"))  # resumed, then SIGTERM to every process
        _when_logged(chain, procs, out["ctrl_c_checkpoints"][-1] + 1)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        out["sigterm"] = _ended(chain, "sigterm", procs)
        out["sigterm_rows"], out["sigterm_checkpoints"] = _logged(chain), _checkpoints(chain)
        launched += (procs := _launch(chain, "resumed"))
        out["resumed"] = _ended(chain, "resumed", procs)
        out["chain"] = _logged(chain)
        out["lost"] = _ended(lost, "lost", dying)
        out["lost_after_s"] = survivor_ended[0]
        out["lost0"] = _ended(lost0, "lost0", leaderless, timeout=120)
        out["lost0_after_s"] = process_1_ended[0]
        out["straight"], out["reference"] = _ended(straight, "straight", reference), _logged(straight)
    finally:
        for p in launched:  # a failed fixture leaves nothing running
            if p.poll() is None:
                p.kill()
    print(f"cluster runs: {time.monotonic() - started:.0f} s")  # shown with -s
    return out


@pytest.mark.slow
def test_ctrl_c_on_one_process_stops_every_process_after_the_same_step(cluster_runs):
    from core.train.stop import STOP_CHECK_EVERY

    assert [e["rc"] for e in cluster_runs["straight"]] == [0, 0], cluster_runs["straight"]
    ends = cluster_runs["ctrl_c"]
    assert [e["rc"] for e in ends] == [130, 130], ends
    last = cluster_runs["ctrl_c_rows"][-1]["step"]
    assert (last + 1) % STOP_CHECK_EVERY == 0 and last < MULTI_STEPS - 1, last  # an agreement step, not the end
    assert cluster_runs["ctrl_c_checkpoints"] == [last], "both stopped after the same step and saved it"
    assert all("Traceback" not in e["err"] for e in ends)


@pytest.mark.slow
def test_sigterm_to_every_process_saves_the_current_step_and_the_reruns_are_bitwise(cluster_runs):
    ends = cluster_runs["sigterm"]
    assert [e["rc"] for e in ends] == [143, 143], ends
    last = cluster_runs["sigterm_rows"][-1]["step"]
    assert cluster_runs["sigterm_checkpoints"][-1] == last < MULTI_STEPS - 1, (cluster_runs["sigterm_checkpoints"], last)
    assert all(len(e["lines"]) == 1 and f"SIGTERM after step {last}" in e["lines"][0] for e in ends), ends
    assert [e["rc"] for e in cluster_runs["resumed"]] == [0, 0], cluster_runs["resumed"]
    want, got = cluster_runs["reference"], cluster_runs["chain"]
    assert [r["step"] for r in got] == list(range(MULTI_STEPS))
    assert [[r[k] for k in KEYS] for r in got] == [[r[k] for k in KEYS] for r in want]


@pytest.mark.slow
def test_a_killed_process_ends_the_others_with_one_line(cluster_runs):
    """kill -9 of process 1: process 0 exits 5 with one line within the heartbeat time-out plus one
    look at the service (core/parallel/peers.py), instead of XLA's abort."""
    from core.parallel import peers

    survivor, killed = cluster_runs["lost"]
    assert killed["rc"] == -9 and survivor["rc"] == 5, cluster_runs["lost"]
    assert "Traceback" not in survivor["err"] and "Check failure" not in survivor["err"], survivor["err"][-3000:]
    assert len(survivor["lines"]) == 1, survivor["err"][-3000:]
    assert "process 1 of 2 was lost" in survivor["lines"][0] and "no checkpoint was written yet" in survivor["lines"][0]
    bound = MULTI_HEARTBEAT_S + 2 * peers.WATCH_PERIOD_S
    assert cluster_runs["lost_after_s"] < bound + 30, cluster_runs["lost_after_s"]  # slack for a loaded machine
    print(f"process 0 ended {cluster_runs['lost_after_s']:.1f} s after kill -9 (heartbeat {MULTI_HEARTBEAT_S} s)")


@pytest.mark.slow
def test_a_killed_process_0_ends_the_others_without_a_hang(cluster_runs):
    """kill -9 of process 0 takes the coordination service with it: JAX's client on every other process
    aborts at once with XLA's message naming the leader (no Python code runs in between, so not dsv4's one
    line; docs/scaling.md#when-a-process-is-lost). The run must not hang, and its checkpoints stay."""
    killed, survivor = cluster_runs["lost0"]
    assert killed["rc"] == -9 and survivor["rc"] in (-6, 134), cluster_runs["lost0"]
    assert "Failed to send RPC to coordination service" in survivor["err"], survivor["err"][-3000:]
    assert cluster_runs["lost0_after_s"] < 60, cluster_runs["lost0_after_s"]
    print(f"process 1 ended {cluster_runs['lost0_after_s']:.1f} s after kill -9 of process 0")
