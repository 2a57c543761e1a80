"""Build every component from a config and run: warm start → eval → TIR-OTB training → eval.

Kept apart from ``recipes/train_tir_math.py`` (a thin script) so that tests and other recipes can
call :func:`run` directly.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from otb_tir import ConfigError
from otb_tir.builders import policy_path, resolve_device, resolved_plugins, seed_everything

log = logging.getLogger(__name__)


def load_items(cfg) -> tuple[list[dict], list[dict]]:
    """Training and held-out prompts: verl parquet files, or the built-in generator's splits."""
    from agent_env.math_task.data import load_parquet
    from otb_tir.builders import task_split

    if cfg.data.train_files:
        train = [row for f in cfg.data.train_files for row in load_parquet(f)]
    else:
        train = task_split(cfg, "train", cfg.data.train_size, seed=cfg.trainer.seed)
    if cfg.data.val_files:
        val = [row for f in cfg.data.val_files for row in load_parquet(f)]
    else:
        # the held-out set does not move with the seed
        val = task_split(cfg, "test", cfg.data.val_size, seed=0)
    return train, val[: cfg.eval.size] if cfg.eval.size else val


def build_optimizer(cfg, model):
    o = cfg.actor.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas))
    total = max(cfg.trainer.total_steps, 1)

    def factor(step: int) -> float:
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.lr_scheduler == "cosine":
            import math

            progress = (step - o.warmup_steps) / max(total - o.warmup_steps, 1)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def run(cfg, *, reward_fn=None) -> dict[str, Any]:
    """The local trainer end to end; returns (and, on rank 0, writes) ``summary.json``.

    Under ``torchrun --nproc_per_node N`` (``WORLD_SIZE`` > 1) the actor is sharded with FSDP2
    across the N processes (see :mod:`otb_tir.trainer.distributed`); otherwise one process.
    ``reward_fn``: optional ``(text, ground_truth, trajectory) -> float`` replacing the math reward.
    """
    import torch.distributed as dist

    from otb_tir.trainer.distributed import init_distributed, shutdown_distributed

    owns_group = not (dist.is_available() and dist.is_initialized())
    info = init_distributed(cfg.trainer.device, cfg.trainer.dist_backend)
    try:
        return _run(cfg, info, reward_fn)
    finally:
        if owns_group and info.distributed:
            shutdown_distributed()


