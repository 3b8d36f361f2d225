"""Run directories and Orbax checkpoints (DESIGN.md, "Training, checkpoints, runs"); the plain files
(config.yml, metrics.jsonl, the output-directory check) are core/checkpoint/run_files.py's.

A run directory holds:

  config.yml               the resolved config (`core.config.schema.dump`)
  metrics.jsonl            one JSON object per step
  checkpoints/<step>/      one Orbax step; <step> is the 0-based index of the last step it includes
      model/               every model variable (parameters, router biases, hash tables) as a plain
                           nested dict, paths like `layers/3/attn/indexer/wq_b`
      optimizer/           the `nnx.Optimizer` state as a plain nested dict (frozen parameters have
                           no entries)
      data/                the data position (JSON, `core.data.batches.TrainBatches.state`)
      metadata/            JSON: config, stage, step, metrics of that step, model_name, dsv4 version

Orbax writes each step into a temporary directory and renames it when complete, so a step killed
mid-write never appears as `checkpoints/<int>/`; only those are listed. Readers accept a run
directory, its checkpoints/ directory or one step directory (`resolve_checkpoint`), and every
problem (missing, foreign, incomplete, shape mismatch) is a one-line `CheckpointError`.
`read_checkpoint` reads a step's metadata, data position and array trees once; `restore` fills
targets from it, checked against the trees read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint._src import asyncio_utils

from core.checkpoint.host_tree import HostTreeHandler, HostTreeSave
from core.config.schema import loads
from core.errors import CheckpointError
from core.model import transformer
from core.parallel.sharding import abstract_state
from core.spec.resolve import parameter_spec
from core.tree import flatten, shapes

CHECKPOINTS_DIR = "checkpoints"
ITEMS = ("model", "optimizer", "data", "metadata")
_ARRAY_ITEMS = ("model", "optimizer")


# ----------------------------------------------------------------------------- trees


def check_compatible(saved: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Raise CheckpointError naming the first parameter whose presence or shape differs.

    Args:
      saved, expected: flat {path: shape} (see `shapes`, `read_tree`).
      where: the checkpoint, for the message.
    """
    for path in sorted(set(saved) | set(expected)):
        if path not in saved:
            raise CheckpointError(f"{where} has no parameter {path!r} that this model needs: "
                                  "it was written by a different model; use matching model keys or a new --output.")
        if path not in expected:
            raise CheckpointError(f"{where} holds parameter {path!r} that this model does not have: "
                                  "it was written by a different model; use matching model keys or a new --output.")
        a, b = tuple(saved[path]), tuple(expected[path])
        if a != b:
            raise CheckpointError(f"{where} has parameter {path!r} of shape {a}, but this model's is {b}: "
                                  "use the model keys the checkpoint was written with, or a new --output.")


# ----------------------------------------------------------------------------- locating checkpoints


def finished_steps(checkpoints_dir: Path) -> list[int]:
    """Finished steps: integer-named directories (Orbax's in-progress ones carry a tmp suffix)."""
    if not checkpoints_dir.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints_dir.iterdir() if p.is_dir() and p.name.isdigit())


