"""agent_env: multi-turn tool episodes, engines, batch rollout and the math reward."""


class EnvError(Exception):
    """Bad episode configuration or an unusable chat template (never raised for model mistakes)."""
