"""agent_env: multi-turn tool episodes, engines, batch rollout and the math reward."""


class EnvError(Exception):
    """Bad episode configuration or an unusable chat template (never raised for model mistakes)."""


# Imported after EnvError (the submodules import it). `agent_env.rollout` is the function (the
# public name the docs use); its module is reached with `from agent_env.rollout import ...`.
from agent_env.episode import AgentEnv, EpisodeConfig  # noqa: E402
from agent_env.records import ToolCallRecord, Trajectory, TurnRecord  # noqa: E402
from agent_env.rollout import RolloutBatch, collate, rollout, rollout_async  # noqa: E402

__all__ = [
    "EnvError",
    "AgentEnv",
    "EpisodeConfig",
    "Trajectory",
    "TurnRecord",
    "ToolCallRecord",
    "RolloutBatch",
    "collate",
    "rollout",
    "rollout_async",
]
