"""A training run's preflight (DESIGN.md, "Training, checkpoints, runs"): every check that needs no
array, each done once, before anything is built, handed on as one frozen `Preflight`.

In order, each stopping the run in one line before the long phases start:
1. the mesh, made once; the config resolved for its platform (core.spec.resolve: the resolved config
   and the model's and the step's specs), so every later phase, and config.yml, sees the resolved values;
   the run loop, its outputs and its header read the resolved config through `RunSettings` alone;
2. a resume's checkpoint, read once (metadata, data position, model and optimizer trees): it must
   hold this command's stage; metrics.jsonl must read (a torn last line is dropped, with a notice);
3. this process's rows of the data; a resume's data position must be theirs (core/data/batches.py);
4. the model's shapes (`nnx.eval_shape`, once) against the resumed or --init-from checkpoint's
   tree: an --init-from without an indexer gives a fresh one (core/train/handoff.py), weights held
   released on one side only are bridged (core/model/quant.py), a resume's optimizer state must
   have this config's structure (core/train/resume_checks.py);
5. the parameters and AdamW's moments against one device's memory (core/train/memory.py);
6. the masks against the stage table (core/train/step.py `check_masks`).
The run's next phase, `fit_remat`, then takes on a TPU with `remat_policy=auto` the step without layer
remat, then with `projections`, compiled, the first that fits the chip (core/train/remat.py
`remat_that_fits`; the run then finds it compiled).
The notices (what a resume changes, a dropped metrics line, a fresh indexer) and the warnings
(top-k that never binds) travel in the record.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
from flax import nnx
from jax.sharding import Mesh

from core import tree
from core.checkpoint import run_files, store
from core.config.schema import Config, dump
from core.data.batches import SyntheticBatches, TrainBatches, train_batches
from core.errors import CheckpointError, ConfigError
from core.model import quant
from core.model.params import mask_matcher
from core.model.transformer import Transformer
from core.spec.resolve import Resolved, Specs, data_spec, resolve
from core.parallel.mesh import describe_mesh, make_mesh, mesh_platform
from core.parallel.sharding import abstract_state, local_batch_slice
from core.train import memory, program, remat, resume_checks, step_guard
from core.train.flops import model_flops_per_step
from core.train.handoff import CSA_RATIO, lacks_indexer, topk_never_binds, without_indexer
from core.train.step import check_masks, config_matcher


@dataclasses.dataclass(frozen=True)
class Source:
    """The checkpoint a run starts from, read once and checked against the model: its own latest
    (a resume: model and optimizer) or --init-from's (the model's weights)."""

    path: Path                        # as the user gave it (the run directory of a resume)
    checkpoint: store.Checkpoint
    resume: bool
    targets: Mapping[str, Any]        # item -> restore target: an abstract pure dict sharded on the mesh
    convert: Callable[[dict], dict]   # the model values read -> the model's (released weights bridged)
    fresh_indexer: bool               # the source has no indexer: the model's keeps its fresh initialisation


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What the run's later phases read of the resolved config: the loop's length and checkpoints,
    the outputs, the header and the host's divergence check; the config itself only as the record
    config.yml and each checkpoint's metadata keep."""

    model_name: str
    steps: int
    checkpoint_period: int            # steps between checkpoints
    max_checkpoints: int
    async_checkpointing: bool
    enable_tensorboard: bool
    compile_ahead: bool               # the step compiled from shapes beside the build (core/train/program.py)
    teacher_init_batches: int         # indexer_init=teacher's calibration batches; 0: no teacher init
    max_target_length: int            # tokens per row
    dtype: str                        # the compute dtype, whose peak FLOPs the MFU divides by
    model_flops_per_step: float       # core/train/flops.py, at the run's global batch
    guard: step_guard.Guard
    config_text: str                  # config.yml (core.config.schema.dump)
    config_record: Mapping[str, Any]  # the checkpoints' metadata["config"] (Config.to_dict)


def run_settings(cfg: Config, mesh) -> RunSettings:
    """The `RunSettings` of a resolved `cfg` on `mesh`."""
    guard = step_guard.Guard(cfg.abort_on_nan_loss, cfg.abort_on_inf_loss, cfg.learning_rate,
                             cfg.gradient_clipping_threshold, (cfg.dtype, cfg.weight_dtype))
    flops = model_flops_per_step(cfg, cfg.per_device_batch_size * mesh.size)["total"]
    teacher = cfg.indexer_init_batches if cfg.indexer_init == "teacher" else 0
    return RunSettings(cfg.model_name, cfg.steps, cfg.checkpoint_period, cfg.max_checkpoints, cfg.async_checkpointing,
                       cfg.enable_tensorboard, cfg.compile_ahead, teacher, cfg.max_target_length, cfg.dtype, flops,
                       guard, dump(cfg), cfg.to_dict())


