"""The step guard (DESIGN.md, "Training, checkpoints, runs"): no non-finite step is applied or saved.

`updated_params`, `step_ok` and `apply_if_ok` run inside the jitted step (core/train/step.py): a
step whose total loss, gradient norm or would-be updated parameters are non-finite returns the old
state unchanged. The test comes before the update, so the step holds no second copy of the state.
`check_finite` repeats the same test on the host, on metrics the run loop fetches anyway (no extra
device sync), and raises `DivergenceError`, which stops the run.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from core.errors import DivergenceError


def _not_bad(x, abort_on_nan: bool, abort_on_inf: bool):
    import jax.numpy as jnp

    if abort_on_nan and abort_on_inf:  # one reduction per array instead of two: a kernel less each to compile
        return jnp.all(jnp.isfinite(x))
    bad = jnp.zeros((), bool)
    if abort_on_nan:
        bad |= jnp.any(jnp.isnan(x))
    if abort_on_inf:
        bad |= jnp.any(jnp.isinf(x))
    return ~bad


def updated_params(model, optimizer, grads):
    """Jit-safe: the parameter arrays `optimizer.update(model, grads)` would write (a pure tree keyed
    like `nnx.state(model, optimizer.wrt)`), computed the way it computes them; nothing is written."""
    import optax
    from flax import nnx

    params = nnx.as_pure(nnx.state(model, optimizer.wrt))
    updates, _ = optimizer.tx.update(nnx.as_pure(nnx.state(grads, optimizer.wrt)), nnx.as_pure(optimizer.opt_state),
                                     params)
    return optax.apply_updates(params, updates)


def step_ok(total, grad_norm, new_params, trained: Callable[[tuple], bool], *, abort_on_nan: bool,
            abort_on_inf: bool):
    """Jit-safe: (ok, params_ok). ok is False when an enabled check finds the total loss, the gradient
    norm or a trained parameter of `new_params` (`updated_params`: what the update would write) NaN /
    infinite (a finite loss can still overflow the update); params_ok (float32 1/0, reported as the
    `params_finite` metric) covers the parameters alone. `trained(path)` picks the parameters the
    step trains (the frozen ones do not move)."""
    import jax
    import jax.numpy as jnp

    flags = dict(abort_on_nan=abort_on_nan, abort_on_inf=abort_on_inf)
    loss_ok = _not_bad(jnp.stack([jnp.asarray(total, jnp.float32), jnp.asarray(grad_norm, jnp.float32)]), **flags)
    params_ok = jnp.array(True)
    for path, leaf in jax.tree_util.tree_leaves_with_path(new_params):
        if trained(path):  # core.train.step.config_matcher: it names jax key paths as `tree.join` does
            params_ok &= _not_bad(leaf, **flags)
    return loss_ok & params_ok, params_ok.astype(jnp.float32)


def apply_if_ok(ok, apply: Callable[[Any], Any], state, platform: str):
    """Jit-safe: `apply(state)` where `ok`, else `state`'s values unchanged. `ok` must come from
    `step_ok` on `updated_params`, i.e. before the update, so that the update can write the donated
    state in place and the step holds one copy of the parameters and optimizer state, as without the
    guard. How, per compiler (measured in docs/planning.md#the-step-guards-memory):

    - "cpu": one `lax.cond` with the update inside its taken branch (fewer temporaries than a
      `where` per array, and a faster compile);
    - elsewhere: a `where` per array, which XLA:GPU fuses into the update (temporaries as without
      the guard; the `lax.cond` form makes XLA:GPU copy the state into the conditional).

    Testing the updated parameters after the update instead (the guard before) held the updated and
    the kept state at once.
    """
    import jax
    import jax.numpy as jnp

    if platform == "cpu":
        return jax.lax.cond(ok, apply, lambda unchanged: unchanged, state)
    kept = jax.tree.map(lambda v: v, state)  # a snapshot (new Variables): `apply` may update state's in place
    return jax.tree.map(lambda new, old: jnp.where(ok, new, old), apply(state), kept)


def check_finite(step: int, metrics: Mapping[str, float], cfg, last_checkpoint: int | None) -> None:
    """Host side of `step_ok` on the fetched metrics; raises DivergenceError naming step and cause."""
    bad = [f"{k} is {metrics[k]}" for k in ("total_loss", "grad_norm")
           if (cfg.abort_on_nan_loss and math.isnan(metrics[k])) or (cfg.abort_on_inf_loss and math.isinf(metrics[k]))]
    if metrics.get("params_finite", 1.0) != 1.0:
        bad.append("the updated parameters are not finite")
    if not bad:
        return
    causes = [f"learning_rate={cfg.learning_rate:g} too high"]
    if cfg.gradient_clipping_threshold <= 0:
        causes.append("gradient clipping off (gradient_clipping_threshold=0)")
    if "bfloat16" in (cfg.dtype, cfg.weight_dtype):
        causes.append("bfloat16 overflow (dtype/weight_dtype=bfloat16)")
    kept = (f"the latest good checkpoint (step {last_checkpoint}) is kept" if last_checkpoint is not None
            else "no checkpoint was written yet")
    raise DivergenceError(f"step {step} diverged ({' and '.join(bad)}): the step was not applied and nothing "
                          f"non-finite was saved; likely cause: {', or '.join(causes)}; {kept}: fix the config and "
                          "rerun, or set abort_on_nan_loss=false / abort_on_inf_loss=false to train on regardless.")
