"""Typed user errors. The CLI maps every one of them to one red line and exit code `exit_code`:
2 for bad input (the default; a config that does not fit the devices too), 3 for a diverged run,
4 for a failed write, 5 for a multi-process run whose processes lost each other, 143 for a run stopped
by SIGTERM (preemption) after saving.

Each message names what is wrong (key, value, path, parameter) and the fix, in one sentence.
`device_memory_error` recognises XLA's out-of-memory error, which is no DsvError when it is raised.
"""

import re


class DsvError(Exception):
    """Base of every expected, user-caused error."""

    exit_code = 2


class ConfigError(DsvError, ValueError):
    """An invalid configuration key, value or combination."""


class DataError(DsvError):
    """A dataset, data file or tokenizer that cannot be used."""


class CheckpointError(DsvError):
    """A missing, foreign, truncated or incompatible checkpoint or run directory."""


class DivergenceError(DsvError):
    """A non-finite loss or gradient norm stopped training before that step was applied."""

    exit_code = 3


class RunWriteError(DsvError):
    """A checkpoint, metrics, config or event file could not be written (disk full, permissions)."""

    exit_code = 4


class DeviceMemoryError(DsvError):
    """A compile, a step or a save ran out of accelerator memory (XLA's RESOURCE_EXHAUSTED)."""


DEVICE_MEMORY_FIX = ("lower per_device_batch_size or max_target_length, set remat_policy=full, or shard the state "
                     "further (ici_fsdp_parallelism=-1), and check a config first with `dsv4 plan --target <target>`")
_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED\b.*?(out of memory|allocat)", re.I)  # XLA:GPU, XLA:TPU wordings


def resource_exhausted(exc: BaseException) -> str | None:
    """The `RESOURCE_EXHAUSTED: ...` line of `exc` or of an exception in its cause chain (at most
    160 characters), else None."""
    seen = 0
    while exc is not None and seen < 8:
        for line in str(exc).splitlines():
            at = line.find("RESOURCE_EXHAUSTED")
            if at >= 0:
                return line[at:at + 160].rstrip()
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def is_device_memory(detail: str) -> bool:
    """Whether a `resource_exhausted` line is XLA running out of device memory (not a storage quota)."""
    return _OUT_OF_MEMORY.search(detail) is not None


def device_memory_error(exc: BaseException) -> DeviceMemoryError | None:
    """`exc` (or its cause) as one line when it is XLA's out-of-device-memory error, else None."""
    detail = resource_exhausted(exc)
    if detail is None or not is_device_memory(detail):
        return None
    return DeviceMemoryError(f"out of device memory ({detail}): {DEVICE_MEMORY_FIX}.")


class ClusterError(DsvError):
    """The processes of a multi-process run lost each other: a peer stopped, hung or fell behind."""

    exit_code = 5


class PreemptedError(DsvError):
    """SIGTERM (or JAX's preemption notice) stopped the run after a step whose checkpoint was saved."""

    exit_code = 143
