"""The compiled train step's one home (DESIGN.md, "Planning" and "time to step 0"): the step as one
program, its abstract inputs, its jit, its per-process memo and its ahead-of-time compile.

Training, `dsv4 plan` (core/plan/compile.py) and `dsv4 bench --train` (core/bench/train.py) build
the step here, as a `StepProgram`: the specs (core.spec.resolve `Specs`), the graphdef, the state's
shardings and the mesh, with `jit`, `lower` and `compile`. `lowered_step` is the program lowered from
`abstract_inputs`, so every figure they report describes the program a training command runs
(tests/plan/test_one_program.py compares the lowered programs).

- `abstract_inputs(rows, length, objects, mesh)`: the step's (graphdef, state, batch, mesh), the state and
  batch as ShapeDtypeStructs that carry the shardings a run gives the real arrays
  (core/parallel/sharding.py's rules, `batch_sharding`); nothing is allocated.
- `jit_step(fn, opt_level, mesh, state_shardings)`: `fn(state, batch)` traced under the mesh's abstract
  mesh, compiled with `step_compiler_options` for the mesh's platform. A step that returns its
  state, `(state, metrics)`, donates it and gives it back in `state_shardings`; a step given no
  `state_shardings` (an evaluation's, which returns metrics alone) donates nothing.
- `StepProgram`: the train step (core/train/step.py's `step_fn` through `jit_step`); equal programs
  (platform, model and step specs, graphdef, mesh) share one jit and one executable in a process, so a
  resumed or repeated run does not compile again (core/train/optimizer.py's `make_optimizer` keeps
  one optax transformation per optimizer spec for the same reason). The step reads the specs alone,
  never the config they were resolved from. Both live in one memo (`StepMemo`,
  `MEMO`).
- `compile_ahead(specs, mesh, objects)`: the step compiled from abstract state while the model
  builds (`StepPrecompile`). On a CPU the first step of a run is mostly two serial waits: building
  the model eagerly and compiling the step; the step needs only shapes, dtypes and shardings.
  When the real state does not match what was compiled (another graphdef, sharding or shape) the
  jitted step runs, which compiles on its first call: the values of every step are the same either way.
The remat choice, which compiles these programs in turn, is core/train/remat.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from core.data.batches import BATCH_KEYS
from core.model import transformer
from core.ops.placement import tied
from core.parallel import sharding
from core.parallel.mesh import mesh_platform
from core.parallel.xla_flags import collective_options
from core.spec.resolve import Specs
from core.train import optimizer
from core.train.step import step_fn

AUTO_CPU_LEVEL = 1  # xla_backend_optimization_level -1 on CPU (step_compiler_options)


class StepMemo:
    """The process's one memo of what a step costs to make, per kind and key: "jitted" (the jitted step)
    and "compiled" (the step compiled ahead of time), both by `StepProgram`. The compile thread fills
    it too, hence the lock."""

    def __init__(self):
        self._items: dict[tuple[str, Any], Any] = {}
        self._lock = threading.RLock()

    def get(self, kind: str, key) -> Any:
        """The value kept for (kind, key), or None."""
        with self._lock:
            return self._items.get((kind, key))

    def get_or_make(self, kind: str, key, make: Callable[[], Any]) -> Any:
        """The value kept for (kind, key), made by `make()` (under the lock) the first time."""
        with self._lock:
            if (kind, key) not in self._items:
                self._items[(kind, key)] = make()
            return self._items[(kind, key)]

    def keep_first(self, kind: str, key, value) -> Any:
        """Keep `value` for (kind, key) unless one is kept already (made outside the lock); the kept one."""
        with self._lock:
            return self._items.setdefault((kind, key), value)

    def forget(self, kind: str, key) -> None:
        with self._lock:
            self._items.pop((kind, key), None)

    def holds_specs(self, specs_key: tuple, mesh=None) -> bool:
        """Whether a jitted or compiled step of these specs (`specs_key`) is kept, on `mesh` if given
        (any graphdef)."""
        with self._lock:
            return any(key.memo_key[:3] == specs_key and (mesh is None or key.mesh == mesh) for _, key in self._items)


MEMO = StepMemo()


class StepInputs(NamedTuple):
    """A step's abstract inputs: `fn(state, batch)` of `jit_step` over `graphdef`'s objects on `mesh`."""
    graphdef: Any
    state: Any
    batch: dict[str, Any]
    mesh: Any


# ----------------------------------------------------------------------------- the memo


def specs_key(specs: Specs) -> tuple:
    """What a step program computes: its platform, model spec and step spec."""
    return (specs.platform, specs.model, specs.step)


def has_specs(specs: Specs, mesh=None) -> bool:
    """Whether the memo holds a jitted or compiled step of `specs` on `mesh` (any mesh if None; any
    graphdef). The specs say what a step computes, not over which devices: a step of equal specs on
    another mesh is another program."""
    return MEMO.holds_specs(specs_key(specs), mesh)


# ----------------------------------------------------------------------------- the program


@dataclasses.dataclass(frozen=True, eq=False)
class StepProgram:
    """The training step as one program: what it computes (`specs`: the model's and the step's specs),
    over which objects (`graphdef`: the split (model, optimizer)), with the state placed how (`shardings`:
    the state's rule shardings, which the step gives back so the next step reuses the program) and on
    which devices (`mesh`).

    Programs of an equal `memo_key` (the platform, the model and step specs, the graphdef, the mesh) are one program:
    the memo (`MEMO`) keeps one jit and one executable for them, whatever their run-only keys, so a
    resumed or repeated run in a process neither traces nor compiles again, and a step compiled from
    abstract state serves the state the run builds.
    """

    specs: Specs
    graphdef: Any
    shardings: Any
    mesh: Any

    @classmethod
    def of(cls, specs: Specs, graphdef, state, mesh) -> "StepProgram":
        """The program over `state` (real or abstract: `abstract_inputs`), its rule shardings on `mesh`."""
        return cls(specs, graphdef, sharding.state_shardings(state, mesh), mesh)

    @functools.cached_property
    def memo_key(self) -> tuple:
        return (*specs_key(self.specs), self.graphdef, self.mesh)

    def __eq__(self, other) -> bool:
        return isinstance(other, StepProgram) and self.memo_key == other.memo_key

    def __hash__(self) -> int:
        return hash(self.memo_key)

    def jit(self):
        """The jitted `(state, batch) -> (state, metrics)`: core/train/step.py's `step_fn` through
        `jit_step`, the one jit of training, `dsv4 plan` and `dsv4 bench` (one per program and process)."""
        return MEMO.get_or_make("jitted", self, lambda: jit_step(
            step_fn(self.specs, self.graphdef), self.specs.step.opt_level, self.mesh, self.shardings))

    def lower(self, state, batch):
        """The jitted step lowered for (abstract) `state` and `batch` (`jax.stages.Lowered`)."""
        return self.jit().lower(state, batch)

    def compile(self, state, batch, on_lowered: Callable[[], None] | None = None):
        """The step compiled ahead of time for (abstract) `state` and `batch`, once per program and
        process (`jax.stages.Compiled`); `on_lowered()` is called between tracing (Python, holds the
        GIL) and XLA's compile (releases it)."""
        compiled = MEMO.get("compiled", self)
        if compiled is None:  # compiled outside the lock: XLA's compile releases the GIL, the build runs beside it
            lowered = self.lower(state, batch)
            if on_lowered is not None:
                on_lowered()
            compiled = MEMO.keep_first("compiled", self, lowered.compile())
        return compiled

    def compiled(self):
        """The ahead-of-time executable this process holds for the program, or None."""
        return MEMO.get("compiled", self)

    def forget(self) -> None:
        """Drop the program's executable (a remat trial that does not fit)."""
        MEMO.forget("compiled", self)

    def step(self) -> Callable:
        """The step to run: the executable compiled ahead if the process holds one (`AheadStep`), else
        the jitted step (which compiles on its first call, or already has)."""
        jitted, compiled = self.jit(), self.compiled()
        return jitted if compiled is None else AheadStep(compiled, jitted)


# ----------------------------------------------------------------------------- inputs and jit


def abstract_model_and_optimizer(specs: Specs):
    """The (model, optimizer) of `specs` (core.spec.resolve) from `nnx.eval_shape`: ShapeDtypeStructs,
    nothing allocated (the objects of `abstract_inputs` for the train step, and the restore targets of
    a run); the model is `transformer.abstract`'s, traced once per spec."""
    model = transformer.abstract(specs.model)
    return model, nnx.eval_shape(lambda m: nnx.Optimizer(m, optimizer.make_optimizer(specs.step.optimizer),
                                                         wrt=nnx.Param), model)


def abstract_inputs(rows: int, length: int, objects: Any, mesh) -> StepInputs:
    """The abstract inputs of a step over `objects` on `mesh`, `rows` rows per device of `length` tokens.

    Args:
      objects: the step's nnx objects from `nnx.eval_shape` (the train step's model and optimizer:
        `abstract_model_and_optimizer`); they depend on neither the mesh nor the batch, so a caller
        that tries several meshes makes them once.
      mesh: a `jax.sharding.Mesh`, or an `AbstractMesh` (shardings without devices: the state bytes
        of a mesh no process has).
    Returns:
      StepInputs: the state with the rule shardings, the batch (`rows` x the mesh's devices rows of
      `length` int32 tokens, for each of `BATCH_KEYS`) split over the batch axes.
    """
    graphdef, state = nnx.split(objects)
    spec = jax.ShapeDtypeStruct((rows * mesh.size, length), jnp.int32,
                                sharding=sharding.batch_sharding(mesh))
    return StepInputs(graphdef, sharding.abstract_state(state, mesh), {k: spec for k in BATCH_KEYS}, mesh)


def jit_step(fn: Callable, opt_level: int, mesh, state_shardings: Any = None):
    """`fn(state, batch)` jitted as the training commands jit their step (module docstring).

    Args:
      fn: the step; it returns `(state, metrics)` when `state_shardings` is given, else anything.
      opt_level: xla_backend_optimization_level (`step_compiler_options`).
      mesh: a `jax.sharding.Mesh` (its devices' platform picks the compiler options).
      state_shardings: the shardings of the returned state (`state_shardings(state, mesh)`: the
        input's rule shardings, so the next step reuses the program); None: nothing donated.
    """
    options = step_compiler_options(opt_level, mesh_platform(mesh)) or None
    if state_shardings is None:
        return jax.jit(with_mesh(mesh, fn), compiler_options=options)
    return jax.jit(with_mesh(mesh, fn), donate_argnums=0, out_shardings=(state_shardings, None),
                   compiler_options=options)


def with_mesh(mesh, fn):
    """`fn` traced under `mesh`'s abstract mesh, so the model sees it (the MoE's expert-parallel
    exchange: core/ops/expert_parallel.py); `jax.set_mesh` cannot be entered under jit. The
    collective-order ties (core/ops/placement.py) are traced where the mesh needs them: on the CPU, with
    more than one device."""
    @functools.wraps(fn)  # keeps the step's name: core/plan reads the jit_step dumps
    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), tied(mesh_platform(mesh) == "cpu" and mesh.size > 1):
            return fn(*args)
    return traced


