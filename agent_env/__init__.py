"""agent_env: multi-turn tool episodes, engines, batch rollout and the math reward."""


class EnvError(Exception):
    """Bad episode configuration or an unusable chat template (never raised for model mistakes)."""


# extras with an install script of their own on a machine without a GPU (their pins differ)
_CPU_SCRIPTS = {"verl": "scripts/install_verl_env.sh", "vllm": "scripts/install_test_env.sh (.venv-vllm)"}


def install_hint(extra: str) -> str:
    """How to install the optional extra ``extra``: otb-tir is installed from its checkout (it is not
    on the package index), so the hint is the command that works there."""
    script = _CPU_SCRIPTS.get(extra.removesuffix("-cpu"))
    cpu = f"; on a machine without a GPU: bash {script}" if script else ""
    return f"pip install -e '.[{extra}]' in the otb-tir checkout{cpu}"


# Imported after EnvError (the submodules import it). `agent_env.rollout` is the function (the
# public name the docs use); its module is reached with `from agent_env.rollout import ...`.
from agent_env.episode import AgentEnv, EpisodeConfig  # noqa: E402
from agent_env.records import ToolCallRecord, Trajectory, TurnRecord  # noqa: E402
from agent_env.rollout import RolloutBatch, collate, rollout, rollout_async  # noqa: E402

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
