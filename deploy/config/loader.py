"""Reading the YAML config file into a :class:`deploy.config.schema.Config`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from configkit import ConfigError, describe
from deploy.config.overrides import apply_overrides
from deploy.config.schema import Config

DEFAULT_CONFIG_PATH = Path(__file__).parent / "default.yaml"


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
        raise ConfigError(f"{path}: top level must be a mapping of config sections, got {describe(data)}")
    return data


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load and validate a YAML config (None: the packaged ``default.yaml``), then apply overrides.

    Missing keys take their defaults; overrides are ``"a.b.c=value"`` strings whose value is parsed
    with ``yaml.safe_load`` (``=null`` or ``=none``, ``=true``, ``=[1,2,4]``; quote to force a string: ``='123'``).
    Raises :class:`configkit.ConfigError`.
    """
    data = read_yaml(DEFAULT_CONFIG_PATH if path is None else path)
    return Config.from_dict(apply_overrides(data, overrides))
