"""Build every component from a config and run: warm start → eval → TIR-OTB training → eval.

Kept apart from ``recipes/train_tir_math.py`` (a thin script) so that tests and other recipes can
call :func:`run` directly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from otb_tir.builders import held_out, resolve_device, resolved_plugins, seed_everything

log = logging.getLogger(__name__)


def engine_summary(engine) -> dict:
    """What generated the rollouts: the engine's class and, where it says (the HF engine), which decode
    step ran (``fused``, ``compiled``, ``model``), its compile's seconds and a failed compile's error."""
    out: dict = {"engine_class": type(engine).__name__}
    for key in ("decode_step", "compile_s", "compile_error"):
        if hasattr(engine, key):
            out[key] = getattr(engine, key)
    return out


def run(cfg, *, reward_fn=None, setup: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """The local trainer end to end; returns (and, on rank 0, writes) ``summary.json``.

    Under ``torchrun --nproc_per_node N`` (``WORLD_SIZE`` > 1) the actor is sharded with FSDP2
    across the N processes (see :mod:`otb_tir.trainer.distributed`); otherwise one process.
    ``reward_fn``: optional ``(text, ground_truth, trajectory) -> float`` replacing the math reward.
    ``setup``: called with the :class:`~otb_tir.trainer.trainer.Trainer` once it is built (before
    it resumes): tests and benchmarks swap a part by assignment (``trainer.estimator = ...``).

    setup (process group, tools, parts, trainer) → train (held-out before, fit, held-out after, the
    final model) → cleanup, in reverse order of setup (an ``ExitStack``), whatever happened.
    """
    import torch.distributed as dist

    from agent_env.rollout import run_sync
    from otb_tir.builders import build_tools
    from otb_tir.trainer.distributed import barrier, init_distributed, shutdown_distributed
    from otb_tir.trainer.parts import build_parts, trainer_settings
    from otb_tir.trainer.trainer import Trainer

    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        # ---------------------------------------------------------------- setup
        owns_group = not (dist.is_available() and dist.is_initialized())
        info = init_distributed(cfg.trainer.device, cfg.trainer.dist_backend)
        if owns_group and info.distributed:
            stack.callback(shutdown_distributed)
        if info.rank > 0:  # one voice: rank 0 logs progress, the others only warnings
            logging.getLogger().setLevel(logging.WARNING)
        out = Path(cfg.trainer.output_dir)
        if info.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        barrier(info.world_size)
        seed_everything(cfg.trainer.seed)
        device = info.device if info.distributed else resolve_device(cfg.trainer.device)
        tools = build_tools(cfg)  # before any heavy work: a tool that does not load stops the run here
        stack.callback(_close_tools, tools)
        parts = build_parts(cfg, tools, info, device, reward_fn)
        ends: dict[str, Any] = {"parts": parts}  # the parts the run ends with (setup may swap some)
        stack.callback(_close_parts, ends)
        # the sandbox's worker pool starts now, on the loop the rollouts run on, not inside step 1's rollout
        # (where its start-up shared the cores with generation and stalled the first steps' tool calls)
        run_sync(tools.start())
        summary = _summary_head(cfg, parts, tools, info.world_size)
        if info.rank == 0 and (cfg.eval.before or cfg.eval.after):
            log.info("held-out evaluation: %s", summary["held_out"])
        trainer = ends["parts"] = Trainer(trainer_settings(cfg, autocast_dtype=parts.autocast_dtype), parts)
        if setup is not None:
            setup(trainer)
        # ---------------------------------------------------------------- train
        summary.update(_train(trainer, parts.tokenizer, info, out, before=cfg.eval.before, after=cfg.eval.after))
    summary["wall_time_s"] = time.perf_counter() - t_start
    if info.rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _close_tools(tools) -> None:
    from agent_env.rollout import run_sync

    run_sync(tools.close())  # on the loop the rollouts ran on, so the sandbox closes cleanly


def _close_parts(ends: dict[str, Any]) -> None:
    from agent_env.rollout import run_sync

    last = ends["parts"]  # the Trainer once built (its attributes are the parts it ran with), else the Parts
    run_sync(last.engine.close())
    if last.logger is not None:
        last.logger.close()


def _summary_head(cfg, parts, tools, world: int) -> dict[str, Any]:
    """What the run is: the model, estimator, engine, seed, steps, tools, plugins, the held-out set."""
    from otb_tir.machine import cpu_kernels

    cold = cfg.model.get("cold_start")
    return {
        "model": str(parts.policy_path),
        # the folder RL started from: model.cold_start's SFT'd one when set (its base and settings below)
        "start_model": str(parts.policy_path),
        **({"cold_start": OmegaConf.to_container(cold, resolve=True)} if cold is not None and cold.base else {}),
        "adv_estimator": cfg.algorithm.adv_estimator,
        "engine": cfg.rollout.name,  # the rollout engine: hf, or a serving engine (vllm, sglang)
        "seed": cfg.trainer.seed,
        "steps": cfg.trainer.total_steps,
        # on-policy, or one step off-policy (trainer.one_step_off_policy: each batch sampled one update
        # before the step that trains on it)
        "policy_lag": 1 if cfg.trainer.one_step_off_policy else 0,
        "world_size": world,
        "cpu_kernels": cpu_kernels(),  # the float order's source: figures move with it across CPUs
        "tools": tools.describe(),
        "plugins": resolved_plugins(cfg, tools),
        "held_out": held_out(cfg, len(parts.val_items)),
    }


def _train(trainer, tokenizer, info, out: Path, *, before: bool, after: bool) -> dict[str, Any]:
    """Resume, the held-out figures before, fit, the figures after, the final model folder."""
    from otb_tir.metrics import summary_figures
    from otb_tir.trainer.distributed import barrier, broadcast_object
    from otb_tir.trainer.timing import format_step_time, step_time_summary

    rank, world = info.rank, info.world_size
    summary: dict[str, Any] = {}
    resumed = trainer.maybe_resume()
    before_file = out / "before.json"
    if broadcast_object(before and resumed and before_file.is_file(), world):
        summary["before"] = json.loads(before_file.read_text())
    elif before:
        _, trajs = trainer.evaluate(tag="val")
        summary["before"] = summary_figures(trajs)
        if rank == 0:
            before_file.write_text(json.dumps(summary["before"]))
        log.info("before training: %s", summary["before"])
    t_fit = time.perf_counter()
    trainer.fit()
    summary["timing"] = step_time_summary(trainer.timing_totals, time.perf_counter() - t_fit)
    summary["steps_without_signal"] = trainer.steps_without_signal  # every group's rewards equal
    summary["generation"] = engine_summary(trainer.engine)  # beside "engine", the configured name
    if rank == 0:
        log.info("where the training loop's time went:\n%s", format_step_time(summary["timing"]))
    if after:
        _, trajs = trainer.evaluate(tag="val")
        summary["after"] = summary_figures(trajs)
        log.info("after training: %s", summary["after"])
    final = out / "final"
    if rank == 0:
        # under FSDP the engine's copy holds the full weights of the last update
        (trainer.engine.model if info.distributed else trainer.model).save_pretrained(final)
        tokenizer.save_pretrained(final)
    barrier(world)
    summary["final_model"] = str(final)
    return summary
