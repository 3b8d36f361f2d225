"""JAX's persistent compilation cache (`jax_cache_dir`, MaxText's key name).

A compiled train step is written to the cache directory, keyed by the program (its HLO), the
backend and the JAX / XLA versions, so a second run of the same shape and config reads the
executable back instead of compiling it (DESIGN.md's "time to step 0": the compile is most of
it on a CPU). Every program is written by default (`min_compile_time_s=0`), the small eager ones
of model building too (a few shared jax.random draws, core/model/init_draws.py, per-shape cuts
and constants, one program for the optimizer state), so a rerun reads those back as well. A
compile-time threshold such as JAX's default of 1 s would cache whichever of them happened to
compile slowly under the machine's load: a different subset on every run
(docs/benchmarks.md#why-the-defaults).

Deviation from MaxText: the default is a per-user directory (`~/.cache/dsv4/jax`, or
`$XDG_CACHE_HOME/dsv4/jax`), not `~/jax_cache`; an empty value turns the cache off. The cache is
trusted code (JAX's warning): never point it at a directory others can write.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

DEFAULT = "default"  # the config value that means `default_cache_dir()`


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/dsv4/jax`, `~/.cache/dsv4/jax` when XDG_CACHE_HOME is unset or empty."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsv4" / "jax"


def resolve_cache_dir(value: str) -> Path | None:
    """The directory a `jax_cache_dir` value names: None for "" (off), the default for "default"."""
    if not value:
        return None
    return default_cache_dir() if value == DEFAULT else Path(os.path.expanduser(value))


def enable_compilation_cache(value: str, *, min_compile_time_s: float = 0.0) -> Path | None:
    """Point JAX's persistent compilation cache at `value`'s directory (created), or leave it off.

    Takes effect for every later compile in this process (JAX reads the directory at its first
    cached compile, so call it before building the train step; eager ops compiled earlier are
    simply not cached). An unwritable directory only warns (JAX's own behaviour) and compiles.

    Args:
      value: the config's `jax_cache_dir`: "" off, "default" (`default_cache_dir()`), or a path
        (`~` expanded).
      min_compile_time_s: programs that compiled faster than this are not written.

    Returns:
      The directory in use, or None when the cache is off.
    """
    path = resolve_cache_dir(value)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # read-only home: run without the cache rather than fail
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    return path
