"""The training step: losses, AdamW with the trainable mask, router-bias updates, its jit (core/train/program.py)
and caches, building.

DESIGN.md's stage table (`core.config.stages.stage_of`) decides what a step computes:
total_loss = lm_loss + indexer_loss + moe_lb_loss, where lm_loss is the mean next-token
cross-entropy over `loss_mask`, and exactly 0.0 (not computed: the model skips its head) in a row
without an LM loss (the warm-up).

Optimizer: AdamW (decoupled weight decay) on a linear warm-up then cosine schedule, after
global-norm clipping, inside `optax.multi_transform({"train": ..., "frozen": set_to_zero()})`
keyed by `trainable_parameters_mask` (regexes fully matching '/'-joined parameter paths such as
`layers/3/attn/indexer/wq_b`; empty = everything) minus `frozen_parameters_mask` (the same kind of
regexes; dsv4 pretrain freezes '.*indexer.*'): `core.model.params.mask_matcher`, the rule the counts
and inspect-ckpt use too. Frozen parameters hold no optimizer state.
Gradients are only taken with respect to trainable parameters, so XLA never builds the frozen
part of the backward pass (in the warm-up only the indexer's own small backward runs); frozen
parameters get an explicit zero gradient for the optimizer's tree and stay bitwise unchanged.

Router biases are not trained by gradients: after each step every learned-routing layer's
`RouterBias` moves by `routed_bias_update_rate` towards balance, unless that router is frozen
(neither its weight nor its bias matches the mask: the warm-up's '.*indexer.*' freezes them all).

A step whose total loss, gradient norm or updated parameters are non-finite is not applied
(core/train/step_guard.py; the run loop in core/train/run.py then stops).

Deviation from MaxText's schedule: the linear warm-up starts at peak / warmup_steps instead of 0,
so step 0 already trains.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from core.checkpoint import store as ckpt
from core import tree
from core.config.platform import resolve
from core.config.stages import stage_of
from core.train import optimizer, program, step_guard
from core.errors import ConfigError
from core.model.init_draws import bucketed_draws
from core.loss.lm import lm_loss_from_hidden
from core.model import transformer
from core.model.transformer import Transformer
from core.model.moe import RouterBias
from core.model.params import count_parameters, mask_matcher
from core.parallel.sharding import abstract_state, create_sharded, shard_state, state_shardings
from core.parallel.mesh import make_mesh, mesh_platform
from core.train.handoff import is_indexer, without_indexer

# moe_dropped: the fraction of routed (token, expert) slots that expert parallelism's capacity
# (moe_capacity_factor) dropped, mean over layers; exactly 0 when drop-free (the default)
METRIC_KEYS = ("total_loss", "lm_loss", "indexer_loss", "moe_lb_loss", "moe_dropped", "grad_norm", "learning_rate")


# ----------------------------------------------------------------------------- losses and schedule


def learning_rate_schedule(cfg) -> Callable[[Any], Any]:
    """lr(step): linear from peak/W to peak over W = round(warmup_steps_fraction * N) steps, then
    cosine from peak to peak * cosine_learning_rate_final_fraction at step N - 1, constant after;
    N = learning_rate_schedule_steps, or steps when that is -1."""
    peak, final = cfg.learning_rate, cfg.learning_rate * cfg.cosine_learning_rate_final_fraction
    n = schedule_steps(cfg)
    warm = int(round(cfg.warmup_steps_fraction * n))
    decay = max(n - 1 - warm, 1)

    def lr(step):
        step = jnp.asarray(step, jnp.float32)
        warm_lr = peak * (step + 1) / max(warm, 1)
        frac = jnp.clip((step - warm) / decay, 0.0, 1.0)
        cos_lr = final + 0.5 * (peak - final) * (1 + jnp.cos(jnp.pi * frac))
        return jnp.where(step < warm, warm_lr, cos_lr)

    return lr


def schedule_steps(cfg_or_dict: Any) -> int:
    """The learning-rate schedule's length: learning_rate_schedule_steps, or steps when it is -1
    (of a Config, or of a saved config's dict)."""
    get = cfg_or_dict.get if isinstance(cfg_or_dict, Mapping) else lambda k, d=None: getattr(cfg_or_dict, k, d)
    n = get("learning_rate_schedule_steps", -1)
    return int(n) if n is not None and n > 0 else int(get("steps"))


# ----------------------------------------------------------------------------- trainable mask


def path_matcher(patterns: Sequence[str], frozen: Sequence[str] = ()) -> Callable[[Sequence[Any]], bool]:
    """`mask_matcher` on key paths (nnx's str/int entries, or a pytree's DictKey, SequenceKey, ...),
    `tree.join`ed as a checkpoint names them."""
    trainable = mask_matcher(patterns, frozen)
    return lambda path: trainable(tree.join(path))


def config_matcher(cfg) -> Callable[[Sequence[Any]], bool]:
    """The config's trainable rule: trainable_parameters_mask minus frozen_parameters_mask."""
    return path_matcher(cfg.trainable_parameters_mask, cfg.frozen_parameters_mask)


def trainable_labels(model: nnx.Module, patterns: Sequence[str], frozen: Sequence[str] = ()) -> dict[str, bool]:
    """{parameter path: trainable?}; ConfigError if the masks leave nothing to train."""
    trainable = mask_matcher(patterns, frozen)
    paths = list(tree.flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    labels = {p: trainable(p) for p in paths}
    if not any(labels.values()):
        outside = f" outside frozen_parameters_mask={list(frozen)}" if frozen else ""
        raise ConfigError(f"trainable_parameters_mask={list(patterns)} matches no parameter{outside}: paths look like "
                          f"{paths[0]!r}; write e.g. '.*indexer.*'.")
    return labels


# Config keys a compiled step does not depend on (data source, run directory, checkpointing).
_RUN_ONLY_KEYS = frozenset({
    "dataset_type", "hf_path", "hf_name", "hf_data_files", "hf_split", "hf_eval_split", "hf_text_column",
    "hf_streaming", "tokenizer_path", "eval_holdout_fraction", "data_shuffle_seed", "checkpoint_period",
    "max_checkpoints", "async_checkpointing", "base_output_directory", "run_name", "allow_data_change",
    "enable_tensorboard", "jax_cache_dir", "compile_ahead"})
# Per process, keyed by the compile-relevant config: the optax transformation (it is part of the
# optimizer's graphdef, so reusing it makes equal configs give equal graphdefs) and the jitted
# step, so a resumed or repeated run in the same process does not compile again.
_TX_CACHE: dict[Any, optax.GradientTransformation] = {}
_STEP_CACHE: dict[Any, Callable] = {}
_COMPILED: dict[Any, Any] = {}  # the same keys -> the step compiled ahead of time (core/train/precompile.py)
_CACHE_LOCK = threading.RLock()


def _compile_key(cfg) -> tuple:
    # steps only shapes the step through the schedule's length, unless learning_rate_schedule_steps fixes it
    skip = _RUN_ONLY_KEYS | ({"steps"} if cfg.learning_rate_schedule_steps > 0 else set())
    return tuple((f, v) for f, v in vars(cfg).items() if f not in skip)


def make_optimizer(cfg) -> optax.GradientTransformation:
    """clip -> AdamW(schedule) for trainable leaves, set_to_zero (no state) for frozen ones."""
    key = _compile_key(cfg)
    with _CACHE_LOCK:  # one object per key, also when core/train/precompile.py's thread asks first
        if key not in _TX_CACHE:
            _TX_CACHE[key] = _make_optimizer(cfg)
        return _TX_CACHE[key]


def _make_optimizer(cfg) -> optax.GradientTransformation:
    return optimizer.adamw(cfg, learning_rate_schedule(cfg), config_matcher(cfg))


# ----------------------------------------------------------------------------- the step


def make_train_step(cfg, graphdef, state, mesh):
    """A jitted `(state, batch) -> (state, metrics)` over the split (model, optimizer) `state`: `step_fn`
    through core/train/program.py's `jit_step`, the one jit of training, `dsv4 plan` and `dsv4 bench`.

    The output state keeps the input's rule-given shardings (so step 1 reuses step 0's program);
    one compiled step is shared by every Trainer of an equal (cfg, graphdef, mesh) in a process.
    """
    key = step_key(cfg, graphdef, mesh)
    with _CACHE_LOCK:  # core/train/precompile.py calls this from its thread too
        if key not in _STEP_CACHE:
            _STEP_CACHE[key] = program.jit_step(step_fn(cfg, graphdef, mesh_platform(mesh)), cfg, mesh,
                                                state_shardings(state, mesh))
        return _STEP_CACHE[key]


def step_key(cfg, graphdef, mesh) -> tuple:
    """The step caches' key: equal for configs, graphdefs and meshes that give the same program."""
    return (_compile_key(cfg), graphdef, mesh)


def compiled_step(cfg, graphdef, state, batch, mesh, on_lowered: Callable[[], None] | None = None):
    """`make_train_step`'s step compiled ahead of time for (abstract) `state` and `batch`, once
    per key and process (`jax.stages.Compiled`; core/train/precompile.py); `on_lowered()` is called
    between tracing (Python, holds the GIL) and XLA's compile (releases it)."""
    key = step_key(cfg, graphdef, mesh)
    if key not in _COMPILED:
        lowered = make_train_step(cfg, graphdef, state, mesh).lower(state, batch)
        if on_lowered is not None:
            on_lowered()
        compiled = lowered.compile()
        with _CACHE_LOCK:
            _COMPILED.setdefault(key, compiled)
    return _COMPILED[key]


def lowered_step(cfg, mesh=None):
    """`make_train_step`'s step lowered from `program.abstract_inputs` on `mesh` (default the run's
    own), as a training command lowers it ahead of its build; nothing is allocated. `dsv4 plan`
    and `dsv4 bench --train` compile this.

    Returns:
      (jax.stages.Lowered, program.StepInputs).
    """
    inputs = program.abstract_inputs(cfg, abstract_model_and_optimizer(cfg), mesh)
    return make_train_step(cfg, inputs.graphdef, inputs.state, inputs.mesh).lower(inputs.state, inputs.batch), inputs


def has_config(cfg) -> bool:
    """Whether either step cache holds a step of `cfg`'s compile-relevant config (any graphdef, mesh)."""
    ck = _compile_key(cfg)
    with _CACHE_LOCK:
        return any(k[0] == ck for k in (*_STEP_CACHE, *_COMPILED))


def cached_compiled(key):
    """The ahead-of-time executable of `key` (`step_key`), or None."""
    with _CACHE_LOCK:
        return _COMPILED.get(key)


def step_fn(cfg, graphdef, platform: str | None = None):
    """The train step `(state, batch) -> (state, metrics)` (module docstring), traced for `platform`'s
    compiler (the mesh's devices; default `jax.default_backend()`), which picks how the non-finite
    guard keeps the state (core/train/step_guard.py `apply_if_ok`)."""
    cfg = resolve(cfg, platform or jax.default_backend())  # a no-op when the entry point resolved it
    trainable = config_matcher(cfg)
    lm_loss = stage_of(cfg).lm_loss  # False in the warm-up: the model returns no hidden states for the head
    grad_filter = nnx.All(nnx.Param, lambda path, _: trainable(path))
    frozen_filter = nnx.All(nnx.Param, nnx.Not(grad_filter))
    # A router bias moves unless its router is frozen: neither it nor the router weight is trainable.
    fixed_bias = nnx.All(RouterBias, lambda path, _: not (trainable(path) or trainable((*path[:-1], "weight"))))
    schedule, rate = learning_rate_schedule(cfg), cfg.routed_bias_update_rate
    guard = cfg.abort_on_nan_loss or cfg.abort_on_inf_loss

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            h, aux = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"], mode="train")
            lm = (lm_loss_from_hidden(h, model.head[...].astype(model.dtype), batch["targets"], batch["loss_mask"],
                                      chunk=cfg.lm_loss_chunk_size) if lm_loss else jnp.zeros((), jnp.float32))
            return lm + aux["indexer_loss"] + aux["moe_lb_loss"], (lm, aux)

        grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, grad_filter), has_aux=True)
        (total, (lm, aux)), grads = grad_fn(model)
        zeros = jax.tree.map(jnp.zeros_like, nnx.state(model, frozen_filter))
        metrics = {"total_loss": total, "lm_loss": lm, "indexer_loss": aux["indexer_loss"],
                   "moe_lb_loss": aux["moe_lb_loss"], "moe_dropped": aux["moe_dropped"],
                   "grad_norm": optax.tree.norm(grads),
                   "learning_rate": schedule(optimizer.step[...])}
        grads = nnx.merge_state(grads, zeros)

        def apply(state):
            model, optimizer = nnx.merge(graphdef, state)
            optimizer.update(model, grads)
            # a snapshot (new Variables): update_router_biases changes the model's Variables in place
            fixed = jax.tree.map(lambda v: v, nnx.state(model, fixed_bias))
            model.update_router_biases(aux["expert_load"], rate)
            nnx.update(model, fixed)  # frozen routers keep their biases
            return nnx.state((model, optimizer))

        state = nnx.state((model, optimizer))
        if not guard:
            return apply(state), metrics
        # a non-finite step is not applied (the host sees the same metrics and stops); tested on what
        # the update would write, before it, so that the update writes the state in place
        ok, metrics["params_finite"] = step_guard.step_ok(
            total, metrics["grad_norm"], step_guard.updated_params(model, optimizer, grads), trainable,
            abort_on_nan=cfg.abort_on_nan_loss, abort_on_inf=cfg.abort_on_inf_loss)
        new_state = step_guard.apply_if_ok(ok, apply, state, platform or jax.default_backend())
        return new_state, metrics

    return step


