"""The remat choice (`remat_policy=auto`), the run's phase after preflight (core/train/preflight.py
`fit_remat`) and the planner's (core/plan/compile.py): on a TPU, the steps without layer remat, with
`projections` and with `experts` compiled in turn (core/train/program.py's `StepProgram`), the first that
fits a chip taken (its executable kept for the run), after a screen (`remat_worth_compiling`) that spares
a compile that cannot fit or changes nothing; on a GPU the same with `none` and `experts`; `full` where none
fits, and on a CPU (its `auto` is `full`: core/spec/platform.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from core.data.batches import BATCH_KEYS
from core.errors import resource_exhausted
from core.parallel.sharding import BATCH_AXES, abstract_state
from core.spec.resolve import Resolved, crosses_layers
from core.train import memory, program
from core.train.step import config_matcher, training_loss


def kept_bytes_per_row(specs: Resolved) -> int:
    """Bytes the backward keeps from the forward per batch row under `specs`' remat_policy.

    jax.vjp's residuals of the step's loss (core/train/step.py `training_loss`, gradients to the
    trainable parameters) traced abstractly (`jax.eval_shape`: nothing compiled or allocated) for one
    and for two rows of max_target_length tokens; the difference is one row's. What the backward reads
    besides (the parameters, their casts) is the same for both and cancels. It is the jaxpr's count:
    XLA keeps at most that (it may recompute a cheap elementwise result instead of keeping it).
    """
    cfg = specs.cfg
    model, _ = program.abstract_model_and_optimizer(specs)
    trainable = config_matcher(cfg)
    graphdef, params, rest = nnx.split(model, nnx.All(nnx.Param, lambda path, _: trainable(path)), ...)
    step = specs.step  # traced on the CPU

    def residuals(params, rest, batch):
        loss = lambda p: training_loss(step, nnx.merge(graphdef, p, rest), batch)[0]  # noqa: E731
        return jax.vjp(loss, params)[1]

    def kept(rows: int) -> int:
        row = jax.ShapeDtypeStruct((rows, cfg.max_target_length), jnp.int32)
        out = jax.eval_shape(residuals, params, rest, {k: row for k in BATCH_KEYS})
        return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(out))

    return kept(2) - kept(1)


# About the largest share of `kept_bytes_per_row` that XLA:TPU kept in the steps without layer remat
# measured (docs/benchmarks.md#why-the-defaults; far less where the layers are not scanned). Under
# `projections` and `experts` the policy names what is kept, and XLA keeps it.
KEPT_SHARE_SCREEN = {"none": 0.6, "projections": 1.0, "experts": 1.0}
# The policies whose screen counts the parameters' gradient too: what they name is kept through the whole
# backward, at whose end every gradient is live beside it. `none`'s share is a measured fraction of the
# peak, gradient included (`$S` without remat fits one chip; its screen with the gradient would not).
SCREEN_WITH_GRADIENT = ("projections", "experts")
REMAT_TRIALS = ("none", "projections", "experts")  # auto's candidates on a TPU, fastest first; `full` needs no compile
# a GPU's: `projections` offloads the layer inputs to the host, whose link the step-time model does not price
GPU_REMAT_TRIALS = ("none", "experts")


def offloaded_bytes_per_row(cfg) -> int:
    """Bytes per batch row of the layers' inputs [T, n, M] in the compute dtype, which `projections`
    keeps in host memory on a TPU (core.model.transformer.remat_policy), not on the device."""
    width = cfg.max_target_length * cfg.mhc_expansion_rate * cfg.emb * jnp.dtype(cfg.dtype).itemsize
    return cfg.num_layers * width


def screen_bytes(specs: Resolved, mesh_axes) -> int:
    """The screen's figure of one device's bytes for the step of `specs`' remat_policy (one of
    REMAT_TRIALS) on an abstract mesh of `mesh_axes`: the parameters and AdamW's moments
    (`state_bytes_needed`), the trainable parameters' gradient in their dtype where the policy is one
    of SCREEN_WITH_GRADIENT, plus KEPT_SHARE_SCREEN of what the backward keeps on the device for the
    rows a device holds (`kept_bytes_per_row`, less `offloaded_bytes_per_row` under `projections`).
    Under the named policies a lower bound of the compiled step's total (tests/train/test_remat_auto.py)."""
    cfg = specs.cfg
    names = tuple(mesh_axes)
    mesh = AbstractMesh(tuple(mesh_axes[n] for n in names), names, axis_types=(AxisType.Auto,) * len(names))
    model, _ = program.abstract_model_and_optimizer(specs)
    state = abstract_state(nnx.state(model), mesh)
    trainable = config_matcher(cfg)
    need = memory.state_bytes_needed(state, trainable, cfg.mu_dtype, cfg.nu_dtype)
    if cfg.remat_policy in SCREEN_WITH_GRADIENT:
        need += sum(memory.state_bytes_per_device(leaf.get_value()) for path, leaf in nnx.to_flat_state(state)
                    if isinstance(leaf, nnx.Param) and trainable(path))
    shards = math.prod(mesh_axes.get(a, 1) for a in BATCH_AXES)
    rows = cfg.per_device_batch_size * math.prod(mesh_axes.values()) // max(shards, 1)  # a device's batch shard
    kept = kept_bytes_per_row(specs)  # traced here on the CPU, where nothing is offloaded
    if cfg.remat_policy == "projections":
        kept -= offloaded_bytes_per_row(cfg)
    return int(need + KEPT_SHARE_SCREEN[cfg.remat_policy] * rows * kept)


