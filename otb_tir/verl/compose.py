"""Compose verl 0.9.1's PPO trainer config with the TIR-OTB recipe (launched by :mod:`otb_tir.verl.launch`).

``compose_verl_config(cfg)`` loads verl's own ``verl/trainer/config/ppo_trainer.yaml`` through
hydra's compose API (as ``verl.trainer.main_ppo`` does) and sets, from our config (see
:mod:`otb_tir.trainer.config`):

* ``algorithm.adv_estimator`` (our estimators by name; the plugin swaps in our OTB functions),
  ``actor_rollout_ref.actor.calculate_sum_pi_squared=True`` for the OTB estimators,
  ``actor_rollout_ref.model.use_fused_kernels=False`` (verl cannot return Σπ² from its fused
  kernels), ``algorithm.rollout_correction`` for truncated IS weights;
* the multi-turn rollout: ``rollout.multi_turn.*`` (format, max turns, tool-response limits),
  ``rollout.agent.agent_loop_config_path`` (an agent-loop YAML written into the run folder with the
  tools and per-turn settings) and ``rollout.agent.default_agent_loop=otb_tir_agent``;
* data (``data.train_files`` / ``data.val_files``; the built-in generator's splits are written to
  parquet under ``<output_dir>/data`` when none are given), model path, ``rollout.name``
  (vllm | sglang), n, temperature, response length, lr and optimizer, batch sizes, GPUs/nodes,
  output dir, loggers;
* the trainer, from ``verl.trainer_mode``: verl's default V1 trainer (``trainer.use_v1=true``) in
  mode ``sync`` (the default), ``colocate_async`` or ``separate_async``, through our classes
  ``trainer.v1.trainer_mode=otb_<mode>`` (:mod:`otb_tir.verl.v1`: verl 0.9.1's V1 trainer never
  asks the actor for Σπ², which the OTB estimators need), or ``legacy`` (``trainer.use_v1=false``,
  verl's RayPPOTrainer, which does). In the asynchronous modes rollout correction is on unless
  ``algorithm.rollout_is=false`` (token-level truncated IS) and staleness is bounded by verl's
  sampler: ``trainer.v1.sampler.max_off_policy_threshold`` = :data:`ASYNC_MAX_OFF_POLICY` (a
  prompt's samples are used at most one weight version after it was queued) with strategy
  ``wait`` (nothing generated is thrown away; sampling waits instead); ``verl.trainer.v1.sampler.*``
  overrides them.

Extra verl settings (any key of verl's ``ppo_trainer`` config the recipe does not model) come from
``cfg.verl.overrides`` (the recipe's ``verl.overrides=[...]`` or ``verl.<verl key>=value``) and then
the ``overrides`` argument, in hydra's override syntax exactly as ``verl.trainer.main_ppo`` takes
them on its command line: ``key=value`` for a key verl has, ``+key=value`` to add a key,
``++key=value`` to add or override, ``~key`` to delete, ``group=option`` to pick a config group. They
are checked by hydra's composition of verl's own config before anything else happens (a key verl
does not have, or a value of the wrong kind, is a :class:`ConfigError`), and applied last, so they
win over the values this module derives from the recipe (that machinery, and the hydra composition of
verl's config, is :mod:`otb_tir.verl.compose_overrides`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from otb_tir import ConfigError
from otb_tir.builders import policy_path
from otb_tir.trainer.config import truncated_sampling
from otb_tir.verl import require_verl
from otb_tir.verl.compose_inputs import agent_loop_entries, data_files, reward_section
from otb_tir.verl.compose_overrides import (
    apply_user_overrides,
    check_override_kinds,
    compose_base,
    is_group_override,
    parse_overrides,
    set_verl_key,
    user_overrides,
)
from otb_tir.verl.hooks import OTB_ESTIMATORS  # the one spelling (hooks: imported in verl's workers too)
from otb_tir.verl.plugin import USER_ESTIMATOR_ENV, verl_estimator_name
from otb_tir.verl.reward_fn import REWARD_ENV
from tools.plugins import absolute_path_name

__all__ = [
    "ASYNC_MAX_OFF_POLICY",
    "ASYNC_MODES",
    "OTB_ESTIMATORS",
    "compose_verl_config",
    "rollout_is",
    "trainer_description",
    "validate_verl_config",
    "verl_device",
    "with_v1_modes",
]

#: our built-in estimators verl has under the same name (its OTB two are swapped for ours by the plugin)
VERL_BUILTIN_ESTIMATORS = (*OTB_ESTIMATORS, "grpo", "rloo")
ASYNC_MODES = ("colocate_async", "separate_async")
#: our default staleness bound in the asynchronous modes (verl's max_off_policy_threshold: the number of
#: weight versions a prompt's samples may span, counting the one it was queued at) and its strategy
ASYNC_MAX_OFF_POLICY = 2
ASYNC_OFF_POLICY_STRATEGY = "wait"
DEFAULT_PROMPT_LENGTH = 1024
# trainer.loggers → verl's trainer.logger; jsonl and tensorboard are written by our hooks in the TaskRunner
# (otb_tir.verl.hooks: the local trainer's MetricsLogger, so both trainers write the same files)
_LOGGERS = {"console": "console", "wandb": "wandb", "jsonl": None, "tensorboard": None}


#: model.dtype → verl's FSDP mixed_precision.param_dtype (the actor's and the reference's compute dtype)
VERL_PARAM_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
PRECISION_KEYS = (
    "actor_rollout_ref.actor.fsdp_config.mixed_precision",
    "actor_rollout_ref.ref.fsdp_config.mixed_precision",
)
GRADIENT_CHECKPOINTING = "actor_rollout_ref.model.enable_gradient_checkpointing"
ROLLOUT_DTYPE = "actor_rollout_ref.rollout.dtype"
# verl keys the CPU profile sets that one of our keys sets when the user gives it (it then wins)
USER_OVER_PROFILE = (GRADIENT_CHECKPOINTING, ROLLOUT_DTYPE)


def actor_param_dtype(cfg: DictConfig, model_path: str, *, cpu: bool) -> str | None:
    """verl's FSDP ``param_dtype`` for ``model.dtype``: the given dtype; auto → the local trainer's rule on
    a CPU (:func:`otb_tir.trainer.parts.model_dtype_for_folder`: bf16 for a policy of >= 100M parameters
    where the CPU computes it natively, else fp32; logged), verl's own (bf16) on an accelerator (None)."""
    if cfg.model.dtype == "auto" and not cpu:
        return None
    from otb_tir.trainer.parts import model_dtype_for_folder

    return VERL_PARAM_DTYPES[model_dtype_for_folder(cfg, model_path)]


