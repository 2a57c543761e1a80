"""What a run assembles from its config, shared by the local trainer, the ``torchrun`` trainer, the
evaluation and the verl launcher; none of them owns it (recipes wire them):

* :func:`policy_path`: the policy folder (``model.path``, or the built-in warm-started tiny policy);
* :func:`build_tools`: the tool set (``multi_turn``), by :func:`tools.build_tool_set`;
* :func:`episode_config`: agent_env's episode settings from the ``rollout``, ``multi_turn`` and
  ``reward`` sections (:meth:`agent_env.EpisodeConfig.from_sections`, the one translation);
* :func:`resolve_device`, :func:`seed_everything`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from otb_tir import ConfigError

__all__ = ["build_tools", "episode_config", "policy_path", "resolve_device", "seed_everything"]


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> Any:
    """``auto`` → CUDA when there is one, else CPU; ``cuda`` without a GPU is a ConfigError."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is available; use trainer.device=cpu")
    return torch.device(name)


def policy_path(cfg: Any) -> Path:
    """``model.path`` (a local Hugging Face model folder), or the built-in tiny policy after its
    (cached) SFT warm start for the run's built-in task (``data.task``)."""
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path={path} is not a local Hugging Face model folder (no config.json)")
        return path
    from otb_tir.defaults.warm_start import task_warm_start

    m = cfg.model
    return Path(task_warm_start(cfg.data.task, steps=m.warm_start_steps, copy_steps=m.warm_start_copy_steps))


def episode_config(cfg: Any, **overrides: Any) -> Any:
    """agent_env's :class:`~agent_env.EpisodeConfig` from the run's ``rollout``, ``multi_turn`` and
    ``reward`` sections (verl's names), ``overrides`` (e.g. ``temperature``) applied last."""
    from agent_env import EpisodeConfig

    return EpisodeConfig.from_sections(cfg.rollout, cfg.multi_turn, cfg.reward, **overrides)


def build_tools(cfg: Any) -> Any:
    """The run's :class:`tools.ToolSet` from ``cfg.multi_turn`` (``tools``, ``tool_config``,
    ``tool_config_path``), by :func:`tools.build_tool_set`. A set with no tools, a tool that does
    not load, a bad config key or schema is a :class:`ConfigError` naming the tool and the reason."""
    from tools import ToolError, build_tool_set

    mt = cfg.multi_turn
    path = mt.tool_config_path
    if path:
        path = str(Path(path).expanduser())
        if not Path(path).is_file():
            raise ConfigError(f"multi_turn.tool_config_path: file not found: {mt.tool_config_path}")
    try:
        return build_tool_set(mt.tools, mt.tool_config, path)  # it takes OmegaConf containers as they are
    except ToolError as e:
        raise ConfigError(f"tools: {e}") from None
