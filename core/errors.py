"""Typed user errors. The CLI maps every one of them to one red line and exit code `exit_code`:
2 for bad input (the default), 3 for a diverged run, 4 for a failed write.

Each message names what is wrong (key, value, path, parameter) and the fix, in one sentence.
"""


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