def resolve_checkpoint(path: str | Path, step: int | None = None) -> tuple[Path, Path, int]:
    """(run_dir, checkpoints_dir, step) for a run dir, its checkpoints/ dir or one step dir.

    Args:
      path: the directory given by the user.
      step: a specific step (default: the latest finished one; a step dir names its own).
    Raises:
      CheckpointError: missing path, not a checkpoint, no finished step, unknown step, or a step
        directory with missing items.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist: give a run directory or a checkpoint step directory.")
    if path.is_dir() and (path / CHECKPOINTS_DIR).is_dir():
        ckpt_dir = path / CHECKPOINTS_DIR
    elif path.is_dir() and (path.name == CHECKPOINTS_DIR or finished_steps(path)):
        ckpt_dir = path
    elif path.is_dir() and path.name.isdigit() and any((path / item).exists() for item in ITEMS):
        if step is not None and step != int(path.name):
            raise CheckpointError(f"{str(path)!r} is the checkpoint of step {path.name}, not {step}: drop --step or give the run directory.")
        ckpt_dir, step = path.parent, int(path.name)
    else:
        raise CheckpointError(f"{str(path)!r} is not a dsv4 run or checkpoint: give a directory holding "
                              f"{CHECKPOINTS_DIR}/<step>/ (a run), {CHECKPOINTS_DIR}/ itself, or one <step>/ directory.")
    steps = finished_steps(ckpt_dir)
    if step is None:
        if not steps:
            raise CheckpointError(f"{str(ckpt_dir)!r} has no finished checkpoint: train with a checkpoint_period "
                                  "that is reached, or let the run finish.")
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"{str(ckpt_dir)!r} has no checkpoint for step {step}: available steps are "
                              f"{', '.join(map(str, steps)) or 'none'}.")
    step_dir = ckpt_dir / str(step)
    missing = [item for item in ITEMS if not (step_dir / item).is_dir()]
    if missing:
        raise CheckpointError(f"checkpoint {str(step_dir)!r} is incomplete or corrupted (no {', '.join(missing)}): "
                              "use another step (--step) or retrain.")
    return ckpt_dir.parent, ckpt_dir, step


# ----------------------------------------------------------------------------- Orbax


_PENDING_WAIT_S = 60.0  # a failed call's sibling reads and writes end with their I/O; later ones are cancelled


def _run_sync_draining(coro):
    """Orbax's `asyncio_utils._run_sync_via_new_loop`, but the loop is closed only after the tasks
    it started have ended.

    Orbax runs every synchronous call (save, restore, metadata) in a fresh event loop and closes it
    as soon as the call's coroutine returns or raises. When one read or write of an
    `asyncio.gather` fails (a corrupted array, a full disk), its siblings are still awaiting
    TensorStore futures: they complete after the close, and TensorStore's completion callback then
    raises "Event loop is closed" as an unraisable exception in whatever code runs at that moment.
    Here the loop first runs until those tasks end (cancelling any that outlive `_PENDING_WAIT_S`,
    as `asyncio.run` cancels them all). They are tracked by the loop's task factory, not
    `asyncio.all_tasks` (a process-wide WeakSet that Orbax avoids iterating from its threads).
    """
    loop = asyncio.new_event_loop()
    started = []

    def track(loop, coro, **kwargs):
        task = asyncio.Task(coro, loop=loop, **kwargs)
        started.append(task)
        return task

    loop.set_task_factory(track)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            pending = [t for t in started if not t.done()]
            if pending:
                _, late = loop.run_until_complete(asyncio.wait(pending, timeout=_PENDING_WAIT_S))
                for task in late:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _drain_orbax_loops() -> None:
    """Run Orbax's per-call event loops with `_run_sync_draining` (idempotent)."""
    if getattr(asyncio_utils, "_run_sync_via_new_loop", None) not in (None, _run_sync_draining):
        asyncio_utils._run_sync_via_new_loop = _run_sync_draining


def _manager(checkpoints_dir: Path, *, max_to_keep: int | None = None, async_save: bool = False,
             host_model: bool = False):
    _drain_orbax_loops()
    model = HostTreeHandler() if host_model else ocp.StandardCheckpointHandler()
    handlers = {"model": model, "optimizer": ocp.StandardCheckpointHandler(),
                "data": ocp.JsonCheckpointHandler(), "metadata": ocp.JsonCheckpointHandler()}
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                           create=max_to_keep is not None)
    return ocp.CheckpointManager(checkpoints_dir.absolute(), options=options, item_handlers=handlers)


def _restore(checkpoints_dir: Path, step: int, **args: Any) -> dict[str, Any]:
    """Restore the named items (ocp.args values) of one step, wrapping Orbax errors."""
    mgr = _manager(checkpoints_dir)
    try:
        out = mgr.restore(step, args=ocp.args.Composite(**args))
    except CheckpointError:
        raise
    except Exception as e:  # Orbax/TensorStore raise ValueError, FileNotFoundError, tensorstore errors...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointError(f"checkpoint {str(checkpoints_dir / str(step))!r} cannot be read ({first}): "
                              "it is truncated or corrupted; use another step (--step) or retrain.") from None
    finally:
        mgr.close()
    return {name: out[name] for name in args}


def read_metadata(path: str | Path, step: int | None = None) -> dict[str, Any]:
    """The JSON metadata of a checkpoint (config, stage, step, metrics, model_name, version)."""
    _, ckpt_dir, step = resolve_checkpoint(path, step)
    return _restore(ckpt_dir, step, metadata=ocp.args.JsonRestore())["metadata"]


