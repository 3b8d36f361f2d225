"""Training runs: the run directory, resume, init-from, metrics, TensorBoard, Ctrl-C and SIGTERM.

A `Trainer` is built in named phases, each a function with its inputs in its signature, each
computing its part once (docs/development.md#a-run-in-phases):
1. `claim` (core/train/run_lock.py): process 0 locks the run directory, one process at a time;
2. `preflight` (core/train/preflight.py): every check that needs no array, from one mesh, one
   abstract model and one read of the checkpoint the run starts from; one frozen record with the
   resolved config's specs (core.spec.resolve), the run's settings (`RunSettings`: what the loop, the
   outputs and the header read of the config) and the notices;
3. `fit_remat` (core/train/preflight.py): on a TPU, `remat_policy=auto`'s compiles, the first step
   that fits taken;
4. `compile_ahead` (core/train/program.py): the step compiled from shapes, beside the build;
5. `materialise` (core/train/materialise.py): model and optimizer, fresh, resumed (model,
   optimizer, data position) or initialised from another run (with a fresh indexer when that run
   has none, core/train/handoff.py, and the teacher's indexer init);
6. `open_outputs` (core/train/outputs.py): the checkpointer, config.yml and metrics.jsonl (process
   0 alone), TensorBoard, the write guard;
7. `ready`: the step program (core/train/program.py `StepProgram`) for the built state, and every
   process at step 0 together.
`run()` then drives the step of core/train/step.py (its docstring holds the maths).

Run safety: a step whose total loss, gradient norm or updated parameters are non-finite stops the
run before it is saved (abort_on_nan_loss / abort_on_inf_loss; core/train/step_guard.py); a
resume that changes the optimizer's structure or the schedule says so (core/train/resume_checks.py);
write failures become one RunWriteError (core/train/write_errors.py).
Ctrl-C, SIGTERM (JAX's preemption notice) and write errors stop every process after the same step
(core/train/stop.py); a lost process ends the others with one line (core/parallel/peers.py). Each
process reads only its own rows of each batch (core/data/batches.py); a checkpoint joins their data
positions. Batches are read ahead on a thread and each step's metrics are read after the next step
is dispatched (`Trainer.run`; docs/scaling.md#host-work).
"""

from __future__ import annotations

import dataclasses
import json
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import jax
from flax import nnx

from core.checkpoint import run_files
from core.data.batches import merge_positions
from core.data.prefetch import Prefetch
from core.errors import ClusterError, DivergenceError, PreemptedError, RunWriteError, device_memory_error
from core.parallel import peers
from core.parallel.chips import peak_flops, utilization
from core.parallel.mesh import describe_mesh, exchange, first_line, wait_for_peers
from core.parallel.sharding import shard_batch
from core.spec.resolve import Specs
from core.train import program, step_guard
from core.train.materialise import Materialised, materialise
from core.train.memory import step_memory_note
from core.train.outputs import open_outputs
from core.train.preflight import Preflight, fit_remat, preflight
from core.train.run_lock import claim
from core.train.step import METRIC_KEYS
from core.train.stop import StopRequest
from core.train.write_errors import quiet_write_errors, tree_bytes


def dsv4_version() -> str:
    try:
        return version("dsv4")
    except Exception:  # not installed (running from a source tree)
        return "unknown"


# ----------------------------------------------------------------------------- the phases after materialise


def ready(ahead: program.StepPrecompile | None, specs: Specs, graphdef, state, mesh,
          progress: Callable[[], str]) -> Callable:
    """Phase: the step for the built `state` (the program compiled ahead, once `ahead` is done, or
    jitted), the progress a lost-process line names, and every process at step 0 together (processes
    compile and restore at their own pace).

    Returns:
      `(state, batch) -> (state, metrics)`.
    """
    if ahead is not None:
        ahead.join()
    step = program.StepProgram.of(specs, graphdef, state, mesh).step()
    peers.set_progress(progress)
    wait_for_peers("dsv4-step-compiled")
    return step


