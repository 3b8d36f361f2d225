"""Resume checks (DESIGN.md, "Training, checkpoints, runs"): what a resumed run's config may change.

`optimizer_mismatch` turns an optimizer-state mismatch that an optimizer setting caused into a
message naming that setting. `resume_notices` are the changes a resume makes and says: the
learning-rate schedule's length (`core.spec.resolve.schedule_steps`), and a stored dtype (the
checkpoint's parameters and moments are converted to this command's dtypes as they are restored;
docs/precision.md#resume). Both compare two configs as plain dicts: the checkpoint's (its metadata,
= the run's config.yml) and this command's (`Config.to_dict`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import jax.numpy as jnp

from core.errors import CheckpointError
from core.spec.resolve import schedule_steps

# Optimizer settings that change the optimizer state's tree (not only its values).
OPTIMIZER_STRUCTURE_KEYS = ("gradient_clipping_threshold", "trainable_parameters_mask")
# The state's storage dtypes (docs/precision.md#the-keys): a resume converts the checkpoint to them.
STORAGE_DTYPE_KEYS = ("weight_dtype", "frozen_weight_dtype", "mu_dtype", "nu_dtype")


def _show(value: Any) -> str:
    return str(list(value)) if isinstance(value, (list, tuple)) else f"{value:g}" if isinstance(value, float) else str(value)


def optimizer_mismatch(error: CheckpointError, saved: Mapping[str, Any], current: Mapping[str, Any],
                       run_dir: Path) -> CheckpointError:
    """A clearer error for an optimizer-state mismatch caused by an optimizer setting, else `error`.

    Args:
      error: the shape/presence error of the optimizer state (`core.checkpoint.store.check_compatible`).
      saved: the config the checkpoint was written with (its metadata, = the run's config.yml).
      current: this command's config (`Config.to_dict`).
    """
    if "(optimizer state)" not in str(error):
        return error
    for key in OPTIMIZER_STRUCTURE_KEYS:
        if key not in saved:
            continue
        old, new = saved[key], current[key]
        differs = (old > 0) != (new > 0) if key == "gradient_clipping_threshold" else list(old) != list(new)
        if differs:
            return CheckpointError(
                f"{str(run_dir)!r} was trained with {key}={_show(old)} (its config.yml) but this command sets "
                f"{key}={_show(new)}, which changes the optimizer state: keep {key}={_show(old)} to resume, or "
                "start a new --output.")
    return error


def resume_notices(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The one-line notices of what this resume changes (empty when nothing), `current` the command's
    config as `Config.to_dict` gives it."""
    return [n for n in (schedule_notice(saved, current), dtype_notice(saved, current)) if n]


def dtype_notice(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """One line when a resume changes a stored dtype, else None. The restore converts the saved
    arrays: widening is exact, narrowing rounds each value once (the user asked for it by the key)."""
    changed = [(k, saved[k], current[k]) for k in STORAGE_DTYPE_KEYS if k in saved and saved[k] != current[k]]
    if not changed:
        return None

    each = ", ".join(f"{k} {old} -> {new} ({'rounded' if jnp.dtype(new).itemsize < jnp.dtype(old).itemsize else 'exact'})"
                     for k, old, new in changed)
    keep = " ".join(f"{k}={old}" for k, old, _ in changed)
    return f"the stored dtypes change on resume, the checkpoint's values converted: {each}; set {keep} to keep them."


def schedule_notice(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """One line when a resume changes the schedule's length, else None."""
    old, new = schedule_steps(saved), schedule_steps(current)
    if old == new:
        return None
    return (f"the learning-rate schedule changes on resume: it spanned {old} steps and now spans {new} "
            f"(steps={current['steps']}, learning_rate_schedule_steps={current['learning_rate_schedule_steps']}); "
            f"set learning_rate_schedule_steps={old} to keep it.")
