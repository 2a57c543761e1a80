"""Builders of what a run assembles from its config, shared by the local trainer, the ``torchrun``
trainer, the evaluation and the verl launcher (one place per mechanism; recipes wire them).
"""

from __future__ import annotations

from typing import Any

from otb_tir import ConfigError

__all__ = ["build_tools"]


def build_tools(cfg: Any) -> Any:
    """The run's :class:`tools.ToolSet` from ``cfg.multi_turn`` (``tools``, ``tool_config``,
    ``tool_config_path``), by :func:`tools.build_tool_set`. A set with no tools, a tool that does
    not load, a bad config key or schema is a :class:`ConfigError` naming the tool and the reason."""
    from pathlib import Path

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
