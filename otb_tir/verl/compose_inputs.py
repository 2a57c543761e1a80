"""What verl's workers read besides its config, written or placed by :func:`otb_tir.verl.compose.compose_verl_config`:

* :func:`data_files`: the train / test parquet files (the user's, or the built-in task's splits written
  under ``<output_dir>/data``);
* :func:`agent_loop_entries`: the agent-loop YAML's entries (our agent loop under both names, with the
  tools, format, task, per-turn budgets and the reward section);
* :func:`reward_section`: the reward section with its file paths absolute (verl's workers run in other
  folders).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from otb_tir import ConfigError
from tools import DEFAULT_TOOLS
from tools.plugins import absolute_path_name

__all__ = ["AGENT_LOOP_TARGET", "agent_loop_entries", "data_files", "reward_section"]

AGENT_LOOP_TARGET = "otb_tir.verl.agent_loop.OTBToolAgentLoop"


def data_files(cfg: DictConfig, out: Path) -> tuple[list[str], list[str]]:
    from agent_env.math_task.data import AGENT_NAME, write_parquet
    from otb_tir.builders import task_split

    def split(name: str, n: int, seed: int) -> list[dict[str, Any]]:
        items = task_split(cfg, name, n, seed=seed)
        for it in items:
            it.setdefault("agent_name", AGENT_NAME)  # our agent loop runs a user task's items too
        return items

    train = [str(Path(p).expanduser().resolve()) for p in cfg.data.train_files]
    val = [str(Path(p).expanduser().resolve()) for p in cfg.data.val_files]
    for p in train + val:
        if not Path(p).is_file():
            raise ConfigError(f"data file not found: {p}")
    if not train:
        path = out / "data" / "train.parquet"
        write_parquet(split("train", cfg.data.train_size, cfg.trainer.seed), path)
        train = [str(path)]
    if not val:
        n = min(cfg.data.val_size, cfg.eval.size) if cfg.eval.size else cfg.data.val_size
        path = out / "data" / "test.parquet"
        write_parquet(split("test", n, 0), path)  # the held-out set does not move with the seed
        val = [str(path)]
    return train, val


def reward_section(cfg: DictConfig) -> dict[str, Any]:
    """The reward section with its file paths absolute (verl's workers run in other folders)."""
    reward = OmegaConf.to_container(cfg.reward, resolve=True)
    crf = reward["custom_reward_function"]
    if crf.get("path") and crf["path"].endswith(".py"):
        crf["path"] = str(Path(crf["path"]).expanduser().resolve())
    reward["per_data_source"] = {k: absolute_path_name(v) for k, v in reward["per_data_source"].items()}
    if reward.get("name"):
        reward["name"] = absolute_path_name(reward["name"])
    return reward


def agent_loop_entries(cfg: DictConfig) -> list[dict[str, Any]]:
    from otb_tir.builders import task

    mt = cfg.multi_turn
    names = mt.tools
    mcp_servers = mt.get("mcp_servers")
    if names is None and not mt.tool_config_path and not mcp_servers:
        names = task(cfg).tools or DEFAULT_TOOLS  # the task's tools, else the default set
    if names is not None:
        otb_tools = [absolute_path_name(n) for n in names]
    else:  # build_tool_set's "not given": [] → only the YAML's tools; None → every MCP server's tools too
        otb_tools = None if mcp_servers else []
    kwargs = {
        "_target_": AGENT_LOOP_TARGET,
        "otb_tools": otb_tools,
        "otb_format": absolute_path_name(mt.format),
        "otb_task": absolute_path_name(cfg.data.task),
        "tool_config": OmegaConf.to_container(mt.tool_config, resolve=True),
        "tool_config_path": str(Path(mt.tool_config_path).expanduser().resolve()) if mt.tool_config_path else None,
        # the same mcpServers file: each verl worker process starts its own client sessions (tools.mcp)
        "otb_mcp_servers": str(Path(mcp_servers).expanduser().resolve()) if mcp_servers else None,
        "max_tokens_per_turn": int(cfg.rollout.max_tokens_per_turn),
        "tool_timeout": float(mt.tool_timeout),
        "system_prompt": None,
        "reward": reward_section(cfg),
    }
    return [{"name": "otb_tir_agent", **kwargs}, {"name": "tool_agent", **kwargs}]
