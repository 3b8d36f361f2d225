"""The compiled train step's one home (DESIGN.md, "Planning" and "time to step 0"): its abstract
inputs, its jit, its per-process memo and its ahead-of-time compile.

Training, `dsv4 plan` (core/plan/compile.py) and `dsv4 bench --train` (core/bench/train.py) build
the step here: `lowered_step` is `make_train_step`'s jit lowered from `abstract_inputs`, so every
figure they report describes the program a training command runs (tests/plan/test_one_program.py
compares the lowered programs).

- `abstract_inputs(cfg, objects, mesh)`: the step's (graphdef, state, batch, mesh), the state and
  batch as ShapeDtypeStructs that carry the shardings a run gives the real arrays
  (core/parallel/sharding.py's rules, `batch_sharding`); nothing is allocated.
- `jit_step(fn, cfg, mesh, state_shardings)`: `fn(state, batch)` traced under the mesh's abstract
  mesh, compiled with `step_compiler_options` for the mesh's platform. A step that returns its
  state, `(state, metrics)`, donates it and gives it back in `state_shardings`; a step given no
  `state_shardings` (an evaluation's, which returns metrics alone) donates nothing.
- `make_train_step`: the jitted step (core/train/step.py's `step_fn`), one per compile-relevant
  config, graphdef and mesh in a process, so a resumed or repeated run does not compile again;
  `make_optimizer` keeps one optax transformation (core/train/optimizer.py's `from_config`) per
  config for the same reason (it is part of the optimizer's graphdef: equal configs give equal
  graphdefs). Both, and the ahead-of-time executables, live in one memo (`StepMemo`, `MEMO`).
- `compile_ahead(cfg, mesh, objects)`: the step compiled from abstract state while the model
  builds (`StepPrecompile`). On a CPU the first step of a run is mostly two serial waits: building
  the model eagerly and compiling the step; the step needs only shapes, dtypes and shardings.
  The executable is cached like the jitted step; when the real state does not match what was
  compiled (another graphdef, sharding or shape) the jitted step runs, which compiles on its first
  call: the values of every step are the same either way.
- `remat_that_fits(asked, cfg, mesh, usable)`: `remat_policy=auto` on a TPU, the steps without layer
  remat and with `projections` compiled in turn, the first that fits a chip taken (its executable
  cached for the run), after a screen (`remat_worth_compiling`) that spares a compile that cannot
  fit or changes nothing; `full` where neither fits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from core.data.batches import BATCH_KEYS
from core.errors import resource_exhausted
from core.model import transformer
from core.ops.placement import tied
from core.parallel import mesh as parallel_mesh
from core.parallel import sharding
from core.parallel.mesh import make_mesh, mesh_platform
from core.ops.placement import BATCH_AXES
from core.parallel.sharding import abstract_state
from core.parallel.xla_flags import collective_options
from core.spec.resolve import crosses_layers, model_spec, resolve
from core.train import memory, optimizer
from core.train.step import config_matcher, step_fn, training_loss

AUTO_CPU_LEVEL = 1  # xla_backend_optimization_level -1 on CPU (step_compiler_options)


class StepMemo:
    """The process's one memo of what a step costs to make, per kind and key: "optimizer" (the optax
    transformation, by compile-relevant config), "jitted" (the jitted step) and "compiled" (the step
    compiled ahead of time), both by `step_key`. The compile thread fills it too, hence the lock."""

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

    def holds_config(self, compile_key: tuple) -> bool:
        """Whether a jitted or compiled step of this compile-relevant config is kept (any graphdef, mesh)."""
        with self._lock:
            return any(kind != "optimizer" and key[0] == compile_key for kind, key in self._items)


MEMO = StepMemo()


class StepInputs(NamedTuple):
    """A step's abstract inputs: `fn(state, batch)` of `jit_step` over `graphdef`'s objects on `mesh`."""
    graphdef: Any
    state: Any
    batch: dict[str, Any]
    mesh: Any


# ----------------------------------------------------------------------------- the memo


def _compile_key(cfg) -> tuple:
    # steps only shapes the step through the schedule's length, unless learning_rate_schedule_steps fixes it
    # the schema marks the keys a step does not depend on (core.config.schema.run_only)
    skip = {"steps"} if cfg.learning_rate_schedule_steps > 0 else set()
    return tuple((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                 if not f.metadata.get("run_only") and f.name not in skip)


def step_key(cfg, graphdef, mesh) -> tuple:
    """The memo's key of a step: equal for configs, graphdefs and meshes that give the same program."""
    return (_compile_key(cfg), graphdef, mesh)