def step_compiler_options(level: int, backend: str | None = None) -> dict[str, Any]:
    """XLA options of a step's compile (the jitted and the ahead-of-time step alike; JAX's
    persistent cache keys on them): on a TPU the collectives' scheduler options
    (core/parallel/xla_flags.py); LLVM's `xla_backend_optimization_level`.

    -1 (the default) is `AUTO_CPU_LEVEL` on the CPU backend, where the step compiles faster than at
    XLA's default and runs as fast (docs/benchmarks.md#why-the-defaults), and XLA's own level on
    other backends (not measured there); 0-3 apply on any backend. A
    --xla_backend_optimization_level in XLA_FLAGS wins.

    Args:
      level: xla_backend_optimization_level.
      backend: the platform the step compiles for (default: `jax.default_backend()`).
    """
    backend = backend or jax.default_backend()
    options = collective_options(backend)  # the TPU's collective scheduling (core/parallel/xla_flags.py)
    if "--xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return options
    if level < 0:
        if backend != "cpu":
            return options
        level = AUTO_CPU_LEVEL
    return {**options, "xla_backend_optimization_level": level}


# ----------------------------------------------------------------------------- the train step


def abstract_program(specs: Specs, mesh, objects=None) -> tuple[StepProgram, StepInputs]:
    """The step of `specs` on `mesh` over abstract inputs (`abstract_inputs` of `objects`, by default
    `abstract_model_and_optimizer(specs)`), as a training command compiles it ahead of its build;
    nothing is allocated."""
    objects = abstract_model_and_optimizer(specs) if objects is None else objects
    inputs = abstract_inputs(specs.step.rows, specs.step.length, objects, mesh)
    return StepProgram.of(specs, inputs.graphdef, inputs.state, mesh), inputs


