"""Generic YAML -> frozen-dataclass loading, driven by the dataclasses' type hints.

Nothing here knows the graphfleet sections (those live in :mod:`deploy.config.schema`); the
machinery understands nested dataclasses, ``Literal[...]``, unions (``X | None``, ``int | str``),
``int``/``float``/``bool``/``str`` and ``list[X]`` / ``tuple[X, ...]``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

DEFAULT_CONFIG_PATH = Path(__file__).parent / "default.yaml"

_T = TypeVar("_T")
_NoneType = type(None)


class ConfigError(ValueError):
    """An invalid configuration; the message names the full key path, the bad value and what is allowed.

    ``key`` is the dotted key path the error is about (None for file-level errors); ``reason`` is
    the message without the key prefix.
    """

    def __init__(self, reason: str, *, key: str | None = None) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}" if key else reason)

    def under(self, prefix: str) -> ConfigError:
        """The same error with its key path moved under the section ``prefix``."""
        if not prefix:
            return self
        return type(self)(self.reason, key=f"{prefix}.{self.key}" if self.key else prefix)


class _TypeMismatch(ConfigError):
    """A value of the wrong type (lets unions report all their alternatives at once)."""


class Section:
    """Mixin for config dataclasses: ``from_dict`` (validating) and ``to_dict`` (plain YAML data)."""

    @classmethod
    def from_dict(cls: type[_T], data: Mapping[str, Any]) -> _T:
        """Build and validate from plain data; missing keys take the dataclass defaults."""
        return build(cls, data)

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts/lists/scalars such that ``type(self).from_dict(self.to_dict()) == self``."""
        return to_plain(self)


def build(cls: type[_T], data: Any, path: str = "") -> _T:
    """Instantiate dataclass ``cls`` from mapping ``data`` found at key path ``path``."""
    if not isinstance(data, Mapping):
        raise _TypeMismatch(f"expected a mapping, got {_show(data)}", key=path or None)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        key_path = _join(path, str(key))
        if key not in fields:
            raise ConfigError(_unknown_key(str(key), list(fields)), key=key_path)
        kwargs[key] = convert(hints[key], value, key_path)
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError("missing required key", key=_join(path, name))
    try:
        return cls(**kwargs)
    except ConfigError as err:  # raised by __post_init__ with a key relative to this section
        raise err.under(path) from None


def convert(hint: Any, value: Any, path: str) -> Any:
    """Check ``value`` against type ``hint`` and return it in its config form."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        # `section:` with every child commented out parses as null: treat it as all defaults.
        return build(hint, {} if value is None else value, path)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if any(type(value) is type(a) and value == a for a in allowed):
            return value
        names = [str(a) for a in allowed]
        hint_text = _did_you_mean(value, names) if isinstance(value, str) else ""
        raise ConfigError(f"invalid value {_show_value(value)}; allowed: {', '.join(names)}{hint_text}", key=path)
    if origin is Union or origin is types.UnionType:
        return _convert_union(hint, value, path)
    if origin in (list, tuple):
        args = typing.get_args(hint)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"{path}: only tuple[X, ...] is supported, got {hint}")
        if not isinstance(value, (list, tuple)):
            raise _TypeMismatch(f"expected {_type_name(hint)}, got {_show(value)}", key=path)
        return origin(convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if hint is Any:
        return value
    if hint is float and type(value) is int:
        return float(value)
    if hint in (int, float, bool, str) and type(value) is hint:  # exact: bool is not an int here
        return value
    if hint is _NoneType and value is None:
        return None
    if hint in (int, float, bool, str, _NoneType):
        raise _TypeMismatch(f"expected {_type_name(hint)}, got {_show(value)}", key=path)
    raise TypeError(f"{path}: unsupported config type {hint!r}")


def _convert_union(hint: Any, value: Any, path: str) -> Any:
    errors = []
    for arm in typing.get_args(hint):  # in declared order, so `int | float` keeps ints as ints
        try:
            return convert(arm, value, path)
        except ConfigError as err:
            errors.append(err)
    # Prefer a specific error (bad enum value, bad list element) over "wrong type" for one arm.
    specific = [e for e in errors if not (isinstance(e, _TypeMismatch) and e.key == path)]
    if specific:
        raise specific[0]
    raise _TypeMismatch(f"expected {_type_name(hint)}, got {_show(value)}", key=path)


def to_plain(obj: Any) -> Any:
    """Dataclasses -> dicts, tuples -> lists, scalars unchanged (the inverse of :func:`build`)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


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


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The top-level mapping of YAML file ``path`` (an empty file is an empty mapping)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of config sections, got {_show(data)}")
    return data


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Any:
    """Load and validate a YAML config (None: the packaged ``default.yaml``), then apply overrides.

    Missing keys take their defaults; overrides are ``"a.b.c=value"`` strings whose value is parsed
    with ``yaml.safe_load`` (``=null`` or ``=none``, ``=true``, ``=[1,2,4]``; quote to force a string: ``='123'``).
    Returns a :class:`deploy.config.Config`; raises :class:`ConfigError`.
    """
    from deploy.config.schema import Config  # schema imports this module

    data = read_yaml(DEFAULT_CONFIG_PATH if path is None else path)
    return Config.from_dict(apply_overrides(data, overrides))


def with_overrides(config: _T, overrides: Sequence[str]) -> _T:
    """A copy of ``config`` (any :class:`Section`) with ``"a.b.c=value"`` overrides applied and validated."""
    return type(config).from_dict(apply_overrides(to_plain(config), overrides))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _unknown_key(key: str, allowed: list[str]) -> str:
    return f"unknown key{_did_you_mean(key, allowed)}; allowed keys: {', '.join(allowed)}"


def _did_you_mean(word: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not match:  # case typos ('FULL') score low with difflib
        match = [c for c in choices if c.lower() == word.lower()]
    return f" (did you mean {match[0]!r}?)" if match else ""


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if hint is _NoneType:
        return "null"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin is Union or origin is types.UnionType:
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    if origin in (list, tuple):
        return f"list[{_type_name(typing.get_args(hint)[0])}]"
    return getattr(hint, "__name__", repr(hint))


def _show_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _show(value: Any) -> str:
    """``'16' (str)``: the bad value and its type, for type errors."""
    return f"{_show_value(value)} ({'null' if value is None else type(value).__name__})"
