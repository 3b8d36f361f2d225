"""The background-compiled train step is the jit's own program: same step, same results."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import train
from core.data import train_batches
from core.precompile import StepPrecompile
from core.sharding import shard_batch
from tests.conftest import tiny_config


def test_precompiled_step_equals_the_jit():
    """Compiled from abstract state in a thread, it is the very program (StableHLO text, shardings and
    donation included) the jit lowers from the built state, and runs on it; a state of another
    structure gets the plain jit instead."""
    cfg = tiny_config("sparse", "dataset_type=synthetic", "per_device_batch_size=1", steps=2)
    mesh = train.make_mesh(cfg)
    pre = StepPrecompile(cfg, mesh)  # compiles while the model is built below
    setup = train.build(cfg)
    graphdef, state = nnx.split((setup.model, setup.optimizer))
    step = pre.step(graphdef, state)
    assert pre.error is None
    assert isinstance(step, jax.stages.Compiled), "the concrete state did not match the precompiled one"
    batch = shard_batch(next(train_batches(cfg, setup.batch_size)), setup.mesh)
    # the program the jit would compile at step 0 from the built state is the one compiled
    jitted = train.make_train_step(cfg, graphdef, state, mesh)
    assert jitted.lower(state, batch).as_text() == pre.lowered.as_text()
    new_state, metrics = step(state, batch)  # and it runs on the built state
    assert np.isfinite(float(metrics["total_loss"]))
    other = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, new_state)
    assert not isinstance(pre.step(graphdef, other), jax.stages.Compiled)  # not what was compiled: the jit
