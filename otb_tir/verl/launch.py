"""Compose verl 0.9.1's PPO trainer config with the TIR-OTB recipe, and launch it.

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
* ``trainer.use_v1=False``: verl 0.9.1's v1 trainer never fetches ``sum_pi_squared`` into its
  advantage batch, so OTB only works on the (RayPPOTrainer) v0 trainer.

``run_verl(cfg)`` validates the result with verl's ``validate_config`` and calls verl's
``run_ppo`` with :class:`otb_tir.verl.task_runner.OTBTaskRunner`, which installs the plugin in the
Ray actor that computes advantages before training starts.

Extra verl settings: ``compose_verl_config(cfg, overrides=["actor_rollout_ref.rollout.
tensor_model_parallel_size=2", ...])`` (``key=value`` of an existing verl key, ``+key=value``
for a new one; applied last).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from otb_tir import ConfigError
from otb_tir.verl import require_verl

logger = logging.getLogger(__name__)

__all__ = ["OTB_ESTIMATORS", "compose_verl_config", "run_verl", "validate_verl_config", "verl_config_dir"]

OTB_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")
AGENT_LOOP_TARGET = "otb_tir.verl.agent_loop.OTBToolAgentLoop"
DEFAULT_PROMPT_LENGTH = 1024
_LOGGERS = {"console": "console", "jsonl": "file", "tensorboard": "tensorboard", "wandb": "wandb"}


def verl_config_dir() -> Path:
    """verl's ``trainer/config`` folder (ppo_trainer.yaml and its defaults)."""
    verl = require_verl()
    return Path(verl.__file__).resolve().parent / "trainer" / "config"


