"""Config values: KEY=VALUE overrides parsed as YAML, and values coerced to a key's declared type.

DESIGN.md, "Layout": command-line overrides are flat MaxText-style `key=value` strings whose
values YAML parses (`indexer_topk=16`, `compress_ratios=[0,4]`); a value YAML cannot parse stays a
plain string (regexes). `coerce` turns a YAML value into the type the Config dataclass declares
for its key (bool, int, float, str or a tuple of one of them), or raises `ConfigError` naming the
key, the value and the type it must have. core/config/schema.py applies the parsed overrides.
"""

from __future__ import annotations

import typing
from typing import Any

import yaml

from core.errors import ConfigError


def parse_override(text: str) -> tuple[str, Any]:
    """'key=value' -> (key, YAML-parsed value)."""
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not KEY=VALUE: write it like indexer_topk=16.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # plain strings such as regexes with YAML-special characters
    return key, value


def coerce(key: str, value: Any, hint: Any) -> Any:
    """`value` as type `hint` (the Config field `key`'s annotation), else ConfigError."""
    bad = ConfigError(f"{key}={value!r} has the wrong type: it must be {_type_name(hint)}.")
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if isinstance(value, str) and item is str:
            value = [value] if value else []
        if not isinstance(value, (list, tuple)):
            raise bad
        return tuple(_coerce_scalar(item, v, bad) for v in value)
    return _coerce_scalar(hint, value, bad)


def _coerce_scalar(kind: type, value: Any, bad: ConfigError) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise bad
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    return float(value)  # YAML reads 1e-3 (no dot) as a string
                except ValueError:
                    raise bad from None
            raise bad
        return float(value)
    if kind is str:
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise bad
        return str(value)
    raise bad


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return f"a list of {typing.get_args(hint)[0].__name__}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]


def plain(value: Any) -> Any:
    """A field value as YAML writes it (tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value