def has_config(cfg) -> bool:
    """Whether the memo holds a jitted or compiled step of `cfg`'s compile-relevant config (any graphdef, mesh)."""
    return MEMO.holds_config(_compile_key(cfg))


def cached_compiled(key):
    """The ahead-of-time executable of `key` (`step_key`), or None."""
    return MEMO.get("compiled", key)


def make_optimizer(cfg):
    """core/train/optimizer.py's `from_config` (clip -> AdamW(schedule) for trainable leaves,
    set_to_zero for frozen ones), one object per compile-relevant config."""
    return MEMO.get_or_make("optimizer", _compile_key(cfg), lambda: optimizer.from_config(cfg))


# ----------------------------------------------------------------------------- inputs and jit


def abstract_model_and_optimizer(cfg):
    """The (model, optimizer) of `cfg` (resolved: core.spec.resolve) from `nnx.eval_shape`:
    ShapeDtypeStructs, nothing allocated (the objects of `abstract_inputs` for the train step, and the
    restore targets of a run); the model is `transformer.abstract`'s, traced once per spec."""
    model = transformer.abstract(model_spec(cfg))
    return model, nnx.eval_shape(lambda m: nnx.Optimizer(m, make_optimizer(cfg), wrt=nnx.Param), model)


def abstract_inputs(cfg, objects: Any, mesh=None) -> StepInputs:
    """The abstract inputs of `cfg`'s step over `objects` on `mesh`.

    Args:
      objects: the step's nnx objects from `nnx.eval_shape` (the train step's model and optimizer:
        `abstract_model_and_optimizer`); they depend on neither the mesh nor the batch, so a caller
        that tries several meshes makes them once.
      mesh: a `jax.sharding.Mesh`, or an `AbstractMesh` (shardings without devices: the state bytes
        of a mesh no process has); default the run's own, `make_mesh(cfg)`.
    Returns:
      StepInputs: the state with the rule shardings, the batch (per_device_batch_size x the mesh's
      devices rows of max_target_length int32 tokens, for each of `BATCH_KEYS`) split over the
      batch axes.
    """
    mesh = make_mesh(cfg) if mesh is None else mesh
    graphdef, state = nnx.split(objects)
    spec = jax.ShapeDtypeStruct((cfg.per_device_batch_size * mesh.size, cfg.max_target_length), jnp.int32,
                                sharding=sharding.batch_sharding(mesh))
    return StepInputs(graphdef, sharding.abstract_state(state, mesh), {k: spec for k in BATCH_KEYS}, mesh)


def jit_step(fn: Callable, cfg, mesh, state_shardings: Any = None):
    """`fn(state, batch)` jitted as the training commands jit their step (module docstring).

    Args:
      fn: the step; it returns `(state, metrics)` when `state_shardings` is given, else anything.
      mesh: a `jax.sharding.Mesh` (its devices' platform picks the compiler options).
      state_shardings: the shardings of the returned state (`state_shardings(state, mesh)`: the
        input's rule shardings, so the next step reuses the program); None: nothing donated.
    """
    options = step_compiler_options(cfg, mesh_platform(mesh)) or None
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


def step_compiler_options(cfg, backend: str | None = None) -> dict[str, Any]:
    """XLA options of a step's compile (the jitted and the ahead-of-time step alike; JAX's
    persistent cache keys on them): on a TPU the collectives' scheduler options
    (core/parallel/xla_flags.py); LLVM's `xla_backend_optimization_level`.

    -1 (the default) is `AUTO_CPU_LEVEL` on the CPU backend, where the step compiles faster than at
    XLA's default and runs as fast (docs/benchmarks.md#why-the-defaults), and XLA's own level on
    other backends (not measured there); 0-3 apply on any backend. A
    --xla_backend_optimization_level in XLA_FLAGS wins.

    Args:
      backend: the platform the step compiles for (default: `jax.default_backend()`).
    """
    backend = backend or jax.default_backend()
    options = collective_options(backend)  # the TPU's collective scheduling (core/parallel/xla_flags.py)
    level = cfg.xla_backend_optimization_level
    if "--xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return options
    if level < 0:
        if backend != "cpu":
            return options
        level = AUTO_CPU_LEVEL
    return {**options, "xla_backend_optimization_level": level}


