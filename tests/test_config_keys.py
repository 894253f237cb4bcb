"""Every leaf key of default.yaml: loads with its default, round-trips through ``--set``, and a
wrong-typed value fails with a ConfigError keyed by exactly that dotted path."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

import pytest
import yaml

from deploy.config import DEFAULT_CONFIG_PATH, Config, ConfigError, load_config


def _leaves(node: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else key
        out.extend(_leaves(value, path) if isinstance(value, dict) else [(path, value)])
    return out


LEAVES = _leaves(yaml.safe_load(DEFAULT_CONFIG_PATH.read_text()))


def _hint(key: str) -> Any:
    """The type hint of dotted ``key`` in :class:`Config`."""
    hint: Any = Config
    for part in key.split("."):
        hint = typing.get_type_hints(hint)[part]
    assert not dataclasses.is_dataclass(hint), f"{key} is a section, not a leaf"
    return hint


def _arms(hint: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(hint)
    return typing.get_args(hint) if origin is Union or origin is types.UnionType else (hint,)


def _accepts_str(hint: Any) -> bool:
    def takes_str(arm: Any) -> bool:
        literal = typing.get_origin(arm) is Literal
        return arm is str or (literal and any(isinstance(a, str) for a in typing.get_args(arm)))

    return any(takes_str(arm) for arm in _arms(hint))


def _wrong_values(hint: Any) -> list[str]:
    """YAML texts of values no arm of ``hint`` accepts: a mapping always, then a string for a key
    that takes no string, or a list for one that does (no leaf takes both a string and a list)."""
    if _accepts_str(hint):
        assert not any(typing.get_origin(arm) in (list, tuple) for arm in _arms(hint)), hint
        return ["{bad: 1}", "[1]"]
    return ["{bad: 1}", "'abc'"]


def _dump(value: Any) -> str:
    """``value`` as one line of YAML, as a user would write it after ``--set key=``."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def _at(data: dict, key: str) -> Any:
    for part in key.split("."):
        data = data[part]
    return data


def _field_paths(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        path = f"{prefix}.{f.name}" if prefix else f.name
        out.extend(_field_paths(hint, path) if dataclasses.is_dataclass(hint) else [path])
    return out


def test_leaves_are_every_config_field_in_order():
    assert [k for k, _ in LEAVES] == _field_paths(Config)


@pytest.mark.parametrize("key, default", LEAVES, ids=[k for k, _ in LEAVES])
def test_key_loads_with_its_default(key, default):
    assert _at(load_config().to_dict(), key) == default
    assert _at(Config().to_dict(), key) == default


@pytest.mark.parametrize("key, default", LEAVES, ids=[k for k, _ in LEAVES])
def test_key_round_trips_through_an_override(key, default):
    assert load_config(None, [f"{key}={_dump(default)}"]) == load_config()


@pytest.mark.parametrize("key", [k for k, _ in LEAVES])
def test_wrong_typed_value_names_the_key(key):
    for bad in _wrong_values(_hint(key)):
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"{key}={bad}"])
        assert info.value.key == key, bad
        assert str(info.value).startswith(f"{key}: "), bad
