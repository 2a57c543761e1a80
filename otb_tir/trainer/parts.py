"""The one place the local trainer reads its config: the parts of a run and the loop's settings.

    tools = build_tools(cfg)                                # otb_tir.builders
    parts = build_parts(cfg, tools, info, device, reward_fn)
    trainer = Trainer(trainer_settings(cfg, autocast_dtype=parts.autocast_dtype), parts)

:func:`build_parts` assembles what a run trains with (policy and reference model, rollout engine,
environments, optimizer and schedule, data, estimator, logger, distributed info), the same for one
process and for ``torchrun``/FSDP2; :func:`trainer_settings` gives the loop's knobs. The trainer
reads neither the config nor anything else: tests and benchmarks build a run here and swap a part
by assignment (``parts.estimator = ...``) before building the trainer.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from otb_tir.advantage import get_estimator
from otb_tir.builders import episode_config, policy_path, task_split
from otb_tir.trainer.actor import ActorSettings
from otb_tir.trainer.data import DataCursor
from otb_tir.trainer.distributed import DistInfo
from otb_tir.trainer.dumps import DumpSettings
from otb_tir.trainer.logging import MetricsLogger
from otb_tir.trainer.settings import TrainerSettings

log = logging.getLogger(__name__)


@dataclass
class Parts:
    """Everything a :class:`~otb_tir.trainer.trainer.Trainer` works with, built once."""

    model: Any  # the policy being trained (under FSDP2: the sharded TokenStatsModule root)
    optimizer: Any
    scheduler: Any  # None: a constant learning rate
    engine: Any  # the rollout engine: shares ``model``'s weights, or gets ``weights_fn()`` after each update
    env: Any  # agent_env.AgentEnv of the training episodes (tools, reward)
    eval_env: Any  # the held-out episodes' environment (same tools, the eval temperature, the task's reward)
    cursor: DataCursor  # the training prompts
    val_items: list[dict[str, Any]]  # the held-out prompts
    estimator: Callable[..., Any]  # the advantage estimator (verl's signature)
    logger: MetricsLogger | None  # rank 0 only
    info: DistInfo = DistInfo()  # rank and world size (a process group exists when world_size > 1)
    weights_fn: Callable[[], Any] | None = None  # the full state dict for the engine; None: shared weights
    ref_model: Any = None  # frozen reference policy (KL loss), one full copy per process
    tokenizer: Any = None
    policy_path: Path | None = None  # the folder the policy came from (None: a model built in memory)
    autocast_dtype: torch.dtype | None = None  # low-precision autocast of the actor (unsharded, on CUDA)


def load_items(cfg) -> tuple[list[dict], list[dict]]:
    """Training and held-out prompts: verl parquet files, or the built-in generator's splits."""
    from otb_tir.builders import load_data_files

    if cfg.data.train_files:
        train = load_data_files("data.train_files", cfg.data.train_files)
    else:
        train = task_split(cfg, "train", cfg.data.train_size, seed=cfg.trainer.seed)
    if cfg.data.val_files:
        val = load_data_files("data.val_files", cfg.data.val_files)
    else:
        # the held-out set does not move with the seed
        val = task_split(cfg, "test", cfg.data.val_size, seed=0)
    return train, val[: cfg.eval.size] if cfg.eval.size else val


#: rollout.dtype auto on a CPU with native bfloat16: bfloat16 from this many parameters (bench_bf16,
#: 2026-12-07, AVX-512 + avx512_bf16, 2 threads: decode 1.0x at 1.3M, 1.7x at 30M, 2.2x at 151M)
BF16_ROLLOUT_MIN_PARAMS = 20_000_000


def rollout_dtype_for(cfg, model, device: torch.device) -> str:
    """The hf engine's dtype: ``rollout.dtype`` when given; auto → bfloat16 on a CPU that computes it
    natively (:func:`otb_tir.machine.native_bf16`) for a policy of at least
    :data:`BF16_ROLLOUT_MIN_PARAMS` parameters, where it measured faster, else float32 (decided at
    start and logged)."""
    if cfg.rollout.dtype != "auto":
        return str(cfg.rollout.dtype)
    if device.type != "cpu":
        return "float32"
    return _bf16_where_native(model, BF16_ROLLOUT_MIN_PARAMS, "rollout.dtype", "bfloat16")