# ----------------------------------------------------------------------------- the train step


def make_train_step(cfg, graphdef, state, mesh):
    """A jitted `(state, batch) -> (state, metrics)` over the split (model, optimizer) `state`:
    core/train/step.py's `step_fn` through `jit_step`, the one jit of training, `dsv4 plan` and
    `dsv4 bench`.

    The output state keeps the input's rule-given shardings (so step 1 reuses step 0's program);
    one jitted step is shared by every run of an equal (cfg, graphdef, mesh) in a process.
    """
    return MEMO.get_or_make("jitted", step_key(cfg, graphdef, mesh), lambda: jit_step(
        step_fn(cfg, graphdef, mesh_platform(mesh)), cfg, mesh, sharding.state_shardings(state, mesh)))


def lowered_step(cfg, mesh=None):
    """`make_train_step`'s step lowered from `abstract_inputs` on `mesh` (default the run's own), as
    a training command compiles it ahead of its build, `cfg` resolved for the mesh (core.spec.resolve:
    the entry point's own when it resolved it); nothing is allocated. `dsv4 plan` and
    `dsv4 bench --train` compile this.

    Returns:
      (jax.stages.Lowered, StepInputs).
    """
    mesh = make_mesh(cfg) if mesh is None else mesh
    cfg = resolve(cfg, mesh_platform(mesh), mesh.shape).cfg
    inputs = abstract_inputs(cfg, abstract_model_and_optimizer(cfg), mesh)
    return make_train_step(cfg, inputs.graphdef, inputs.state, inputs.mesh).lower(inputs.state, inputs.batch), inputs


def compiled_step(cfg, graphdef, state, batch, mesh, on_lowered: Callable[[], None] | None = None):
    """`make_train_step`'s step compiled ahead of time for (abstract) `state` and `batch`, once per
    key and process (`jax.stages.Compiled`); `on_lowered()` is called between tracing (Python, holds
    the GIL) and XLA's compile (releases it)."""
    key = step_key(cfg, graphdef, mesh)
    compiled = MEMO.get("compiled", key)
    if compiled is None:  # compiled outside the lock: XLA's compile releases the GIL, the build runs beside it
        lowered = make_train_step(cfg, graphdef, state, mesh).lower(state, batch)
        if on_lowered is not None:
            on_lowered()
        compiled = MEMO.keep_first("compiled", key, lowered.compile())
    return compiled


def ahead_or_jitted_step(cfg, graphdef, state, mesh) -> Callable:
    """The compiled-ahead step of this (config, graphdef, mesh) if the process has one, else the
    jitted step of `make_train_step` (which compiles on its first call, or already has)."""
    jitted = make_train_step(cfg, graphdef, state, mesh)
    compiled = cached_compiled(step_key(cfg, graphdef, mesh))
    return jitted if compiled is None else AheadStep(compiled, jitted)


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


# ----------------------------------------------------------------------------- remat_policy=auto


def kept_bytes_per_row(cfg) -> int:
    """Bytes the backward keeps from the forward per batch row under `cfg`'s remat_policy.

    jax.vjp's residuals of the step's loss (core/train/step.py `training_loss`, gradients to the
    trainable parameters) traced abstractly (`jax.eval_shape`: nothing compiled or allocated) for one
    and for two rows of max_target_length tokens; the difference is one row's. What the backward reads
    besides (the parameters, their casts) is the same for both and cancels. It is the jaxpr's count:
    XLA keeps at most that (it may recompute a cheap elementwise result instead of keeping it).
    """
    model, _ = abstract_model_and_optimizer(cfg)
    trainable = config_matcher(cfg)
    graphdef, params, rest = nnx.split(model, nnx.All(nnx.Param, lambda path, _: trainable(path)), ...)
    step = resolve(cfg, "cpu").step  # traced on the CPU

    def residuals(params, rest, batch):
        loss = lambda p: training_loss(step, nnx.merge(graphdef, p, rest), batch)[0]  # noqa: E731
        return jax.vjp(loss, params)[1]

    def kept(rows: int) -> int:
        row = jax.ShapeDtypeStruct((rows, cfg.max_target_length), jnp.int32)
        out = jax.eval_shape(residuals, params, rest, {k: row for k in BATCH_KEYS})
        return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(out))

    return kept(2) - kept(1)


