"""The train step's XLA options (`xla_backend_optimization_level`): the config's level, for -1 the
CPU level on CPU and none elsewhere, none when XLA_FLAGS sets the level (the test suite's 0), and
the config's range check."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_config
from core.train import step as ts
from core.errors import ConfigError


def test_options_follow_the_config_and_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    auto = tiny_config()  # the default -1: AUTO_CPU_LEVEL on CPU, XLA's own level elsewhere
    assert ts.step_compiler_options(auto, "cpu") == {"xla_backend_optimization_level": ts.AUTO_CPU_LEVEL}
    assert ts.step_compiler_options(auto, "gpu") == {} and ts.step_compiler_options(auto, "tpu") == {}
    assert ts.step_compiler_options(tiny_config(None, "xla_backend_optimization_level=2"), "gpu") == {
        "xla_backend_optimization_level": 2}
    assert ts.step_compiler_options(tiny_config(None, "xla_backend_optimization_level=1")) == {
        "xla_backend_optimization_level": 1}
    assert ts.step_compiler_options(tiny_config(None, "xla_backend_optimization_level=2")) == {
        "xla_backend_optimization_level": 2}
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")  # the environment wins
    assert ts.step_compiler_options(tiny_config(None, "xla_backend_optimization_level=1")) == {}
    with pytest.raises(ConfigError, match="xla_backend_optimization_level=4"):
        tiny_config(None, "xla_backend_optimization_level=4")


def test_the_options_reach_the_compile(monkeypatch):
    """XLA accepts the options a jit carries (an unknown option would fail the compile), and the
    level-1 program gives the level-3 result of a small float32 function to rounding."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    monkeypatch.setenv("XLA_FLAGS", "")
    options = ts.step_compiler_options(tiny_config(), "cpu")
    assert options == {"xla_backend_optimization_level": ts.AUTO_CPU_LEVEL}
    f = lambda x: jnp.tanh(x @ x.T).sum(-1)  # noqa: E731
    x = jax.random.normal(jax.random.key(0), (64, 32))
    got = jax.jit(f, compiler_options=options)(x)
    level3 = jax.jit(f, compiler_options={"xla_backend_optimization_level": 3})(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(level3), rtol=1e-6, atol=1e-6)
    with pytest.raises(Exception, match="no_such_option"):
        jax.jit(f, compiler_options={"xla_no_such_option": 1})(x)
