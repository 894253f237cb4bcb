"""graphfleet configuration: one YAML file loaded into frozen, validated dataclasses.

The composition point: each section is owned by the layer that uses it (:mod:`graphs.config`,
:mod:`worker.config`, :mod:`cluster.config`, ``serve`` here) and re-exported for deploy's callers.

>>> cfg = load_config(None, ["graphs.decode.backend=eager"])
>>> cfg.graphs.decode.backend
'eager'
"""

from cluster.config import ClusterConfig, GroupConfig
from configkit import ConfigError
from deploy.config.loader import DEFAULT_CONFIG_PATH, load_config
from deploy.config.overrides import apply_overrides, parse_override, with_overrides
from deploy.config.schema import Config, ServeConfig
from graphs.config import DecodeGraphConfig, GraphsConfig, PrefillGraphConfig
from worker.config import AttentionConfig, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "AttentionConfig",
    "CacheConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DecodeGraphConfig",
    "EngineConfig",
    "GraphsConfig",
    "GroupConfig",
    "ModelConfig",
    "PrefillGraphConfig",
    "SchedulerConfig",
    "ServeConfig",
    "apply_overrides",
    "load_config",
    "parse_override",
    "with_overrides",
]