# About the largest share of `kept_bytes_per_row` that XLA:TPU kept in the steps without layer remat
# measured (docs/benchmarks.md#why-the-defaults; far less where the layers are not scanned). Under
# `projections` the policy names what is kept, and XLA keeps it.
KEPT_SHARE_SCREEN = {"none": 0.6, "projections": 1.0}
REMAT_TRIALS = ("none", "projections")  # auto's candidates on a TPU, fastest first; `full` needs no compile


def offloaded_bytes_per_row(cfg) -> int:
    """Bytes per batch row of the layers' inputs [T, n, M] in the compute dtype, which `projections`
    keeps in host memory on a TPU (core.model.transformer.remat_policy), not on the device."""
    width = cfg.max_target_length * cfg.mhc_expansion_rate * cfg.emb * jnp.dtype(cfg.dtype).itemsize
    return cfg.num_layers * width


def remat_worth_compiling(cfg, mesh_axes, usable_bytes: int) -> bool:
    """Whether the step of `cfg`'s remat_policy (one of REMAT_TRIALS) may fit one device of
    `usable_bytes`, before compiling it: False where no gradient crosses the layers (the warm-up:
    layer remat changes nothing, `core.spec.resolve.crosses_layers`), else whether the parameters
    and AdamW's moments per device (`state_bytes_needed` on an abstract mesh of `mesh_axes`) plus
    KEPT_SHARE_SCREEN of what the backward keeps on the device for the rows a device holds
    (`kept_bytes_per_row`, less `offloaded_bytes_per_row` under `projections`) fit. A screen, not the
    verdict: XLA:TPU recomputes what it must to fit its limit by itself, so the compile decides
    (`remat_that_fits`); the screen spares a compile that cannot fit (V4-Flash's 43 layers at full
    size without remat) or would change nothing."""
    if not crosses_layers(cfg):
        return False
    names = tuple(mesh_axes)
    mesh = AbstractMesh(tuple(mesh_axes[n] for n in names), names, axis_types=(AxisType.Auto,) * len(names))
    model, _ = abstract_model_and_optimizer(cfg)
    state = memory.state_bytes_needed(abstract_state(nnx.state(model), mesh), config_matcher(cfg), cfg.mu_dtype,
                                      cfg.nu_dtype)
    shards = math.prod(mesh_axes.get(a, 1) for a in BATCH_AXES)
    rows = cfg.per_device_batch_size * math.prod(mesh_axes.values()) // max(shards, 1)  # a device's batch shard
    kept = kept_bytes_per_row(cfg)  # traced here on the CPU, where `projections` offloads nothing
    if cfg.remat_policy == "projections":
        kept -= offloaded_bytes_per_row(cfg)
    return state + KEPT_SHARE_SCREEN[cfg.remat_policy] * rows * kept <= usable_bytes


def remat_candidates(asked, cfg, platform: str, mesh_axes, usable_bytes: int | None) -> tuple[str, ...]:
    """The remat policies compiled in turn for `asked` (the config before `resolve`; `cfg`, after it),
    fastest first, before `cfg`'s `full`: REMAT_TRIALS past `remat_worth_compiling` where `asked` says
    `remat_policy=auto` and the platform is a TPU of known memory; none elsewhere (a CPU's and a GPU's
    `auto` is `full`: core/spec/platform.py). The run (`remat_that_fits`) and `dsv4 plan`
    (core/plan/compile.py) ask this one question."""
    if not (asked.remat_policy == "auto" and cfg.remat_policy == "full" and platform == "tpu"
            and usable_bytes is not None):
        return ()
    return tuple(p for p in REMAT_TRIALS
                 if remat_worth_compiling(cfg.replace(remat_policy=p), mesh_axes, usable_bytes))


