"""Pytree paths and shapes: the '/'-joined variable paths every checkpoint, count and map uses."""

from __future__ import annotations

from typing import Any


def flatten(tree: Any) -> dict[str, Any]:
    """A nested dict (or any pytree) -> {"a/b/0/c": leaf} with '/'-joined keys."""
    import jax

    def key(entry) -> str:
        for attr in ("key", "idx", "name"):
            if hasattr(entry, attr):
                return str(getattr(entry, attr))
        return str(entry)

    return {"/".join(key(k) for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """{"a/b/c": shape} of a pytree of arrays or ShapeDtypeStructs."""
    return {k: tuple(v.shape) for k, v in flatten(tree).items()}