def lowered_step(specs: Specs, mesh):
    """The step of `specs` (resolved for `mesh`'s platform) lowered from abstract inputs on `mesh`
    (`abstract_program`): what `dsv4 plan` and `dsv4 bench --train` compile.

    Returns:
      (jax.stages.Lowered, StepInputs).
    """
    program, inputs = abstract_program(specs, mesh)
    return program.lower(inputs.state, inputs.batch), inputs


class AheadStep:
    """Calls the compiled executable; on an input it was not compiled for, the jitted step."""

    def __init__(self, compiled, jitted):
        self.compiled, self.jitted = compiled, jitted

    def __call__(self, state, batch):
        if self.compiled is not None:
            try:
                return self.compiled(state, batch)
            except (TypeError, ValueError):  # checked before anything runs or is donated
                self.compiled = None
        return self.jitted(state, batch)


# ----------------------------------------------------------------------------- ahead of time


def compile_ahead(specs: Specs, mesh, objects) -> "StepPrecompile | None":
    """The run's step compiled in a background thread from `objects` (`abstract_model_and_optimizer`)
    on `mesh`; None when this process already holds a step of the specs on that mesh (a second run of
    them in the process neither starts a thread nor compiles)."""
    if has_specs(specs, mesh):
        return None
    return StepPrecompile(*abstract_program(specs, mesh, objects))


