"""kvfleet's configuration: one pydantic schema for the whole cluster, YAML presets, overrides."""

from configs.load import ConfigError, available_presets, config_from_dict, config_to_yaml, load_config
from configs.schema import (
    ClusterConfig,
    KVCacheConfig,
    ModelConfig,
    PinningConfig,
    RouterConfig,
    SchedulerConfig,
    ServeConfig,
    TransferConfig,
    WorkersConfig,
)

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "KVCacheConfig",
    "ModelConfig",
    "PinningConfig",
    "RouterConfig",
    "SchedulerConfig",
    "ServeConfig",
    "TransferConfig",
    "WorkersConfig",
    "available_presets",
    "config_from_dict",
    "config_to_yaml",
    "load_config",
]
