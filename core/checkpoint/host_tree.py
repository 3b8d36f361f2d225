"""Saving a tree of host NumPy arrays as an ordinary `model` item in bounded extra memory.

`dsv4 import-hf` builds the whole model as NumPy buffers and must write it as the run layout's
`model` item (core.checkpoint.store) without a second copy of the model (DESIGN.md, "Real
checkpoints"). Orbax's default save holds two: its NumPy handler deep-copies every host leaf
before writing (`deepcopy_host_arrays=True`), and TensorStore's OCDBT driver buffers each data
file up to `ocdbt_target_data_file_size` (2 GiB by default) per file in flight, each chunk being the
whole leaf by default. `HostTreeHandler` is `StandardCheckpointHandler` (same typestr, same
on-disk layout: zarr3 arrays in one OCDBT store, the same `_METADATA` tree) with three save
options changed:
  - NumPy leaves are written in place (`NumpyHandler(deepcopy_host_arrays=False)`); the caller
    must not modify them until the save returns (a synchronous save does);
  - every array is chunked to at most `chunk_bytes` (`SaveArgs.chunk_byte_size`);
  - OCDBT data files are at most `chunk_bytes` (`ocdbt_target_data_file_size`).
What lives at once beyond the tree: the chunks and data files in flight, a bounded number times
`chunk_bytes`, independent of the model's size, where Orbax's default keeps about two extra
copies of the tree (docs/checkpoints.md#import-and-export-at-flash-width).
Readers need nothing special: chunking and file sizes are recorded in the checkpoint itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

CHUNK_BYTES = 16 * 2**20


def _registry():
    """Orbax's global type handlers, except NumPy arrays: written without a defensive copy."""
    import jax

    th = ocp.type_handlers
    same = [(ty, th.get_type_handler(ty)) for ty in (int, float, bytes, np.number, jax.Array, str)]
    return th.create_type_handler_registry(*same, (np.ndarray, th.NumpyHandler(deepcopy_host_arrays=False)))


class HostTreeHandler(ocp.StandardCheckpointHandler):
    """`StandardCheckpointHandler` for host NumPy trees: no copy, bounded chunks (module docstring).

    Args:
      chunk_bytes: the largest array chunk and OCDBT data file written (default CHUNK_BYTES).
    """

    def __init__(self, chunk_bytes: int | None = None):
        super().__init__()
        # The standard handler delegates to a PyTree handler; this one carries the no-copy registry.
        self._impl = ocp.PyTreeCheckpointHandler(type_handler_registry=_registry())
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES
        # The step's metadata names the standard handler, as a normal save's does (readers use it);
        # the class keeps its own name in Orbax's registry of handlers for HostTreeSave.
        self.typestr = ocp.StandardCheckpointHandler.typestr

    async def async_save(self, directory, item: Any = None, save_args: Any = None, args: Any = None):
        """Start writing `args.item` (a `HostTreeSave`)."""
        import jax

        item = self._validate_save_state(args.item)
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=self.chunk_bytes), item)
        return await self._impl.async_save(directory, args=ocp.args.PyTreeSave(
            item, save_args=save_args, ocdbt_target_data_file_size=self.chunk_bytes))


@ocp.args.register_with_handler(HostTreeHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class HostTreeSave(ocp.args.CheckpointArgs):
    """The save argument of `HostTreeHandler`: a nested dict of NumPy arrays, unchanged until saved."""

    item: Any