def verl_rollout_data_dir(cfg: DictConfig) -> None:
    """verl's ``trainer.rollout_data_dir``: None for now, said at start when ours is on. verl 0.9.1 dumps
    generations (one JSONL file per step, no per-token fields) in its legacy and V1 trainers alike
    (trainer/ppo/v1/trainer_base.py:506), but that has not run under our V1 modes yet."""
    import logging

    from otb_tir.trainer.parts import dump_settings

    if dump_settings(cfg).dir is not None:
        logging.getLogger(__name__).warning(
            "trainer.rollout_data_dir: the verl path writes no step dumps yet (the local trainer does); "
            "verl's own, untested here: verl.overrides=[trainer.rollout_data_dir=/path]"
        )
    return None


def _check_supported(cfg: DictConfig) -> None:
    if cfg.rollout.name not in ("vllm", "sglang"):
        raise ConfigError(
            f"rollout.name={cfg.rollout.name!r}: the verl path serves the policy with vllm or sglang "
            "(e.g. trainer=verl rollout.name=vllm)"
        )
    if cfg.rollout.get("engine_kwargs"):
        raise ConfigError(
            f"rollout.engine_kwargs {sorted(cfg.rollout.engine_kwargs)} are for the local trainer's vllm/sglang "
            "engine; verl's rollout takes its settings as verl keys (verl.actor_rollout_ref.rollout.<key>=...)"
        )
    if cfg.trainer.get("one_step_off_policy"):
        raise ConfigError(
            "trainer.one_step_off_policy is the local trainer's; on the verl path the rollout runs beside "
            "the update in verl's asynchronous modes: verl.trainer_mode=colocate_async or separate_async"
        )
    if cfg.algorithm.adv_estimator in OTB_ESTIMATORS and not cfg.algorithm.handle_zero_tail:
        raise ConfigError(
            "algorithm.handle_zero_tail=false is not available on the verl path (verl's "
            "compute_advantage does not pass it; the OTB estimators use the default, true)"
        )
    f = cfg.algorithm.filter
    unsupported = [k for k in ("void_turns", "overlong", "all_equal_reward_groups") if f[k]]
    if unsupported:
        raise ConfigError(
            f"algorithm.filter.{unsupported[0]}=true is only implemented by the local trainer "
            "(trainer=local); verl's trainer has no such filter"
        )


