"""What a run assembles from its config, shared by the local trainer, the ``torchrun`` trainer, the
evaluation and the verl launcher; none of them owns it (recipes wire them):

* :func:`policy_path`: the policy folder (``model.path``, which the entry points set to the built-in
  warm-started tiny policy when the user gives none: :func:`otb_tir.defaults.policy.resolve_policy`);
* :func:`build_tools`: the tool set (``multi_turn``), by :func:`tools.build_tool_set`;
* :func:`episode_config`: agent_env's episode settings from the ``rollout``, ``multi_turn`` and
  ``reward`` sections (:meth:`agent_env.EpisodeConfig.from_sections`, the one translation);
* :func:`task`: the run's task (``data.task``), :func:`check_plugins`: every name a config gives
  an extension point (task, tool-call format, rewards, estimator) resolved at start,
  :func:`check_sections`: that and the ranges of the keys training and eval share, and
  :func:`resolved_plugins`: what they resolved to and from where (``summary.json``, the eval report);
* :func:`load_data_files`, :func:`check_tokenizer` and :func:`check_inputs`: the user's data and
  model checked before anything is loaded or written (a ConfigError, one line, with the fix);
* :func:`resolve_device`, :func:`seed_everything`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from otb_tir import ConfigError

__all__ = [
    "build_tools",
    "check_inputs",
    "check_plugins",
    "check_tokenizer",
    "held_out",
    "load_data_files",
    "check_sections",
    "apply_task_settings",
    "episode_config",
    "policy_path",
    "resolve_device",
    "resolved_plugins",
    "seed_everything",
    "task",
    "task_split",
]


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


#: The Qwen-style chat template (tool calls and tool results) the project ships with its tiny policy
#: (``otb_tir.defaults.tiny.CHAT_TEMPLATE_PATH``, named here by path: the defaults sit above the builders).
SHIPPED_CHAT_TEMPLATE = Path(__file__).resolve().parent / "defaults" / "chat_template.jinja"


def load_data_files(key: str, files: Any) -> list[dict[str, Any]]:
    """The rows of the verl-format parquet ``files`` given by config key ``key``; a file that is
    missing, unreadable or not in verl's format is a :class:`ConfigError` naming the key, the file
    and what is wrong (with the fix: ``otb-tir-prepare-data`` writes the format)."""
    from agent_env import EnvError
    from agent_env.math_task.data import load_parquet

    rows: list[dict[str, Any]] = []
    for f in files:
        path = Path(str(f)).expanduser()
        if not path.is_file():
            raise ConfigError(f"{key}: file not found: {path} (from {Path.cwd()})")
        try:
            rows += load_parquet(path)
        except EnvError as e:
            raise ConfigError(f"{key}: {e}") from None
    return rows


def check_tokenizer(path: Path) -> Any:
    """The tokenizer of the model folder ``path``, which must have a chat template (tool use is
    rendered through it): otherwise a :class:`ConfigError` pointing at the one the project ships."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load a tokenizer from {path}: {str(e).splitlines()[0]}") from None
    if not getattr(tok, "chat_template", None):
        raise ConfigError(
            f"the tokenizer of {path} has no chat template, and tool calls are rendered through one: "
            "save the model's own (with tool support) into the folder, or the Qwen-style one this project "
            f"ships ({SHIPPED_CHAT_TEMPLATE}): tok.chat_template = open(that file).read(); tok.save_pretrained(folder)"
        )
    return tok


def check_inputs(cfg: Any) -> None:
    """A training run's own inputs, before anything is loaded or written (the local trainer,
    ``torchrun`` and ``trainer=verl`` alike): ``data.train_files`` / ``data.val_files`` exist and are
    verl-format parquet with well-formed rows, the held-out figures come from the user's data when
    they train on their own, and ``model.path`` is a model folder whose tokenizer has a chat
    template. Raises :class:`ConfigError`."""
    train = load_data_files("data.train_files", cfg.data.train_files)
    load_data_files("data.val_files", cfg.data.val_files)
    if cfg.data.train_files and not cfg.data.val_files and (cfg.eval.before or cfg.eval.after):
        # refused, not warned: the before/after figures would silently be another task's
        raise ConfigError(
            "data.train_files is set but data.val_files is not: the held-out figures before and after "
            f"training would be on data.task={cfg.data.task}'s generated problems, not your data. Give "
            "data.val_files=[test.parquet], or eval.before=false eval.after=false to train without them"
        )
    if cfg.data.train_files and len(train) < cfg.data.train_batch_size:  # (the cursor says it again, later)
        raise ConfigError(
            f"data.train_batch_size ({cfg.data.train_batch_size}) exceeds the number of training prompts "
            f"({len(train)} in data.train_files): lower it or give more data"
        )
    if cfg.model.path:
        check_tokenizer(policy_path(cfg))


