"""Typed run configuration (pydantic) loaded from YAML with command-line overrides."""

from agentrl.config.loader import ConfigError, apply_override, check_model_loads, dump_yaml, load_config
from agentrl.config.schema import Config

__all__ = ["Config", "ConfigError", "apply_override", "check_model_loads", "dump_yaml", "load_config"]