def _check_one_run_length(cfg: DictConfig, parsed: list) -> None:
    """The run's length is given once: ``trainer.total_steps`` (> 0) or verl's own
    ``trainer.total_training_steps`` / ``trainer.total_epochs`` as a verl override, never both (the
    override would win without a word: ``--config tir_math_qwen3_8b_gpu trainer.total_steps=10``
    would train the config's 15 epochs)."""
    given = sorted({o.key_or_group for o in parsed} & {"trainer.total_training_steps", "trainer.total_epochs"})
    if given and int(cfg.trainer.total_steps) > 0:
        raise ConfigError(
            f"trainer.total_steps={cfg.trainer.total_steps} and the verl override(s) {given} both set the "
            "run's length: give one (trainer.total_steps=0 lets verl's keys decide; with --config "
            "tir_math_qwen3_8b_gpu, which trains for verl.trainer.total_epochs, a shorter run is "
            "verl.trainer.total_training_steps=N)"
        )


def compose_verl_config(cfg: DictConfig, overrides: Sequence[str] = (), *, cpu: bool | None = None) -> DictConfig:
    """verl's PPO trainer config for our recipe ``cfg`` (see the module docstring).

    Writes the agent-loop YAML (and, without data files, the built-in train/test parquet files)
    into ``cfg.trainer.output_dir``. Raises :class:`ConfigError` for settings the verl path cannot
    honour.
    """
    require_verl()
    _check_supported(cfg)
    # The user's verl overrides are checked first (hydra composes verl's config with them), before
    # the data files are prepared. model.path is resolved by the caller (prepare_verl).
    user = user_overrides(cfg, overrides)
    parsed = parse_overrides(user)
    _check_one_run_length(cfg, parsed)
    compose_base(user)  # hydra checks every override against verl's config (unknown keys, bad syntax)
    v = compose_base([o.input_line for o in parsed if is_group_override(o)])
    check_override_kinds(v, parsed)
    out = Path(cfg.trainer.output_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    train_files, val_files = data_files(cfg, out)
    model_path = str(policy_path(cfg))
    agent_loop_yaml = out / "agent_loop.yaml"
    OmegaConf.save(OmegaConf.create(agent_loop_entries(cfg)), agent_loop_yaml)

    a, r, o = cfg.actor, cfg.rollout, cfg.actor.optim
    # verl splits each mini-batch (and each log-prob batch) into micro-batches of exactly this many
    # rows and asserts divisibility: the largest size <= ours that divides them
    micro = math.gcd(int(a.ppo_micro_batch_size), int(a.ppo_mini_batch_size) * int(r.n))
    log_prob_micro = math.gcd(micro, int(cfg.data.train_batch_size) * int(r.n))
    otb = cfg.algorithm.adv_estimator in OTB_ESTIMATORS
    mode = cfg.verl.trainer_mode
    if cpu is None:
        cpu = verl_device(cfg) == "cpu"
    # grad_clip 0 = off, as on the local trainer: verl clips with max_norm=clip_grad, which at 0 zeroes
    # every gradient (verl 0.9.1 workers/engine/fsdp/transformer_impl.py ~806); ∞ measures the norm only
    clip = float(a.grad_clip) if a.grad_clip > 0 else float("inf")
    settings: dict[str, Any] = {
        # algorithm
        "algorithm.adv_estimator": verl_estimator_name(cfg.algorithm.adv_estimator),
        "algorithm.norm_adv_by_std_in_grpo": bool(cfg.algorithm.norm_adv_by_std_in_grpo),
        "algorithm.use_kl_in_reward": False,
        "critic.enable": False,
        "reward.custom_reward_function.path": str(Path(__file__).resolve().parent / "reward_fn.py"),
        "reward.custom_reward_function.name": "compute_score",
        # actor
        "actor_rollout_ref.actor.calculate_sum_pi_squared": otb,
        "actor_rollout_ref.model.use_fused_kernels": False,
        "actor_rollout_ref.model.path": model_path,
        "actor_rollout_ref.actor.ppo_mini_batch_size": int(a.ppo_mini_batch_size),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.actor.ppo_epochs": int(a.ppo_epochs),
        "actor_rollout_ref.actor.clip_ratio_low": float(a.clip_ratio_low),
        "actor_rollout_ref.actor.clip_ratio_high": float(a.clip_ratio_high),
        "actor_rollout_ref.actor.clip_ratio_c": float(a.clip_ratio_c),
        "actor_rollout_ref.actor.grad_clip": clip,
        "actor_rollout_ref.actor.optim.clip_grad": clip,
        "actor_rollout_ref.actor.use_kl_loss": bool(a.use_kl_loss),
        "actor_rollout_ref.actor.kl_loss_coef": float(a.kl_loss_coef),
        "actor_rollout_ref.actor.entropy_coeff": float(a.entropy_coeff),
        "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        "actor_rollout_ref.actor.optim.lr": float(o.lr),
        "actor_rollout_ref.actor.optim.weight_decay": float(o.weight_decay),
        "actor_rollout_ref.actor.optim.betas": [float(b) for b in o.betas],
        "actor_rollout_ref.actor.optim.lr_warmup_steps": int(o.warmup_steps) if o.warmup_steps else -1,
        "actor_rollout_ref.actor.optim.lr_scheduler_type": o.lr_scheduler,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": log_prob_micro,
        # rollout
        "actor_rollout_ref.rollout.name": r.name,
        "actor_rollout_ref.rollout.mode": "async",
        "actor_rollout_ref.rollout.n": int(r.n),
        "actor_rollout_ref.rollout.temperature": float(r.temperature),
        "actor_rollout_ref.rollout.top_p": float(r.top_p),
        "actor_rollout_ref.rollout.top_k": int(r.top_k),
        "actor_rollout_ref.rollout.enable_prefix_caching": bool(r.enable_prefix_caching),
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": log_prob_micro,
        "actor_rollout_ref.rollout.val_kwargs.temperature": float(cfg.eval.temperature),
        "actor_rollout_ref.rollout.val_kwargs.do_sample": float(cfg.eval.temperature) > 0,
        "actor_rollout_ref.rollout.val_kwargs.n": int(cfg.eval.n),
        "actor_rollout_ref.rollout.multi_turn.enable": True,
        # verl's own key keeps a name verl knows; our agent loop takes the format (any registered name
        # or path) from the agent-loop YAML's otb_format
        "actor_rollout_ref.rollout.multi_turn.format": "hermes",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": int(cfg.multi_turn.max_assistant_turns),
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": int(cfg.multi_turn.max_parallel_calls),
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": int(cfg.multi_turn.max_tool_response_length),
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": cfg.multi_turn.tool_response_truncate_side,
        "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(agent_loop_yaml),
        "actor_rollout_ref.rollout.agent.default_agent_loop": "otb_tir_agent",
        # data
        "data.train_files": train_files,
        "data.val_files": val_files,
        "data.train_batch_size": int(cfg.data.train_batch_size),
        "data.max_prompt_length": DEFAULT_PROMPT_LENGTH,
        "data.max_response_length": int(r.response_length),
        "data.shuffle": bool(cfg.data.shuffle),
        "data.seed": int(cfg.trainer.seed),
        "data.return_raw_chat": True,
        "data.filter_overlong_prompts": True,
        # trainer
        "trainer.use_v1": mode != "legacy",
        "trainer.n_gpus_per_node": int(cfg.trainer.n_gpus_per_node),
        "trainer.nnodes": int(cfg.trainer.nnodes),
        "trainer.total_training_steps": int(cfg.trainer.total_steps),
        "trainer.total_epochs": 1_000_000,  # total_training_steps decides
        "trainer.save_freq": int(cfg.trainer.save_every),
        "trainer.max_actor_ckpt_to_keep": int(cfg.trainer.keep_checkpoints),
        "trainer.default_local_dir": str(out / "checkpoints"),
        "trainer.resume_mode": "auto" if cfg.trainer.resume else "disable",
        # a resumed run whose held-out figure before training is logged does not validate again
        "trainer.val_before_train": bool(cfg.eval.before) and not before_is_logged(cfg, out),
        # verl validates every test_freq steps and after the last: eval.every, else only at the end
        "trainer.test_freq": (int(cfg.eval.every) or int(cfg.trainer.total_steps)) if cfg.eval.after else -1,
        "trainer.project_name": cfg.trainer.project_name,
        "trainer.experiment_name": cfg.trainer.experiment_name,
        "trainer.logger": [_LOGGERS[name] for name in cfg.trainer.loggers if _LOGGERS.get(name)],
        "trainer.rollout_data_dir": verl_rollout_data_dir(cfg),  # None, and a warning where ours is on
    }
    if cfg.model.get("enable_gradient_checkpointing") is not None:  # null: verl's own (the CPU profile's off)
        settings[GRADIENT_CHECKPOINTING] = bool(cfg.model.enable_gradient_checkpointing)
    if cfg.rollout.get("dtype", "auto") != "auto":  # auto: verl's own (the CPU profile's float32)
        settings[ROLLOUT_DTYPE] = str(cfg.rollout.dtype)
    if mode != "legacy":
        settings["trainer.v1.trainer_mode"] = f"otb_{mode}"  # otb_tir.verl.v1 registers these
    if mode in ASYNC_MODES:
        settings["trainer.v1.sampler.max_off_policy_threshold"] = ASYNC_MAX_OFF_POLICY
        settings["trainer.v1.sampler.max_off_policy_strategy"] = ASYNC_OFF_POLICY_STRATEGY
    if mode == "separate_async":
        settings.update(separate_async_settings(cfg, cpu=cpu))
    if rollout_is(cfg):
        settings["algorithm.rollout_correction.rollout_is"] = "token"
        settings["algorithm.rollout_correction.rollout_is_threshold"] = float(cfg.algorithm.rollout_is_threshold)
    unknown_loggers = [name for name in cfg.trainer.loggers if name not in _LOGGERS]
    if unknown_loggers:
        raise ConfigError(f"trainer.loggers {unknown_loggers} have no verl counterpart; valid: {sorted(_LOGGERS)}")
    for key, value in settings.items():
        set_verl_key(v, key, value)
    param_dtype = actor_param_dtype(cfg, model_path, cpu=cpu)
    if cpu:  # no accelerator: what verl and vLLM-CPU need (otb_tir.verl.cpu); the user's overrides still win
        from otb_tir.verl.cpu import cpu_overrides

        prompt = DEFAULT_PROMPT_LENGTH
        profile = cpu_overrides(max_model_len=prompt + int(r.response_length), param_dtype=param_dtype)
        for key, value in profile.items():
            if key in USER_OVER_PROFILE and key in settings:  # the user gave our key for it
                continue
            if key.startswith("+"):
                OmegaConf.update(v, key[1:], value, merge=False, force_add=True)
            else:
                set_verl_key(v, key, value)
    elif param_dtype is not None:  # model.dtype given on an accelerator (auto: verl's own)
        for key in PRECISION_KEYS:
            OmegaConf.update(v, f"{key}.param_dtype", param_dtype, merge=True, force_add=True)
    with open_dict(v):
        runtime_env = v.ray_kwargs.ray_init.runtime_env
        current = runtime_env.get("env_vars")
        env_vars = dict(OmegaConf.to_container(current)) if current is not None else {}
        env_vars["OTB_TIR_OUTPUT_DIR"] = str(out)  # read by otb_tir.verl.task_runner (hooks, metrics files)
        # metrics.jsonl always (summary.json and the step count are read from it), TensorBoard when asked
        env_vars["OTB_TIR_LOGGERS"] = "jsonl,tensorboard" if "tensorboard" in cfg.trainer.loggers else "jsonl"
        env_vars["OTB_TIR_RESUME"] = "1" if cfg.trainer.resume else "0"  # a resumed run appends to metrics.jsonl
        # the run's reward in verl's reward workers too (otb_tir/verl/reward_fn.py)
        env_vars[REWARD_ENV] = json.dumps({"reward": reward_section(cfg), "task": absolute_path_name(cfg.data.task)})
        est = cfg.algorithm.adv_estimator
        if est not in VERL_BUILTIN_ESTIMATORS:  # a user's estimator, registered in verl's registry by the plugin
            env_vars[USER_ESTIMATOR_ENV] = f"{verl_estimator_name(est)}={absolute_path_name(est)}"
        # our V1 trainer modes in every verl process (the verl.plugins entry point does it too, once installed)
        env_vars["VERL_USE_EXTERNAL_MODULES"] = with_v1_modes(env_vars.get("VERL_USE_EXTERNAL_MODULES"))
        runtime_env["env_vars"] = env_vars
    apply_user_overrides(v, parsed)
    if cfg.verl.get("ray_address"):
        _join_an_existing_cluster(v, str(cfg.verl.ray_address))
    check_untruncated_sampling(v)  # also with the user's overrides applied
    from otb_tir.verl.v1 import check_bypass

    try:
        check_bypass(v)  # also with the user's overrides applied
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return v


def before_is_logged(cfg: DictConfig, out: Path) -> bool:
    """Whether this run resumes from a checkpoint (``trainer.resume`` and verl's marker of its latest
    one) after a run that logged its held-out figure before training (a ``val/accuracy`` row at step
    0 in ``metrics.jsonl``). verl validates before its loop on every start, a resumed one at the
    checkpoint's step (~20 s of the built-in run's held-out set here, a row the log then drops); the
    local trainer reuses its ``before.json`` instead. So does this path: the summary's before figure
    is the step-0 row."""
    if not cfg.trainer.resume or not (out / "checkpoints" / "latest_checkpointed_iteration.txt").is_file():
        return False
    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        return False
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by the kill
        if row.get("step") == 0 and "val/accuracy" in row:
            return True
    return False


def _join_an_existing_cluster(v: DictConfig, address: str) -> None:
    """``verl.ray_address=HOST:PORT`` (or ``auto``): the run joins that Ray cluster instead of starting
    its own (``local``, the CPU profile's default). ``ray.init`` refuses resource counts when it
    connects, so the CPU profile's ``num_cpus`` / ``num_gpus`` (what a cluster of its own declares) are
    dropped; the cluster's nodes declare theirs, and the run's environment reaches their workers
    through ``runtime_env.env_vars`` as on one node."""
    with open_dict(v):
        v.ray_kwargs.ray_init.address = address
        for key in ("num_cpus", "num_gpus"):
            if key in v.ray_kwargs.ray_init:
                del v.ray_kwargs.ray_init[key]


def separate_async_settings(cfg: DictConfig, *, cpu: bool) -> dict[str, Any]:
    """verl's ``separate_async``: the rollout on a resource pool of its own (one replica of one device by
    default), weights moved by a checkpoint engine once per step.

    verl asserts (``trainer/ppo/v1/trainer_separate_async.py`` ~59-68) ``train_batch_size ==
    parameter_sync_step * ppo_mini_batch_size``, ``rollout.nnodes > 0``, ``rollout.n_gpus_per_node > 0``
    and a checkpoint engine other than ``naive``. ``parameter_sync_step`` is the number of mini-batches
    in our step (each a local update on π_old, then one weight sync), so a step trains what the other
    modes train. On a CPU the engine is our ``gloo`` one (:mod:`otb_tir.verl.gloo_engine`, registered by
    importing :mod:`otb_tir.verl.cpu`), in 64 MB buckets (verl's default is 2 GB, allocated twice by the
    sender), and there are no colocated (hybrid) replicas on the trainer's pool (``hybrid_engine=False``):
    one vLLM, the standalone one. Ray needs two logical GPUs (trainer pool + rollout replica); the
    CPU profile declares four."""
    batch, mini = int(cfg.data.train_batch_size), int(cfg.actor.ppo_mini_batch_size)
    out: dict[str, Any] = {
        "trainer.v1.separate_async.parameter_sync_step": batch // mini,
        "actor_rollout_ref.rollout.nnodes": 1,
        "actor_rollout_ref.rollout.n_gpus_per_node": 1,
        "actor_rollout_ref.rollout.checkpoint_engine.backend": "gloo" if cpu else "nccl",
    }
    if cpu:
        out["actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"] = 64
        out["actor_rollout_ref.hybrid_engine"] = False
    return out


def check_untruncated_sampling(v: DictConfig) -> None:
    """Refuse nucleus / top-k sampling in training rollouts: verl asks vLLM for its processed
    log-probs (the truncated, renormalised distribution) while the actor's old log-probs are the full
    softmax's, so at lag 0 the IS ratio π_old/π_rollout is the kept mass S_t ≤ 1, not 1, and no
    reweighting recovers the expectation under π_old (verl issue #6240). Validation sampling
    (``val_kwargs``) trains nothing and is not checked."""
    ro = v.actor_rollout_ref.rollout
    which = truncated_sampling(ro.get("top_p", 1.0), ro.get("top_k", -1))
    if which:
        raise ConfigError(
            f"{which} (actor_rollout_ref.rollout.{which.split('.')[1]}) with trainer=verl: verl's rollout "
            "reports the truncated, renormalised log-probs while its actor computes full-softmax ones, so "
            "the IS ratio at lag 0 is the kept probability mass, not 1, and the update is biased (verl "
            "#6240). Sample with rollout.top_p=1 rollout.top_k=-1 (temperature still applies)"
        )


def with_v1_modes(modules: Any) -> str:
    """``VERL_USE_EXTERNAL_MODULES`` with our V1 trainer modes added (once, after what was there)."""
    listed = [m for m in str(modules or "").split(",") if m]
    return ",".join(dict.fromkeys([*listed, "otb_tir.verl.v1"]))


def rollout_is(cfg: DictConfig) -> bool:
    """Truncated IS weights: ``algorithm.rollout_is``, or (null) on in verl's asynchronous modes."""
    if cfg.algorithm.rollout_is is not None:
        return bool(cfg.algorithm.rollout_is)
    return cfg.verl.trainer_mode in ASYNC_MODES


def trainer_description(mode: str) -> str:
    """What ``verl.trainer_mode`` runs, in words (summary.json's ``trainer_path``)."""
    if mode == "legacy":
        return "verl RayPPOTrainer (trainer.use_v1=false), verl's legacy trainer"
    return (
        f"verl V1 trainer, mode {mode} (trainer.use_v1=true, trainer.v1.trainer_mode=otb_{mode}: verl's "
        f"{mode} class with the Σπ² step of otb_tir.verl.v1)"
    )


def validate_verl_config(vcfg: DictConfig) -> None:
    """Run what verl runs on its config before training (``main_ppo.main`` → ``validate_config``)."""
    require_verl()
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    try:
        validate_config(config=vcfg, use_reference_policy=need_reference_policy(vcfg), use_critic=need_critic(vcfg))
    except (AssertionError, ValueError) as exc:
        raise ConfigError(f"verl rejected the composed config: {exc}") from exc


def verl_device(cfg: DictConfig) -> str:
    """``cpu`` (this module's CPU profile, :mod:`otb_tir.verl.cpu`) or ``gpu``, from ``trainer.device``."""
    from otb_tir.verl import has_accelerator

    want = cfg.trainer.device
    if want == "cpu":
        return "cpu"
    if want == "cuda":
        return "gpu"
    return "gpu" if has_accelerator() else "cpu"
