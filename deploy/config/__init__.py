"""graphfleet configuration: one YAML file loaded into frozen, validated dataclasses.

>>> cfg = load_config(None, ["graphs.decode.backend=eager"])
>>> cfg.graphs.decode.backend
'eager'
"""

from deploy.config.loader import DEFAULT_CONFIG_PATH, ConfigError, load_config, with_overrides
from deploy.config.schema import (
    AttentionConfig,
    CacheConfig,
    ClusterConfig,
    Config,
    DecodeGraphConfig,
    GraphsConfig,
    ModelConfig,
    PrefillGraphConfig,
    SchedulerConfig,
    ServeConfig,
    parse_bytes,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "AttentionConfig",
    "CacheConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DecodeGraphConfig",
    "GraphsConfig",
    "ModelConfig",
    "PrefillGraphConfig",
    "SchedulerConfig",
    "ServeConfig",
    "load_config",
    "parse_bytes",
    "with_overrides",
]
