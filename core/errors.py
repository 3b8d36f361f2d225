"""Typed user errors. The CLI maps every one of them to one red line and exit code 2.

Each message names what is wrong (key, value, path, parameter) and the fix, in one sentence.
"""


class DsvError(Exception):
    """Base of every expected, user-caused error."""


class ConfigError(DsvError, ValueError):
    """An invalid configuration key, value or combination."""


class DataError(DsvError):
    """A dataset, data file or tokenizer that cannot be used."""


class CheckpointError(DsvError):
    """A missing, foreign, truncated or incompatible checkpoint or run directory."""
