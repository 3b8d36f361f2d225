"""Training runs: the run directory, resume, init-from, metrics, TensorBoard, Ctrl-C and SIGTERM.

A `Trainer` drives the jitted step of core/train/step.py (losses, optimizer, trainable mask,
router biases; its docstring holds that maths) over one run directory (DESIGN.md, "Run layout"):
fresh, resumed from its latest checkpoint (model, optimizer and data position), or initialised
from another run's weights (with a fresh indexer when that run has none, core/train/handoff.py).

Run safety: a step whose total loss, gradient norm or updated parameters are non-finite is not
applied and stops the run (abort_on_nan_loss / abort_on_inf_loss; core/train/step_guard.py); one
process at a time holds a run directory (core/train/run_lock.py); a resume that changes the
optimizer's structure or the schedule says so (core/train/resume_checks.py); write failures become
one RunWriteError (core/train/write_errors.py).
Ctrl-C, SIGTERM (JAX's preemption notice) and write errors stop every process after the same step
(core/train/stop.py); a lost process ends the others with one line (core/parallel/peers.py). Each
process reads only its own rows of each batch (core/data/batches.py); a checkpoint joins their data
positions. Batches are read ahead on a thread and each step's metrics are read after the next step
is dispatched (`Trainer.run`; docs/scaling.md#host-work).

The step itself (`make_train_step`, `build`, `Setup`, ...) is core/train/step.py's.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Iterator

import jax
from flax import nnx

from core.checkpoint import store as ckpt
from core.config.platform import resolve
from core.config.stages import stage_of
from core import tree
from core.checkpoint import run_files
from core.train import resume_checks, step_guard
from core.train.run_lock import RunLock, releases_lock_on_error
from core.train.write_errors import WriteGuard, quiet_write_errors, tree_bytes
from core.data.batches import merge_positions, train_batches
from core.data.prefetch import Prefetch
from core.errors import (CheckpointError, ClusterError, DivergenceError, PreemptedError, RunWriteError,
                         device_memory_error)
from core.model import transformer
from core.train.precompile import StepPrecompile, ahead_or_jitted_step, check_state_fits
from core.parallel import peers
from core.parallel.mesh import describe_mesh, exchange, first_line, make_mesh, wait_for_peers
from core.parallel.sharding import local_batch_slice, shard_batch
from core.train.stop import StopRequest
from core.train.handoff import is_indexer, source_lacks_indexer, topk_warning
from core.train.tensorboard import EventWriter
from core.train.step import (METRIC_KEYS, abstract_pure, build, check_masks, has_config, load_init_weights,
                             new_optimizer)


# ----------------------------------------------------------------------------- the run


def dsv4_version() -> str:
    try:
        from importlib.metadata import version

        return version("dsv4")
    except Exception:  # not installed (running from a source tree)
        return "unknown"


def compiled_memory(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled step from XLA's memory analysis (also `dsv4 plan`'s figures).

    Returns:
      {"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "code_bytes", "total_bytes"}:
      total = arguments + temporaries + code + outputs not aliased with the (donated) arguments.
    """
    mem = compiled.memory_analysis()
    out = {"argument_bytes": int(mem.argument_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
           "alias_bytes": int(mem.alias_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
           "code_bytes": int(mem.generated_code_size_in_bytes)}
    out["total_bytes"] = (out["argument_bytes"] + out["temp_bytes"] + out["code_bytes"]
                          + max(out["output_bytes"] - out["alias_bytes"], 0))
    return out


def memory_note(total_bytes: int, usable_bytes: int) -> str:
    """The header's note on the step's memory, "step needs <total> GiB of <usable> GiB per device (<share> %)"."""
    return (f"step needs {total_bytes / 2**30:.1f} GiB of {usable_bytes / 2**30:.1f} GiB per device "
            f"({100 * total_bytes / usable_bytes:.0f} %)")


def step_memory_note(compiled, device) -> str | None:
    """`memory_note` of a compiled step on an accelerator: its total (`compiled_memory`) against
    the device's usable memory (its allocator's bytes_limit); None on the CPU or without figures."""
    if compiled is None or device.platform == "cpu":
        return None
    try:
        usable = (device.memory_stats() or {}).get("bytes_limit")
        total = compiled_memory(compiled)["total_bytes"]
    except Exception:  # noqa: BLE001  (a backend without memory statistics or analysis)
        return None
    return memory_note(total, usable) if usable else None


def _write_metrics(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """Replace metrics.jsonl by `rows` (the format of `ckpt.append_metrics`)."""
    (run_dir / run_files.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))


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

    @releases_lock_on_error
    def __init__(self, cfg, *, stage: str, run_dir: str | Path, init_from: str | Path | None = None):
        cfg = resolve(cfg, jax.devices()[0].platform)  # every `auto` key, before anything reads it
        self.cfg, self.stage, self.run_dir = cfg, stage, Path(run_dir)
        self.lock = RunLock(self.run_dir, f"dsv4 {stage}")
        if jax.process_index() == 0:  # one writer per run directory; other hosts write only their shards
            self.lock.acquire()
        self.saved_config: dict[str, Any] = {}
        self.ckpt = ckpt.RunCheckpointer(self.run_dir, max_to_keep=cfg.max_checkpoints,
                                         async_save=cfg.async_checkpointing)
        self.start_step, self.resumed_from, self.init_step = 0, self.ckpt.latest_step(), None
        # Cheap checks first (stage, data, shapes from metadata): building and compiling take a while.
        logged: list[dict[str, Any]] = []
        metrics_notices: list[str] = []
        if self.resumed_from is not None:
            self._check_stage(self.resumed_from)
            # read once, here: a corrupt metrics.jsonl stops the resume before anything is written
            logged = run_files.read_metrics(self.run_dir, metrics_notices)
        rows = cfg.per_device_batch_size * jax.device_count()
        local = local_batch_slice(make_mesh(cfg), rows)  # this process reads and tokenises its own rows only
        self.data = train_batches(cfg, rows, range(local.start, local.stop))
        notices = ([] if self.resumed_from is None  # changed data stops a resume before the model is built
                   else self.data.check(ckpt.read_data_state(self.ckpt.dir, self.resumed_from)))
        fresh_indexer = self._check_sources(init_from)
        # the step needs only shapes: compile it while the model builds (unless this process already has)
        check_state_fits(cfg, stage, self._abstract_model())  # a model that cannot fit stops here, in one line
        ahead = None
        if cfg.compile_ahead and not has_config(cfg):
            if not stage_of(cfg).trains_indexer or cfg.trainable_parameters_mask:  # masks that can be wrong:
                # check them first, from shapes (a compile under way would hold the error's exit until it ends)
                check_masks(cfg, self._abstract_model())
            ahead = StepPrecompile(cfg)
        # a state read from a checkpoint is built from shapes, not initialised first: one copy in memory
        # (a fresh indexer beside loaded weights is the one case that initialises, then loads)
        from_checkpoint = self.resumed_from is not None or (init_from is not None and not fresh_indexer)
        self.setup = setup = build(cfg, abstract=from_checkpoint)
        if self.resumed_from is not None:
            self._resume(self.resumed_from)
        elif init_from is not None:
            self.init_step = load_init_weights(setup, init_from, fresh_indexer)
            if from_checkpoint:  # the zero moments, of the loaded parameters
                setup.optimizer = new_optimizer(cfg, setup.model, setup.mesh)
            if cfg.indexer_init == "teacher":  # once, before step 0: a resume takes the branch above
                notices.append(self._teacher_init(init_from, fresh_indexer))
        self.init_from = None if self.resumed_from is not None else init_from
        self.graphdef, self.state = nnx.split((setup.model, setup.optimizer))
        self.guard = WriteGuard(self.run_dir, self.ckpt.dir, tree_bytes(self.state),
                                self.ckpt.latest_step, self.ckpt.abandon)
        with self.guard.writing("config", self.run_dir / run_files.CONFIG_FILE):
            run_files.write_config(self.run_dir, cfg)
        with self.guard.writing("metrics", self.run_dir / run_files.METRICS_FILE):
            # steps logged after the checkpoint the run resumes from are dropped (all of them when fresh)
            _write_metrics(self.run_dir, [r for r in logged if r.get("step", -1) < self.start_step])
        notices += metrics_notices
        notices += resume_checks.resume_notices(self.saved_config, cfg) if self.saved_config else []
        self.events = EventWriter(self.run_dir, self.start_step) if cfg.enable_tensorboard else None
        self._step_fn = (ahead.step(self.graphdef, self.state, setup.mesh) if ahead is not None
                         else ahead_or_jitted_step(cfg, self.graphdef, self.state, setup.mesh))
        self.last_saved = self.resumed_from
        peers.set_progress(lambda: peers.kept(self.last_saved))  # what a lost-process line says
        self.info = self._describe(init_from, fresh_indexer, notices)
        # processes compile and restore at their own pace: start step 0's collectives together
        wait_for_peers("dsv4-step-compiled")

    def _teacher_init(self, init_from: str | Path, fresh_indexer: bool) -> str:
        """indexer_init=teacher over an indexer that never trained (none in the source, or a pre-training
        run's idle one); a trained indexer (a warm-up's, an imported release's) is kept as loaded."""
        source_stage = None if fresh_indexer else ckpt.read_metadata(init_from).get("stage")
        if source_stage not in (None, "pretrain"):
            return (f"indexer_init=teacher skipped: {init_from} (stage {source_stage}) holds a trained indexer, "
                    "kept as loaded (docs/indexer-init.md)")
        from core.train.indexer_init import teacher_init

        return teacher_init(self.setup.model, self.cfg, self.setup.mesh).line()

    def _abstract_model(self):
        """The config's model from `nnx.eval_shape` (shapes only), traced once per Trainer."""
        if getattr(self, "_abstract", None) is None:
            self._abstract = transformer.abstract(self.cfg)
        return self._abstract

    def _check_sources(self, init_from: str | Path | None) -> bool:
        """Check the resumed or init-from checkpoint's shapes against the config (from metadata, nothing
        built); returns whether `init_from` lacks an indexer, which then starts fresh."""
        if self.resumed_from is None and init_from is None:
            return False
        abstract = self._abstract_model()
        source = self.ckpt.dir if self.resumed_from is not None else init_from
        expected = nnx.to_pure_dict(nnx.state(abstract))
        if self.resumed_from is None:  # weights held released on one side only are bridged (core/model/quant.py)
            from core.model import quant
            from core.train.step import config_matcher

            expected = quant.restore_target(expected, ckpt.read_tree(init_from), config_matcher(self.cfg),
                                            self.stage)[0]
        expected = tree.shapes(expected)
        fresh_indexer = self.resumed_from is None and source_lacks_indexer(init_from, list(expected))
        if fresh_indexer:
            expected = {p: s for p, s in expected.items() if not is_indexer(p)}
        ckpt.check_model_shapes(source, expected, self.resumed_from)
        return fresh_indexer

    def _describe(self, init_from: str | Path | None, fresh_indexer: bool, notices: list[str]) -> dict[str, Any]:
        """The `info` dict: what the run is, before its first step."""
        cfg, setup, devices = self.cfg, self.setup, jax.devices()
        if fresh_indexer:
            notices = [*notices, f"indexer initialised fresh (init_weights_seed={cfg.init_weights_seed}): "
                                 f"{init_from} has no indexer parameters; everything else comes from it"]
        return {
            "model_name": cfg.model_name, "stage": self.stage, "run_dir": str(self.run_dir),
            "params_total": setup.params_total, "params_trainable": setup.params_trainable,
            "batch_size": setup.batch_size, "max_target_length": cfg.max_target_length,
            "tokens_per_step": setup.batch_size * cfg.max_target_length,
            "devices": f"{len(devices)} x {devices[0].platform}", "mesh": self._mesh_line(), "steps": cfg.steps,
            "start_step": self.start_step, "resumed_from": self.resumed_from,
            "init_from": None if self.init_from is None else str(self.init_from), "init_step": self.init_step,
            "init_from_ignored": init_from is not None and self.resumed_from is not None,
            "data": self.data.fingerprint["source"],
            "notices": notices,  # one-line messages for the user before the first step
            "init_fresh_indexer": fresh_indexer,
            "warnings": [w for w in (topk_warning(cfg),) if w],
        }

    def _mesh_line(self) -> str:
        """The header's devices line: the mesh and, on accelerators, the compiled step's memory need."""
        mesh = describe_mesh(self.setup.mesh)
        local = next(d for d in self.setup.mesh.devices.flat if d.process_index == jax.process_index())
        note = step_memory_note(getattr(self._step_fn, "compiled", None), local)
        return mesh if note is None else f"{mesh}  ·  {note}"

    def _check_stage(self, step: int) -> None:
        meta = ckpt.read_metadata(self.ckpt.dir, step)
        self.saved_config = meta.get("config", {})
        if meta.get("stage") != self.stage:
            raise CheckpointError(f"{str(self.run_dir)!r} holds a {meta.get('stage')} run, which dsv4 {self.stage} "
                                  "cannot resume: choose another --output (and --init-from this run for sparse).")

    def _resume(self, step: int) -> None:
        setup = self.setup
        try:
            out = self.ckpt.restore(step, model=abstract_pure(setup.model, setup.mesh),
                                    optimizer=abstract_pure(setup.optimizer, setup.mesh))
        except CheckpointError as e:
            raise resume_checks.optimizer_mismatch(e, self.saved_config, self.cfg, self.run_dir) from None
        for obj, values in ((setup.model, out["model"]), (setup.optimizer, out["optimizer"])):
            state = nnx.state(obj)
            nnx.replace_by_pure_dict(state, values)
            nnx.update(obj, state)
        self.data.restore(out["data"])
        self.start_step = step + 1

    def _save(self, step: int, row: dict[str, Any], data: dict[str, Any]) -> None:
        """Checkpoint `step` (checked already) with `data`, the data position after its batch."""
        if jax.process_count() > 1:  # each process knows the position of its own rows
            data = merge_positions([json.loads(v) for v in exchange("dsv4-data", json.dumps(data))])
        model, optimizer = nnx.merge(self.graphdef, self.state)
        metadata = {"config": self.cfg.to_dict(), "stage": self.stage, "step": step, "metrics": row,
                    "model_name": self.cfg.model_name, "dsv4_version": dsv4_version()}
        with self.guard.writing("checkpoint", self.ckpt.dir, step):
            self.ckpt.save(step, model=nnx.to_pure_dict(nnx.state(model)),
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
        cfg = self.cfg
        row: dict[str, Any] = {}
        stop = StopRequest(cfg.steps - 1)
        self._settled_at = time.perf_counter()
        try:
            with Prefetch(self.data, max(cfg.steps - self.start_step, 0)) as feed, stop.signals(), \
                    quiet_write_errors():
                pending: _InFlight | None = None
                for step in range(self.start_step, cfg.steps):
                    current = self._dispatch(step, feed)
                    if pending is not None:  # the previous step's metrics, while this one runs
                        row = self._settle(pending, stop)
                        yield row
                    pending = current
                    if step == cfg.steps - 1 or (step + 1) % cfg.checkpoint_period == 0:
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
                if self.events is not None:
                    self.events.close()
                with self.guard.writing("checkpoint", self.ckpt.dir, self.last_saved):
                    self.ckpt.close()  # a failed background save surfaces here, as one RunWriteError
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
        step_guard.check_finite(flight.step, metrics, self.cfg, self.last_saved)
        now = time.perf_counter()
        elapsed = now - max(flight.start, self._settled_at)
        self._settled_at = now
        row = {"step": flight.step, **{k: metrics[k] for k in METRIC_KEYS}, "step_time_s": elapsed,
               "tokens_per_s": self.info["tokens_per_step"] / elapsed, "compile": flight.step == self.start_step}
        self._log(row, stop)
        return row

    def _log(self, row: dict[str, Any], stop: StopRequest) -> None:
        """Process 0 appends the row to metrics.jsonl and TensorBoard; a failed write stops this process
        alone at once, or every process of a multi-process run after the agreed step (`StopRequest`)."""
        if jax.process_index() != 0 or stop.reason == "write":
            return
        try:
            with self.guard.writing("metrics", self.run_dir / run_files.METRICS_FILE):
                run_files.append_metrics(self.run_dir, row)
            if self.events is not None:
                with self.guard.writing("TensorBoard events", self.events.dir):
                    self.events.write(row)
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
        latest = self.ckpt.latest_step()
        return {"run_dir": str(self.run_dir), "first": rows[0] if rows else None, "last": rows[-1] if rows else None,
                "checkpoint": None if latest is None else str(self.ckpt.dir / str(latest))}
