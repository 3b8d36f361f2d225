"""Pytree paths and shapes: the '/'-joined variable paths every checkpoint, count, mask and map uses."""

from __future__ import annotations

from typing import Any, Sequence


def join(path: Sequence[Any]) -> str:
    """'/'-joined names of a path: nnx path entries (str, int) or jax key entries (DictKey,
    SequenceKey, GetAttrKey, ...), e.g. `layers/3/attn/indexer/wq_b`. A Variable's own `value`
    attribute entry is left out, so a path through an `nnx.State` of Variables names the same
    parameter as the path through its pure dict."""
    names = []
    for entry in path:
        for attr in ("key", "idx", "name"):
            if hasattr(entry, attr):
                name = getattr(entry, attr)
                break
        else:
            name = entry
        if not (hasattr(entry, "name") and name == "value"):
            names.append(str(name))
    return "/".join(names)


def flatten(tree: Any) -> dict[str, Any]:
    """A nested dict (or any pytree) -> {"a/b/0/c": leaf} with `join`ed keys."""
    import jax

    return {join(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """{"a/b/c": shape} of a pytree of arrays or ShapeDtypeStructs."""
    return {k: tuple(v.shape) for k, v in flatten(tree).items()}