def _compose_base(overrides: Sequence[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        try:
            return compose(config_name="ppo_trainer", overrides=list(overrides))
        except Exception as exc:  # hydra's OverrideParseException, ConfigCompositionException, ...
            raise ConfigError(f"verl rejected the overrides {list(overrides)}: {exc}") from None


def _set(vcfg: DictConfig, key: str, value: Any) -> None:
    """Set an *existing* verl key (a typo in a key name fails loudly)."""
    if not _exists(vcfg, key):
        raise ConfigError(f"verl {require_verl().__version__} has no config key '{key}'")
    OmegaConf.update(vcfg, key, value, merge=False)


def _exists(vcfg: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(vcfg, parent) if parent else vcfg
    return isinstance(node, DictConfig) and leaf in node.keys()  # (`in node` is False for ??? values)


def _check_supported(cfg: DictConfig) -> None:
    if cfg.rollout.name not in ("vllm", "sglang"):
        raise ConfigError(f"rollout.name={cfg.rollout.name!r}: the verl path serves the policy with vllm or sglang "
                          "(e.g. trainer=verl rollout.name=vllm)")
    if cfg.algorithm.adv_estimator in OTB_ESTIMATORS and not cfg.algorithm.handle_zero_tail:
        raise ConfigError("algorithm.handle_zero_tail=false is not available on the verl path (verl's "
                          "compute_advantage does not pass it; the OTB estimators use the default, true)")
    f = cfg.algorithm.filter
    unsupported = [k for k in ("void_turns", "overlong", "all_equal_reward_groups") if f[k]]
    if unsupported:
        raise ConfigError(f"algorithm.filter.{unsupported[0]}=true is only implemented by the local trainer "
                          "(trainer=local); verl's trainer has no such filter")


def _data_files(cfg: DictConfig, out: Path) -> tuple[list[str], list[str]]:
    from agent_env.data import make_split, write_parquet

    train = [str(Path(p).expanduser().resolve()) for p in cfg.data.train_files]
    val = [str(Path(p).expanduser().resolve()) for p in cfg.data.val_files]
    for p in train + val:
        if not Path(p).is_file():
            raise ConfigError(f"data file not found: {p}")
    if not train:
        path = out / "data" / "train.parquet"
        write_parquet(make_split("train", cfg.data.train_size, seed=cfg.trainer.seed), path)
        train = [str(path)]
    if not val:
        n = min(cfg.data.val_size, cfg.eval.size) if cfg.eval.size else cfg.data.val_size
        path = out / "data" / "test.parquet"
        write_parquet(make_split("test", n, seed=0), path)  # the held-out set does not move with the seed
        val = [str(path)]
    return train, val


def _model_path(cfg: DictConfig) -> str:
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path={path} is not a local Hugging Face model folder (no config.json)")
        return str(path)
    from otb_tir.trainer.warm_start import warm_start_policy

    return str(warm_start_policy(steps=cfg.model.warm_start_steps, seed=0))


def _agent_loop_entries(cfg: DictConfig) -> list[dict[str, Any]]:
    mt = cfg.multi_turn
    kwargs = {
        "_target_": AGENT_LOOP_TARGET,
        "otb_tools": list(mt.tools),
        "tool_config": {},
        "tool_config_path": str(Path(mt.tool_config_path).expanduser().resolve()) if mt.tool_config_path else None,
        "max_tokens_per_turn": int(cfg.rollout.max_tokens_per_turn),
        "tool_timeout": float(mt.tool_timeout),
        "system_prompt": None,
        "reward": {k: float(v) for k, v in OmegaConf.to_container(cfg.reward).items()},
    }
    return [{"name": "otb_tir_agent", **kwargs}, {"name": "tool_agent", **kwargs}]


def compose_verl_config(cfg: DictConfig, overrides: Sequence[str] = ()) -> DictConfig:
    """verl's PPO trainer config for our recipe ``cfg`` (see the module docstring).

    Writes the agent-loop YAML (and, without data files, the built-in train/test parquet files)
    into ``cfg.trainer.output_dir``. Raises :class:`ConfigError` for settings the verl path cannot
    honour.
    """
    require_verl()
    _check_supported(cfg)
    out = Path(cfg.trainer.output_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    train_files, val_files = _data_files(cfg, out)
    model_path = _model_path(cfg)
    agent_loop_yaml = out / "agent_loop.yaml"
    OmegaConf.save(OmegaConf.create(_agent_loop_entries(cfg)), agent_loop_yaml)

    v = _compose_base(())
    a, r, o = cfg.actor, cfg.rollout, cfg.actor.optim
    otb = cfg.algorithm.adv_estimator in OTB_ESTIMATORS
    settings: dict[str, Any] = {
        # algorithm
        "algorithm.adv_estimator": cfg.algorithm.adv_estimator,
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
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": int(a.ppo_micro_batch_size),
        "actor_rollout_ref.actor.ppo_epochs": int(a.ppo_epochs),
        "actor_rollout_ref.actor.clip_ratio_low": float(a.clip_ratio_low),
        "actor_rollout_ref.actor.clip_ratio_high": float(a.clip_ratio_high),
        "actor_rollout_ref.actor.clip_ratio_c": float(a.clip_ratio_c),
        "actor_rollout_ref.actor.grad_clip": float(a.grad_clip),
        "actor_rollout_ref.actor.optim.clip_grad": float(a.grad_clip),
        "actor_rollout_ref.actor.use_kl_loss": bool(a.use_kl_loss),
        "actor_rollout_ref.actor.kl_loss_coef": float(a.kl_loss_coef),
        "actor_rollout_ref.actor.entropy_coeff": float(a.entropy_coeff),
        "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        "actor_rollout_ref.actor.optim.lr": float(o.lr),
        "actor_rollout_ref.actor.optim.weight_decay": float(o.weight_decay),
        "actor_rollout_ref.actor.optim.betas": [float(b) for b in o.betas],
        "actor_rollout_ref.actor.optim.lr_warmup_steps": int(o.warmup_steps) if o.warmup_steps else -1,
        "actor_rollout_ref.actor.optim.lr_scheduler_type": o.lr_scheduler,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": int(a.ppo_micro_batch_size),
        # rollout
        "actor_rollout_ref.rollout.name": r.name,
        "actor_rollout_ref.rollout.mode": "async",
        "actor_rollout_ref.rollout.n": int(r.n),
        "actor_rollout_ref.rollout.temperature": float(r.temperature),
        "actor_rollout_ref.rollout.top_p": float(r.top_p),
        "actor_rollout_ref.rollout.top_k": int(r.top_k),
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": int(a.ppo_micro_batch_size),
        "actor_rollout_ref.rollout.val_kwargs.temperature": float(cfg.eval.temperature),
        "actor_rollout_ref.rollout.val_kwargs.do_sample": float(cfg.eval.temperature) > 0,
        "actor_rollout_ref.rollout.val_kwargs.n": int(cfg.eval.n),
        "actor_rollout_ref.rollout.multi_turn.enable": True,
        "actor_rollout_ref.rollout.multi_turn.format": cfg.multi_turn.format,
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": int(cfg.multi_turn.max_assistant_turns),
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": int(cfg.multi_turn.max_parallel_calls),
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": int(cfg.multi_turn.max_tool_response_length),
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side":
            cfg.multi_turn.tool_response_truncate_side,
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
        "trainer.use_v1": False,
        "trainer.n_gpus_per_node": int(cfg.trainer.n_gpus_per_node),
        "trainer.nnodes": int(cfg.trainer.nnodes),
        "trainer.total_training_steps": int(cfg.trainer.total_steps),
        "trainer.total_epochs": 1_000_000,  # total_training_steps decides
        "trainer.save_freq": int(cfg.trainer.save_every),
        "trainer.max_actor_ckpt_to_keep": int(cfg.trainer.keep_checkpoints),
        "trainer.default_local_dir": str(out / "checkpoints"),
        "trainer.resume_mode": "auto" if cfg.trainer.resume else "disable",
        "trainer.val_before_train": bool(cfg.eval.before),
        "trainer.test_freq": int(cfg.trainer.total_steps) if cfg.eval.after else -1,
        "trainer.project_name": cfg.trainer.project_name,
        "trainer.experiment_name": cfg.trainer.experiment_name,
        "trainer.logger": [_LOGGERS[name] for name in cfg.trainer.loggers if name in _LOGGERS],
        "trainer.rollout_data_dir": None,
    }
    if cfg.algorithm.rollout_is:
        settings["algorithm.rollout_correction.rollout_is"] = "token"
        settings["algorithm.rollout_correction.rollout_is_threshold"] = float(cfg.algorithm.rollout_is_threshold)
    unknown_loggers = [name for name in cfg.trainer.loggers if name not in _LOGGERS]
    if unknown_loggers:
        raise ConfigError(f"trainer.loggers {unknown_loggers} have no verl counterpart; valid: {sorted(_LOGGERS)}")
    for key, value in settings.items():
        _set(v, key, value)
    with open_dict(v):
        runtime_env = v.ray_kwargs.ray_init.runtime_env
        current = runtime_env.get("env_vars")
        env_vars = dict(OmegaConf.to_container(current)) if current is not None else {}
        env_vars["TENSORBOARD_DIR"] = str(out / "tensorboard")
        env_vars["VERL_FILE_LOGGER_PATH"] = str(out / "metrics.jsonl")
        runtime_env["env_vars"] = env_vars
    if overrides:
        from omegaconf.errors import OmegaConfBaseException

        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"verl overrides must look like key=value, got {item!r}")
            key, value = item.split("=", 1)
            try:
                parsed = OmegaConf.from_dotlist([f"x={value}"]).x
                if key.startswith("+"):  # a new key, as in hydra's override syntax
                    with open_dict(v):
                        OmegaConf.update(v, key[1:], parsed, merge=False, force_add=True)
                else:
                    _set(v, key, parsed)
            except OmegaConfBaseException as exc:
                raise ConfigError(f"bad verl override {item!r}: {exc}") from None
    return v


def validate_verl_config(vcfg: DictConfig) -> None:
    """Run what verl runs on its config before training (``main_ppo.main`` → ``validate_config``)."""
    require_verl()
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    try:
        validate_config(config=vcfg, use_reference_policy=need_reference_policy(vcfg), use_critic=need_critic(vcfg))
    except (AssertionError, ValueError) as exc:
        raise ConfigError(f"verl rejected the composed config: {exc}") from exc


def run_verl(cfg: DictConfig, overrides: Sequence[str] = ()) -> None:
    """Compose, validate and run verl's PPO trainer with the OTB plugin (needs GPUs and Ray)."""
    vcfg = compose_verl_config(cfg, overrides)
    from verl.trainer.main_ppo import run_ppo
    from verl.utils.device import auto_set_device

    auto_set_device(vcfg)
    validate_verl_config(vcfg)
    out = Path(cfg.trainer.output_dir).expanduser().resolve()
    OmegaConf.save(vcfg, out / "verl_config.yaml")
    logger.info("verl config written to %s; starting verl's run_ppo", out / "verl_config.yaml")
    from otb_tir.verl.task_runner import OTBTaskRunner

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    run_ppo(vcfg, task_runner_class=OTBTaskRunner)
