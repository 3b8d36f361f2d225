"""Run safety through the CLI (core/train/ step_guard.py, run_lock.py, resume_checks.py,
write_errors.py, tensorboard.py): a diverging run stops with exit 3 and keeps its good
checkpoints, learning_rate_schedule_steps extends a run bitwise,
TensorBoard events hold every step once across a resume, an optimizer change on resume names the
key, a full disk or failed write is one line with exit 4, and one process at a time owns a run
directory.

Every run is a 2-layer warm-up (SWA + CSA, 64 tokens, one row) so that a compile takes seconds;
runs of equal configs share their compiled step within the session.
"""

from __future__ import annotations

import errno
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from flax import nnx
from typer.testing import CliRunner

from core.checkpoint import store as ckpt
from core import tree
from core.checkpoint import run_files
from core.spec.resolve import data_spec, resolve
from dsv4cli.main import app
from tests.conftest import resolved

runner = CliRunner()
SMALL = ("compress_ratios=[0,4]", "base_num_decoder_layers=2", "first_num_hash_layers=1", "vocab_size=512",
         "max_target_length=64", "per_device_batch_size=1", "checkpoint_period=2")
FIXED = "learning_rate_schedule_steps=6"  # the schedule of a 6-step run, whatever --steps says


def _warmup(run, steps, *extra):
    return runner.invoke(app, ["warmup", "--steps", str(steps), "--output", str(run), *SMALL, *extra])


def _one_error_line(result, code):
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def _snapshot(run):
    """Bytes of every file in a run directory, except the lock file's pid line."""
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