def held_out(cfg: Any, problems: int | None = None) -> dict[str, Any]:
    """How the held-out figures of a training run are measured (``summary.json`` 'held_out', the
    log): which problems, how many, samples per problem and decoding. ``otb-tir-eval`` gives the
    same figure as 'mean@1' with ``rollout.n=1 rollout.temperature=0`` on the same data."""
    if cfg.data.val_files:
        source = "data.val_files: " + ", ".join(str(f) for f in cfg.data.val_files)
    else:
        source = f"data.task={cfg.data.task}: its generator's held-out split (seed 0)"
    t = float(cfg.eval.temperature)
    return {
        "source": source,
        "problems": problems,
        "samples_per_problem": int(cfg.eval.n),
        "decoding": "greedy" if t == 0 else f"sampled at temperature {t:g}",
    }


def policy_path(cfg: Any) -> Path:
    """``model.path``, a local Hugging Face model folder. An empty one is resolved at the entry points
    (otb-tir-train, otb-tir-eval, the verl launch) into the built-in warm-started tiny policy by
    :func:`otb_tir.defaults.policy.resolve_policy`; here it is a :class:`ConfigError` saying so."""
    if not cfg.model.path:
        raise ConfigError(
            "model.path is not set: give a local Hugging Face model folder (--model), or resolve the built-in "
            "tiny policy first with otb_tir.defaults.policy.resolve_policy(cfg), as otb-tir-train and otb-tir-eval do"
        )
    path = Path(cfg.model.path).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path={path} is not a local Hugging Face model folder (no config.json)")
    return path


def episode_config(cfg: Any, **overrides: Any) -> Any:
    """agent_env's :class:`~agent_env.EpisodeConfig` from the run's ``rollout``, ``multi_turn`` and
    ``reward`` sections (verl's names), ``overrides`` (e.g. ``temperature``) applied last."""
    from agent_env import EpisodeConfig

    overrides.setdefault("task", cfg.data.task)
    return EpisodeConfig.from_sections(cfg.rollout, cfg.multi_turn, cfg.reward, **overrides)


def build_tools(cfg: Any) -> Any:
    """The run's :class:`tools.ToolSet` from ``cfg.multi_turn`` (``tools``, ``tool_config``,
    ``tool_config_path``, ``mcp_servers``), by :func:`tools.build_tool_set`. A set with no tools, a
    tool that does not load, a bad config key or schema, an MCP server that does not start is a
    :class:`ConfigError` naming the tool (or server) and the reason."""
    from tools import ToolError, build_tool_set

    mt = cfg.multi_turn
    names = mt.tools
    mcp_servers = _mcp_servers_path(cfg)
    if names is None and not mt.tool_config_path and not mcp_servers and task(cfg).tools is not None:
        names = list(task(cfg).tools)  # the task's tools when the run names none
    path = mt.tool_config_path
    if path:
        path = str(Path(path).expanduser())
        if not Path(path).is_file():
            raise ConfigError(f"multi_turn.tool_config_path: file not found: {mt.tool_config_path}")
    try:
        return build_tool_set(names, mt.tool_config, path, mcp_servers)  # it takes OmegaConf containers as they are
    except ToolError as e:
        raise ConfigError(f"tools: {e}") from None


def _mcp_servers_path(cfg: Any) -> str | None:
    """``multi_turn.mcp_servers`` as an existing file's path (None when unset); ConfigError if missing."""
    path = getattr(cfg.multi_turn, "mcp_servers", None)
    if not path:
        return None
    full = Path(str(path)).expanduser()
    if not full.is_file():
        raise ConfigError(f"multi_turn.mcp_servers: file not found: {path}")
    return str(full.resolve())