#: model.dtype auto on a CPU with native bfloat16: the actor computes under bfloat16 autocast from this
#: many parameters (bench_bf16, 2026-12-07, AVX-512 + avx512_bf16, 2 threads: an update 1.03x at 1.3M,
#: 0.86x at 30M, 1.44x at 151M, 1.46x at 596M)
BF16_AUTOCAST_MIN_PARAMS = 100_000_000


def model_dtype_for(cfg, model, device: torch.device, *, shard: bool = False) -> str:
    """The actor's compute dtype: ``model.dtype`` when given; auto → bfloat16 (autocast over float32
    master weights) on a CPU that computes it natively (:func:`otb_tir.machine.native_bf16`) for a policy
    of at least :data:`BF16_AUTOCAST_MIN_PARAMS` parameters, unsharded, where it measured faster; else
    float32, on a GPU too (set ``model.dtype=bfloat16`` there). Decided at start and logged."""
    if cfg.model.dtype != "auto":
        return str(cfg.model.dtype)
    if device.type != "cpu" or shard:
        return "float32"
    return _bf16_where_native(model, BF16_AUTOCAST_MIN_PARAMS, "model.dtype", "bfloat16 autocast")


def model_dtype_for_folder(cfg, path) -> str:
    """:func:`model_dtype_for` on the CPU for the model in folder ``path``, counted without its weights
    (a meta-device copy): for a run that does not build the actor in this process (the cold start,
    trainer=verl's CPU profile)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.model.dtype != "auto":
        return str(cfg.model.dtype)
    with torch.device("meta"):
        counted = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return model_dtype_for(cfg, counted, torch.device("cpu"))


def _bf16_where_native(model, min_params: int, key: str, what: str) -> str:
    """The auto rule of both dtypes on the CPU: bfloat16 where the CPU computes it natively and the policy
    has at least ``min_params`` parameters, else float32; logged with what it was decided from."""
    from otb_tir.machine import native_bf16

    params = sum(p.numel() for p in model.parameters())
    native = native_bf16()
    choice = "bfloat16" if native and params >= min_params else "float32"
    log.info(
        "%s auto -> %s (CPU bfloat16: %s; policy %.1fM parameters, %s from %.0fM)",
        key,
        choice,
        native or "emulated only",
        params / 1e6,
        what,
        min_params / 1e6,
    )
    return choice


def build_optimizer(cfg, model):
    """AdamW over ``model``'s parameters and its schedule (``actor.optim``: warmup, constant | cosine).

    torch's fused AdamW (one kernel over each parameter) where the parameters are plain float32 or
    bfloat16 tensors on the CPU or CUDA, else its default (foreach; FSDP2's sharded parameters): the
    foreach step holds a temporary the size of all parameters (√v), 2.2 GiB at Qwen3-0.6B's shape,
    which set the run's peak resident set (bench_scale, 2026-12-07)."""
    o = cfg.actor.optim
    params = list(model.parameters())
    fused = all(
        type(p) is torch.nn.Parameter
        and type(p.data) is torch.Tensor
        and p.device.type in ("cpu", "cuda")
        and p.dtype in (torch.float32, torch.bfloat16)
        for p in params
    )
    opt = torch.optim.AdamW(
        params, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), fused=True if fused else None
    )
    total = max(cfg.trainer.total_steps, 1)

    def factor(step: int) -> float:
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.lr_scheduler == "cosine":
            progress = (step - o.warmup_steps) / max(total - o.warmup_steps, 1)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def actor_settings(cfg, autocast_dtype: torch.dtype | None = None) -> ActorSettings:
    """The actor's settings from ``actor`` (and the rollout temperature its log-probs are taken at)."""
    temp = cfg.rollout.temperature
    section = OmegaConf.to_object(cfg.actor)  # the typed ActorConfig, every key as the user gave it
    return ActorSettings(
        **{f.name: getattr(section, f.name) for f in fields(section)},
        temperature=max(temp, 1e-6) if temp > 0 else 1.0,
        autocast_dtype=autocast_dtype,
    )


