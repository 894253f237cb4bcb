"""Typed, validated configuration sections: the machinery every layer's config is built with.

A section is a frozen dataclass that mixes in :class:`Section`; :meth:`Section.from_dict` checks
plain (YAML) data against its type hints and its ``__post_init__`` checks ranges with
:func:`check` and friends. Every failure is a :class:`ConfigError` naming the full key path.

This package imports no graphfleet layer: graphs, worker, cluster and deploy each own their
sections and build on it.
"""

from configkit.checks import check, check_ladder, check_min, parse_bytes
from configkit.errors import ConfigError, TypeMismatch, describe, show_value
from configkit.suggest import did_you_mean
from configkit.typed import Section, build, convert, to_plain

__all__ = [
    "ConfigError",
    "Section",
    "TypeMismatch",
    "build",
    "check",
    "check_ladder",
    "check_min",
    "convert",
    "describe",
    "did_you_mean",
    "parse_bytes",
    "show_value",
    "to_plain",
]
