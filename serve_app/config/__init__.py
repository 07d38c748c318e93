"""headroom's configuration: vocabulary, schema, errors and loading (pure: no ray, vllm or torch)."""

from serve_app.config.errors import ConfigError
from serve_app.config.loading import (
    DEFAULT_CONFIG_DIR,
    available_envs,
    deep_merge,
    load_config,
    load_config_files,
    load_env_config,
    load_yaml,
    parse_config,
)
from serve_app.config.schema import (
    DeploymentSection,
    EngineSection,
    HeadroomConfig,
    ModelSection,
    ResourcesSection,
    SLOSection,
    SpeculativeSection,
)
from serve_app.config.security import SecuritySection
from serve_app.config.workload import WorkloadSection

__all__ = [
    "DEFAULT_CONFIG_DIR",
    "ConfigError",
    "DeploymentSection",
    "EngineSection",
    "HeadroomConfig",
    "ModelSection",
    "ResourcesSection",
    "SLOSection",
    "SecuritySection",
    "SpeculativeSection",
    "WorkloadSection",
    "available_envs",
    "deep_merge",
    "load_config",
    "load_config_files",
    "load_env_config",
    "load_yaml",
    "parse_config",
]
