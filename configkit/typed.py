"""Plain YAML data <-> frozen config dataclasses, checked against the dataclasses' type hints.

Nothing here knows a graphfleet section. The builder understands nested dataclasses,
``Literal[...]``, unions (``X | None``, ``int | str``), ``int``/``float``/``bool``/``str`` and
``list[X]`` / ``tuple[X, ...]``. Every error is a :class:`~configkit.errors.ConfigError` whose key
is the full dotted path from the top of the data given to :func:`build`.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

from configkit.errors import ConfigError, TypeMismatch, describe, show_value
from configkit.suggest import did_you_mean

_T = TypeVar("_T")
_NoneType = type(None)


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
    """Instantiate dataclass ``cls`` from mapping ``data`` found at key path ``path``.

    Unknown keys, wrong types and the errors of ``__post_init__`` (keyed relative to ``cls``)
    raise :class:`ConfigError` keyed by the full path.
    """
    if not isinstance(data, Mapping):
        raise TypeMismatch(f"expected a mapping, got {describe(data)}", key=path or None)
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
    """Check ``value`` against type ``hint`` and return it in its config form (lists become tuples
    where the hint says ``tuple``, ints become floats where it says ``float``)."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        # `section:` with every child commented out parses as null: treat it as all defaults.
        return build(hint, {} if value is None else value, path)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if any(type(value) is type(a) and value == a for a in allowed):
            return value
        names = [str(a) for a in allowed]
        hint_text = did_you_mean(value, names) if isinstance(value, str) else ""
        raise ConfigError(f"invalid value {show_value(value)}; allowed: {', '.join(names)}{hint_text}", key=path)
    if origin is Union or origin is types.UnionType:
        return _convert_union(hint, value, path)
    if origin in (list, tuple):
        args = typing.get_args(hint)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"{path}: only tuple[X, ...] is supported, got {hint}")
        if not isinstance(value, (list, tuple)):
            raise TypeMismatch(f"expected {_type_name(hint)}, got {describe(value)}", key=path)
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
        raise TypeMismatch(f"expected {_type_name(hint)}, got {describe(value)}", key=path)
    raise TypeError(f"{path}: unsupported config type {hint!r}")


def _convert_union(hint: Any, value: Any, path: str) -> Any:
    errors = []
    for arm in typing.get_args(hint):  # in declared order, so `int | float` keeps ints as ints
        try:
            return convert(arm, value, path)
        except ConfigError as err:
            errors.append(err)
    # Prefer a specific error (bad enum value, bad list element) over "wrong type" for one arm.
    specific = [e for e in errors if not (isinstance(e, TypeMismatch) and e.key == path)]
    if specific:
        raise specific[0]
    raise TypeMismatch(f"expected {_type_name(hint)}, got {describe(value)}", key=path)


def to_plain(obj: Any) -> Any:
    """Dataclasses -> dicts, tuples -> lists, scalars unchanged (the inverse of :func:`build`)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _unknown_key(key: str, allowed: list[str]) -> str:
    return f"unknown key{did_you_mean(key, allowed)}; allowed keys: {', '.join(allowed)}"


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
