"""Evaluation configuration: a dataclass schema loaded with the training loader
(:func:`otb_tir.config.load_structured`, the loader training uses: YAML + dotted overrides,
ConfigError naming the key).

The sections reuse the training config's names where the concept is the same (``model``,
``rollout``, ``multi_turn``, ``reward``), so the episode settings come from the same
:func:`otb_tir.builders.episode_config` as training: what is measured is what is trained.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig

from otb_tir import ConfigError
from otb_tir.config import load_structured
from otb_tir.trainer.config import CHOICES, ModelConfig, MultiTurnConfig, RewardConfig, RolloutConfig

__all__ = ["EvalConfig", "load_eval_config", "EVAL_CHOICES", "DEFAULT_CONFIG"]

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "eval_tool_use.yaml"  # shipped in the package


@dataclass
class EvalDataConfig:
    task: str = "arith"  # the task when `files` is empty (a built-in or a plugin), as training's data.task.
    files: list[str] = field(default_factory=list)  # verl-format parquet; empty → built-in held-out split
    size: int = 100  # first `size` problems (0 = all of the files)


@dataclass
class EvalRolloutConfig(RolloutConfig):
    """The training ``rollout`` section (same keys and meaning), with the evaluation's defaults and
    the engine settings a standalone evaluation needs."""

    name: str = "hf"  # engine: hf | vllm | sglang
    n: int = 4  # samples per problem
    device: str = "auto"  # hf engine: auto | cpu | cuda
    dtype: str = "auto"  # hf: float32 when auto; vllm/sglang: the engine default when auto
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to VLLMEngine / SGLangEngine


@dataclass
class EvalSettings:
    pass_k: list[int] = field(default_factory=lambda: [1, 2, 4])  # every k must be <= rollout.n
    without_tools: bool = True  # also run the same model and prompts with tools disabled
    seed: int = 0  # seed of sampling
    max_concurrent_episodes: int | None = None  # None: all episodes at once (the engine batches them)


@dataclass
class OutputConfig:
    dir: str = "runs/eval_tool_use"  # report folder
    name: str = "eval"  # files: <dir>/<name>.json, <name>.md, <name>_*.png
    records: bool = True  # per-episode records in the JSON
    plots: bool = True  # write the PNG figures
    progress: bool = True  # a tqdm progress bar of the episodes


@dataclass
class EvalConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    rollout: EvalRolloutConfig = field(default_factory=EvalRolloutConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalSettings = field(default_factory=EvalSettings)
    output: OutputConfig = field(default_factory=OutputConfig)


#: The training config's choices for the keys eval shares, and the eval engine's own settings.
EVAL_CHOICES: dict[str, tuple[Any, ...]] = {
    **{k: CHOICES[k] for k in ("model.dtype", "rollout.decode_step", "multi_turn.tool_response_truncate_side")},
    "rollout.name": tuple(c for c in CHOICES["rollout.name"] if c != "auto"),  # no trainer to choose for
    "rollout.device": CHOICES["trainer.device"],
    "rollout.dtype": CHOICES["rollout.dtype"],
}


def _check(cfg: DictConfig, given: frozenset[str] = frozenset()) -> None:
    from otb_tir.builders import apply_task_settings, check_sections

    apply_task_settings(cfg, given)  # data.task's turns and budget, unless the user set them
    check_sections(cfg)  # the plugins and the keys training shares (rollout.*, multi_turn.*, reward.*)
    if "eval.pass_k" not in given and cfg.rollout.n >= 1:  # the default k's follow rollout.n, saying so
        dropped = [k for k in cfg.eval.pass_k if k > cfg.rollout.n]
        cfg.eval.pass_k = [k for k in cfg.eval.pass_k if 1 <= k <= cfg.rollout.n] or [1]
        if dropped:
            logging.getLogger(__name__).warning(
                "eval.pass_k: %s not reported: pass@k needs rollout.n >= k (rollout.n=%d); raise rollout.n for them",
                ", ".join(f"pass@{k}" for k in dropped),
                cfg.rollout.n,
            )
    if cfg.rollout.max_batch_size <= 0:
        raise ConfigError(f"'rollout.max_batch_size' must be > 0; got {cfg.rollout.max_batch_size}")
    if cfg.data.size < 0:
        raise ConfigError(f"'data.size' must be >= 0 (0 = every problem of data.files); got {cfg.data.size}")
    if not cfg.data.files and cfg.data.size == 0:
        raise ConfigError("'data.size' must be > 0 with the built-in generator (data.files is empty)")
    ks = list(cfg.eval.pass_k)
    if not ks:
        raise ConfigError("'eval.pass_k' must list at least one k (e.g. [1])")
    bad = [k for k in ks if k < 1 or k > cfg.rollout.n]
    if bad:
        raise ConfigError(
            f"'eval.pass_k' = {ks}: every k must be in 1..rollout.n ({cfg.rollout.n}); "
            f"bad: {bad}. Raise rollout.n or drop those k"
        )
    if len(set(ks)) != len(ks):
        raise ConfigError(f"'eval.pass_k' = {ks} lists a k twice")
    if cfg.eval.max_concurrent_episodes is not None and cfg.eval.max_concurrent_episodes < 1:
        raise ConfigError("'eval.max_concurrent_episodes' must be >= 1 or null")
    if cfg.eval.without_tools and cfg.multi_turn.format == "code_block":
        raise ConfigError(
            "eval.without_tools=true needs multi_turn.format=hermes: the code_block format runs "
            "every code block with the python tool, so it has no tools-disabled variant; "
            "set eval.without_tools=false"
        )
    if not cfg.output.name or "/" in cfg.output.name:
        raise ConfigError(f"'output.name' must be a plain file stem; got {cfg.output.name!r}")


def load_eval_config(path: str | Path | None = DEFAULT_CONFIG, overrides: Sequence[str] = ()) -> DictConfig:
    """Schema defaults ← YAML (default: the shipped ``otb_tir/configs/eval_tool_use.yaml``) ← ``key=value``
    overrides, validated (unknown keys, bad types, choices, ranges, ``k > n``).

    Files, tools and the tokenizer are checked when the run starts (:func:`otb_tir.evaluation.run.prepare`).
    """
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+")
        if key.split(".", 1)[0] == "verl":  # the training loader passes verl.* through; eval has no verl section
            raise ConfigError(
                f"unknown config key '{key}'; the evaluation config has no 'verl' section "
                f"(valid top-level keys: {', '.join(EvalConfig.__dataclass_fields__)})"
            )
    return load_structured(EvalConfig, path, overrides, choices=EVAL_CHOICES, check=_check)
