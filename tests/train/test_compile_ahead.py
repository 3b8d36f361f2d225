"""The train step compiled ahead of time beside the model build (core/train/program.py `compile_ahead`).

A run with `compile_ahead=true` must give bitwise the metrics of the jitted step it replaces, use
the executable it compiled (not a fallback that compiles again), and share it with a later run of
the same config in the process; an input the executable was not compiled for takes the jitted path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.conftest import resolved, tiny_config
from core.train import program
from core.train import step as ts
from core.data.batches import train_batches
from core.parallel.sharding import shard_batch, state_shardings
from core.train.materialise import build
from core.spec.resolve import data_spec, optimizer_spec
from core.train.optimizer import make_optimizer
from core.train.run import Trainer

# a learning rate no other test uses: this file's step is its own compile
OVERRIDES = ("learning_rate=7e-3", "dataset_type=synthetic", "jax_cache_dir=")
STEPS = 2


def _jitted_rows(cfg) -> list[dict[str, float]]:
    """Metrics of STEPS steps of the plain jitted step on a fresh build (the reference path)."""
    specs, mesh = resolved(cfg)
    setup = build(specs, mesh)
    graphdef, state = nnx.split((setup.model, setup.optimizer))
    # StepProgram.jit's jit outside its memo, as a new function: its own compile
    step = program.jit_step(ts.step_fn(specs, graphdef), specs.step.opt_level, mesh, state_shardings(state, mesh))
    data, rows = train_batches(data_spec(cfg), setup.batch_size), []
    for _ in range(STEPS):
        state, metrics = step(state, shard_batch(next(data), setup.mesh))
        rows.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return rows


def test_ahead_step_matches_the_jitted_step_and_is_shared(tmp_path):
    cfg = tiny_config("warmup", *OVERRIDES, steps=STEPS)
    assert cfg.compile_ahead and not program.has_specs(resolved(cfg)[0])
    trainer = Trainer(cfg, stage="warmup", run_dir=tmp_path / "a")
    rows = list(trainer.run())
    step = trainer._step_fn
    assert isinstance(step, program.AheadStep) and step.compiled is not None, "fell back to the jitted step"
    want = _jitted_rows(cfg)
    for got, ref in zip(rows, want, strict=True):
        for k in ts.METRIC_KEYS:
            assert got[k] == ref[k], f"{k}: ahead {got[k]!r} != jitted {ref[k]!r}"
    # a second run of the config in this process starts no thread and reuses the executable
    again = Trainer(cfg, stage="warmup", run_dir=tmp_path / "b")
    assert isinstance(again._step_fn, program.AheadStep) and again._step_fn.compiled is step.compiled
    assert [r["total_loss"] for r in again.run()] == [r["total_loss"] for r in rows]


def test_ahead_step_falls_back_on_other_inputs():
    jitted = jax.jit(lambda x, y: x * 2 + y)
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    step = program.AheadStep(jitted.lower(spec, spec).compile(), jitted)
    np.testing.assert_array_equal(step(jnp.ones(2), jnp.ones(2)), [3, 3])
    assert step.compiled is not None
    np.testing.assert_array_equal(step(jnp.ones(3), jnp.ones(3)), [3, 3, 3])  # another shape: the jitted step
    assert step.compiled is None


def test_one_optimizer_per_optimizer_spec():
    """`make_optimizer`: configs of equal optimizer specs share one optax object (part of the optimizer's
    graphdef, so of the program's memo key); run-only keys, and `steps` under a fixed schedule length, do not
    split it; a learning rate, or `steps` when it sets the schedule's length, does."""
    made = lambda cfg: make_optimizer(optimizer_spec(cfg))  # noqa: E731
    fixed = ("learning_rate_schedule_steps=50",)
    a = tiny_config(None, *fixed, steps=3)
    assert made(a) is made(tiny_config(None, *fixed, "checkpoint_period=2", "compile_ahead=false", steps=7))
    assert made(a) is not made(tiny_config(None, *fixed, "learning_rate=3e-3", steps=3))
    assert made(tiny_config(None, steps=3)) is not made(tiny_config(None, steps=7))