def trainer_settings(cfg, autocast_dtype: torch.dtype | None = None) -> TrainerSettings:
    """The loop's settings from the config (``autocast_dtype``: :attr:`Parts.autocast_dtype`)."""
    t, alg, f = cfg.trainer, cfg.algorithm, cfg.algorithm.filter
    return TrainerSettings(
        output_dir=Path(t.output_dir),
        n=cfg.rollout.n,
        ppo_mini_batch_size=cfg.actor.ppo_mini_batch_size,
        ppo_epochs=cfg.actor.ppo_epochs,
        total_steps=t.total_steps,
        seed=t.seed,
        save_every=t.save_every,
        keep_checkpoints=t.keep_checkpoints,
        resume=t.resume,
        eval_every=cfg.eval.every,
        eval_n=cfg.eval.n,
        adv_estimator=alg.adv_estimator,
        handle_zero_tail=alg.handle_zero_tail,
        norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        # null (auto): on only when the local trainer's samples are off-policy (one step old)
        rollout_is=bool(t.one_step_off_policy if alg.rollout_is is None else alg.rollout_is),
        one_step_off_policy=t.one_step_off_policy,
        rollout_is_threshold=alg.rollout_is_threshold,
        filters=OmegaConf.to_object(f),  # the typed FilterConfig
        dumps=dump_settings(cfg),
        actor=actor_settings(cfg, autocast_dtype),
    )


def dump_settings(cfg) -> DumpSettings:
    """``trainer.rollout_data_*``: the folder relative to the run folder (None: no dumps)."""
    t = cfg.trainer
    folder = None
    if t.rollout_data_dir:
        folder = Path(t.rollout_data_dir).expanduser()
        folder = folder if folder.is_absolute() else Path(t.output_dir) / folder
    return DumpSettings(dir=folder, every=int(t.rollout_data_every), max_bytes=int(t.rollout_data_max_bytes))


def build_parts(
    cfg,
    tools,
    info: DistInfo,
    device: torch.device,
    reward_fn: Callable[..., Any] | None = None,
    *,
    policy: tuple[Any, Any] | None = None,
    shard: bool | None = None,
) -> Parts:
    """The parts of a local training run on ``device``.

    ``tools``: the run's tool set (:func:`otb_tir.builders.build_tools`; the caller closes it);
    ``reward_fn``: optional ``(text, ground_truth, trajectory) -> float`` replacing the task's reward
    in training episodes. ``policy``: a ``(model, tokenizer)`` built elsewhere instead of
    ``model.path``'s (a benchmark's random model of a given shape). ``shard``: FSDP2-wrap the actor
    (default: under ``torchrun``, ``info.distributed``); then the engine keeps its own unsharded
    copy, refreshed with :func:`~otb_tir.trainer.distributed.full_state_dict` after each update.
    """
    from agent_env import AgentEnv
    from agent_env.engines.hf import HFEngine
    from otb_tir.trainer.distributed import fsdp_wrap, full_state_dict

    shard = info.distributed if shard is None else shard
    path = None
    if policy is None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = policy_path(cfg)  # resolved at the entry point (otb_tir.defaults.policy), on every rank
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    else:
        model, tokenizer = policy
    if cfg.model.enable_gradient_checkpointing:
        from otb_tir import ConfigError

        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(
                f"model.enable_gradient_checkpointing=true: {type(model).__name__} does not support "
                "transformers' gradient checkpointing; set it to false"
            )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        log.info("gradient checkpointing on: each decoder layer's activations are recomputed in the backward")
    model_dtype = model_dtype_for(cfg, model, device, shard=shard)
    low_precision = None if model_dtype == "float32" else getattr(torch, model_dtype)
    autocast = None
    if low_precision is not None and device.type == "cpu" and low_precision == torch.bfloat16 and not shard:
        from otb_tir.machine import native_bf16

        autocast = low_precision
        log.info("model.dtype=bfloat16 on the CPU: autocast (%s)", native_bf16() or "no native bfloat16: emulated")
    elif low_precision is not None and device.type != "cuda":
        log.warning("model.dtype=%s needs a GPU here; training in float32 on %s", model_dtype, device)
    elif low_precision is not None and not shard:
        autocast = low_precision
    ref_model = None
    if cfg.actor.use_kl_loss:  # frozen, never sharded: one full copy per process
        if path is not None:
            from transformers import AutoModelForCausalLM

            ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        else:
            ref_model = copy.deepcopy(model)
        ref_model = ref_model.to(device).eval()
    # The episode stops turns at the template's end-of-turn token; the tiny policy's generation
    # config also lists the pad token as eos, which must not end a turn.
    weights_fn = None
    # the hf engine's dtype (vllm / sglang take theirs in _serving_engine)
    rollout_dtype = rollout_dtype_for(cfg, model, device) if cfg.rollout.name not in ("vllm", "sglang") else None
    common = dict(
        max_batch_size=cfg.rollout.max_batch_size,
        seed=cfg.trainer.seed,
        stop_at_eos=False,
        prefix_cache_bytes=None if cfg.rollout.enable_prefix_caching else 0,
        cpu_threads=cfg.rollout.cpu_threads,
        decode_step=cfg.rollout.decode_step,
    )
    if cfg.rollout.name in ("vllm", "sglang"):
        engine = _serving_engine(cfg, path, shard, policy)

        def weights_fn():  # the engine holds its own copy: the new weights go in after each update
            return model.state_dict()

        actor = model
    elif shard:
        # the engine keeps its own unsharded copy; the full state dict is copied in after each update
        engine = HFEngine(model, tokenizer, device=device, dtype=rollout_dtype, share_weights=False, **common)
        hf_model = model
        actor = fsdp_wrap(
            model, info, param_dtype=low_precision, reshard_after_forward=cfg.trainer.fsdp_reshard_after_forward
        )

        def weights_fn():
            return full_state_dict(hf_model)
    elif cfg.trainer.one_step_off_policy:
        # the engine rolls out the next step while the update changes the actor: its own copy
        engine = HFEngine(model, tokenizer, device=device, dtype=rollout_dtype, share_weights=False, **common)
        actor = model

        def weights_fn():
            return model.state_dict()
    elif rollout_dtype != "float32":
        # the engine's weights in another dtype: its own copy in it, the actor's weights copied in after each update
        engine = HFEngine(model, tokenizer, device=device, dtype=rollout_dtype, share_weights=False, **common)
        actor = model

        def weights_fn():
            return model.state_dict()
    else:
        engine = HFEngine(model, tokenizer, share_weights=True, **common)
        actor = model
    env = AgentEnv(tokenizer, tools=tools, config=episode_config(cfg), reward_fn=reward_fn)
    temp = cfg.eval.temperature
    eval_env = AgentEnv(tokenizer, tools=tools, config=episode_config(cfg, temperature=temp if temp > 0 else 0.0))
    train_items, val_items = load_items(cfg)
    optimizer, scheduler = build_optimizer(cfg, actor)
    t = cfg.trainer
    cursor = DataCursor(train_items, cfg.data.train_batch_size, seed=t.seed, shuffle=cfg.data.shuffle)
    estimator = get_estimator(cfg.algorithm.adv_estimator)
    logger = None
    if info.rank == 0:
        logger = MetricsLogger(
            t.output_dir, t.loggers, project=t.project_name, experiment=t.experiment_name, resume=t.resume
        )
    return Parts(
        model=actor,
        optimizer=optimizer,
        scheduler=scheduler,
        engine=engine,
        env=env,
        eval_env=eval_env,
        cursor=cursor,
        val_items=val_items,
        estimator=estimator,
        logger=logger,
        info=info,
        weights_fn=weights_fn,
        ref_model=ref_model,
        tokenizer=tokenizer,
        policy_path=path,
        autocast_dtype=autocast,
    )


