"""The training step's maths: losses, the learning-rate schedule, the trainable mask, router-bias
updates (its jit, caches and ahead-of-time compile are core/train/program.py's; the AdamW it applies
is core/train/optimizer.py's).

DESIGN.md's stage table (the row `core.spec.resolve.StepSpec` carries) decides what a step computes:
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
bias (an `nnx.BatchStat`) moves by `routed_bias_update_rate` towards balance, unless that router is frozen
(neither its weight nor its bias matches the mask: the warm-up's '.*indexer.*' freezes them all).

A step whose total loss or gradient norm is non-finite is not applied, and one whose updated
parameters are non-finite is flagged (core/train/step_guard.py); the run loop in core/train/run.py
then stops before saving either.

Deviation from MaxText's schedule: the linear warm-up starts at peak / warmup_steps instead of 0,
so step 0 already trains.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from core import tree
from core.errors import ConfigError
from core.loss.lm import lm_loss_from_hidden
from core.model.params import mask_matcher
from core.spec.resolve import OptimizerSpec, Specs, StepSpec
from core.train import step_guard
from core.train.handoff import is_indexer

# moe_dropped: the fraction of routed (token, expert) slots that expert parallelism's capacity
# (moe_capacity_factor) dropped, mean over layers; exactly 0 when drop-free (the default)
METRIC_KEYS = ("total_loss", "lm_loss", "indexer_loss", "moe_lb_loss", "moe_dropped", "grad_norm", "learning_rate")


# ----------------------------------------------------------------------------- losses and schedule


def learning_rate_schedule(spec: OptimizerSpec) -> Callable[[Any], Any]:
    """lr(step): linear from peak/W to peak over W = round(warmup_fraction * N) steps, then cosine
    from peak to peak * final_fraction at step N - 1, constant after; N = spec.schedule_steps
    (core.spec.resolve.schedule_steps)."""
    peak, final = spec.learning_rate, spec.learning_rate * spec.final_fraction
    n = spec.schedule_steps
    warm = int(round(spec.warmup_fraction * n))
    decay = max(n - 1 - warm, 1)

    def lr(step):
        step = jnp.asarray(step, jnp.float32)
        warm_lr = peak * (step + 1) / max(warm, 1)
        frac = jnp.clip((step - warm) / decay, 0.0, 1.0)
        cos_lr = final + 0.5 * (peak - final) * (1 + jnp.cos(jnp.pi * frac))
        return jnp.where(step < warm, warm_lr, cos_lr)

    return lr


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


def check_masks(spec: StepSpec, model) -> dict[str, bool]:
    """`trainable_labels` of `model` (concrete or `nnx.eval_shape`) under the step's masks, and
    ConfigError when they train the indexer in a stage-table row that does not
    (`Stage.trains_indexer`: pre-training, where no loss reaches it)."""
    labels = trainable_labels(model, spec.optimizer.trainable, spec.optimizer.frozen)
    if not spec.stage.trains_indexer and any(v for p, v in labels.items() if is_indexer(p)):
        raise ConfigError("dense_pretraining=true leaves the indexer idle, yet the masks train its parameters "
                          "(weight decay alone would move them): add '.*indexer.*' to frozen_parameters_mask.")
    return labels


# ----------------------------------------------------------------------------- the step


def training_loss(spec: StepSpec, model, batch):
    """The step's loss of `model` on `batch`: (total, (lm_loss, the model's aux)); lm_loss is 0.0 in a
    stage-table row without one (the warm-up: the model returns no hidden states for the head)."""
    h, aux = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"], mode="train")
    lm = (lm_loss_from_hidden(h, model.head[...].astype(model.dtype), batch["targets"], batch["loss_mask"],
                              chunk=spec.lm_loss_chunk) if spec.stage.lm_loss else jnp.zeros((), jnp.float32))
    return lm + aux["indexer_loss"] + aux["moe_lb_loss"], (lm, aux)


def step_fn(specs: Specs, graphdef):
    """The train step `(state, batch) -> (state, metrics)` (module docstring) of `specs` (core.spec.resolve),
    traced for their platform's compiler (the mesh's devices), which picks how the non-finite guard keeps
    the state (core/train/step_guard.py `apply_if_ok`)."""
    spec, backend = specs.step, specs.platform
    trainable = path_matcher(spec.optimizer.trainable, spec.optimizer.frozen)
    grad_filter = nnx.All(nnx.Param, lambda path, _: trainable(path))
    frozen_filter = nnx.All(nnx.Param, nnx.Not(grad_filter))
    # A router bias moves unless its router is frozen: neither it nor the router weight is trainable.
    fixed_bias = nnx.All(nnx.BatchStat, lambda path, _: not (trainable(path) or trainable((*path[:-1], "weight"))))
    schedule, rate = learning_rate_schedule(spec.optimizer), spec.bias_update_rate
    guard = spec.abort_on_nan or spec.abort_on_inf

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        grad_fn = nnx.value_and_grad(lambda model: training_loss(spec, model, batch),
                                     argnums=nnx.DiffState(0, grad_filter), has_aux=True)
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
        # a step whose loss or gradient norm is non-finite is not applied (known before the update, so
        # the update still writes the state in place); a finite one whose update overflows is flagged
        # from what it wrote. The host sees the same metrics and stops before saving either.
        flags = dict(abort_on_nan=spec.abort_on_nan, abort_on_inf=spec.abort_on_inf)
        ok = step_guard.loss_ok(total, metrics["grad_norm"], **flags)

        def written_ok(state):  # the trained parameters (and on a TPU their moments) of a state the step returns
            new_model, new_optimizer = nnx.merge(graphdef, state)
            moments = None if backend != "tpu" else nnx.as_pure(nnx.state(new_optimizer, nnx.OptState))
            return step_guard.params_ok(nnx.as_pure(nnx.state(new_model, nnx.Param)), trainable, moments, **flags)

        new_state, metrics["params_finite"] = step_guard.apply_if_ok(ok, apply, state, backend, written_ok)
        return new_state, metrics

    return step