def remat_worth_compiling(specs: Resolved, mesh_axes, usable_bytes: int) -> bool:
    """Whether the step of `specs`' remat_policy (one of REMAT_TRIALS) may fit one device of
    `usable_bytes`, before compiling it: False where no gradient crosses the layers (the warm-up:
    layer remat changes nothing, `core.spec.resolve.crosses_layers`), else whether `screen_bytes` fit.
    A screen, not the verdict: XLA:TPU recomputes what it must to fit its limit by itself, so the
    compile decides (`remat_that_fits`); the screen spares a compile that cannot fit (V4-Flash's 43
    layers at full size without remat, or with `projections` on v5p-128) or would change nothing."""
    if not crosses_layers(specs.cfg):
        return False
    return screen_bytes(specs, mesh_axes) <= usable_bytes


def remat_candidates(asked: str, specs: Resolved, mesh_axes, usable_bytes: int | None) -> tuple[str, ...]:
    """The remat policies compiled in turn for `asked` (the remat_policy the command's config asked for,
    before `resolve`; `specs`, after it), fastest first, before `specs`' `full`: REMAT_TRIALS (a GPU's
    GPU_REMAT_TRIALS) past `remat_worth_compiling` where `asked` is `auto` and the platform is a TPU or a
    GPU of known memory; none elsewhere (a CPU's `auto` is `full`: core/spec/platform.py). The run
    (`remat_that_fits`) and `dsv4 plan` (core/plan/compile.py) ask this one question."""
    if not (asked == "auto" and specs.cfg.remat_policy == "full" and specs.platform in ("tpu", "gpu")
            and usable_bytes is not None):
        return ()
    return tuple(p for p in (REMAT_TRIALS if specs.platform == "tpu" else GPU_REMAT_TRIALS)
                 if remat_worth_compiling(specs.replace(remat_policy=p), mesh_axes, usable_bytes))


def fitting_remat(specs: Resolved, mesh, usable_bytes: int, candidates) -> Resolved:
    """`specs` with the first remat policy of `candidates` whose step compiles within `usable_bytes` per
    device on `mesh` (its executable kept for the run: `StepProgram.compile`'s memo), else `specs`
    themselves. A compile XLA refuses for memory, or whose memory analysis exceeds `usable_bytes`, is
    passed over (and not kept); any other compile error is raised."""
    for policy in candidates:
        trial = specs.replace(remat_policy=policy)
        step, inputs = program.abstract_program(trial, mesh)
        try:
            compiled = step.compile(inputs.state, inputs.batch)
        except Exception as e:  # noqa: BLE001  (XLA:TPU refuses a program over its limit at compile)
            if resource_exhausted(e) is None:
                raise
            continue
        if memory.compiled_memory(compiled)["total_bytes"] <= usable_bytes:
            return trial
        step.forget()
    return specs


def remat_that_fits(asked: str, specs: Resolved, mesh, usable_bytes: int | None = None) -> Resolved:
    """Phase: the specs a run that asked for remat_policy `asked` (before `resolve`) trains with on
    `mesh`: `specs` (resolved: `remat_policy=auto` is `full` there) or, on a TPU, the first of `remat_candidates`
    (`none`, `projections`, then `experts`) whose step compiles within `usable_bytes` per device
    (`fitting_remat`). Without layer remat the backward runs no layer's forward again, and XLA:TPU
    recomputes by itself what it must to fit its limit; `projections` recomputes the elementwise work
    alone, `experts` the attention but none of the MoE's matmuls. A compile that
    fits is kept for the run, so the run does not compile again.

    Args:
      mesh: a `jax.sharding.Mesh` of the run's devices, or of the planner's target's (an ahead-of-time
        topology); usable_bytes: one device's memory, by default this process's first device's
        (`core.train.memory.device_memory_bytes`; unknown: `specs` are kept).
    """
    if usable_bytes is None:
        usable_bytes = memory.device_memory_bytes(jax.local_devices()[0])[0]
    candidates = remat_candidates(asked, specs, dict(mesh.shape), usable_bytes)
    return fitting_remat(specs, mesh, usable_bytes, candidates) if candidates else specs
