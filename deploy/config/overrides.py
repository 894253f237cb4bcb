"""``"a.b.c=value"`` overrides (the CLI's ``--set``) on plain config data and on built sections."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import yaml

from configkit import ConfigError, Section, to_plain

_S = TypeVar("_S", bound=Section)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"a.b.c=value"`` into ``(["a", "b", "c"], value)``.

    The value is parsed as YAML; ``none``/``None`` also mean null (quote them for the string).
    """
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"invalid override {text!r}; expected KEY=VALUE, e.g. graphs.decode.backend=full")
    if raw.strip() in ("none", "None"):
        return parts, None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {exc}") from None
    return parts, value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A deep copy of plain config ``data`` with each ``"a.b.c=value"`` override set (unvalidated)."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'KEY=VALUE' strings, not a single string")
    data = copy.deepcopy(dict(data))
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return data


def with_overrides(config: _S, overrides: Sequence[str]) -> _S:
    """A copy of ``config`` (any :class:`Section`) with ``"a.b.c=value"`` overrides applied and validated."""
    return type(config).from_dict(apply_overrides(to_plain(config), overrides))
