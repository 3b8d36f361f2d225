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

import dataclasses
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from core.train.step import compile_key, config_matcher, learning_rate_schedule


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


@dataclasses.dataclass(frozen=True)
class AdamW:
    """AdamW's settings, each the config key named beside it."""

    clip: float          # gradient_clipping_threshold: the global norm gradients are clipped to; <= 0 off
    b1: float            # adam_b1
    b2: float            # adam_b2
    eps: float           # adam_eps
    weight_decay: float  # adam_weight_decay (decoupled)
    mu_dtype: str        # mu_dtype: the first moment's storage dtype
    nu_dtype: str        # nu_dtype: the second moment's storage dtype


def adamw_spec(cfg) -> AdamW:
    """The config's `AdamW`."""
    return AdamW(cfg.gradient_clipping_threshold, cfg.adam_b1, cfg.adam_b2, cfg.adam_eps, cfg.adam_weight_decay,
                 cfg.mu_dtype, cfg.nu_dtype)


def from_config(cfg) -> optax.GradientTransformation:
    """The run's optimizer: `adamw` with the config's settings, its learning-rate schedule and its
    trainable mask (core/train/step.py). A new object each call: a run takes it through
    `make_optimizer`, one per compiled step."""
    return adamw(adamw_spec(cfg), learning_rate_schedule(cfg), config_matcher(cfg))


_MADE: dict[tuple, optax.GradientTransformation] = {}
_MADE_LOCK = threading.Lock()  # the compile thread (core/train/program.py's compile_ahead) makes one too


def make_optimizer(cfg) -> optax.GradientTransformation:
    """`from_config`, one object per compile-relevant config (core/train/step.py's `compile_key`) in a
    process: the transformation is part of the optimizer's graphdef, so equal configs give equal
    graphdefs and share one compiled step (core/train/program.py's `StepProgram`)."""
    key = compile_key(cfg)
    with _MADE_LOCK:
        if key not in _MADE:
            _MADE[key] = from_config(cfg)
        return _MADE[key]


def adamw(spec: AdamW, schedule: Callable[[Any], Any], trainable: Callable[[Sequence[Any]], bool]
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
