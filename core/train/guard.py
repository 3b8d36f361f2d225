"""Run safety (DESIGN.md, "Training, checkpoints, runs"): one writer per run directory, no
non-finite step applied or saved, resume checks against the saved config, write failures as one
typed error.

- `RunLock`: an exclusive `fcntl.flock` on `<run>/.lock`. The kernel drops it when the process
  exits, however it exits (kill -9 included), so a lock is never stale; the file itself stays.
- `updated_params`, `step_ok` and `apply_if_ok` run inside the jitted step: a step whose total
  loss, gradient norm or would-be updated parameters are non-finite returns the old state
  unchanged; the test comes before the update, so the step holds no second copy of the state. `check_finite` repeats the same test on the host
  on metrics the loop fetches anyway (no extra device sync) and raises `DivergenceError`.
- `optimizer_mismatch` and `schedule_notice` compare a resume with the saved config.
- `WriteGuard` turns OS errors of checkpoint (Orbax, possibly from its background thread),
  metrics, config and event writes into one `RunWriteError`, after removing the partial
  `*.orbax-checkpoint-tmp*` directory; `quiet_write_errors` keeps Orbax's and asyncio's logged
  tracebacks of that same failure off the terminal.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from core.errors import CheckpointError, DivergenceError, DsvError, RunWriteError

LOCK_FILE = ".lock"
MIB = 2**20
# Optimizer settings that change the optimizer state's tree (not only its values).
OPTIMIZER_STRUCTURE_KEYS = ("gradient_clipping_threshold", "trainable_parameters_mask")


# ----------------------------------------------------------------------------- one writer


class RunLock:
    """An exclusive OS lock on a run directory, held from `acquire` to `release` (or process exit)."""

    def __init__(self, run_dir: str | Path, command: str):
        self.run_dir, self.command = Path(run_dir), command
        self._file, self._created = None, False

    def acquire(self) -> "RunLock":
        """Create the run directory if needed and lock it.

        Raises:
          CheckpointError: another live process holds the lock (names its pid), or the directory
            cannot be created. Nothing in the directory is changed in either case.
        """
        path = self.run_dir / LOCK_FILE
        self._created = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            f = open(path, "a+")
        except OSError as e:
            raise CheckpointError(f"cannot use {str(self.run_dir)!r} as a run directory ({e.strerror or e}): "
                                  "choose a writable --output.") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise CheckpointError(f"run directory {str(self.run_dir)!r} is in use by process {holder}: wait for it "
                                  "to finish or stop it, or choose another --output.") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()} ({self.command})\n")
        f.flush()
        self._file = f
        return self

    def release(self, *, undo: bool = False) -> None:
        """Drop the lock; `undo` also removes the run directory if `acquire` created it and it holds
        nothing but the lock file (a command that failed before writing anything leaves no trace)."""
        if self._file is None:
            return
        if undo and self._created and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
            (self.run_dir / LOCK_FILE).unlink()
            self.run_dir.rmdir()
        self._file.close()  # closing the descriptor drops the flock
        self._file = None


def releases_lock_on_error(init: Callable[..., None]) -> Callable[..., None]:
    """Decorate an `__init__` that sets `self.lock`: a failing constructor releases the lock."""

    @functools.wraps(init)
    def wrapper(self, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            lock = getattr(self, "lock", None)
            if lock is not None:
                lock.release(undo=True)
            raise

    return wrapper


# ----------------------------------------------------------------------------- non-finite steps


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
    guard. How, per compiler (measured; docs/planning.md#the-step-guards-memory):

    - "cpu": one `lax.cond` with the update inside its taken branch (deepseek4-tiny's sparse step at
      1 x 256: 252.3 MB of temporaries, 353.0 with a `where` per array, whose compile also takes
      30 s against 20);
    - elsewhere: a `where` per array, which XLA:GPU fuses into the update (V4-Flash's sparse step on
      64 x H200, fsdp 64: 21.51 GiB of temporaries, as without the guard; the `lax.cond` form makes
      XLA:GPU copy the state into the conditional, 55.57 GiB).

    Testing the updated parameters after the update instead (the guard before) held the updated and
    the kept state at once: 42.08 GiB there.
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


# ----------------------------------------------------------------------------- resume checks


def _show(value: Any) -> str:
    return str(list(value)) if isinstance(value, (list, tuple)) else f"{value:g}" if isinstance(value, float) else str(value)


def optimizer_mismatch(error: CheckpointError, saved: Mapping[str, Any], cfg, run_dir: Path) -> CheckpointError:
    """A clearer error for an optimizer-state mismatch caused by an optimizer setting, else `error`.

    Args:
      error: the shape/presence error of the optimizer state (`RunCheckpointer.restore`).
      saved: the config the checkpoint was written with (its metadata, = the run's config.yml).
      cfg: this command's Config.
    """
    if "(optimizer state)" not in str(error):
        return error
    for key in OPTIMIZER_STRUCTURE_KEYS:
        if key not in saved:
            continue
        old, new = saved[key], getattr(cfg, key)
        differs = (old > 0) != (new > 0) if key == "gradient_clipping_threshold" else list(old) != list(new)
        if differs:
            return CheckpointError(
                f"{str(run_dir)!r} was trained with {key}={_show(old)} (its config.yml) but this command sets "
                f"{key}={_show(new)}, which changes the optimizer state: keep {key}={_show(old)} to resume, or "
                "start a new --output.")
    return error


def schedule_steps(cfg_or_dict: Any) -> int:
    """The learning-rate schedule's length: learning_rate_schedule_steps, or steps when it is -1."""
    get = cfg_or_dict.get if isinstance(cfg_or_dict, Mapping) else lambda k, d=None: getattr(cfg_or_dict, k, d)
    n = get("learning_rate_schedule_steps", -1)
    return int(n) if n is not None and n > 0 else int(get("steps"))


def schedule_notice(saved: Mapping[str, Any], cfg) -> str | None:
    """One line when a resume changes the schedule's length, else None."""
    old, new = schedule_steps(saved), schedule_steps(cfg)
    if old == new:
        return None
    return (f"the learning-rate schedule changes on resume: it spanned {old} steps and now spans {new} "
            f"(steps={cfg.steps}, learning_rate_schedule_steps={cfg.learning_rate_schedule_steps}); "
            f"set learning_rate_schedule_steps={old} to keep it.")


# ----------------------------------------------------------------------------- write failures

_ERRNO_PATTERNS = (
    (re.compile(r"os_error_code='(\d+)'"), None), (re.compile(r"\[Errno (\d+)\]"), None),
    (re.compile(r"No space left on device|RESOURCE_EXHAUSTED"), errno.ENOSPC),
    (re.compile(r"Permission denied|PERMISSION_DENIED"), errno.EACCES),
    (re.compile(r"Read-only file system"), errno.EROFS),
)


def os_error_code(exc: BaseException) -> int | None:
    """The errno behind an OSError or an Orbax/TensorStore error that wraps one (by its message)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        text = str(exc)
        for pattern, code in _ERRNO_PATTERNS:
            m = pattern.search(text)
            if m:
                return code if code is not None else int(m.group(1))
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


class WriteGuard:
    """Converts a run's write failures into one RunWriteError (exit 4) with the fix.

    Args:
      run_dir, checkpoints_dir: the run's directories.
      checkpoint_bytes: bytes of one checkpoint (model + optimizer arrays), for "free N MiB".
      latest_step: returns the latest complete checkpoint step (None: none yet).
      abandon: stops the checkpointer without raising (called before partial steps are removed).
    """

    def __init__(self, run_dir: Path, checkpoints_dir: Path, checkpoint_bytes: int,
                 latest_step: Callable[[], int | None], abandon: Callable[[], None]):
        self.run_dir, self.checkpoints_dir, self.checkpoint_bytes = run_dir, checkpoints_dir, checkpoint_bytes
        self.latest_step, self.abandon = latest_step, abandon

    def remove_partial_checkpoints(self) -> list[int]:
        """Delete Orbax's unfinished `<step>.orbax-checkpoint-tmp*` directories; returns their steps."""
        steps = []
        for p in sorted(self.checkpoints_dir.glob("*.orbax-checkpoint-tmp*")) if self.checkpoints_dir.is_dir() else []:
            shutil.rmtree(p, ignore_errors=True)
            head = p.name.split(".")[0]
            steps += [int(head)] if head.isdigit() else []
        return steps

    @contextlib.contextmanager
    def writing(self, what: str, path: Path, checkpoint_step: int | None = None) -> Iterator[None]:
        """Run a write; an OS-level failure becomes RunWriteError (other errors pass through).

        Args:
          what: "checkpoint", "metrics", "config", "TensorBoard events".
          path: the file or directory written.
          checkpoint_step: the step being saved (what == "checkpoint").
        """
        try:
            yield
        except DsvError:
            raise
        except Exception as e:
            code = os_error_code(e)
            if code is None:
                raise
            raise self.error(what, path, code, checkpoint_step) from None

    def error(self, what: str, path: Path, code: int, checkpoint_step: int | None) -> RunWriteError:
        with contextlib.suppress(Exception):
            self.abandon()
        partial = self.remove_partial_checkpoints()
        if what == "checkpoint":
            step = partial[0] if partial else checkpoint_step
            what, path = f"checkpoint step {step}", self.checkpoints_dir / str(step)
        latest = self.latest_step()
        resume = (f"rerun the same command to resume from checkpoint step {latest}" if latest is not None
                  else "rerun the same command to start again")
        if code == errno.ENOSPC:
            need = (self.checkpoint_bytes if what.startswith("checkpoint") else 0) + MIB
            fix = f"free {max(math.ceil((need - _free_bytes(path)) / MIB), 1)} MiB or point --output elsewhere"
        else:
            fix = "make it writable or point --output elsewhere"
        return RunWriteError(f"cannot write {what} to {str(path)!r}: {os.strerror(code)} [errno {code}]; "
                             f"{fix}; {resume}.")


class _DropWriteFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        text = record.getMessage() + (logging.Formatter().formatException(record.exc_info) if record.exc_info else "")
        return not any(pattern.search(text) for pattern, _ in _ERRNO_PATTERNS)


@contextlib.contextmanager
def quiet_write_errors() -> Iterator[None]:
    """Drop ERROR records about OS write failures from Orbax (absl) and asyncio while training:
    the same failure reaches the user once, as a RunWriteError."""
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    drop = _DropWriteFailures()
    for lg in loggers:
        lg.addFilter(drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(drop)


def tree_bytes(tree: Any) -> int:
    """Total bytes of the arrays in a pytree."""
    import jax

    return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))
