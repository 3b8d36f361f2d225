"""The one parameter count: the official checkpoint's tensor inventory, MTP excluded.

Every figure dsv4 prints about a model's size comes from `count_parameters`: the training
header (`core.train.materialise.build`), `dsv4 inspect-ckpt` (from saved metadata, no array read), its
`--json`, and `core.model.transformer.param_counts`.

  parameters  = every nnx.Param + the router selection biases (`.../gate/bias`)
              = trainable + frozen + router_bias
  trainable   = the nnx.Params whose '/'-joined path one of `trainable_parameters_mask`'s
                regexes fully matches (empty mask = all): what gradients move
  frozen      = the other nnx.Params
  router_bias = the selection biases, moved by the load-balance update, never by gradients
  hash_table  = the token -> experts tables (`.../gate/tid2eid`): integer state, not counted
  scales      = the e8m0 block scales of a weight held in the released format (`.../scales`,
                core/model/quant.py): not counted; its `.../codes` count as the weight's elements
                (two per byte for the packed FP4 routed experts, `.../experts/w*/codes`)

Kinds are told apart by path, following core/model/moe.py's names. Import-light (no jax), so the
CLI's metadata-only commands can use it.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Mapping, Sequence

KINDS = ("param", "router_bias", "hash_table", "scales")


def variable_kind(path: str) -> str:
    """'hash_table' for .../gate/tid2eid, 'router_bias' for .../gate/bias, 'scales' for a held
    weight's .../scales, else 'param'."""
    parts = path.split("/")
    if parts[-1] == "tid2eid":
        return "hash_table"
    if parts[-1] == "scales":
        return "scales"
    if parts[-2:] == ["gate", "bias"]:
        return "router_bias"
    return "param"


def mask_matcher(patterns: Sequence[str], frozen: Sequence[str] = ()) -> Callable[[str], bool]:
    """The one trainable rule (the train step's optimizer and gradients, the counts, inspect-ckpt).

    Args:
      patterns: `trainable_parameters_mask` regexes; empty = every parameter.
      frozen: `frozen_parameters_mask` regexes, which win over `patterns`.
    Returns:
      '/'-joined path -> True when one of `patterns` fully matches it (or there are none) and no
      `frozen` pattern does.
    """
    compiled, never = [re.compile(p) for p in patterns], [re.compile(p) for p in frozen]
    return lambda path: ((not compiled or any(c.fullmatch(path) for c in compiled))
                         and not any(c.fullmatch(path) for c in never))


def count_parameters(shapes: Mapping[str, Sequence[int]], trainable: Callable[[str], bool] | None = None
                     ) -> dict[str, int]:
    """Element counts of a model's variables under the one counting rule (module docstring).

    Args:
      shapes: {'/'-joined variable path: shape} of every model variable (params, router biases,
        hash tables), e.g. `core.checkpoint.store.shapes(nnx.to_pure_dict(nnx.state(model)))`.
      trainable: path -> trained by gradients? (default: every nnx.Param).
    Returns:
      {"parameters", "trainable", "frozen", "router_bias", "hash_table"}.
    """
    out = dict.fromkeys(("parameters", "trainable", "frozen", "router_bias", "hash_table"), 0)
    for path, shape in shapes.items():
        n, kind = math.prod(shape), variable_kind(path)
        if kind == "scales":
            continue
        if kind == "hash_table":
            out["hash_table"] += n
            continue
        if path.endswith("/codes"):  # a held weight: its elements, two per byte when FP4-packed
            path = path.removesuffix("/codes")
            n *= 2 if re.search(r"(^|/)experts/w[123]$", path) else 1
        out["parameters"] += n
        if kind == "router_bias":
            out["router_bias"] += n
        elif trainable is None or trainable(path):
            out["trainable"] += n
        else:
            out["frozen"] += n
    return out
