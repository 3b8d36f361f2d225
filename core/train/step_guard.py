"""The step guard (DESIGN.md, "Training, checkpoints, runs"): no non-finite state is applied or saved.

Inside the jitted step (core/train/step.py): `loss_ok` tests the total loss and the gradient norm,
known before the update, and `apply_if_ok` applies the update only where they are finite, so a
step with a NaN or infinite loss or gradient returns its input state bit for bit while the update
still writes the donated state in place (one copy of it). A finite loss and gradient can still
overflow the update (a huge learning rate); `params_ok` tests the trained parameters the step
returns (on a TPU with their moments: XLA:TPU then fuses those reductions into the one pass that
writes them all), and reports it as the `params_finite` metric. `check_finite` reads the same
flags on the host, from metrics the run loop fetches anyway (no extra device sync), and raises
`DivergenceError`, which stops the run before that step or any later one is saved. Why the
parameters are tested after the update rather than before it: docs/run-safety.md#divergence.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from core.errors import DivergenceError


def _not_bad(x, abort_on_nan: bool, abort_on_inf: bool):
    if abort_on_nan and abort_on_inf:  # one reduction per array instead of two: a kernel less each to compile
        return jnp.all(jnp.isfinite(x))
    bad = jnp.zeros((), bool)
    if abort_on_nan:
        bad |= jnp.any(jnp.isnan(x))
    if abort_on_inf:
        bad |= jnp.any(jnp.isinf(x))
    return ~bad


def loss_ok(total, grad_norm, *, abort_on_nan: bool, abort_on_inf: bool):
    """Jit-safe: False when an enabled check finds the total loss or the gradient norm NaN / infinite.
    Known before the update, so `apply_if_ok` can keep the state without a second copy of it."""
    pair = jnp.stack([jnp.asarray(total, jnp.float32), jnp.asarray(grad_norm, jnp.float32)])
    return _not_bad(pair, abort_on_nan=abort_on_nan, abort_on_inf=abort_on_inf)


def params_ok(params, trained: Callable[[tuple], bool], opt_state=None, *, abort_on_nan: bool, abort_on_inf: bool):
    """Jit-safe: float32 1/0, the `params_finite` metric: 0 when an enabled check finds a trained
    parameter of `params` (the state the step returns) or a floating-point leaf of `opt_state` (its
    moments) NaN / infinite. A finite loss and gradient can still overflow the update, but hardly the
    moments (each is at most the largest of its last value and the gradient or its square, up to
    rounding, all finite when the gradient norm is), so testing them is for the compiler: it is how
    XLA:TPU writes each array's update and its tests in one pass, where a test of the parameters
    alone splits off a second pass writing the moments. The step passes them on a TPU only (on a CPU
    the `lax.cond` form would read them once more; docs/run-safety.md#divergence)."""
    ok = jnp.array(True)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if trained(path):  # core.train.step.config_matcher: it names jax key paths as `tree.join` does
            ok &= _not_bad(leaf, abort_on_nan=abort_on_nan, abort_on_inf=abort_on_inf)
    for leaf in jax.tree.leaves(opt_state):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            ok &= _not_bad(leaf, abort_on_nan=abort_on_nan, abort_on_inf=abort_on_inf)
    return ok.astype(jnp.float32)


def apply_if_ok(ok, apply: Callable[[Any], Any], state, platform: str, written_ok: Callable[[Any], Any]):
    """Jit-safe: (`apply(state)` where `ok`, else `state`'s values unchanged; `written_ok` of the
    applied state, float32 1 where not applied). `ok` (`loss_ok`) is known before the update, so the
    update can write the donated state in place and the step holds one copy of the parameters and
    optimizer state, as without the guard. How, per compiler (measured in
    docs/planning.md#the-step-guards-memory):

    - "cpu": one `lax.cond` with the update and `written_ok` inside its taken branch (fewer
      temporaries than a `where` per array, and a faster compile; `written_ok` after the
      conditional would read its whole output once more);
    - elsewhere: a `where` per array, which XLA:GPU and XLA:TPU fuse into the update, and
      `written_ok` of the result, which XLA:TPU fuses into the pass that writes the parameters
      (temporaries as without the guard; the `lax.cond` form makes XLA:GPU copy the state into the
      conditional). Where not applied, the result is the kept state, whose parameters are finite.
    """
    if platform == "cpu":
        def applied(state):
            new = apply(state)
            return new, written_ok(new)

        return jax.lax.cond(ok, applied, lambda unchanged: (unchanged, jnp.ones((), jnp.float32)), state)
    kept = jax.tree.map(lambda v: v, state)  # a snapshot (new Variables): `apply` may update state's in place
    new = jax.tree.map(lambda new, old: jnp.where(ok, new, old), apply(state), kept)
    return new, written_ok(new)


@dataclasses.dataclass(frozen=True)
class Guard:
    """The host check's settings: which non-finite values stop the run, and the config keys its
    message names as likely causes."""

    abort_on_nan: bool          # abort_on_nan_loss
    abort_on_inf: bool          # abort_on_inf_loss
    learning_rate: float
    clipping: float             # gradient_clipping_threshold; <= 0 off
    dtypes: tuple[str, str]     # (dtype, weight_dtype)


def check_finite(step: int, metrics: Mapping[str, float], guard: Guard, last_checkpoint: int | None) -> None:
    """Host side of `loss_ok` and `params_ok` on the fetched metrics; raises DivergenceError naming step and cause."""
    bad = [f"{k} is {metrics[k]}" for k in ("total_loss", "grad_norm")
           if (guard.abort_on_nan and math.isnan(metrics[k])) or (guard.abort_on_inf and math.isinf(metrics[k]))]
    if metrics.get("params_finite", 1.0) != 1.0:
        bad.append("the updated parameters or moments are not finite")
    if not bad:
        return
    causes = [f"learning_rate={guard.learning_rate:g} too high"]
    if guard.clipping <= 0:
        causes.append("gradient clipping off (gradient_clipping_threshold=0)")
    if "bfloat16" in guard.dtypes:
        causes.append("bfloat16 overflow (dtype/weight_dtype=bfloat16)")
    kept = (f"the latest good checkpoint (step {last_checkpoint}) is kept" if last_checkpoint is not None
            else "no checkpoint was written yet")
    raise DivergenceError(f"step {step} diverged ({' and '.join(bad)}): neither it nor anything "
                          f"non-finite was saved; likely cause: {', or '.join(causes)}; {kept}: fix the config and "
                          "rerun, or set abort_on_nan_loss=false / abort_on_inf_loss=false to train on regardless.")