def fitting_remat(cfg, mesh, usable_bytes: int, candidates) -> Any:
    """`cfg` with the first remat policy of `candidates` whose step compiles within `usable_bytes` per
    device on `mesh` (its executable kept for the run: `compiled_step`'s memo), else `cfg` itself.
    A compile XLA refuses for memory, or whose memory analysis exceeds `usable_bytes`, is passed over
    (and not kept); any other compile error is raised."""
    for policy in candidates:
        trial = cfg.replace(remat_policy=policy)
        inputs = abstract_inputs(trial, abstract_model_and_optimizer(trial), mesh)
        try:
            compiled = compiled_step(trial, *inputs)
        except Exception as e:  # noqa: BLE001  (XLA:TPU refuses a program over its limit at compile)
            if resource_exhausted(e) is None:
                raise
            continue
        if memory.compiled_memory(compiled)["total_bytes"] <= usable_bytes:
            return trial
        MEMO.forget("compiled", step_key(trial, inputs.graphdef, mesh))
    return cfg


def remat_that_fits(asked, cfg, mesh, usable_bytes: int | None = None):
    """The config a run of `asked` (the config before `resolve`) trains with on `mesh`: `cfg` (resolved:
    `remat_policy=auto` is `full` there) or, on a TPU, the first of `remat_candidates` (`none`, then
    `projections`) whose step compiles within `usable_bytes` per device (`fitting_remat`). Without layer
    remat the backward runs no layer's forward again, and XLA:TPU recomputes by itself what it must to
    fit its limit; `projections` recomputes the elementwise work alone. A compile that fits is kept for
    the run, so the run does not compile again.

    Args:
      mesh: a `jax.sharding.Mesh` of the run's devices, or of the planner's target's (an ahead-of-time
        topology); usable_bytes: one device's memory, by default this process's first device's
        (`core.train.memory.device_memory_bytes`; unknown: `cfg` is kept).
    """
    if usable_bytes is None:
        usable_bytes = memory.device_memory_bytes(jax.local_devices()[0])[0]
    platform = parallel_mesh.mesh_platform(mesh)  # the module's, asked at call time: a test stands a TPU in
    candidates = remat_candidates(asked, cfg, platform, dict(mesh.shape), usable_bytes)
    return fitting_remat(cfg, mesh, usable_bytes, candidates) if candidates else cfg


# ----------------------------------------------------------------------------- ahead of time


def compile_ahead(cfg, mesh, objects) -> "StepPrecompile | None":
    """The run's step compiled in a background thread from `objects` (`abstract_model_and_optimizer`)
    on `mesh`; None when `compile_ahead` is off or this process already holds a step of the config
    (a second run of it in the process neither starts a thread nor compiles)."""
    if not cfg.compile_ahead or has_config(cfg):
        return None
    return StepPrecompile(cfg, abstract_inputs(cfg, objects, mesh))


class StepPrecompile:
    """The train step of `cfg` over abstract `inputs`, compiled in a background thread.

    Errors in the thread (a config the model rejects) are kept, not raised: the build then raises
    the same error in the main thread, or `step` falls back to the jitted step. The thread is not
    a daemon: a process that fails while it compiles (a checkpoint that does not restore) prints its
    error at once and exits when the compile ends; a daemon thread still inside XLA at interpreter
    exit aborts the process (exit 134 instead of 2).
    """
    def __init__(self, cfg, inputs: StepInputs):
        self.cfg, self.error = cfg, None
        self._lowered = threading.Event()
        self._thread = threading.Thread(target=self._compile, args=(inputs,), name="dsv4-precompile", daemon=False)
        self._thread.start()
        # Tracing is Python: beside the (Python-heavy) model build the two share the GIL and the
        # trace, the head of the critical path, took twice as long. Wait for it; XLA's compile then
        # runs beside the build.
        self._lowered.wait()

    def _compile(self, inputs: StepInputs) -> None:
        try:
            compiled_step(self.cfg, *inputs, on_lowered=self._lowered.set)
        except Exception as e:  # noqa: BLE001  (reported through `step`'s fallback)
            self.error = e
        finally:
            self._lowered.set()

    def step(self, graphdef, state, mesh) -> Callable:
        """The step for the real `state` (`nnx.split((model, optimizer))` of the built state on
        `mesh`): the ahead-of-time executable, or the jitted step; `(state, batch) -> (state, metrics)`."""
        self._thread.join()
        return ahead_or_jitted_step(self.cfg, graphdef, state, mesh)