def read_tree(path: str | Path, step: int | None = None, item: str = "model") -> dict[str, tuple[tuple[int, ...], str]]:
    """{"a/b/c": (shape, dtype name)} of an array item without loading any array.

    Args:
      item: "model" or "optimizer".
    """
    _, ckpt_dir, step = resolve_checkpoint(path, step)
    return _read_trees(ckpt_dir, step, (item,))[item]


def _read_trees(ckpt_dir: Path, step: int, items: tuple[str, ...]) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
    """`read_tree` of each of `items` of a resolved step, from one read of its metadata."""
    bad = [item for item in items if item not in _ARRAY_ITEMS]
    if bad:
        raise ValueError(f"item must be one of {_ARRAY_ITEMS}, got {bad[0]!r}")
    if not items:
        return {}
    where = f"checkpoint {str(ckpt_dir / str(step))!r}"
    mgr = _manager(ckpt_dir)
    try:
        metadata = mgr.item_metadata(step)
        trees = {item: metadata[item] for item in items}
    except Exception as e:
        raise CheckpointError(f"{where} has unreadable {' and '.join(items)} metadata "
                              f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__}): it is truncated or corrupted.") from None
    finally:
        mgr.close()
    out = {}
    for item, tree in trees.items():
        if tree is None:
            raise CheckpointError(f"{where} has no {item} metadata: it is truncated or corrupted.")
        tree = getattr(tree, "tree", tree)
        out[item] = {k: (tuple(v.shape), str(v.dtype)) for k, v in flatten(tree).items()}
    return out


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One finished checkpoint step, read once (`read_checkpoint`): where it lies, its JSON items, and
    the trees of the array items asked for (shapes and dtypes; no array is read)."""

    run_dir: Path
    dir: Path                  # its checkpoints/ directory
    step: int
    metadata: Mapping[str, Any]  # config, stage, step, metrics, model_name, dsv4 version
    data: Mapping[str, Any]    # the data position after the step's batch
    trees: Mapping[str, Mapping[str, tuple[tuple[int, ...], str]]]  # item -> `read_tree` of it

    def shapes(self, item: str = "model") -> dict[str, tuple[int, ...]]:
        """{path: shape} of an array item read with the checkpoint."""
        return {k: s for k, (s, _) in self.trees[item].items()}


def read_checkpoint(path: str | Path, step: int | None = None, items: tuple[str, ...] = ("model",)) -> Checkpoint:
    """A checkpoint's metadata, data position and the trees of `items`, read once for every later use.

    Args:
      path: run dir, checkpoints/ dir or step dir (`resolve_checkpoint`).
      items: the array items whose trees to read ("model", "optimizer").
    """
    run_dir, ckpt_dir, step = resolve_checkpoint(path, step)
    json_items = _restore(ckpt_dir, step, metadata=ocp.args.JsonRestore(), data=ocp.args.JsonRestore())
    return Checkpoint(run_dir, ckpt_dir, step, json_items["metadata"], json_items["data"],
                      _read_trees(ckpt_dir, step, tuple(items)))


def restore(checkpoint: Checkpoint, **targets: Any) -> dict[str, Any]:
    """Array items of `checkpoint` restored into `targets` (item -> an abstract plain dict of
    jax.ShapeDtypeStruct, with shardings to restore each leaf straight into its shards).

    Raises:
      CheckpointError: naming the first parameter whose shape or presence differs from the tree read
        with the checkpoint ("(optimizer state)" in the message for the optimizer item).
    """
    where = f"checkpoint {str(checkpoint.dir / str(checkpoint.step))!r}"
    for item, target in targets.items():
        check_compatible(checkpoint.shapes(item), shapes(target), where if item == "model" else f"{where} ({item} state)")
    return _restore(checkpoint.dir, checkpoint.step, **{k: ocp.args.StandardRestore(v) for k, v in targets.items()})


def config_of(path: str | Path, step: int | None = None):
    """The resolved Config a checkpoint was trained with."""
    return saved_config(read_metadata(path, step))


def saved_config(metadata: Mapping[str, Any]):
    """The Config of a checkpoint's metadata (`read_metadata`, `Checkpoint.metadata`)."""
    return loads(json.dumps(metadata["config"]))