def task(cfg: Any) -> Any:
    """The run's :class:`agent_env.tasks.Task` (``data.task``: a built-in, an ``otb_tir.tasks``
    entry point or a path ``pkg.mod:task`` / ``file.py:task``); ConfigError if it does not resolve."""
    from agent_env import EnvError
    from agent_env.tasks import get_task

    try:
        return get_task(cfg.data.task)
    except EnvError as e:
        raise ConfigError(f"data.task: {e}") from None


def apply_task_settings(cfg: Any, given: frozenset[str]) -> None:
    """The task's config defaults (:attr:`agent_env.tasks.Task.settings`) applied to ``cfg``, each
    unless the user set that key (``given``); a key of a section this config lacks (e.g. ``actor``
    in eval) is skipped, an unknown key of a section it has is a ConfigError naming the task."""
    from omegaconf import OmegaConf

    for key, value in task(cfg).settings.items():
        section = key.split(".", 1)[0]
        if key in given or section not in cfg:
            continue
        if OmegaConf.select(cfg, key, default=_MISSING) is _MISSING:
            raise ConfigError(f"data.task={cfg.data.task}: its setting {key!r} is not a config key")
        OmegaConf.update(cfg, key, value, merge=False)


_MISSING = object()


def task_split(cfg: Any, split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` items of ``split`` from the run's task, checked: verl-format dicts with a prompt and a
    ``reward_model.ground_truth`` (a user's task that returns something else is a ConfigError)."""
    t = task(cfg)
    try:
        items = list(t.make_split(split, n, seed))
    except Exception as e:  # noqa: BLE001 - a user's generator, named
        raise ConfigError(
            f"data.task={cfg.data.task}: make_split({split!r}, {n}, {seed}) failed: {type(e).__name__}: {e}"
        ) from e
    for i, it in enumerate(items):
        if not isinstance(it, dict) or "prompt" not in it or not isinstance(it.get("reward_model"), dict):
            raise ConfigError(
                f"data.task={cfg.data.task}: item {i} of make_split({split!r}) is not a verl-format dict with "
                f"'prompt' and 'reward_model': {str(it)[:200]}"
            )
        it.setdefault("data_source", t.data_source)
    return items[:n]


def _reward_specs(cfg: Any) -> dict[str, str]:
    from agent_env.rewards import reward_spec

    r = cfg.reward
    default = reward_spec(r.custom_reward_function.path, r.custom_reward_function.name) or r.name or task(cfg).reward
    specs = {"default": default}
    specs.update({f"data_source {k}": str(v) for k, v in (r.per_data_source or {}).items()})
    return specs


def check_plugins(cfg: Any) -> None:
    """Resolve every name the config gives an extension point, now, so that a plugin that does not
    load stops the run at start with the reason: ``data.task``, ``multi_turn.format``, the reward
    section's functions and (training) ``algorithm.adv_estimator``. Tools are checked when the tool
    set is built (:func:`build_tools`)."""
    from agent_env import EnvError
    from agent_env.parsers import FORMATS
    from agent_env.rewards import REWARDS

    task(cfg)
    try:
        FORMATS.resolve(cfg.multi_turn.format)
    except EnvError as e:
        raise ConfigError(f"multi_turn.format: {e}") from None
    for where, spec in _reward_specs(cfg).items():
        try:
            REWARDS.resolve(spec)
        except EnvError as e:
            raise ConfigError(f"reward ({where}): {e}") from None
    if "algorithm" in cfg:
        from otb_tir.advantage import ESTIMATORS

        ESTIMATORS.resolve(cfg.algorithm.adv_estimator)  # raises ConfigError naming the problem


def check_sections(cfg: Any) -> None:
    """The checks training and eval share, each key checked in one place: the plugins
    (:func:`check_plugins`), ``rollout.n``, and the episode's ``rollout`` / ``multi_turn`` /
    ``reward`` keys by :class:`agent_env.EpisodeConfig`'s own validator."""
    from agent_env import EnvError

    check_plugins(cfg)
    if cfg.rollout.n <= 0:
        raise ConfigError(f"'rollout.n' must be > 0; got {cfg.rollout.n}")
    threads = cfg.rollout.get("cpu_threads")
    if threads is not None and threads < 0:
        raise ConfigError(f"'rollout.cpu_threads' must be >= 0 (0 = torch's own setting) or null; got {threads}")
    try:
        episode_config(cfg)
    except EnvError as e:
        raise ConfigError(str(e).removeprefix("invalid episode config: ")) from None


def resolved_plugins(cfg: Any, tools: Any = None) -> dict[str, Any]:
    """What each extension point resolved to and from where, for ``summary.json`` and the eval
    report: ``{"task": {name, source}, "format": ..., "reward": {where: {reward, source}},
    "estimator": ..., "tools": {name: source}}``."""
    from agent_env.parsers import FORMATS
    from agent_env.rewards import REWARDS
    from agent_env.tasks import TASKS

    out: dict[str, Any] = {
        "task": {"name": cfg.data.task, "source": TASKS.source(cfg.data.task)},
        "format": {"name": cfg.multi_turn.format, "source": FORMATS.source(cfg.multi_turn.format)},
        "reward": {
            where: {"reward": spec, "source": REWARDS.source(spec)} for where, spec in _reward_specs(cfg).items()
        },
    }
    if "algorithm" in cfg:
        from otb_tir.advantage import ESTIMATORS

        est = cfg.algorithm.adv_estimator
        out["estimator"] = {"name": est, "source": ESTIMATORS.source(est)}
    if tools is not None:
        describe = getattr(tools, "describe", None)
        records = describe() if callable(describe) else [{"name": n, "source": "given"} for n in tools]
        out["tools"] = {r["name"]: r["source"] for r in records}
    else:  # the names, without building the tools
        from tools.registry import TOOLS

        mt = cfg.multi_turn
        given = mt.tool_config_path or getattr(mt, "mcp_servers", None)
        names = mt.tools if mt.tools is not None else (task(cfg).tools or ([] if given else None))
        if names is not None:
            out["tools"] = {str(n): TOOLS.source(str(n)) for n in names}
    return out


def list_plugins(mcp_servers: str | None = None) -> str:
    """Every registered tool, reward, estimator, tool-call format and task, with where each comes
    from (the console scripts' ``--list``); with ``mcp_servers`` (an mcpServers file) also the tools
    its servers list, each with its server (the servers are started to ask them, then stopped)."""
    from agent_env.parsers import FORMATS
    from agent_env.rewards import REWARDS
    from agent_env.tasks import TASKS
    from otb_tir.advantage import ESTIMATORS
    from tools.registry import TOOLS

    lines = []
    for title, reg in (
        ("tools", TOOLS),
        ("rewards", REWARDS),
        ("advantage estimators", ESTIMATORS),
        ("tool-call formats", FORMATS),
        ("tasks", TASKS),
    ):
        lines.append(f"{title} (entry-point group {reg.group}; or a path pkg.mod:attr / file.py:attr):")
        width = max((len(n) for n in reg.names()), default=0)
        lines += [f"  {name:<{width}}  {source}" for name, source in reg.describe()]
        if reg is TOOLS and mcp_servers:
            lines += _list_mcp(mcp_servers)
    return "\n".join(lines)


def _list_mcp(path: str) -> list[str]:
    from tools.base import close_quietly
    from tools.mcp import build_mcp_tools

    found = build_mcp_tools(path)  # ToolError: the caller says "config error"
    try:
        lines = [f"tools of the MCP servers in {path} (multi_turn.mcp_servers):"]
        width = max((len(t.name) for t, _ in found), default=0)
        lines += [f"  {t.name:<{width}}  MCP server {t.server!r} ({t.transport}): {t.description}" for t, _ in found]
        return lines
    finally:
        close_quietly([t for t, _ in found])


def serving_engine(name: str, path: Path, *, dtype: str | None, seed: int, engine_kwargs: dict[str, Any]) -> Any:
    """A vLLM or sglang engine serving the HF checkpoint at ``path`` (training, eval and benchmarks
    build theirs here). An engine that is not installed, or cannot run on this machine, is an
    EngineError naming the install."""
    if name == "vllm":
        from agent_env.engines.vllm import VLLMEngine

        return VLLMEngine(str(path), dtype=dtype, seed=seed, **engine_kwargs)
    if name == "sglang":
        from agent_env.engines.sglang import SGLangEngine

        return SGLangEngine(str(path), dtype=dtype or "auto", seed=seed, **engine_kwargs)
    raise ValueError(f"no serving engine {name!r}: vllm | sglang")