@dataclasses.dataclass(frozen=True)
class Preflight:
    """What the later phases of a run take, each made once."""

    resolved: Resolved                # the config resolved for the mesh's platform, and its specs
    run: RunSettings                  # what the loop, the outputs and the header read of the resolved config
    mesh: Mesh
    abstract: tuple[Transformer, nnx.Optimizer]  # from nnx.eval_shape: the step's and restore's shapes
    labels: Mapping[str, bool]        # parameter path -> trained?, the masks checked
    data: TrainBatches | SyntheticBatches  # this process's rows of the batches (core/data/batches.py)
    source: Source | None             # the checkpoint the run starts from; None when fresh
    kept_metrics: tuple[dict, ...]    # metrics.jsonl's rows up to the resumed step
    notices: tuple[str, ...]          # one-line messages for the user before the first step
    warnings: tuple[str, ...]

    @property
    def specs(self) -> Specs:
        """The model's and the step's specs, without the config: what the phases after the remat
        choice take."""
        return self.resolved.specs


def preflight(cfg: Config, stage: str, run_dir: Path, init_from: str | Path | None = None) -> Preflight:
    """Phase: check everything that needs no array (module docstring); raises the first problem as
    one typed error (ConfigError, CheckpointError, DataError).

    Args:
      stage: the command ("pretrain", "warmup", "sparse"); a resume must find its checkpoints.
      run_dir: the run directory; its latest checkpoint, if any, is resumed and `init_from` ignored.
    """
    mesh = make_mesh(cfg)
    specs = resolve(cfg, mesh_platform(mesh), mesh.shape)
    cfg = specs.cfg
    notices: list[str] = []
    resumed = _resumed(run_dir, stage)
    kept = ()
    if resumed is not None:  # read once, here: a corrupt metrics.jsonl stops the resume before anything is written
        kept = tuple(r for r in run_files.read_metrics(run_dir, notices) if r.get("step", -1) <= resumed.step)
    rows = cfg.per_device_batch_size * jax.device_count()
    local = local_batch_slice(mesh, rows)  # this process reads and tokenises its own rows only
    data = train_batches(data_spec(cfg), rows, range(local.start, local.stop))
    if resumed is not None:  # changed data stops a resume before the model is built
        notices += data.check(dict(resumed.data))
    abstract = program.abstract_model_and_optimizer(specs)
    if resumed is not None:
        source = _resume_source(cfg, mesh, abstract, resumed, run_dir)
        saved = resumed.metadata.get("config")
        notices += resume_checks.resume_notices(saved, cfg.to_dict()) if saved else []
    elif init_from is not None:
        source = _init_source(cfg, stage, mesh, abstract[0], Path(init_from))
        if source.fresh_indexer:
            notices.append(f"indexer initialised fresh (init_weights_seed={cfg.init_weights_seed}): {init_from} has "
                           "no indexer parameters; everything else comes from it")
    else:
        source = None
    check_fits(cfg, stage, mesh, abstract[0])  # a model that cannot fit stops here, in one line
    labels = check_masks(specs.step, abstract[0])
    warnings = tuple(w for w in (topk_warning(cfg),) if w)
    return Preflight(specs, run_settings(cfg, mesh), mesh, abstract, labels, data, source, kept, tuple(notices),
                     warnings)


def fit_remat(asked: str, plan: Preflight) -> Preflight:
    """Phase, once every cheap check passed: on a TPU where `asked` (the remat_policy of the command's
    config, before `resolve`) is `auto`, the step without layer remat, then with `projections`, compiled and the
    first that fits the chip taken, with a notice (core/train/remat.py `remat_that_fits`: the run then
    finds it compiled); `plan` itself elsewhere."""
    fitted = remat.remat_that_fits(asked, plan.resolved, plan.mesh)
    if fitted is plan.resolved:
        return plan
    notice = (f"remat_policy=auto: {fitted.cfg.remat_policy} (the first of none, projections whose step fits the "
              "chip, compiled; remat_policy=full keeps the whole layer remat)")
    return dataclasses.replace(plan, resolved=fitted, run=run_settings(fitted.cfg, plan.mesh),
                               abstract=program.abstract_model_and_optimizer(fitted), notices=(*plan.notices, notice))


