"""A train step's memory against a device's (DESIGN.md, "Planning").

- `state_bytes_needed`: the parameters and AdamW's two moments of the trainable ones, per device,
  from shapes and shardings alone: the run's preflight compares it with `device_memory_bytes`
  before anything is built or compiled (a lower bound of the step's needs: `dsv4 plan` adds the
  compiler's temporaries).
- `compiled_memory`: a compiled step's per-device bytes from XLA's memory analysis, the figures
  `dsv4 plan` reports; `step_memory_note` turns them into the run header's note on accelerators.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from core.parallel.sharding import shard_bytes


def state_bytes_per_device(state) -> int:
    """Bytes of one device's shards of an abstract state (ShapeDtypeStructs with shardings): the
    largest shard of every leaf, so uneven and replicated leaves count in full."""
    return sum(shard_bytes(leaf) for leaf in jax.tree.leaves(state))


def state_bytes_needed(state, trainable: Callable[[Sequence[Any]], bool], mu_dtype: str, nu_dtype: str) -> int:
    """Per-device bytes of the variables of `state` (an nnx State of ShapeDtypeStructs with the run's
    shardings) plus AdamW's moments of its trainable parameters, in `mu_dtype` and `nu_dtype`."""
    moments = jnp.dtype(mu_dtype).itemsize + jnp.dtype(nu_dtype).itemsize
    need = 0
    for path, leaf in nnx.to_flat_state(state):
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        shard = state_bytes_per_device(value)
        need += shard
        if isinstance(leaf, nnx.Param) and trainable(path):  # + the two moments, in their own dtypes
            need += shard // value.dtype.itemsize * moments
    return need


def device_memory_bytes(device) -> tuple[int | None, str]:
    """(usable bytes of one device, where the figure comes from): the allocator's bytes_limit on an
    accelerator; on the CPU this host's RAM over its local devices; None when unknown."""
    if device.platform != "cpu":
        limit = (device.memory_stats() or {}).get("bytes_limit")
        return (int(limit), "the device's allocator limit") if limit else (None, "")
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None, ""
    return ram // max(jax.local_device_count(), 1), "this host's RAM over its devices"


def compiled_memory(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled step from XLA's memory analysis (also `dsv4 plan`'s figures).

    Returns:
      {"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "code_bytes", "total_bytes"}:
      total = arguments + temporaries + code + outputs not aliased with the (donated) arguments.
    """
    mem = compiled.memory_analysis()
    out = {"argument_bytes": int(mem.argument_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
           "alias_bytes": int(mem.alias_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
           "code_bytes": int(mem.generated_code_size_in_bytes)}
    out["total_bytes"] = (out["argument_bytes"] + out["temp_bytes"] + out["code_bytes"]
                          + max(out["output_bytes"] - out["alias_bytes"], 0))
    return out


def memory_note(total_bytes: int, usable_bytes: int) -> str:
    """The header's note on the step's memory, "step needs <total> GiB of <usable> GiB per device (<share> %)"."""
    return (f"step needs {total_bytes / 2**30:.1f} GiB of {usable_bytes / 2**30:.1f} GiB per device "
            f"({100 * total_bytes / usable_bytes:.0f} %)")


def step_memory_note(compiled, device) -> str | None:
    """`memory_note` of a compiled step on an accelerator: its total (`compiled_memory`) against
    the device's usable memory (its allocator's bytes_limit); None on the CPU or without figures."""
    if compiled is None or device.platform == "cpu":
        return None
    try:
        usable = (device.memory_stats() or {}).get("bytes_limit")
        total = compiled_memory(compiled)["total_bytes"]
    except Exception:  # noqa: BLE001  (a backend without memory statistics or analysis)
        return None
    return memory_note(total, usable) if usable else None