# ----------------------------------------------------------------------------- building


@dataclasses.dataclass
class Setup:
    """Everything a training loop needs, built from a config."""

    cfg: Any
    mesh: Any
    model: Transformer
    optimizer: nnx.Optimizer
    batch_size: int      # global rows per step
    params_total: int    # core.model.params.count_parameters: nnx.Params + router biases
    params_trainable: int


def build(cfg, *, abstract: bool = False) -> Setup:
    """Model and optimizer on the config's mesh, with their rule-given shardings.

    On a single CPU process the model is built eagerly and then placed (`shard_state`): the CPU
    compiles a many-layer model's initialiser as one XLA program far more slowly than it creates
    the parameters op by op. Its optimizer state (zeros) is the opposite: one small jitted program
    is cheaper than one per distinct parameter shape (docs/benchmarks.md#why-the-defaults).
    Elsewhere `create_sharded` builds both directly into their shards.

    With `abstract` nothing is initialised or allocated: model and optimizer hold ShapeDtypeStructs
    (`nnx.eval_shape`) for a checkpoint to fill, so a resumed or --init-from run never holds a
    throwaway random state beside the one it reads (`new_optimizer` then makes the zero moments of
    an --init-from).
    """
    mesh = make_mesh(cfg)
    make_model = lambda: Transformer(cfg, rngs=nnx.Rngs(cfg.init_weights_seed))  # noqa: E731
    if abstract:
        model, optimizer = abstract_model_and_optimizer(cfg)
    elif _one_cpu_process():
        with bucketed_draws():  # a few shared jax.random programs, the same values (core/model/init_draws.py)
            model = shard_state(make_model(), mesh)
        optimizer = new_optimizer(cfg, model, mesh)
    else:
        model = create_sharded(make_model, mesh)
        optimizer = new_optimizer(cfg, model, mesh)
    labels = check_masks(cfg, model)
    counts = count_parameters(tree.shapes(nnx.to_pure_dict(nnx.state(model))), lambda p: labels.get(p, False))
    return Setup(cfg, mesh, model, optimizer, cfg.per_device_batch_size * mesh.size,
                 counts["parameters"], counts["trainable"])


