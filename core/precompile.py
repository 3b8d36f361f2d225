"""Compile the train step ahead of time, in a thread, while the model is being built.

Time to step 0 on a CPU is model building (eager initialisers, one small XLA program per
parameter shape, one core) followed by the step's compile (XLA, mostly one core). Neither needs
the other's result: the step compiles from abstract state (shapes, dtypes, the rule-given
shardings, nothing allocated), so `StepPrecompile` starts it in a background thread before
`build(cfg)` and the first step waits only for whichever finishes last. XLA's compile releases
the GIL, so on two cores the two overlap.

The compiled program is `core.train.make_train_step`'s own jit, lowered from
`core.sharding.abstract_state` of the (model, optimizer) and the batch sharding, i.e. exactly the
program the jit would compile at step 0 from the concrete state. `StepPrecompile.step` returns
it, or the plain jit (compiling at step 0 as before) when the background compile failed or the
concrete state does not match what was compiled (a structure the abstract build cannot foresee).
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class StepPrecompile:
    """`make_train_step(cfg, ...)` lowered and compiled in a background thread.

    Usage (core/train.py's Trainer): `pre = StepPrecompile(cfg, mesh)` before `build(cfg)`;
    after splitting the built (model, optimizer): `step_fn = pre.step(graphdef, state)`.
    """

    def __init__(self, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh
        self._compiled: Any = None
        self._graphdef: Any = None
        self._state: Any = None  # the abstract state it was compiled for
        self.lowered: Any = None  # the jax.stages.Lowered program that was compiled
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dsv4-precompile", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._graphdef, self._state, self.lowered = lower_abstract_step(self.cfg, self.mesh)
            self._compiled = self.lowered.compile()
        except BaseException as e:  # reported by `step`, which falls back to the jit
            self.error = e

    def step(self, graphdef, state) -> Callable:
        """The compiled step if it fits (graphdef, state); else the jit of `make_train_step`."""
        import jax

        from core.train import make_train_step

        self._thread.join()
        jitted = make_train_step(self.cfg, graphdef, state, self.mesh)
        if self._compiled is None or graphdef != self._graphdef:
            return jitted
        key = lambda x: (x.shape, x.dtype, x.sharding)  # noqa: E731
        want, have = jax.tree.map(key, self._state), jax.tree.map(key, state)
        return self._compiled if jax.tree.structure(want) == jax.tree.structure(have) and \
            jax.tree.leaves(want) == jax.tree.leaves(have) else jitted


def lower_abstract_step(cfg, mesh):
    """(graphdef, abstract state, lowered step) of cfg's (model, optimizer) from abstract state on `mesh`.

    Shapes: state as `abstract_state` (ShapeDtypeStructs with NamedShardings), batch
    int32 [per_device_batch_size * mesh.size, max_target_length] per key, `batch_sharding(mesh)`.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from core.data import BATCH_KEYS
    from core.model import Transformer
    from core.sharding import abstract_state, batch_sharding
    from core.train import make_optimizer, make_train_step

    def make():
        model = Transformer(cfg, rngs=nnx.Rngs(cfg.init_weights_seed))
        return model, nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)

    graphdef, shapes = nnx.split(nnx.eval_shape(make))
    state = abstract_state(shapes, mesh)
    rows = cfg.per_device_batch_size * mesh.size
    spec = jax.ShapeDtypeStruct((rows, cfg.max_target_length), jnp.int32, sharding=batch_sharding(mesh))
    jitted = make_train_step(cfg, graphdef, state, mesh)
    return graphdef, state, jitted.lower(state, {k: spec for k in BATCH_KEYS})