def _serving_engine(cfg: Any, path: Path | None, shard: bool, policy: Any) -> Any:
    """rollout.name=vllm|sglang on the local trainer: the engine serves the checkpoint the actor starts
    from and gets the actor's weights after every update (Trainer._sync_weights)."""
    from omegaconf import OmegaConf

    from agent_env.engines.base import EngineError
    from otb_tir import ConfigError
    from otb_tir.builders import serving_engine

    name = cfg.rollout.name
    if shard:
        raise ConfigError(
            f"rollout.name={name} with torchrun: one serving engine per process is not supported; "
            "use rollout.name=hf under torchrun, or trainer=verl to serve with vLLM / sglang at scale"
        )
    if policy is not None or path is None:
        raise ConfigError(f"rollout.name={name} serves a checkpoint folder (model.path), not an in-memory policy")
    kwargs = OmegaConf.to_container(cfg.rollout.engine_kwargs, resolve=True) if cfg.rollout.engine_kwargs else {}
    # rollout.dtype when given, else the actor's (auto: no bfloat16 rule for a serving engine here)
    dtype = cfg.rollout.dtype if cfg.rollout.dtype != "auto" else cfg.model.dtype
    dtype = "float32" if dtype == "auto" else dtype  # model.dtype auto's rule needs the model in memory
    try:
        return serving_engine(name, path, dtype=dtype, seed=cfg.trainer.seed, engine_kwargs=kwargs)
    except EngineError as e:
        raise ConfigError(f"rollout.name={name}: {e}") from None