def describe(plan: Preflight, made: Materialised, stage: str, run_dir: Path, init_from: str | Path | None,
             step: Callable) -> dict[str, Any]:
    """The `info` dict: what the run is, before its first step."""
    run, setup, source = plan.run, made.setup, plan.source
    resumed_from = source.checkpoint.step if source is not None and source.resume else None
    devices = jax.devices()
    peak, peak_source = peak_flops(jax.local_devices()[0], run.dtype)
    return {
        "model_name": run.model_name, "stage": stage, "run_dir": str(run_dir),
        "params_total": setup.params_total, "params_trainable": setup.params_trainable,
        "batch_size": setup.batch_size, "max_target_length": run.max_target_length,
        "tokens_per_step": setup.batch_size * run.max_target_length,
        # MFU's numerator and denominator (docs/benchmarks.md#how-mfu-is-counted)
        "model_flops_per_step": run.model_flops_per_step,
        "peak_flops_per_device": peak, "peak_source": peak_source, "mesh_devices": setup.mesh.size,
        "devices": f"{len(devices)} x {devices[0].platform}", "mesh": _mesh_line(setup.mesh, step), "steps": run.steps,
        "start_step": made.start_step, "resumed_from": resumed_from,
        "init_from": None if init_from is None or resumed_from is not None else str(init_from),
        "init_step": made.init_step, "init_from_ignored": init_from is not None and resumed_from is not None,
        "data": plan.data.fingerprint["source"],
        "notices": [*plan.notices, *made.notices],  # one-line messages for the user before the first step
        "init_fresh_indexer": source is not None and source.fresh_indexer,
        "warnings": list(plan.warnings),
    }


def _mesh_line(mesh, step: Callable) -> str:
    """The header's devices line: the mesh and, on accelerators, the compiled step's memory need."""
    local = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    note = step_memory_note(getattr(step, "compiled", None), local)
    return describe_mesh(mesh) if note is None else f"{describe_mesh(mesh)}  ·  {note}"


def step_row(step: int, metrics: Mapping[str, float], elapsed: float, info: Mapping[str, Any], first: bool
             ) -> dict[str, Any]:
    """The per-step record of metrics.jsonl, TensorBoard and the display: the step's metrics, its time
    (`elapsed` seconds) and throughput; `first`: the step that compiled."""
    return {"step": step, **{k: metrics[k] for k in METRIC_KEYS}, "step_time_s": elapsed,
            "tokens_per_s": info["tokens_per_step"] / elapsed,
            **utilization(info["model_flops_per_step"], elapsed, info["mesh_devices"], info["peak_flops_per_device"]),
            "compile": first}


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass
class _InFlight:
    """A dispatched step: its metrics (device arrays), the data position after its batch, when it began."""

    step: int
    metrics: Any
    data: dict[str, Any]
    start: float


