"""The policy of a run, resolved once at its entry points (``otb-tir-train`` / the recipe,
``otb-tir-eval``, the verl launch): :func:`resolve_policy`.

Everything below the entry points (the builders, the local trainer's parts, the evaluation, verl's
config) reads ``model.path`` as given; only here does an empty one become the built-in tiny policy
after its cached SFT warm start for the run's built-in task (``data.task``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["resolve_policy"]


def resolve_policy(cfg: Any) -> Path:
    """``model.path`` as a folder; when it is empty, the built-in warm-started tiny policy, written
    into ``cfg.model.path`` (so ``config.yaml`` and ``summary.json`` name the folder that ran).

    Under ``torchrun`` every rank calls this: the warm start's cache builds it once under a lock
    (:func:`agent_env.cache.publish`) and the others find it there."""
    from otb_tir.builders import policy_path, task

    if cfg.model.cold_start.base and not _is_cold_start(cfg.model.path):
        if cfg.model.path:
            from otb_tir import ConfigError

            raise ConfigError(
                f"model.cold_start.base={cfg.model.cold_start.base} and model.path={cfg.model.path}: RL starts "
                "from the cold start's SFT'd folder; unset one of them"
            )
        cfg.model.path = str(_cold_start(cfg))
    elif cfg.model.path == "smollm2":
        from otb_tir.defaults.cold_start import named_model

        cfg.model.path = str(named_model("smollm2"))
    if not cfg.model.path:
        from otb_tir.defaults.warm_start import task_warm_start

        m = cfg.model
        cfg.model.path = str(
            task_warm_start(
                task(cfg).warm_start,
                steps=m.warm_start_steps,
                copy_steps=m.warm_start_copy_steps,
                shipped=m.warm_start_shipped,
            )
        )
    return policy_path(cfg)


def _is_cold_start(path: str | None) -> bool:
    """A folder this resolution already made (resolving twice, e.g. on every rank, keeps it)."""
    return bool(path) and (Path(str(path)) / "otb_tir_cold_start.json").is_file()


def _cold_start(cfg: Any) -> Path:
    """``model.cold_start``'s SFT'd folder (cached): the task's traces with the run's tools, under
    bfloat16 autocast where ``model.dtype`` (auto: :func:`otb_tir.trainer.parts.model_dtype_for`) says so."""
    from otb_tir import ConfigError
    from otb_tir.builders import task
    from otb_tir.defaults.cold_start import ColdStartSettings, cold_start_policy, named_model
    from otb_tir.defaults.traces import DEFAULT_TOOLS
    from otb_tir.trainer.parts import model_dtype_for_folder

    c = cfg.model.cold_start
    names = cfg.multi_turn.tools or task(cfg).tools or DEFAULT_TOOLS  # the tools the run's prompts list
    if "calculator" not in names or cfg.multi_turn.tool_config_path or cfg.multi_turn.get("mcp_servers"):
        raise ConfigError(
            "model.cold_start: the traces call the built-in calculator and render the built-in tools' schemas; "
            f"multi_turn.tools={list(names)} (and no tool_config_path / mcp_servers) must include calculator"
        )
    base = named_model(c.base)
    dtype = model_dtype_for_folder(cfg, base)
    settings = ColdStartSettings(
        steps=c.steps,
        batch_size=c.batch_size,
        lr=c.lr,
        n_traces=c.n_traces,
        seed=0,
        task=cfg.data.task,
        tools=tuple(names),
        dtype="bfloat16" if dtype == "bfloat16" else "float32",
    )
    return cold_start_policy(base, settings)