def _run(cfg, info, reward_fn) -> dict[str, Any]:
    from otb_tir.builders import build_tools
    from otb_tir.trainer.distributed import barrier

    t_start = time.perf_counter()
    rank, world = info.rank, info.world_size
    if rank > 0:  # one voice: rank 0 logs progress, the others only warnings
        logging.getLogger().setLevel(logging.WARNING)
    out = Path(cfg.trainer.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    barrier(world)
    seed_everything(cfg.trainer.seed)
    if cfg.rollout.name != "hf":
        raise ConfigError(
            f"the local trainer runs rollout.name=hf; rollout.name={cfg.rollout.name} "
            "is for trainer=verl (vLLM / sglang servers managed by verl)"
        )
    device = info.device if info.distributed else resolve_device(cfg.trainer.device)
    tools = build_tools(cfg)  # before any heavy work: a tool that does not load stops the run here
    try:
        return _run_with_tools(cfg, info, reward_fn, tools, device, t_start, out)
    finally:
        from agent_env.rollout import run_sync

        run_sync(tools.close())  # on the loop the rollouts ran on, so the sandbox closes cleanly


def _run_with_tools(cfg, info, reward_fn, tools, device, t_start: float, out: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_env import AgentEnv
    from agent_env.engines.hf import HFEngine
    from otb_tir.builders import episode_config
    from otb_tir.metrics import summary_figures
    from otb_tir.trainer.distributed import barrier, broadcast_object, fsdp_wrap, full_state_dict
    from otb_tir.trainer.trainer import Trainer, format_step_time, step_time_summary

    rank, world = info.rank, info.world_size
    path = policy_path(cfg) if rank == 0 else None
    path = Path(broadcast_object(str(path) if path else None, world))  # rank 0 builds the cached warm start
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    low_precision = None if cfg.model.dtype == "float32" else getattr(torch, cfg.model.dtype)
    autocast = None
    if low_precision is not None and device.type != "cuda":
        log.warning("model.dtype=%s needs a GPU here; training in float32 on %s", cfg.model.dtype, device)
    elif low_precision is not None and not info.distributed:
        autocast = low_precision
    ref_model = None
    if cfg.actor.use_kl_loss:  # frozen, never sharded: one full copy per process
        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    # The episode stops turns at the template's end-of-turn token; the tiny policy's generation
    # config also lists the pad token as eos, which must not end a turn.
    weights_fn = None
    if info.distributed:
        # the engine keeps its own unsharded copy; the full state dict is copied in after each update
        engine = HFEngine(
            model,
            tokenizer,
            device=device,
            share_weights=False,
            max_batch_size=cfg.rollout.max_batch_size,
            seed=cfg.trainer.seed,
            stop_at_eos=False,
        )
        hf_model = model
        actor = fsdp_wrap(
            model, info, param_dtype=low_precision, reshard_after_forward=cfg.trainer.fsdp_reshard_after_forward
        )

        def weights_fn():
            return full_state_dict(hf_model)
    else:
        engine = HFEngine(
            model,
            tokenizer,
            share_weights=True,
            max_batch_size=cfg.rollout.max_batch_size,
            seed=cfg.trainer.seed,
            stop_at_eos=False,
        )
        actor = model
    env = AgentEnv(tokenizer, tools=tools, config=episode_config(cfg), reward_fn=reward_fn)
    train_items, val_items = load_items(cfg)
    optimizer, scheduler = build_optimizer(cfg, actor)
    trainer = Trainer(
        cfg,
        actor,
        optimizer,
        scheduler,
        engine,
        env,
        train_items,
        val_items,
        out,
        weights_fn=weights_fn,
        ref_model=ref_model,
        rank=rank,
        world_size=world,
        autocast_dtype=autocast,
    )
    summary: dict[str, Any] = {
        "model": str(path),
        "adv_estimator": cfg.algorithm.adv_estimator,
        "seed": cfg.trainer.seed,
        "steps": cfg.trainer.total_steps,
        "world_size": world,
        "tools": tools.describe(),
        "plugins": resolved_plugins(cfg, tools),
    }
    try:
        resumed = trainer.maybe_resume()
        before_file = out / "before.json"
        reuse_before = broadcast_object(cfg.eval.before and resumed and before_file.is_file(), world)
        if reuse_before:
            summary["before"] = json.loads(before_file.read_text())
        elif cfg.eval.before:
            _, trajs = trainer.evaluate(tag="val")
            summary["before"] = summary_figures(trajs)
            if rank == 0:
                before_file.write_text(json.dumps(summary["before"]))
            log.info("before training: %s", summary["before"])
        t_fit = time.perf_counter()
        trainer.fit()
        summary["timing"] = step_time_summary(trainer.timing_totals, time.perf_counter() - t_fit)
        if rank == 0:
            log.info("where the training loop's time went:\n%s", format_step_time(summary["timing"]))
        if cfg.eval.after:
            _, trajs = trainer.evaluate(tag="val")
            summary["after"] = summary_figures(trajs)
            log.info("after training: %s", summary["after"])
        final = out / "final"
        if rank == 0:
            # under FSDP the engine's copy holds the full weights of the last update
            (engine.model if info.distributed else model).save_pretrained(final)
            tokenizer.save_pretrained(final)
        barrier(world)
        summary["final_model"] = str(final)
    finally:
        from agent_env.rollout import run_sync

        run_sync(engine.close())
        if trainer.logger is not None:
            trainer.logger.close()
    summary["wall_time_s"] = time.perf_counter() - t_start
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