def _variables(run, step=None):
    model, _, meta = ckpt.restore_model(run, step)
    return {k: np.asarray(v) for k, v in tree.flatten(nnx.to_pure_dict(nnx.state(model))).items()}, meta


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A straight 6-step warm-up with the schedule fixed at 6 steps (checkpoints 1, 3, 5)."""
    run = tmp_path_factory.mktemp("safety") / "straight"
    result = _warmup(run, 6, FIXED)
    assert result.exit_code == 0, result.output
    assert "step 5 " in result.output and "[6/6 steps  elapsed" in result.output  # the plain progress figures
    return run


# ----------------------------------------------------------------------------- 1. divergence


def test_diverging_run_stops_with_exit_3_and_keeps_the_good_checkpoint(tmp_path):
    run = tmp_path / "diverge"
    args = ("learning_rate=1e30", "gradient_clipping_threshold=0", "checkpoint_period=1")
    line = _one_error_line(_warmup(run, 6, *args), 3)
    bad = int(re.search(r"step (\d+) diverged", line).group(1))
    assert bad >= 1 and "neither it nor anything non-finite was saved" in line and "learning_rate=1e+30" in line, line
    assert "gradient_clipping_threshold=0" in line and f"checkpoint (step {bad - 1}) is kept" in line, line
    assert ckpt.finished_steps(run / "checkpoints") == list(range(bad))[-3:]  # max_checkpoints=3
    assert [r["step"] for r in run_files.read_metrics(run)] == list(range(bad))
    saved, meta = _variables(run)
    assert meta["step"] == bad - 1 and all(np.isfinite(v).all() for v in saved.values() if v.dtype.kind == "f")
    before = _snapshot(run / "checkpoints")

    again = _warmup(run, 6, *args)  # the same command resumes from the last good step and meets the same stop
    assert f"resuming from checkpoint step {bad - 1}" in again.output
    assert _one_error_line(again, 3) == line
    assert _snapshot(run / "checkpoints") == before


def test_a_divergence_with_a_step_in_flight_saves_nothing_past_the_good_steps(tmp_path):
    """Checkpoints every 3 steps: the step after each unsaved one is dispatched before its metrics are read
    (core/train/run.py). The run still stops with exit 3, logs and saves only steps before the diverged one,
    and every saved value is finite."""
    run = tmp_path / "diverge-overlapped"
    line = _one_error_line(_warmup(run, 6, "learning_rate=1e30", "gradient_clipping_threshold=0",
                                   "checkpoint_period=3"), 3)
    bad = int(re.search(r"step (\d+) diverged", line).group(1))
    assert [r["step"] for r in run_files.read_metrics(run)] == list(range(bad))
    saved = ckpt.finished_steps(run / "checkpoints")
    assert saved == [s for s in (2, 5) if s < bad], (saved, bad)
    for step in saved:
        values, _ = _variables(run, step)
        assert all(np.isfinite(v).all() for v in values.values() if v.dtype.kind == "f")


# the guard tests' model: one sliding-window layer, 1 x 64 tokens
ONE_SWA_LAYER = ("compress_ratios=[0]", "base_num_decoder_layers=1", "first_num_hash_layers=0", "max_target_length=64",
                 "per_device_batch_size=1")


def test_the_guard_holds_no_second_copy_of_the_state():
    """The loss and gradient norm are tested before the update, so each array's select fuses into the
    update, which writes the donated state in place, as does the test of the parameters it wrote: the guarded step's compiled temporaries
    are the unguarded step's, not one more copy of the state (testing the updated parameters held
    both: +22 MB here, 1.25x the parameters; V4-Flash's sparse step on 64 x H200: +20.6 GiB per
    GPU). A one-layer step whose state (a 32K vocabulary) outweighs its activations."""
    from core.config.schema import load_config
    from core.plan.report import state_bytes
    from core.train.program import lowered_step

    shape = (*ONE_SWA_LAYER, "vocab_size=32768")
    temp = {}
    for guard in ("true", "false"):
        cfg = load_config("deepseek4-tiny", [*shape, f"abort_on_nan_loss={guard}", f"abort_on_inf_loss={guard}"],
                          stage="sparse")
        lowered, (_, state, batch, _) = lowered_step(*resolved(cfg))
        compiled = lowered.compile()
        temp[guard] = compiled.memory_analysis().temp_size_in_bytes
    params = state_bytes(cfg, state, batch)["parameter_bytes"]
    assert temp["true"] - temp["false"] < params // 10, (temp, params)


def test_both_guard_forms_keep_a_diverged_state_and_apply_a_good_one_alike():
    """`apply_if_ok`'s two forms (core/train/step_guard.py: a `lax.cond` on CPU, a `where` per array for
    GPU and TPU compilers, both run here on CPU), two steps at learning_rate=1e30 without clipping:
    the first applies (finite: weight decay takes p to about -1e29 p) and the second's loss is NaN, so
    it returns its input bit for bit; from sinks of 1e11 the loss and gradient stay finite but the
    update overflows: applied, and flagged for the host to stop. States and metrics are bitwise the
    same under both forms."""
    import jax
    from flax import nnx

    from core.config.schema import load_config
    from core.data.batches import train_batches
    from core.errors import DivergenceError
    from core.parallel.sharding import shard_batch
    from core.train import step_guard
    from core.train.materialise import build
    from core.train.preflight import run_settings
    from core.train.step import step_fn

    shape = (*ONE_SWA_LAYER, "vocab_size=512")
    cfg = load_config("deepseek4-tiny", [*shape, "learning_rate=1e30", "gradient_clipping_threshold=0"], stage="sparse")
    setup = build(*resolved(cfg))
    graphdef, state = nnx.split((setup.model, setup.optimizer))
    batch = shard_batch(next(train_batches(data_spec(cfg), setup.batch_size)), setup.mesh)
    bytes_of = lambda tree: [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]  # noqa: E731
    from tests.conftest import PRODUCT_FUSION

    # a third start: the sinks at 1e11 (finite; the sink takes every row, so the loss and gradient stay
    # finite) make the decay's lr * wd * p overflow: the update is applied and flagged
    big = jax.tree.map(lambda v: v, state)
    sink = big[0]["layers"][0]["attn"]["attn_sink"]
    sink.set_value(jax.device_put(np.full(sink.get_value().shape, 1e11, np.float32), sink.get_value().sharding))
    out = {}
    kept = (jax.tree.map(lambda x: x.sharding, state), None)  # as the run pins them: one compile per form
    for platform in ("cpu", "gpu"):
        specs = resolve(cfg, platform, setup.mesh.shape)  # the guard's form is the platform's
        step = jax.jit(step_fn(specs, graphdef), compiler_options=PRODUCT_FUSION, out_shardings=kept)
        first, good = step(state, batch)
        last, bad = step(first, batch)
        flagged, over = step(big, batch)
        assert step._cache_size() == 1
        out[platform] = (bytes_of(first), bytes_of(last), bytes_of(flagged),
                         [np.asarray([m[k] for k in sorted(m)]).tobytes() for m in (good, bad, over)])
        assert float(good["params_finite"]) == 1.0 and np.isnan(float(bad["total_loss"])), (good, bad)
        assert float(bad["params_finite"]) == 1.0, bad  # the state it returns is the kept one
        assert np.isfinite(float(over["total_loss"])) and np.isfinite(float(over["grad_norm"])), over
        assert float(over["params_finite"]) == 0.0, over
    assert out["cpu"] == out["gpu"]
    first, last, _, _ = out["cpu"]
    assert first != bytes_of(state) and last == first
    with pytest.raises(DivergenceError, match=r"step 0 diverged \(the updated parameters or moments are not finite\): "
                                              "neither it nor anything non-finite was saved"):
        step_guard.check_finite(0, {k: float(v) for k, v in over.items()}, run_settings(cfg, setup.mesh).guard, None)


def test_the_written_state_test_reads_trained_parameters_and_every_moment():
    import jax.numpy as jnp

    from core.train.step_guard import params_ok

    params = {"trained": jnp.ones(3), "frozen": jnp.array([np.nan])}
    trained = lambda path: path[0].key == "trained"  # noqa: E731
    moments = {"mu": jnp.zeros(3, jnp.bfloat16), "nu": jnp.array([0.0, np.inf, 0.0]), "count": jnp.array(7)}
    both = dict(abort_on_nan=True, abort_on_inf=True)
    assert float(params_ok(params, trained, **both)) == 1.0  # a frozen NaN is not the update's
    assert float(params_ok(params, trained, moments, **both)) == 0.0
    assert float(params_ok(params, trained, moments, abort_on_nan=True, abort_on_inf=False)) == 1.0
    assert float(params_ok({**params, "trained": jnp.array([np.nan])}, trained, **both)) == 0.0


# ----------------------------------------------------------------------------- 6. schedule length


def test_fixed_schedule_extends_a_run_bitwise(straight, tmp_path):
    run = tmp_path / "extended"
    first = _warmup(run, 3, FIXED)
    assert first.exit_code == 0, first.output
    second = _warmup(run, 6, FIXED)
    assert second.exit_code == 0 and "resuming from checkpoint step 2" in second.output, second.output
    assert "schedule changes" not in second.output
    keys = ("total_loss", "indexer_loss", "moe_lb_loss", "grad_norm", "learning_rate")
    want, got = run_files.read_metrics(straight), run_files.read_metrics(run)
    assert [r["step"] for r in got] == list(range(6))
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want]
    (a, _), (b, _) = _variables(straight), _variables(run)
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_overlapped_steps_equal_the_straight_run_bitwise(straight, tmp_path, monkeypatch):
    """One checkpoint at the end: every step's metrics are read after the next step is dispatched, while
    the straight run (checkpoints 1, 3, 5) reads steps 1 and 3 before dispatching the next. Metrics,
    weights and the saved data position are equal bitwise."""
    from core.train.run import Trainer

    order = []
    dispatch, settle = Trainer._dispatch, Trainer._settle
    monkeypatch.setattr(Trainer, "_dispatch", lambda self, step, feed: order.append(f"d{step}") or
                        dispatch(self, step, feed))
    monkeypatch.setattr(Trainer, "_settle", lambda self, flight, stop: order.append(f"s{flight.step}") or
                        settle(self, flight, stop))
    run = tmp_path / "overlapped"
    result = _warmup(run, 6, FIXED, "checkpoint_period=6")
    assert result.exit_code == 0, result.output
    assert order == ["d0", "d1", "s0", "d2", "s1", "d3", "s2", "d4", "s3", "d5", "s4", "s5"], order
    keys = ("total_loss", "indexer_loss", "moe_lb_loss", "grad_norm", "learning_rate")
    want, got = run_files.read_metrics(straight), run_files.read_metrics(run)
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want]
    (a, _), (b, _) = _variables(straight), _variables(run)
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert ckpt.read_checkpoint(run, 5, items=()).data == ckpt.read_checkpoint(straight, 5, items=()).data


def test_resume_that_changes_the_schedule_says_so(straight, tmp_path):
    run = tmp_path / "longer"
    shutil.copytree(straight, run)
    result = _warmup(run, 8)  # learning_rate_schedule_steps=-1: the schedule now spans 8 steps, not 6
    assert result.exit_code == 0, result.output
    text = result.output.replace("\n", " ")
    notice = text.index("notice: the learning-rate schedule changes on resume: it spanned 6 steps and now spans 8")
    assert "learning_rate_schedule_steps=6 to keep it" in text and notice < text.index("step 6 ")


# ----------------------------------------------------------------------------- 8. TensorBoard


def _events(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_has_every_step_once_after_a_resume(straight, tmp_path):
    run = tmp_path / "crashed"
    shutil.copytree(straight, run)
    shutil.rmtree(run / "checkpoints" / "5")  # as if killed after logging step 5, before its checkpoint
    result = _warmup(run, 6, FIXED)
    assert result.exit_code == 0 and "resuming from checkpoint step 3" in result.output, result.output
    assert len(list((run / "tensorboard").iterdir())) == 2  # appended: a second event file
    rows = run_files.read_metrics(run)
    events = _events(run)
    assert {"total_loss", "indexer_loss", "grad_norm", "learning_rate", "tokens_per_s"} <= set(events)
    for tag, points in events.items():
        assert [s for s, _ in points] == list(range(6)), (tag, points)
    np.testing.assert_allclose([v for _, v in events["total_loss"]], [r["total_loss"] for r in rows], rtol=1e-6)


# ----------------------------------------------------------------------------- 9. optimizer change


def test_resume_with_another_optimizer_structure_names_the_key(straight):
    before = _snapshot(straight)
    # compile_ahead=false: the restore refuses the optimizer state after the build; a step compiled
    # ahead for the new config would be thrown away (and, in this process, finish in the background)
    line = _one_error_line(_warmup(straight, 8, FIXED, "gradient_clipping_threshold=0", "compile_ahead=false"), 2)
    assert "gradient_clipping_threshold=1 (its config.yml)" in line and "gradient_clipping_threshold=0" in line, line
    assert "keep gradient_clipping_threshold=1" in line and "new --output" in line, line
    assert _snapshot(straight) == before


# ----------------------------------------------------------------------------- 10. write failures


def _mount_tmpfs(path, size_kib):
    path.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                         capture_output=True, text=True)
    return out.returncode == 0


def test_full_disk_is_one_line_exit_4(straight, tmp_path, monkeypatch):
    """On a tmpfs that holds one checkpoint (or, where mounting is not allowed, an injected ENOSPC)."""
    size = sum(p.stat().st_size for p in (straight / "checkpoints" / "1").rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    mounted = _mount_tmpfs(disk, int(1.6 * size) // 1024)
    try:
        if not mounted:
            original = ckpt.RunCheckpointer.save

            def save(self, step, **kwargs):
                if step == 3:
                    (self.dir / "3.orbax-checkpoint-tmp-0").mkdir()
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return original(self, step, **kwargs)

            monkeypatch.setattr(ckpt.RunCheckpointer, "save", save)
        run = disk / "run"
        line = _one_error_line(_warmup(run, 6, FIXED), 4)
        assert "checkpoint step 3" in line and "No space left on device" in line, line
        assert " MiB or point --output elsewhere; rerun the same command to resume from checkpoint step 1" in line, line
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1"]  # the partial step removed
        (a, meta), (b, _) = _variables(run), _variables(straight, 1)
        assert meta["step"] == 1 and all(a[k].tobytes() == b[k].tobytes() for k in a)
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


def test_failed_metrics_write_is_one_line_exit_4(tmp_path, monkeypatch):
    calls = []

    def append(run_dir, row):
        calls.append(row["step"])
        if row["step"] == 2:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(run_dir / run_files.METRICS_FILE))
        with open(run_dir / run_files.METRICS_FILE, "a") as f:
            f.write("{}\n".format(__import__("json").dumps(dict(row))))

    monkeypatch.setattr(run_files, "append_metrics", append)
    run = tmp_path / "run"
    line = _one_error_line(_warmup(run, 6, FIXED), 4)
    assert f"cannot write metrics to {str(run / 'metrics.jsonl')!r}: Permission denied" in line, line
    assert "make it writable or point --output elsewhere; rerun the same command to resume from checkpoint step 1" in line
    assert calls == [0, 1, 2] and ckpt.finished_steps(run / "checkpoints") == [1]


# ----------------------------------------------------------------------------- 11. one writer

LOCK_WAIT_S = 120  # for the holder to import core and take the lock, on a loaded machine


def test_second_process_on_a_run_directory_is_refused(straight):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from core.train.run_lock import RunLock
        lock = RunLock({str(straight)!r}, "dsv4 warmup").acquire()
        print("locked", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        ready, _, _ = select.select([holder.stdout], [], [], LOCK_WAIT_S)  # a hang fails, not blocks
        assert ready, f"the lock holder printed nothing in {LOCK_WAIT_S} s"
        assert holder.stdout.readline().strip() == "locked"
        before = _snapshot(straight)
        line = _one_error_line(_warmup(straight, 6, FIXED), 2)
        assert f"run directory {str(straight)!r} is in use by process {holder.pid} (dsv4 warmup)" in line, line
        assert _snapshot(straight) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    after = _warmup(straight, 6, FIXED)  # kill -9 leaves no stale lock
    assert after.exit_code == 0 and "nothing to do" in after.output, after.output


def test_a_refused_start_leaves_no_run_directory_behind(tmp_path):
    run = tmp_path / "new" / "run"
    line = _one_error_line(_warmup(run, 6, "hf_path=/nonexistent/data.jsonl"), 2)
    assert "/nonexistent/data.jsonl" in line and not run.exists()


# ----------------------------------------------------------------------------- 7. progress


def _info(**changes):
    info = dict(model_name="deepseek4-tiny", stage="warmup", run_dir="runs/x", params_total=10, params_trainable=5,
                batch_size=1, max_target_length=64, tokens_per_step=64, mesh="1 cpu", data="synthetic", steps=6,
                start_step=2, resumed_from=1, init_from=None, init_step=None, init_from_ignored=False, notices=[])
    return {**info, **changes}


def test_progress_bar_under_the_live_table_and_plain_lines():
    import io

    from rich.console import Console

    from dsv4cli.display import TrainDisplay

    row = dict(step=0, total_loss=1.0, lm_loss=0.9, indexer_loss=0.01, moe_lb_loss=4e-4, step_time_s=0.5,
               tokens_per_s=128.0, compile=False)
    view = TrainDisplay(Console(force_terminal=True, width=160))
    view.header(_info())
    with view.steps():
        for s in range(2, 5):
            view.row({**row, "step": s})
        screen = Console(record=True, width=160, force_terminal=True)
        screen.print(view._view())  # what the live display shows now: the table, the bar under it
    lines = screen.export_text().splitlines()
    assert lines[-2].split()[0] == "4" and "5/6" in lines[-1] and "ETA" in lines[-1], lines
    assert lines[-1].lstrip().startswith("steps") and "128 tokens/s" in lines[-1], lines

    plain = TrainDisplay(Console(file=io.StringIO(), width=80))
    plain.header(_info())
    with plain.steps():
        for s in range(2, 4):
            plain.row({**row, "step": s})
    lines = plain.console.file.getvalue().splitlines()
    clock = r"\d+:\d\d:\d\d"  # h:mm:ss, whatever the machine's speed
    assert lines[-2].startswith("step 2 ") and re.search(
        rf"\[3/6 steps  elapsed {clock}  ETA -:--:--  128 tokens/s\]$", lines[-2]), lines[-2]
    assert lines[-1].startswith("step 3 ") and re.search(
        rf"\[4/6 steps  elapsed {clock}  ETA {clock}  128 tokens/s\]$", lines[-1]), lines[-1]