class Trainer:
    """One run directory: fresh, resumed from its latest checkpoint, or initialised from another run.

    `info` describes the run before it starts; `run()` yields one metrics dict per step (the
    same object appended to metrics.jsonl) and raises KeyboardInterrupt after saving when Ctrl-C
    arrived; `summary()` describes the result.
    """

    def __init__(self, cfg, *, stage: str, run_dir: str | Path, init_from: str | Path | None = None):
        self.stage, self.run_dir = stage, Path(run_dir)
        self.lock = claim(self.run_dir, f"dsv4 {stage}")
        with self.lock.undone_on_error():  # a run that fails while it starts leaves no trace
            plan = fit_remat(cfg.remat_policy, preflight(cfg, stage, self.run_dir, init_from))
            # the step compiles while the model builds
            ahead = program.compile_ahead(plan.specs, plan.mesh, plan.abstract) if plan.run.compile_ahead else None
            made = materialise(plan.specs, plan.mesh, plan.labels, plan.abstract, plan.source, plan.data,
                               teacher_init_batches=plan.run.teacher_init_batches)
            self.outputs = open_outputs(
                self.run_dir, config_text=plan.run.config_text, kept_metrics=plan.kept_metrics,
                start_step=made.start_step, state_bytes=tree_bytes(made.state),
                max_checkpoints=plan.run.max_checkpoints, async_save=plan.run.async_checkpointing,
                tensorboard=plan.run.enable_tensorboard)
            self.specs, self.settings, self.data, self.setup = plan.specs, plan.run, plan.data, made.setup
            self.graphdef, self.state, self.start_step = made.graphdef, made.state, made.start_step
            self.last_saved = made.start_step - 1 if made.start_step else None  # the checkpoint resumed from
            self._step_fn = ready(ahead, plan.specs, made.graphdef, made.state, plan.mesh,
                                  lambda: peers.kept(self.last_saved))
            self.info = describe(plan, made, stage, self.run_dir, init_from, self._step_fn)

    def _save(self, step: int, row: dict[str, Any], data: dict[str, Any]) -> None:
        """Checkpoint `step` (checked already) with `data`, the data position after its batch."""
        if jax.process_count() > 1:  # each process knows the position of its own rows
            data = merge_positions([json.loads(v) for v in exchange("dsv4-data", json.dumps(data))])
        model, optimizer = nnx.merge(self.graphdef, self.state)
        metadata = {"config": dict(self.settings.config_record), "stage": self.stage, "step": step, "metrics": row,
                    "model_name": self.settings.model_name, "dsv4_version": dsv4_version()}
        checkpointer = self.outputs.checkpointer
        with self.outputs.guard.writing("checkpoint", checkpointer.dir, step):
            checkpointer.save(step, model=nnx.to_pure_dict(nnx.state(model)),
                              optimizer=nnx.to_pure_dict(nnx.state(optimizer)), data=data, metadata=metadata)
        self.last_saved = step

    def _fetch(self, step: int, metrics) -> dict[str, float]:
        """The step's metrics on the host; a failed collective of a multi-process run (a peer stopped
        or timed out) becomes one ClusterError naming the step and the last complete checkpoint."""
        try:
            return {k: float(v) for k, v in jax.device_get(metrics).items()}
        except (jax.errors.JaxRuntimeError, ValueError) as e:  # a gloo time-out arrives as a ValueError
            if jax.process_count() == 1 or device_memory_error(e) is not None:
                raise
            peers.await_verdict()  # a peer that died: its loss is the line to show (core/parallel/peers.py)
            kept = peers.kept(self.last_saved)
            cpu = (" (on CPUs this can also be XLA:CPU's collective order, docs/scaling.md#collective-order-on-the-cpu)"
                   if "Gloo" in str(e) else "")
            raise ClusterError(f"step {step} failed on process {jax.process_index()} of {jax.process_count()}: a "
                               f"collective with the other processes failed ({first_line(e)}){cpu}; {kept}: check "
                               "that every process is alive, then rerun the same command on all of them.") from None

    def run(self) -> Iterator[dict[str, Any]]:
        """Train from `start_step` to `steps`, yielding each step's metrics row once it is checked.

        Host work overlaps the device (docs/scaling.md#host-work): batches are read ahead on a
        thread (core/data/prefetch.py), and step s's metrics are fetched after step s+1 is dispatched.
        A step is saved only after its metrics are checked (`step_guard.check_finite`): a checkpoint
        step and the last step are fetched before the next dispatch, and a stop finishes the step in
        flight, checks it and saves it. After a DivergenceError the in-memory state may hold the step
        dispatched after the diverged one; it is never saved.
        """
        run = self.settings
        row: dict[str, Any] = {}
        stop = StopRequest(run.steps - 1)
        self._settled_at = time.perf_counter()
        try:
            with Prefetch(self.data, max(run.steps - self.start_step, 0)) as feed, stop.signals(), \
                    quiet_write_errors():
                pending: _InFlight | None = None
                for step in range(self.start_step, run.steps):
                    current = self._dispatch(step, feed)
                    if pending is not None:  # the previous step's metrics, while this one runs
                        row = self._settle(pending, stop)
                        yield row
                    pending = current
                    if step == run.steps - 1 or (step + 1) % run.checkpoint_period == 0:
                        row, pending = self._settle(current, stop), None
                        self._save(step, row, current.data)
                        yield row
                    decision = stop.agreed(step)  # once per step, before the next dispatch, on every process
                    if decision is not None:
                        if pending is not None:
                            row = self._settle(pending, stop)
                            yield row
                        self._stop(step, row, current.data, *decision)
            peers.leave("done")  # every process ends after the same step: none is lost when another exits
        except DivergenceError:
            peers.leave("done")  # the guard's verdict is all-reduced: every process stops at this step
            raise
        finally:
            try:
                self.outputs.close(self.last_saved)
            finally:
                self.lock.release()

    def _dispatch(self, step: int, feed: Prefetch) -> "_InFlight":
        """Start `step` on the device with the next prefetched batch; returns at once (async dispatch)."""
        start = time.perf_counter()
        batch, position = next(feed)
        self.state, metrics = self._step_fn(self.state, shard_batch(batch, self.setup.mesh, process_local=True))
        return _InFlight(step, metrics, position, start)

    def _settle(self, flight: "_InFlight", stop: StopRequest) -> dict[str, Any]:
        """Fetch and check a dispatched step's metrics (DivergenceError if non-finite) and log its row.
        Its time runs from the later of its dispatch and the previous step's fetch: the step's share of
        the device when steps overlap."""
        metrics = self._fetch(flight.step, flight.metrics)
        step_guard.check_finite(flight.step, metrics, self.settings.guard, self.last_saved)
        now = time.perf_counter()
        elapsed = now - max(flight.start, self._settled_at)
        self._settled_at = now
        row = step_row(flight.step, metrics, elapsed, self.info, flight.step == self.start_step)
        self._log(row, stop)
        return row

    def _log(self, row: dict[str, Any], stop: StopRequest) -> None:
        """Process 0 appends the row to metrics.jsonl and TensorBoard; a failed write stops this process
        alone at once, or every process of a multi-process run after the agreed step (`StopRequest`)."""
        if stop.reason == "write":
            return
        try:
            self.outputs.append(row)
        except RunWriteError as e:
            if jax.process_count() == 1:
                raise
            stop.request("write", str(e))

    def _stop(self, step: int, row: dict[str, Any], data: dict[str, Any], reason: str, message: str) -> None:
        """Every process stops after `step` (core/train/stop.py): Ctrl-C and SIGTERM save this step's
        checkpoint first (on every process); a write error keeps the last complete one."""
        if reason == "write":
            peers.leave("done")
            raise RunWriteError(message or f"a write failed on another process after step {step}: see its error line")
        if self.last_saved != step:
            self._save(step, row, data)
        peers.leave("done")  # an agreed stop: none is lost when another exits
        if reason == "interrupted":
            raise KeyboardInterrupt
        raise PreemptedError(f"stopped by SIGTERM after step {step}; checkpoint step {step} is saved"
                             f"{' on every process' if jax.process_count() > 1 else ''}: rerun the same command to "
                             "resume from it.")

    def summary(self) -> dict[str, Any]:
        """First and last rows of the run's metrics and the latest checkpoint directory."""
        rows = run_files.read_metrics(self.run_dir)
        checkpointer = self.outputs.checkpointer
        latest = checkpointer.latest_step()
        return {"run_dir": str(self.run_dir), "first": rows[0] if rows else None, "last": rows[-1] if rows else None,
                "checkpoint": None if latest is None else str(checkpointer.dir / str(latest))}