class StepPrecompile:
    """A step program compiled over its abstract `inputs` in a background thread.

    Errors in the thread (a config the model rejects) are kept, not raised: the build then raises
    the same error in the main thread, or the run falls back to the jitted step. The thread is not
    a daemon: a process that fails while it compiles (a checkpoint that does not restore) prints its
    error at once and exits when the compile ends; a daemon thread still inside XLA at interpreter
    exit aborts the process (exit 134 instead of 2).
    """
    def __init__(self, program: StepProgram, inputs: StepInputs):
        self.program, self.error = program, None
        self._lowered = threading.Event()
        self._thread = threading.Thread(target=self._compile, args=(inputs,), name="dsv4-precompile", daemon=False)
        self._thread.start()
        # Tracing is Python: beside the (Python-heavy) model build the two share the GIL and the
        # trace, the head of the critical path, took twice as long. Wait for it; XLA's compile then
        # runs beside the build.
        self._lowered.wait()

    def _compile(self, inputs: StepInputs) -> None:
        try:
            self.program.compile(inputs.state, inputs.batch, on_lowered=self._lowered.set)
        except Exception as e:  # noqa: BLE001  (reported through the jitted step's fallback)
            self.error = e
        finally:
            self._lowered.set()

    def join(self) -> None:
        """Wait for the compile (its executable is then in the memo, for every equal program)."""
        self._thread.join()