def _resumed(run_dir: Path, stage: str) -> store.Checkpoint | None:
    """The run directory's latest checkpoint (model and optimizer trees), which must be `stage`'s; None if it has none."""
    steps = store.finished_steps(run_dir / store.CHECKPOINTS_DIR)
    if not steps:
        return None
    checkpoint = store.read_checkpoint(run_dir / store.CHECKPOINTS_DIR, steps[-1], items=("model", "optimizer"))
    saved = checkpoint.metadata.get("stage")
    if saved != stage:
        raise CheckpointError(f"{str(run_dir)!r} holds a {saved} run, which dsv4 {stage} cannot resume: choose "
                              "another --output (and --init-from this run for sparse).")
    return checkpoint


def _resume_source(cfg, mesh, abstract, checkpoint: store.Checkpoint, run_dir: Path) -> Source:
    """A resume's model and optimizer targets, checked against the checkpoint's trees; an optimizer
    state of another structure names the setting that changed it."""
    targets = {"model": _abstract_pure(abstract[0], mesh), "optimizer": _abstract_pure(abstract[1], mesh)}
    where = f"checkpoint {str(checkpoint.dir / str(checkpoint.step))!r}"
    store.check_compatible(checkpoint.shapes("model"), tree.shapes(targets["model"]), where)
    try:
        store.check_compatible(checkpoint.shapes("optimizer"), tree.shapes(targets["optimizer"]),
                               f"{where} (optimizer state)")
    except CheckpointError as e:
        raise resume_checks.optimizer_mismatch(e, checkpoint.metadata.get("config", {}), cfg.to_dict(),
                                               run_dir) from None
    return Source(run_dir, checkpoint, True, targets, lambda values: values, False)


def _init_source(cfg, stage: str, mesh, model, path: Path) -> Source:
    """--init-from's model target, checked against its tree: without the indexer when the source has
    none, with released weights read as the source holds them (ConfigError if this run trains one)."""
    checkpoint = store.read_checkpoint(path)
    target = _abstract_pure(model, mesh)
    fresh = lacks_indexer(checkpoint.trees["model"], tree.flatten(target))
    if fresh:
        target = without_indexer(target)
    trainable = mask_matcher(cfg.trainable_parameters_mask, cfg.frozen_parameters_mask)
    read, convert = quant.restore_target(target, checkpoint.trees["model"], trainable, stage)
    store.check_compatible(checkpoint.shapes("model"), tree.shapes(read),
                           f"checkpoint {str(checkpoint.dir / str(checkpoint.step))!r}")
    return Source(path, checkpoint, False, {"model": read}, convert, fresh)


def _abstract_pure(obj, mesh) -> dict[str, Any]:
    return nnx.to_pure_dict(abstract_state(obj, mesh))


def check_fits(cfg, stage: str, mesh, model) -> None:
    """ConfigError when the parameters of the abstract `model` and AdamW's moments of the trainable
    ones (`memory.state_bytes_needed`, with the run's shardings on `mesh`) exceed one device's memory."""
    need = memory.state_bytes_needed(abstract_state(nnx.state(model), mesh), config_matcher(cfg),
                                     cfg.mu_dtype, cfg.nu_dtype)
    usable, source = memory.device_memory_bytes(jax.local_devices()[0])  # another process's device has no stats
    if usable is None or need <= usable:
        return
    gib = 2 ** 30
    raise ConfigError(
        f"{cfg.model_name}: its parameters and optimizer state alone need {need / gib:.1f} GiB per device on mesh "
        f"{describe_mesh(mesh)}, and a device has {usable / gib:.1f} GiB ({source}): shard further "
        f"(e.g. ici_fsdp_parallelism=-1, mu_dtype=bfloat16 nu_dtype=bfloat16) and check first with "
        f"`dsv4 plan --model {cfg.model_name} --stage {stage} --target <target>`.")


def topk_warning(cfg) -> str | None:
    """The training commands' start-up warning when top-k cannot bind (core/train/handoff.py); None
    when it can, or the model has no indexer."""
    if not (cfg.use_indexer and cfg.csa_layers) or not topk_never_binds(cfg.indexer_topk, cfg.max_target_length):
        return None
    blocks = cfg.max_target_length // CSA_RATIO
    return (f"top-k never binds: indexer_topk={cfg.indexer_topk} >= max_target_length // {CSA_RATIO} = "
            f"{blocks} blocks, so sparse attention equals dense and the indexer loss scores blocks attention uses anyway; "
            f"lower indexer_topk below {blocks} or raise max_target_length.")
