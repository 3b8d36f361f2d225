"""The run's state made real (DESIGN.md, "Training, checkpoints, runs"): model and optimizer built on
the mesh, then filled from a checkpoint when the run starts from one.

`build` makes the model and optimizer of resolved specs (core.spec.resolve) with their rule-given
shardings (training, and the benchmarks' real builds). `materialise` is the run's phase: it builds on the mesh preflight made,
with the masks preflight checked, and fills the state from the checkpoint preflight read
(core/train/preflight.py `Source`): a resume restores model, optimizer and data position; an
--init-from loads the weights (with a fresh optimizer, and the teacher's indexer init once, before
step 0). A state read from a checkpoint is built from shapes, not initialised first, so only one
copy is ever in memory; a fresh indexer beside loaded weights is the one case that initialises,
then loads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
from flax import nnx

from core import tree
from core.checkpoint import store
from core.model.init_draws import bucketed_draws
from core.model.params import count_parameters
from core.model.transformer import Transformer
from core.parallel.sharding import create_sharded, shard_state
from core.spec.resolve import OptimizerSpec, Specs
from core.train.indexer_init import calibration_batches, teacher_init
from core.train.optimizer import make_optimizer
from core.train.step import check_masks


@dataclasses.dataclass
class Setup:
    """The model and optimizer of resolved specs on their mesh."""

    specs: Specs
    mesh: Any
    model: Transformer
    optimizer: nnx.Optimizer
    batch_size: int      # global rows per step
    params_total: int    # core.model.params.count_parameters: nnx.Params + router biases
    params_trainable: int


def build(specs: Specs, mesh, *, labels: Mapping[str, bool] | None = None, objects=None) -> Setup:
    """The model and optimizer of `specs` (resolved for `mesh`) on `mesh`, with their rule-given shardings.

    On a single CPU process the model is built eagerly and then placed (`shard_state`): the CPU
    compiles a many-layer model's initialiser as one XLA program far more slowly than it creates
    the parameters op by op. Its optimizer state (zeros) is the opposite: one small jitted program
    is cheaper than one per distinct parameter shape (docs/benchmarks.md#why-the-defaults).
    Elsewhere `create_sharded` builds both directly into their shards.

    Args:
      labels: the trainable labels `check_masks` gave (default: checked here).
      objects: (model, optimizer) from `nnx.eval_shape` (`program.abstract_model_and_optimizer`) to
        hold instead of initialising anything: ShapeDtypeStructs for a checkpoint to fill.
    """
    spec = specs.model
    make_model = lambda: Transformer(spec, rngs=nnx.Rngs(spec.init_seed))  # noqa: E731
    if objects is not None:
        model, optimizer = objects
    elif _one_cpu_process():
        with bucketed_draws():  # a few shared jax.random programs, the same values (core/model/init_draws.py)
            model = shard_state(make_model(), mesh)
        optimizer = new_optimizer(specs.step.optimizer, model, mesh)
    else:
        model = create_sharded(make_model, mesh)
        optimizer = new_optimizer(specs.step.optimizer, model, mesh)
    labels = check_masks(specs.step, model) if labels is None else labels
    counts = count_parameters(tree.shapes(nnx.to_pure_dict(nnx.state(model))), lambda p: labels.get(p, False))
    return Setup(specs, mesh, model, optimizer, specs.step.rows * mesh.size,
                 counts["parameters"], counts["trainable"])


def new_optimizer(spec: OptimizerSpec, model: Transformer, mesh) -> nnx.Optimizer:
    """The optimizer of `spec` for `model` (its concrete, placed parameters) with fresh state, its
    moments sharded as their parameters."""
    optimizer = create_sharded(lambda m: nnx.Optimizer(m, make_optimizer(spec), wrt=nnx.Param), mesh, model)
    # on one CPU process, onto the rule shardings, which the compiled-ahead step (core/train/program.py)
    # expects: the jit's own output shardings are only equivalent to them
    return shard_state(optimizer, mesh) if _one_cpu_process() else optimizer


def _one_cpu_process() -> bool:
    return jax.process_count() == 1 and jax.default_backend() == "cpu"


# ----------------------------------------------------------------------------- the run's phase


@dataclasses.dataclass
class Materialised:
    """The run's state, ready to step."""

    setup: Setup
    graphdef: Any          # of (model, optimizer)
    state: Any             # nnx.split's state of (model, optimizer): what the step takes and returns
    start_step: int        # the first step to train: 0, or the resumed checkpoint's step + 1
    init_step: int | None  # the --init-from checkpoint's step
    notices: tuple[str, ...]


def materialise(specs: Specs, mesh, labels: Mapping[str, bool], abstract, source, data, *,
                teacher_init_batches: int = 0) -> Materialised:
    """Phase: the run's model and optimizer, fresh or filled from `source`.

    Args:
      specs: the run's model and step specs (preflight's `specs`, after the remat phase).
      mesh, labels: preflight's mesh and trainable labels.
      abstract: preflight's (model, optimizer) from `nnx.eval_shape`, copied to hold a checkpoint's values.
      source: preflight's `Source` (core/train/preflight.py), or None for a fresh run.
      data: the run's batches; a resume restores their position.
      teacher_init_batches: indexer_init=teacher's calibration batches (0: none), for an --init-from.
    """
    fills = source is not None and not source.fresh_indexer
    setup = build(specs, mesh, labels=labels, objects=nnx.merge(*nnx.split(abstract), copy=True) if fills else None)
    start_step, init_step, notices = 0, None, []
    if source is not None and source.resume:
        values = store.restore(source.checkpoint, **source.targets)
        _fill(setup.model, values["model"])
        _fill(setup.optimizer, values["optimizer"])
        data.restore(source.checkpoint.data)
        start_step = source.checkpoint.step + 1
    elif source is not None:
        _fill(setup.model, source.convert(store.restore(source.checkpoint, model=source.targets["model"])["model"]))
        init_step = source.checkpoint.step
        if fills:  # the zero moments, of the loaded parameters
            setup.optimizer = new_optimizer(specs.step.optimizer, setup.model, mesh)
        if teacher_init_batches:  # once, before step 0: a resume takes the branch above
            notices.append(_teacher_init(teacher_init_batches, setup, source, data))
    graphdef, state = nnx.split((setup.model, setup.optimizer))
    return Materialised(setup, graphdef, state, start_step, init_step, tuple(notices))


def _fill(obj: nnx.Module, values: dict[str, Any]) -> None:
    """Overwrite `obj`'s variables with a plain nested dict of values (all of them, or a subtree's)."""
    state = nnx.state(obj)
    nnx.replace_by_pure_dict(state, values)
    nnx.update(obj, state)


def _teacher_init(batches: int, setup: Setup, source, data) -> str:
    """indexer_init=teacher over an indexer that never trained (none in the source, or a pre-training
    run's idle one), calibrated on the first batches of the run's own `data`; a trained indexer (a
    warm-up's, an imported release's) is kept as loaded."""
    source_stage = None if source.fresh_indexer else source.checkpoint.metadata.get("stage")
    if source_stage not in (None, "pretrain"):
        return (f"indexer_init=teacher skipped: {source.path} (stage {source_stage}) holds a trained "
                "indexer, kept as loaded (docs/indexer-init.md)")
    return teacher_init(setup.model, calibration_batches(data, batches, setup.mesh), setup.mesh).line()