def restore_model_state(path: str | Path, target: Any, step: int | None = None) -> tuple[dict[str, Any], int]:
    """Load a checkpoint's model variables into the structure of `target`.

    Args:
      path: run dir, checkpoints/ dir or step dir.
      target: the model's abstract state as a plain nested dict of jax.ShapeDtypeStruct (with
        shardings for a mesh), e.g. `nnx.to_pure_dict(core.parallel.sharding.abstract_state(model, mesh))`.
    Returns:
      (the restored plain dict, the step it came from).
    Raises:
      CheckpointError: naming the first parameter whose shape or presence differs.
    """
    checkpoint = read_checkpoint(path, step)
    return restore(checkpoint, model=target)["model"], checkpoint.step


def restore_model(path: str | Path, step: int | None = None, spec=None, *, mesh=None):
    """(model, the checkpoint's config, metadata): a `core.model.transformer.Transformer` with a
    checkpoint's variables.

    Args:
      spec: the model's `ModelSpec`, of a config resolved where the caller starts (core.spec.resolve:
        for `mesh`, or for where the model is placed); its parameters must match the checkpoint's.
        None: the checkpoint's own config's parameters (`core.spec.resolve.parameter_spec`, laid out as
        a CPU runs them), to read or export the weights.
      mesh: restore each variable straight into its rule sharding on this mesh
        (`core.parallel.sharding.abstract_state`: no device ever holds the whole model); None: as
        Orbax places it.
    """
    checkpoint = read_checkpoint(path, step)
    cfg = saved_config(checkpoint.metadata)
    graphdef, state = nnx.split(transformer.abstract(parameter_spec(cfg) if spec is None else spec))
    target = state if mesh is None else abstract_state(state, mesh)
    nnx.replace_by_pure_dict(state, restore(checkpoint, model=nnx.to_pure_dict(target))["model"])
    return nnx.merge(graphdef, state), cfg, dict(checkpoint.metadata)


class RunCheckpointer:
    """Saves and restores the training state of one run directory (async, `max_to_keep` kept).

    `host_model=True` (a synchronous save of a model tree of NumPy arrays, e.g. `dsv4 import-hf`)
    writes the model item in place, in bounded chunks: core.checkpoint.host_tree; same layout.
    """

    def __init__(self, run_dir: str | Path, *, max_to_keep: int, async_save: bool, host_model: bool = False):
        if host_model and async_save:
            raise ValueError("host_model saves write the caller's arrays in place: they must be synchronous")
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / CHECKPOINTS_DIR
        self._options = dict(max_to_keep=max_to_keep, async_save=async_save, host_model=host_model)
        self._mgr_instance = None

    @property
    def _mgr(self):
        if self._mgr_instance is None:  # created on first use: nothing is written before a save
            self._mgr_instance = _manager(self.dir, **self._options)
        return self._mgr_instance

    def latest_step(self) -> int | None:
        steps = finished_steps(self.dir)
        return steps[-1] if steps else None

    def save(self, step: int, *, model: Any, optimizer: Any, data: Mapping[str, Any],
             metadata: Mapping[str, Any]) -> None:
        """Start writing step `step` (model/optimizer: plain nested dicts of arrays)."""
        host = self._options["host_model"]
        self._mgr.save(step, args=ocp.args.Composite(
            model=HostTreeSave(model) if host else ocp.args.StandardSave(model), optimizer=ocp.args.StandardSave(optimizer),
            data=ocp.args.JsonSave(dict(data)), metadata=ocp.args.JsonSave(dict(metadata))), force=True)

    def wait(self) -> None:
        if self._mgr_instance is not None:
            self._mgr_instance.wait_until_finished()

    def close(self) -> None:
        if self._mgr_instance is not None:
            self._mgr_instance.wait_until_finished()
            self._mgr_instance.close()
            self._mgr_instance = None

    def abandon(self) -> None:
        """Stop after a failed save: wait for Orbax's threads, ignore their errors, forget the manager."""
        mgr, self._mgr_instance = self._mgr_instance, None
        if mgr is not None:
            for finish in (mgr.wait_until_finished, mgr.close):
                try:
                    finish()
                except Exception:  # the failure itself is reported by the caller
                    pass
