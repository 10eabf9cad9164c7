"""The job's configuration: Hydra YAML groups in this folder, composed, then validated into typed dataclasses.

    cfg = compose_config(["algorithm=gae"])   # DictConfig, as `python -m hybridrl.main_ppo algorithm=gae` builds
    config = validate_config(cfg)             # PPOConfig, or ConfigError listing every problem
    check_paths(config)                       # files and model directories exist
    check_before_start(config)                # ... and data, models, reward function, resources, run dir are usable

The rules across keys and the preflight checks live beside the subsystems they are about (<subsystem>/config_checks.py)
and register with config/checks.py; import hybridrl.checks before validating (it imports them all).
"""
from hybridrl.config.compose import CONFIG_DIR, compose_config
from hybridrl.config.preflight import check_before_start, check_paths
from hybridrl.config.schema import PPOConfig
from hybridrl.config.validation import NOT_IMPLEMENTED, NOT_IMPLEMENTED_VALUES, ConfigError, validate_config

__all__ = [
    "CONFIG_DIR",
    "NOT_IMPLEMENTED",
    "NOT_IMPLEMENTED_VALUES",
    "ConfigError",
    "PPOConfig",
    "check_before_start",
    "check_paths",
    "compose_config",
    "validate_config",
]
