"""The train step's XLA options (`xla_backend_optimization_level`): the config's level, for -1 the
CPU level on CPU and none elsewhere, none when XLA_FLAGS sets the level (the test suite's 0), and
the config's range check; on a TPU the collectives' scheduler options (core/parallel/xla_flags.py)."""

from __future__ import annotations

import pytest

from tests.conftest import resolved, tiny_config
from core.train import program
from core.errors import ConfigError
from core.parallel.xla_flags import TPU_COLLECTIVE_OPTIONS


def test_options_follow_the_config_and_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    auto = tiny_config().xla_backend_optimization_level  # the default -1: AUTO_CPU_LEVEL on CPU, XLA's own level elsewhere
    assert program.step_compiler_options(auto, "cpu") == {"xla_backend_optimization_level": program.AUTO_CPU_LEVEL}
    assert program.step_compiler_options(auto, "gpu") == {}
    assert program.step_compiler_options(auto, "tpu") == TPU_COLLECTIVE_OPTIONS  # the collectives' scheduling
    assert program.step_compiler_options(2, "gpu") == {
        "xla_backend_optimization_level": 2}
    assert program.step_compiler_options(1) == {
        "xla_backend_optimization_level": 1}
    assert program.step_compiler_options(2) == {
        "xla_backend_optimization_level": 2}
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")  # the environment wins
    assert program.step_compiler_options(1) == {}
    assert program.step_compiler_options(1, "tpu") == \
        TPU_COLLECTIVE_OPTIONS
    with pytest.raises(ConfigError, match="xla_backend_optimization_level=4"):
        tiny_config(None, "xla_backend_optimization_level=4")


def _level_of(compiled) -> int | None:
    """The `xla_backend_optimization_level` an executable was compiled with, None for XLA's own.

    Read from the serialized executable's CompileOptionsProto: its env_option_overrides map holds
    the entry {key (1): the option name, value (2): OptionOverrideProto {int_field (3): level}}.
    """
    name = b"xla_backend_optimization_level"
    entry = b"\x0a" + bytes([len(name)]) + name + b"\x12\x02\x18"
    blob = compiled.runtime_executable().serialize()
    at = blob.find(entry)
    return None if at < 0 else blob[at + len(entry)]


def test_the_options_reach_the_compile(monkeypatch):
    """The train step's executable (the ahead-of-time and the jitted step share one jit) carries
    the config's level in its compile options; XLA accepts the options a jit carries (an unknown
    option fails the compile), and the level-1 program gives the level-3 result to rounding."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    monkeypatch.setenv("XLA_FLAGS", "")  # the suite's level 0 (tests/conftest.py) would win otherwise
    options = program.step_compiler_options(tiny_config().xla_backend_optimization_level, "cpu")
    assert options == {"xla_backend_optimization_level": program.AUTO_CPU_LEVEL}
    f = lambda x: jnp.tanh(x @ x.T).sum(-1)  # noqa: E731
    x = jax.random.normal(jax.random.key(0), (64, 32))
    assert _level_of(jax.jit(f).lower(x).compile()) is None  # the reader finds no override where none is
    assert _level_of(jax.jit(f, compiler_options={"xla_backend_optimization_level": 3}).lower(x).compile()) == 3
    got = jax.jit(f, compiler_options=options)(x)
    level3 = jax.jit(f, compiler_options={"xla_backend_optimization_level": 3})(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(level3), rtol=1e-6, atol=1e-6)
    with pytest.raises(Exception, match="no_such_option"):
        jax.jit(f, compiler_options={"xla_no_such_option": 1})(x)

    # one SWA layer and a level no other test compiles with: this file's own step
    specs, mesh = resolved(tiny_config("warmup", "xla_backend_optimization_level=2", "compress_ratios=[0]",
                                       "base_num_decoder_layers=1", "first_num_hash_layers=0", "max_target_length=64",
                                       "per_device_batch_size=1"))
    step, inputs = program.abstract_program(specs, mesh)
    level = _level_of(step.compile(inputs.state, inputs.batch))
    assert level == 2, f"the train step was compiled with level {level}, not the config's 2"
