"""Build every component from an evaluation config, check it at start, run the episodes
(with tools, then the same model and prompts with tools disabled) and write the report.

"Tools disabled" means: the same model, the same problems and the same episode budgets, the
prompts rendered *without* tool schemas (``tools=None`` for the chat template), and an episode
with an empty tool set: a tool call the model still writes is parsed, counted, and answered with
an error observation (``unknown_tool``: "Error: unknown tool 'python'. Available tools: .") in a
``tool`` message, exactly as an unknown tool is answered in training. The episode goes on (up to
``multi_turn.max_assistant_turns``), so a model can still recover and answer directly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from otb_tir import ConfigError

log = logging.getLogger(__name__)

__all__ = ["Prepared", "prepare", "evaluate", "build_engine"]


@dataclass
class Prepared:
    """Everything checked at start: problems, tools, model folder, tokenizer."""

    items: list[dict[str, Any]]
    tools: Any  # tools.ToolSet
    model_path: Path
    tokenizer: Any
    data_desc: str
    extra: dict[str, Any] = field(default_factory=dict)


def _load_items(cfg: DictConfig) -> tuple[list[dict[str, Any]], str]:
    from otb_tir.builders import load_data_files, task_split

    if cfg.data.files:
        items = load_data_files("data.files", cfg.data.files)
        desc = ", ".join(str(f) for f in cfg.data.files)
    else:
        items = task_split(cfg, "test", cfg.data.size, seed=0)  # training's val set
        desc = f"built-in generator ({cfg.data.task} task), held-out split"
    if cfg.data.size:
        items = items[: cfg.data.size]
    if not items:
        raise ConfigError(f"no problems to evaluate in {desc}")
    for i, it in enumerate(items):
        gt = (it.get("reward_model") or {}).get("ground_truth")
        if gt is None or "prompt" not in it:
            raise ConfigError(f"problem {i} of {desc} has no prompt or no reward_model.ground_truth")
    return items, desc


def prepare(cfg: DictConfig) -> Prepared:
    """Check every input before any episode runs; bad input raises :class:`ConfigError`."""
    from agent_env import AgentEnv, EnvError
    from otb_tir.builders import build_tools, check_tokenizer, episode_config, policy_path

    items, desc = _load_items(cfg)
    if cfg.model.path and not (Path(cfg.model.path).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"model.path={cfg.model.path} is not a local Hugging Face model folder (no config.json); "
            "a trained checkpoint is e.g. runs/tir_math/final"
        )
    tools = build_tools(cfg)
    try:
        path = policy_path(cfg)  # model.path (otb-tir-eval resolves the built-in policy: otb_tir.defaults.policy)
        tokenizer = check_tokenizer(path)
        try:  # the episode's own checks (chat template renders, eos, tool schemas) before any episode
            AgentEnv(tokenizer, tools=tools, config=episode_config(cfg))
            if cfg.eval.without_tools:
                AgentEnv(tokenizer, tools={}, config=episode_config(cfg))
        except EnvError as e:
            raise ConfigError(f"model {path}: {e}") from None
    except BaseException:
        from agent_env.rollout import run_sync

        run_sync(tools.close())
        raise
    return Prepared(items=items, tools=tools, model_path=path, tokenizer=tokenizer, data_desc=desc)


async def _start_tools(tools: dict[str, Any]) -> None:
    """Start the tools' workers before the first episode, so a cold start (the sandbox pool
    imports numpy/sympy) is never counted as the model's tool timeout."""
    t0 = time.perf_counter()
    for t in tools.values():
        start = getattr(t, "start", None)
        if start is not None:
            try:
                await start()
            except Exception as e:  # noqa: BLE001 - a sandbox that cannot run would make every figure meaningless
                raise ConfigError(f"tool {t.name!r} could not start: {type(e).__name__}: {e}") from e
    log.info("tools %s started in %.1f s", sorted(tools), time.perf_counter() - t0)