def new_optimizer(cfg, model: Transformer, mesh) -> nnx.Optimizer:
    """The optimizer of `model` (its concrete, placed parameters) with fresh state, its moments sharded
    as their parameters."""
    optimizer = create_sharded(lambda m: nnx.Optimizer(m, make_optimizer(cfg), wrt=nnx.Param), mesh, model)
    # on one CPU process, onto the rule shardings, which the compiled-ahead step (core/train/precompile.py)
    # expects: the jit's own output shardings are only equivalent to them
    return shard_state(optimizer, mesh) if _one_cpu_process() else optimizer


def _one_cpu_process() -> bool:
    return jax.process_count() == 1 and jax.default_backend() == "cpu"


def check_masks(cfg, model) -> dict[str, bool]:
    """`trainable_labels` of `model` (concrete or `nnx.eval_shape`), and ConfigError when the masks
    train the indexer in a stage-table row that does not (`Stage.trains_indexer`: pre-training,
    where no loss reaches it)."""
    labels = trainable_labels(model, cfg.trainable_parameters_mask, cfg.frozen_parameters_mask)
    if not stage_of(cfg).trains_indexer and any(v for p, v in labels.items() if is_indexer(p)):
        raise ConfigError("dense_pretraining=true leaves the indexer idle, yet the masks train its parameters "
                          "(weight decay alone would move them): add '.*indexer.*' to frozen_parameters_mask.")
    return labels


