"""Compile the train step ahead of time, beside the model build (DESIGN.md's "time to step 0").

On a CPU the first step of a run is mostly two serial waits: building the model and optimizer
eagerly (a few dozen small XLA programs, core/model/init_draws.py) and compiling the train step (one
large one). The step does not need the values, only their shapes, dtypes and shardings, so
`StepPrecompile(cfg)` traces and lowers the step from core/train/program.py's `abstract_inputs`
in a background thread (the constructor waits for that: tracing is Python and would share the
GIL with the build), then XLA compiles it there while the main thread builds (XLA releases the GIL), and
`step(graphdef, state, mesh)` hands the Trainer the compiled executable.

The result goes through the per-process step cache of core/train/step.py (`compiled_step`,
keyed like `make_train_step`): a second run of an equal config in the same process neither
starts a thread nor compiles. When the real state does not match what was compiled (another
graphdef, sharding or shape) the jitted step of `make_train_step` is used, which compiles on
its first call exactly as without this module; the values of every step are the same either
way (one jitted program, compiled once).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from core.train import program
from core.train import step as ts


class StepPrecompile:
    """The train step of `cfg`, compiled in a background thread from abstract state.

    Errors in the thread (a config the model rejects) are kept, not raised: `build` then raises
    the same error in the main thread, or `step` falls back to the jitted step. The thread is not
    a daemon: a process that fails while it compiles (a bad mask found by `build`, a checkpoint
    that does not restore) prints its error at once and exits when the compile ends; a daemon
    thread still inside XLA at interpreter exit aborts the process (exit 134 instead of 2).
    """

    def __init__(self, cfg):
        self.cfg, self.error = cfg, None
        self._lowered = threading.Event()
        self._thread = threading.Thread(target=self._compile, name="dsv4-precompile", daemon=False)
        self._thread.start()
        # Tracing is Python: beside the (Python-heavy) model build the two share the GIL and the
        # trace, the head of the critical path, took twice as long. Wait for it; XLA's compile then
        # runs beside the build.
        self._lowered.wait()

    def _compile(self) -> None:
        try:
            inputs = program.abstract_inputs(self.cfg, ts.abstract_model_and_optimizer(self.cfg))
            ts.compiled_step(self.cfg, *inputs, on_lowered=self._lowered.set)
        except Exception as e:  # noqa: BLE001  (reported through `step`'s fallback)
            self.error = e
        finally:
            self._lowered.set()

    def step(self, graphdef, state, mesh) -> Callable:
        """The step for the real `state`: the ahead-of-time executable, or the jitted step.

        Args:
          graphdef, state: `nnx.split((model, optimizer))` of the built setup.
          mesh: the setup's mesh.
        Returns:
          `(state, batch) -> (state, metrics)`.
        """
        self._thread.join()
        return ahead_or_jitted_step(self.cfg, graphdef, state, mesh)


def ahead_or_jitted_step(cfg, graphdef, state, mesh) -> Callable:
    """The compiled-ahead step of this (config, graphdef, mesh) if the process has one, else the
    jitted step of `make_train_step` (which compiles on its first call, or already has)."""
    jitted = ts.make_train_step(cfg, graphdef, state, mesh)
    compiled = ts.cached_compiled(ts.step_key(cfg, graphdef, mesh))
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


def state_bytes_per_device(state) -> int:
    """Bytes of one device's shards of an abstract state (ShapeDtypeStructs with shardings): the
    largest shard of every leaf, so uneven and replicated leaves count in full."""
    import jax

    from core.parallel.sharding import shard_bytes

    return sum(shard_bytes(leaf) for leaf in jax.tree.leaves(state))


def device_memory_bytes(device) -> tuple[int | None, str]:
    """(usable bytes of one device, where the figure comes from): the allocator's bytes_limit on an
    accelerator; on the CPU this host's RAM over its local devices; None when unknown."""
    import os

    import jax

    if device.platform != "cpu":
        limit = (device.memory_stats() or {}).get("bytes_limit")
        return (int(limit), "the device's allocator limit") if limit else (None, "")
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None, ""
    return ram // max(jax.local_device_count(), 1), "this host's RAM over its devices"


def check_state_fits(cfg, stage: str, model) -> None:
    """ConfigError, before anything is built or compiled, when the parameters and AdamW's two
    moments of the trainable ones (in mu_dtype, nu_dtype; shapes and the run's shardings of the
    abstract `model`) exceed one device's memory under the config's mesh. A lower bound of the step's needs: `dsv4 plan`
    adds the compiler's temporaries."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from core.errors import ConfigError
    from core.parallel.mesh import describe_mesh, make_mesh
    from core.parallel.sharding import abstract_state

    mesh = make_mesh(cfg)
    trainable = ts.config_matcher(cfg)
    moments = jnp.dtype(cfg.mu_dtype)
    need = 0
    for path, leaf in nnx.to_flat_state(abstract_state(nnx.state(model), mesh)):
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        shard = state_bytes_per_device(value)
        need += shard
        if isinstance(leaf, nnx.Param) and trainable(path):  # + AdamW's moments, in their own dtypes
            need += shard // value.dtype.itemsize * (moments.itemsize + jnp.dtype(cfg.nu_dtype).itemsize)
    usable, source = device_memory_bytes(jax.local_devices()[0])  # another process's device has no stats
    if usable is None or need <= usable:
        return
    gib = 2 ** 30
    raise ConfigError(
        f"{cfg.model_name}: its parameters and optimizer state alone need {need / gib:.1f} GiB per device on mesh "
        f"{describe_mesh(mesh)}, and a device has {usable / gib:.1f} GiB ({source}): shard further "
        f"(e.g. ici_fsdp_parallelism=-1, mu_dtype=bfloat16 nu_dtype=bfloat16) and check first with "
        f"`dsv4 plan --model {cfg.model_name} --stage {stage} --target <target>`.")