def build_engine(cfg: DictConfig, path: Path, tokenizer: Any) -> Any:
    """The engine named by ``rollout.name`` (an uninstalled engine is a ConfigError naming the pip install)."""
    from agent_env.engines.base import EngineError

    r = cfg.rollout
    kwargs = OmegaConf.to_container(r.engine_kwargs, resolve=True) if r.engine_kwargs else {}
    try:
        if r.name == "hf":
            from agent_env.engines.hf import HFEngine
            from otb_tir.builders import resolve_device

            if kwargs:
                raise ConfigError(
                    f"rollout.engine_kwargs {sorted(kwargs)} are for vllm/sglang; the hf engine takes "
                    "rollout.max_batch_size, rollout.device and rollout.dtype"
                )
            dtype = "float32" if r.dtype == "auto" else r.dtype
            # stop_at_eos=False as in training: turns end at the template's end-of-turn token.
            return HFEngine(
                str(path),
                tokenizer,
                device=resolve_device(r.device),
                dtype=dtype,
                max_batch_size=r.max_batch_size,
                seed=cfg.eval.seed,
                stop_at_eos=False,
                prefix_cache_bytes=None if r.enable_prefix_caching else 0,
                cpu_threads=r.cpu_threads,
                decode_step=r.decode_step,
            )
        from otb_tir.builders import serving_engine

        dtype = None if r.dtype == "auto" else r.dtype
        return serving_engine(r.name, path, dtype=dtype, seed=cfg.eval.seed, engine_kwargs=kwargs)
    except EngineError as e:
        raise ConfigError(f"rollout.name={r.name}: {e}") from None


async def _run_pass(
    engine: Any, env: Any, items: list[dict[str, Any]], cfg: DictConfig, label: str
) -> tuple[list, dict]:
    from agent_env import rollout_async
    from agent_env.records import Prompt

    prompts = [Prompt.from_row(it, uid=f"p{i}", index=i) for i, it in enumerate(items)]
    log.info("%s: %d problems × n=%d episodes", label, len(items), cfg.rollout.n)
    batch = await rollout_async(
        engine,
        env,
        prompts,
        cfg.rollout.n,
        seed=cfg.eval.seed,
        max_concurrent_episodes=cfg.eval.max_concurrent_episodes,
        pad_to="longest",
        progress=cfg.output.progress,
    )
    return batch.trajectories, dict(batch.stats)


def evaluate(cfg: DictConfig, prepared: Prepared | None = None) -> dict[str, Any]:
    """Run the evaluation described by ``cfg``; returns the report (also written to ``output.dir``)."""
    from agent_env import AgentEnv
    from otb_tir.builders import episode_config, seed_everything
    from otb_tir.evaluation.report import build_report, write_report

    t0 = time.perf_counter()
    prep = prepared or prepare(cfg)
    seed_everything(cfg.eval.seed)
    engine = None
    passes: dict[str, tuple[list, dict]] = {}
    try:
        engine = build_engine(cfg, prep.model_path, prep.tokenizer)

        async def main() -> None:
            await _start_tools(prep.tools)
            env = AgentEnv(prep.tokenizer, tools=prep.tools, config=episode_config(cfg))
            passes["with_tools"] = await _run_pass(engine, env, prep.items, cfg, "with tools")
            if cfg.eval.without_tools:
                env_off = AgentEnv(prep.tokenizer, tools={}, config=episode_config(cfg))
                passes["without_tools"] = await _run_pass(engine, env_off, prep.items, cfg, "tools disabled")

        from agent_env.rollout import run_sync

        run_sync(main())
    finally:
        from agent_env.rollout import run_sync

        if engine is not None:
            run_sync(engine.close())
        run_sync(prep.tools.close())
    report = build_report(cfg, prep, passes, wall_s=time.perf_counter() - t0)
    write_report(report, cfg)
    return report
