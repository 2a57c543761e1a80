"""otb_tir: the training side of otb-tir (token statistics, advantage estimators, PPO, trainers)."""

__version__ = "0.1.0"


class ConfigError(ValueError):
    """Bad configuration: an unknown or ill-typed key, or an impossible combination of settings."""
