"""The persistent compilation cache (`jax_cache_dir`): where it points, and that a recompile hits it."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax._src import compilation_cache

from core.train.compile_cache import default_cache_dir, enable_compilation_cache, resolve_cache_dir
from core.config.schema import load_config


@pytest.fixture
def restore_cache():
    """Put JAX's cache settings back (they are process-wide). The process's in-memory executables stay:
    `jax.clear_caches()` would drop every program the worker compiled for earlier test files (seconds to
    free, and each one still in use traced, lowered and read back again)."""
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    yield
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    compilation_cache.reset_cache()


def test_resolve(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert resolve_cache_dir("") is None
    assert resolve_cache_dir("default") == default_cache_dir() == tmp_path / "dsv4" / "jax"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert str(default_cache_dir()).endswith("/.cache/dsv4/jax")
    assert resolve_cache_dir("~/x") == Path.home() / "x"
    assert load_config("deepseek4-tiny").jax_cache_dir == "default"
    assert load_config("deepseek4-tiny", ["jax_cache_dir="]).jax_cache_dir == ""


def test_off_leaves_jax_alone(restore_cache):
    before = jax.config.jax_compilation_cache_dir
    assert enable_compilation_cache("") is None
    assert jax.config.jax_compilation_cache_dir == before


def test_second_compile_hits_the_cache(restore_cache, tmp_path):
    """The first compile writes an entry; the same program, jitted anew (in no in-memory cache), is
    read back from the directory (JAX's cache-hit event), not compiled again."""
    events = []
    listen = lambda name, **kw: events.append(name)  # noqa: E731
    jax.monitoring.register_event_listener(listen)
    try:
        _compile_twice(tmp_path, events)
    finally:
        jax.monitoring.unregister_event_listener(listen)


def _compile_twice(tmp_path, events):
    compilation_cache.reset_cache()
    path = enable_compilation_cache(str(tmp_path / "cache"), min_compile_time_s=0.0)
    assert path == tmp_path / "cache" and path.is_dir()

    def program():
        """A new function object per call: the same program, in none of JAX's in-memory caches (keyed by
        the function), so its second compile must look it up in the directory."""
        def f(x):
            return jnp.sin(x) @ x.T + 3.0
        return f

    x = jnp.arange(12.0).reshape(3, 4)
    want = jax.jit(program())(x)
    entries = sorted(p.name for p in path.iterdir())
    assert entries, "the first compile wrote nothing to the cache directory"
    assert "/jax/compilation_cache/cache_hits" not in events
    got = jax.jit(program())(x)
    assert "/jax/compilation_cache/cache_hits" in events
    assert sorted(p.name for p in path.iterdir()) == entries  # read back, nothing new written
    assert jnp.array_equal(got, want)


def test_default_writes_the_small_initialisers(restore_cache, tmp_path):
    """A model's eager initialisers compile fast (well under JAX's usual 1 s threshold): by default
    they are written too, so a rerun's model build reads them back."""
    compilation_cache.reset_cache()
    path = enable_compilation_cache(str(tmp_path / "cache"))
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    jax.random.truncated_normal(jax.random.key(3), -2.0, 2.0, (5, 7)).block_until_ready()
    assert any(p.name.startswith("jit__truncated_normal") for p in path.iterdir()), sorted(path.iterdir())
