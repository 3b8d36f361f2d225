"""One recipe for a stage's step program (DESIGN.md, "Planning"): its abstract inputs and its jit.

Training (core/train/step.py's `make_train_step`, which the Trainer and the ahead-of-time compile
of core/train/precompile.py run), `dsv4 plan` (core/plan/compile.py) and `dsv4 bench --train`
(core/bench/train.py) build their inputs with `abstract_inputs` and jit with `jit_step`, so every
figure they report describes the program a training command runs (tests/plan/test_one_program.py
compares the lowered programs).

- `abstract_inputs(cfg, objects, mesh)`: the step's (graphdef, state, batch, mesh), the state and
  batch as ShapeDtypeStructs that carry the shardings a run gives the real arrays
  (core/parallel/sharding.py's rules, `batch_sharding`); nothing is allocated.
- `jit_step(fn, cfg, mesh, state_shardings)`: `fn(state, batch)` traced under the mesh's abstract
  mesh, compiled with `step_compiler_options` for the mesh's platform. A step that returns its
  state, `(state, metrics)`, donates it and gives it back in `state_shardings`; a step given no
  `state_shardings` (an evaluation's, which returns metrics alone) donates nothing.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, NamedTuple

AUTO_CPU_LEVEL = 1  # xla_backend_optimization_level -1 on CPU (step_compiler_options)


class StepInputs(NamedTuple):
    """A step's abstract inputs: `fn(state, batch)` of `jit_step` over `graphdef`'s objects on `mesh`."""

    graphdef: Any
    state: Any
    batch: dict[str, Any]
    mesh: Any


def abstract_inputs(cfg, objects: Any, mesh=None) -> StepInputs:
    """The abstract inputs of `cfg`'s step over `objects` on `mesh`.

    Args:
      objects: the step's nnx objects from `nnx.eval_shape` (the train step's model and optimizer:
        `core.train.step.abstract_model_and_optimizer`); they depend on neither the mesh nor the
        batch, so a caller that tries several meshes makes them once.
      mesh: a `jax.sharding.Mesh`, or an `AbstractMesh` (shardings without devices: the state bytes
        of a mesh no process has); default the run's own, `make_mesh(cfg)`.
    Returns:
      StepInputs: the state with the rule shardings, the batch (per_device_batch_size x the mesh's
      devices rows of max_target_length int32 tokens, for each of `BATCH_KEYS`) split over the
      batch axes.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from core.data.batches import BATCH_KEYS
    from core.parallel.mesh import make_mesh
    from core.parallel.sharding import abstract_state, batch_sharding

    mesh = make_mesh(cfg) if mesh is None else mesh
    graphdef, state = nnx.split(objects)
    spec = jax.ShapeDtypeStruct((cfg.per_device_batch_size * mesh.size, cfg.max_target_length), jnp.int32,
                                sharding=batch_sharding(mesh))
    return StepInputs(graphdef, abstract_state(state, mesh), {k: spec for k in BATCH_KEYS}, mesh)


def jit_step(fn: Callable, cfg, mesh, state_shardings: Any = None):
    """`fn(state, batch)` jitted as the training commands jit their step (module docstring).

    Args:
      fn: the step; it returns `(state, metrics)` when `state_shardings` is given, else anything.
      mesh: a `jax.sharding.Mesh` (its devices' platform picks the compiler options).
      state_shardings: the shardings of the returned state (`state_shardings(state, mesh)`: the
        input's rule shardings, so the next step reuses the program); None: nothing donated.
    """
    import jax

    from core.parallel.mesh import mesh_platform

    options = step_compiler_options(cfg, mesh_platform(mesh)) or None
    if state_shardings is None:
        return jax.jit(with_mesh(mesh, fn), compiler_options=options)
    return jax.jit(with_mesh(mesh, fn), donate_argnums=0, out_shardings=(state_shardings, None),
                   compiler_options=options)


def with_mesh(mesh, fn):
    """`fn` traced under `mesh`'s abstract mesh, so the model sees it (the MoE's expert-parallel
    exchange: core/ops/expert_parallel.py); `jax.set_mesh` cannot be entered under jit. The
    collective-order ties (core/ops/order.py) are traced where the mesh needs them: on the CPU, with
    more than one device."""
    import jax

    from core.ops.order import tied
    from core.parallel.mesh import mesh_platform

    @functools.wraps(fn)  # keeps the step's name: core/plan reads the jit_step dumps
    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), tied(mesh_platform(mesh) == "cpu" and mesh.size > 1):
            return fn(*args)
    return traced


def step_compiler_options(cfg, backend: str | None = None) -> dict[str, Any]:
    """XLA options of a step's compile (the jitted and the ahead-of-time step alike; JAX's
    persistent cache keys on them): LLVM's `xla_backend_optimization_level`.

    -1 (the default) is `AUTO_CPU_LEVEL` on the CPU backend, where the step compiles faster than at
    XLA's default and runs as fast (docs/benchmarks.md#why-the-defaults), and XLA's own level on
    other backends (not measured there); 0-3 apply on any backend. A
    --xla_backend_optimization_level in XLA_FLAGS wins.

    Args:
      backend: the platform the step compiles for (default: `jax.default_backend()`).
    """
    import jax

    level = cfg.xla_backend_optimization_level
    if "--xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return {}
    if level < 0:
        if (backend or jax.default_backend()) != "cpu":
            return {}
        level = AUTO_CPU_LEVEL
    return {"xla_backend_optimization_level": level}
