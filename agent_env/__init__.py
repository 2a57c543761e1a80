"""agent_env: multi-turn tool episodes, engines, batch rollout and the math reward.

``agent_env.rollout`` is the function (the public name the docs use); its module is reached with
``from agent_env.rollout import ...``. Submodules import :class:`EnvError` and :func:`install_hint`
from :mod:`agent_env.errors`, never from here (one exception until the next reship of the warm start:
``agent_env.math_task.data``, see tests/test_layers.py, so the errors come first)."""

from agent_env.errors import EnvError, install_hint

# isort: split
from agent_env.episode import AgentEnv
from agent_env.episode_config import EpisodeConfig
from agent_env.records import ToolCallRecord, Trajectory, TurnRecord
from agent_env.rollout import RolloutBatch, collate, rollout, rollout_async

__all__ = [
    "install_hint",
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