def abstract_model_and_optimizer(cfg) -> tuple[Transformer, nnx.Optimizer]:
    """`cfg`'s (model, optimizer) from `nnx.eval_shape`: ShapeDtypeStructs, nothing allocated (the
    objects of `program.abstract_inputs` for the train step, and of `build(abstract=True)`); the
    model is `transformer.abstract`'s, traced once per config."""
    model = transformer.abstract(cfg)
    return model, nnx.eval_shape(lambda m: nnx.Optimizer(m, make_optimizer(cfg), wrt=nnx.Param), model)


def abstract_pure(obj, mesh):
    return nnx.to_pure_dict(abstract_state(obj, mesh))


def load_init_weights(setup: Setup, path: str | Path, fresh_indexer: bool = False) -> int:
    """Overwrite the model's variables (params, router biases) with a checkpoint's; returns its step.

    With `fresh_indexer` the checkpoint holds no indexer (`source_lacks_indexer`): the indexer
    keeps its fresh initialisation and everything else is loaded (core.train.handoff).
    """
    from core.model import quant

    target = abstract_pure(setup.model, setup.mesh)
    if fresh_indexer:
        target = without_indexer(target)
    # weights held released on one side and as parameters on the other are bridged (core/model/quant.py)
    read, convert = quant.restore_target(target, ckpt.read_tree(path), config_matcher(setup.cfg),
                                         stage_of(setup.cfg).name)
    values, step = ckpt.restore_model_state(path, read)
    values = convert(values)
    state = nnx.state(setup.model)
    nnx.replace_by_pure_dict(state, values)
    nnx.update(setup.model, state)
    return step
