"""The optimizer: global-norm clipping, then AdamW with its moments in their configured dtypes.

DESIGN.md, "Training"; docs/precision.md. AdamW updates the trained parameters in place, in their
storage dtype `weight_dtype` (float32: the master copy, which every use casts to `dtype`). The
moments are stored in `mu_dtype` / `nu_dtype` (MaxText's name for the first); each step computes
them and the update in float32 and rounds only what it stores. DeepSeek-V3 keeps both moments in
bfloat16; a bfloat16 second moment needs adam_b2 <= BF16_NU_MAX_B2 (core/config/validate.py).

Frozen parameters get `optax.set_to_zero()` inside one `optax.multi_transform`: no state, no
update. The state tree is optax.adamw's (chain of ScaleByAdamState, the weight decay's and the
schedule's), so checkpoints written before these keys restore unchanged.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from core.spec.resolve import OptimizerSpec
from core.train.step import learning_rate_schedule, path_matcher


def scale_by_adam(b1: float, b2: float, eps: float, mu_dtype, nu_dtype) -> optax.GradientTransformation:
    """optax.scale_by_adam with the second moment stored in `nu_dtype` too.

    optax keeps each step's new nu in the dtype of the state it was given (`cast_like`), so a
    bfloat16 nu made at init stays bfloat16; the arithmetic runs in float32 (the gradients' dtype).
    """
    inner = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype)

    def init(params):
        state = inner.init(params)
        return state._replace(nu=jax.tree.map(lambda v: v.astype(nu_dtype), state.nu))

    return optax.GradientTransformation(init, inner.update)


_MADE: dict[OptimizerSpec, optax.GradientTransformation] = {}
_MADE_LOCK = threading.Lock()  # the compile thread (core/train/program.py's compile_ahead) makes one too


def make_optimizer(spec: OptimizerSpec) -> optax.GradientTransformation:
    """The run's optimizer: `adamw` with `spec`'s settings, its learning-rate schedule and its
    trainable mask (core/train/step.py), one object per spec in a process: the transformation is
    part of the optimizer's graphdef, so equal specs give equal graphdefs and share one compiled step
    (core/train/program.py's `StepProgram`)."""
    with _MADE_LOCK:
        if spec not in _MADE:
            _MADE[spec] = adamw(spec, learning_rate_schedule(spec), path_matcher(spec.trainable, spec.frozen))
        return _MADE[spec]


def adamw(spec: OptimizerSpec, schedule: Callable[[Any], Any], trainable: Callable[[Sequence[Any]], bool]
          ) -> optax.GradientTransformation:
    """clip -> AdamW(schedule) for the leaves `trainable(path)` accepts, set_to_zero for the rest.

    Args:
      spec: the settings.
      schedule: step -> learning rate.
      trainable: a pytree key path -> trained?
    """
    train = [optax.clip_by_global_norm(spec.clip)] if spec.clip > 0 else []
    # nested as optax.adamw nests it, so the state tree (and a checkpoint's paths) is optax.adamw's
    adam = scale_by_adam(spec.b1, spec.b2, spec.eps, jnp.dtype(spec.mu_dtype), jnp.dtype(spec.nu_dtype))
    train.append(optax.chain(adam,
                             optax.add_decayed_weights(spec.weight_decay),
                             optax.scale_by_learning_rate(schedule)))

    def labels(params):
        return jax.tree_util.tree_map_with_path(lambda p, _: "train" if trainable(p) else "frozen", params)

    return optax.multi_transform({"train": optax.chain(*train), "frozen": optax.set_to_zero()}, labels)
