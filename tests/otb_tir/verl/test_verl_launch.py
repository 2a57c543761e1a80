"""compose_verl_config / run_verl on CPU: the composed config passes verl's own validation and
dataclass conversions with our values at verl's keys; run_verl hands it to verl's run_ppo with a
TaskRunner that installs the plugin first. Ray and training are never started here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.support.optional import need

need("verl")

from otb_tir import ConfigError  # noqa: E402

BASE = [
    "trainer=verl",
    "rollout.name=vllm",
    "data.train_size=12",
    "data.val_size=4",
    "rollout.n=4",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "actor.ppo_micro_batch_size=4",
    "rollout.response_length=2048",
    "rollout.temperature=0.9",
    "actor.optim.lr=3e-6",
    "multi_turn.max_assistant_turns=5",
    "multi_turn.max_tool_response_length=300",
    "multi_turn.tool_response_truncate_side=tail",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=2",
    "trainer.total_steps=7",
    "trainer.loggers=[console,jsonl,tensorboard]",
    "trainer.device=cuda",
]


def _cfg(tiny_model_dir, out, *extra):
    from otb_tir.trainer.config import load_config

    return load_config(None, [*BASE, f"model.path={tiny_model_dir}", f"trainer.output_dir={out}", *extra])


@pytest.fixture(scope="module")
def composed(tiny_model_dir, tmp_path_factory):
    from otb_tir.verl.compose import compose_verl_config

    out = tmp_path_factory.mktemp("verl_launch")
    cfg = _cfg(tiny_model_dir, out)
    return cfg, compose_verl_config(cfg), out


def test_composed_config_passes_verls_validation_and_dataclasses(composed):
    from verl.trainer.config import AlgoConfig
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import FSDPActorConfig, HFModelConfig, RolloutConfig

    from otb_tir.verl.compose import validate_verl_config

    cfg, v, out = composed
    validate_verl_config(v)  # verl's validate_config, incl. FSDPActorConfig.validate(n_gpus, batch, model)
    actor = omega_conf_to_dataclass(v.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(v.actor_rollout_ref.rollout)
    model = omega_conf_to_dataclass(v.actor_rollout_ref.model)
    algo = omega_conf_to_dataclass(v.algorithm)
    assert isinstance(actor, FSDPActorConfig) and isinstance(rollout, RolloutConfig)
    assert isinstance(model, HFModelConfig) and isinstance(algo, AlgoConfig)
    # the OTB recipe
    assert algo.adv_estimator == "tir_optimal_token_baseline"
    assert actor.calculate_sum_pi_squared is True and actor.use_fused_kernels is False
    assert model.use_fused_kernels is False and model.path == str(Path(cfg.model.path).resolve())
    # verl's default V1 trainer in sync mode, through our class (verl's lacks the Σπ² step); on-policy
    assert v.trainer.use_v1 is True and v.trainer.v1.trainer_mode == "otb_sync"
    assert v.algorithm.rollout_correction.rollout_is is None
    env_vars = v.ray_kwargs.ray_init.runtime_env.env_vars
    assert "otb_tir.verl.v1" in env_vars.VERL_USE_EXTERNAL_MODULES.split(",")
    assert v.critic.enable is False
    # rollout / multi-turn
    assert rollout.name == "vllm" and rollout.mode == "async" and rollout.n == 4 and rollout.temperature == 0.9
    assert rollout.response_length == 2048 and rollout.prompt_length == v.data.max_prompt_length
    assert rollout.calculate_log_probs is True
    mt = rollout.multi_turn
    assert mt.enable and mt.max_assistant_turns == 5 and mt.max_tool_response_length == 300
    assert mt.format == "hermes" and mt.tool_response_truncate_side == "tail"
    assert rollout.agent.default_agent_loop == "otb_tir_agent"
    entries = OmegaConf.load(rollout.agent.agent_loop_config_path)
    assert {e.name for e in entries} == {"otb_tir_agent", "tool_agent"}
    for e in entries:
        assert e._target_ == "otb_tir.verl.agent_loop.OTBToolAgentLoop"
        assert (
            list(e.otb_tools) == ["python", "calculator"] and e.max_tokens_per_turn == cfg.rollout.max_tokens_per_turn
        )
    # optimizer and batch sizes
    assert actor.optim.lr == 3e-6 and list(actor.optim.betas) == list(cfg.actor.optim.betas)
    assert v.actor_rollout_ref.actor.ppo_mini_batch_size == 2 and v.data.train_batch_size == 4
    assert v.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    assert v.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 4
    # data: the built-in splits as parquet under the run folder
    from agent_env.math_task.data import load_parquet

    assert len(load_parquet(v.data.train_files[0])) == 12 and len(load_parquet(v.data.val_files[0])) == 4
    assert all(Path(p).parent == out / "data" for p in [*v.data.train_files, *v.data.val_files])
    # trainer
    assert v.trainer.n_gpus_per_node == 8 and v.trainer.nnodes == 2 and v.trainer.total_training_steps == 7
    assert v.trainer.default_local_dir == str(out / "checkpoints")
    # verl logs to the console; metrics.jsonl and TensorBoard are written by our hooks in the TaskRunner
    assert list(v.trainer.logger) == ["console"]
    env = v.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.OTB_TIR_OUTPUT_DIR == str(out) and env.OTB_TIR_LOGGERS == "jsonl,tensorboard"
    # a GPU run gets none of the CPU profile (otb_tir.verl.cpu)
    from otb_tir.verl.cpu import ENV_FLAG

    assert ENV_FLAG not in env and "VERL_PLATFORM" not in env and v.trainer.device == "cuda"
    assert "num_gpus" not in v.ray_kwargs.ray_init and v.actor_rollout_ref.rollout.enforce_eager is False
    assert v.actor_rollout_ref.actor.strategy == "fsdp"
    assert Path(v.reward.custom_reward_function.path).is_file()


@pytest.mark.slow
def test_the_cpu_profile_is_what_a_machine_without_an_accelerator_gets(tiny_model_dir, tmp_path):
    from otb_tir.verl.compose import compose_verl_config
    from otb_tir.verl.cpu import ENV_FLAG, cpu_overrides
    from otb_tir.verl.launch import prepare_verl

    cfg = _cfg(tiny_model_dir, tmp_path, "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1")
    v = compose_verl_config(cfg)
    for key, value in cpu_overrides(max_model_len=1).items():
        if key.endswith("max_model_len"):
            continue
        assert OmegaConf.select(v, key.lstrip("+")) == value, key
    assert v.ray_kwargs.ray_init.address == "local"  # never another run's Ray cluster
    assert v.trainer.device == "cpu" and v.actor_rollout_ref.rollout.enable_sleep_mode is False
    # the actor computes in float32 as the local trainer (verl's FSDP engine skips autocast at fp32)
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.torch_dtypes import PrecisionType

    mp = omega_conf_to_dataclass(v.actor_rollout_ref.actor).fsdp_config.mixed_precision
    assert PrecisionType.to_dtype(mp["param_dtype"]) == torch.float32
    info = prepare_verl(cfg)
    assert info["device"] == "cpu" and info["env"][ENV_FLAG] == "1" and info["env"]["VERL_PLATFORM"] == "cpu"
    assert "otb_tir.verl.cpu" in info["env"]["VERL_USE_EXTERNAL_MODULES"].split(",")
    saved = OmegaConf.load(info["verl_config"])
    assert saved.ray_kwargs.ray_init.runtime_env.env_vars[ENV_FLAG] == "1"  # the Ray workers get it too
    with pytest.raises(ConfigError, match="does not run on a CPU from the project's files.*rollout.name=vllm"):
        prepare_verl(_cfg(tiny_model_dir, tmp_path, "trainer.device=cpu", "rollout.name=sglang"))


@pytest.mark.parametrize("given, want", [(None, False), ("true", True), ("false", False)])
def test_gradient_checkpointing_key_reaches_verl(tiny_model_dir, tmp_path, given, want):
    """model.enable_gradient_checkpointing (verl's name) is verl's actor_rollout_ref.model key, the CPU
    profile's off when the user gave none, the user's value when given (the profile does not undo it)."""
    from otb_tir.verl.compose import compose_verl_config

    extra = [] if given is None else [f"model.enable_gradient_checkpointing={given}"]
    cfg = _cfg(tiny_model_dir, tmp_path, "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1", *extra)
    assert compose_verl_config(cfg).actor_rollout_ref.model.enable_gradient_checkpointing is want


@pytest.mark.parametrize("given, want", [(None, "float32"), ("auto", "float32"), ("bfloat16", "bfloat16")])
def test_rollout_dtype_reaches_verl(tiny_model_dir, tmp_path, given, want):
    """rollout.dtype (verl's name) is verl's actor_rollout_ref.rollout.dtype: the CPU profile's float32
    when the user gave none, the user's value when given."""
    from otb_tir.verl.compose import compose_verl_config

    extra = [] if given is None else [f"rollout.dtype={given}"]
    cfg = _cfg(tiny_model_dir, tmp_path, "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1", *extra)
    assert compose_verl_config(cfg).actor_rollout_ref.rollout.dtype == want


def test_verls_checks_reject_a_bad_layout(tiny_model_dir, tmp_path):
    from otb_tir.verl.compose import compose_verl_config, validate_verl_config

    # 3 prompts × 4 samples = 12 trajectories cannot be split over 16 GPUs
    v = compose_verl_config(_cfg(tiny_model_dir, tmp_path, "data.train_batch_size=3", "actor.ppo_mini_batch_size=3"))
    with pytest.raises(ConfigError, match="verl rejected"):
        validate_verl_config(v)


@pytest.mark.slow
def test_overrides_and_unsupported_settings(tiny_model_dir, tmp_path):
    from otb_tir.verl.compose import compose_verl_config

    v = compose_verl_config(
        _cfg(tiny_model_dir, tmp_path, "algorithm.adv_estimator=grpo", "algorithm.rollout_is=true"),
        overrides=["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "+my.new_key=3"],
    )
    assert v.actor_rollout_ref.rollout.tensor_model_parallel_size == 2 and v.my.new_key == 3
    assert v.algorithm.adv_estimator == "grpo" and v.actor_rollout_ref.actor.calculate_sum_pi_squared is False
    assert v.algorithm.rollout_correction.rollout_is == "token"
    with pytest.raises(ConfigError, match="Could not override 'actor_rollout_ref.rollout.tensor_parallel'"):
        compose_verl_config(_cfg(tiny_model_dir, tmp_path), overrides=["actor_rollout_ref.rollout.tensor_parallel=2"])
    for extra, match in [
        ("rollout.name=hf", "vllm or sglang"),
        ("algorithm.handle_zero_tail=false", "handle_zero_tail"),
        ("algorithm.filter.overlong=true", "filter.overlong"),
        ("rollout.engine_kwargs.max_model_len=512", "engine_kwargs.*local trainer"),
        ("trainer.one_step_off_policy=true", "one_step_off_policy.*colocate_async or separate_async"),
        ("data.train_files=[/nonexistent.parquet]", "not found"),
    ]:
        with pytest.raises(ConfigError, match=match):
            compose_verl_config(_cfg(tiny_model_dir, tmp_path, extra))


def test_verl_section_passes_any_verl_key_through_to_verls_dataclasses(tiny_model_dir, tmp_path):
    """verl keys the recipe does not model, from YAML (nested and `overrides`), `verl.<key>=v` on the
    command line and the `overrides` argument, in that order, win over the recipe's values and reach
    verl's own dataclasses."""
    from verl.utils.config import omega_conf_to_dataclass

    from otb_tir.trainer.config import load_config
    from otb_tir.verl.compose import compose_verl_config, validate_verl_config

    yaml = tmp_path / "recipe.yaml"
    yaml.write_text(
        "verl:\n  overrides: ['actor_rollout_ref.actor.ppo_epochs=3', 'trainer.val_only=true']\n"
        "  actor_rollout_ref:\n    actor:\n      checkpoint: {save_contents: [model]}\n"
        "      ppo_epochs: 4\n"
    )
    cfg = load_config(
        yaml,
        [
            *BASE,
            f"model.path={tiny_model_dir}",
            f"trainer.output_dir={tmp_path}",
            "verl.actor_rollout_ref.actor.optim.lr=2e-5",
            "verl.actor_rollout_ref.actor.ppo_epochs=2",
            "+verl.my_plugin.setting=[1,2]",
        ],
    )
    assert list(cfg.verl.overrides) == [
        "actor_rollout_ref.actor.ppo_epochs=3",
        "trainer.val_only=true",
        'actor_rollout_ref.actor.checkpoint.save_contents=["model"]',
        "actor_rollout_ref.actor.ppo_epochs=4",
        "actor_rollout_ref.actor.optim.lr=2e-5",
        "actor_rollout_ref.actor.ppo_epochs=2",
        "+my_plugin.setting=[1,2]",
    ]
    v = compose_verl_config(cfg, overrides=["~trainer.val_only", "actor_rollout_ref.actor.use_dynamic_bsz=true"])
    validate_verl_config(v)
    actor = omega_conf_to_dataclass(v.actor_rollout_ref.actor)
    assert actor.ppo_epochs == 2 and actor.optim.lr == 2e-5  # last one wins; the recipe's lr was 3e-6
    assert list(actor.checkpoint.save_contents) == ["model"] and actor.use_dynamic_bsz is True
    assert list(v.my_plugin.setting) == [1, 2] and "val_only" not in v.trainer
    # the recipe's own values are untouched where no override names them
    assert actor.calculate_sum_pi_squared is True and v.actor_rollout_ref.rollout.n == 4


@pytest.mark.slow
def test_bad_verl_overrides_fail_before_any_work(tiny_model_dir, tmp_path):
    from otb_tir.trainer.config import load_config
    from otb_tir.verl.compose import compose_verl_config

    for extra, match in [
        ("verl.actor_rollout_ref.actor.ppo_epoch=2", r"Could not override 'actor_rollout_ref.actor.ppo_epoch'"),
        ("+verl.actor_rollout_ref.actor.ppo_epochs=2", "An item is already at"),
        (
            "verl.actor_rollout_ref.actor.ppo_epochs=two",
            r"'actor_rollout_ref.actor.ppo_epochs' is a number \(default 1\), got a str",
        ),
        ("verl.actor_rollout_ref.actor.use_dynamic_bsz=3", "is a bool .*got a number"),
        ("verl.actor_rollout_ref.actor=3", "'actor_rollout_ref.actor' is a mapping, got a number"),
        ("verl.trainer.logger=console", r"'trainer.logger' is a list"),
        ("verl.actor_rollout_ref.actor.ppo_epochs=1,2", "no sweeps"),
        ("verl.overrides=[justakey]", "must look like key=value"),
    ]:
        out = tmp_path / str(abs(hash(extra)))
        with pytest.raises(ConfigError, match=match):
            compose_verl_config(_cfg(tiny_model_dir, out, extra))
        assert not (out / "data").exists() and not (out / "agent_loop.yaml").exists()  # nothing prepared yet
    with pytest.raises(ConfigError, match="only apply to trainer=verl"):
        load_config(None, ["verl.actor_rollout_ref.actor.ppo_epochs=2"])
    with pytest.raises(ConfigError, match="only apply to trainer=verl"):
        load_config(None, ["verl.overrides=[actor_rollout_ref.actor.ppo_epochs=2]", "trainer=local"])


def test_task_runner_installs_the_plugin_before_verls_run(composed, monkeypatch):
    from verl.trainer.main_ppo_v0 import BaseTaskRunner

    from otb_tir.verl import plugin, task_runner
    from otb_tir.verl.task_runner import OTBTaskRunner, OTBTaskRunnerImpl

    # ours derives from BaseTaskRunner, not from verl's TaskRunner (see task_runner.py)
    assert OTBTaskRunner.__ray_actor_class__ is OTBTaskRunnerImpl and issubclass(OTBTaskRunnerImpl, BaseTaskRunner)
    plugin.uninstall()
    assert not plugin.installed()
    seen = {}

    def fake_run(self, config):
        seen["installed"] = plugin.installed()
        seen["config"] = config

    monkeypatch.delenv("OTB_TIR_OUTPUT_DIR", raising=False)
    monkeypatch.setattr(task_runner, "_verl_run", fake_run)
    OTBTaskRunnerImpl().run("cfg")
    assert seen == {"installed": True, "config": "cfg"}
    plugin.uninstall()


@pytest.mark.slow
def test_dry_run_prints_the_exact_gpu_command_and_the_child_runs_run_ppo(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The multi-GPU recipe validated without running: the printed command runs
    ``python -m otb_tir.verl.launch <verl_config.yaml>``, whose main() calls verl's run_ppo with our TaskRunner."""
    import shlex

    import verl.trainer.main_ppo as main_ppo

    from otb_tir.train import main as train_main
    from otb_tir.verl.launch import main as launch_main
    from otb_tir.verl.task_runner import OTBTaskRunner

    for rollout in ("vllm", "sglang"):
        out = tmp_path / rollout
        rc = train_main(
            [
                *BASE,
                f"rollout.name={rollout}",
                f"trainer.output_dir={out}",
                "verl.dry_run=true",
                "--model",
                str(tiny_model_dir),
            ]
        )
        printed = capsys.readouterr().out
        assert rc == 0
        command = [line for line in printed.splitlines() if not line.startswith("#")][-1]
        argv = shlex.split(command)
        assert argv[-3:] == ["-m", "otb_tir.verl.launch", str(out.resolve() / "verl_config.yaml")]
        assert not any(a.startswith("OTB_TIR_VERL_CPU=") for a in argv)  # the GPU command: no CPU profile
        saved = OmegaConf.load(out / "verl_config.yaml")
        assert saved.actor_rollout_ref.rollout.name == rollout and saved.trainer.n_gpus_per_node == 8
        assert saved.trainer.nnodes == 2 and saved.trainer.use_v1 is True
        assert not (out / "metrics.jsonl").exists() and not (out / "verl.log").exists()  # nothing ran
    calls = []
    monkeypatch.setattr(
        main_ppo, "run_ppo", lambda config, task_runner_class: calls.append((config, task_runner_class))
    )
    assert launch_main([str(tmp_path / "vllm" / "verl_config.yaml")]) == 0
    config, runner = calls[0]
    assert runner is main_ppo.TaskRunnerV1 and config.algorithm.adv_estimator == "tir_optimal_token_baseline"
    assert config.actor_rollout_ref.actor.calculate_sum_pi_squared is True
    assert config.trainer.v1.trainer_mode == "otb_sync"
    # the legacy trainer: verl's RayPPOTrainer under our TaskRunner
    out = tmp_path / "legacy"
    args = [*BASE, f"trainer.output_dir={out}", "verl.dry_run=true", "verl.trainer_mode=legacy"]
    assert train_main([*args, "--model", str(tiny_model_dir)]) == 0
    capsys.readouterr()
    assert launch_main([str(out / "verl_config.yaml")]) == 0
    config, runner = calls[1]
    assert runner is OTBTaskRunner and config.trainer.use_v1 is False


def test_missing_verl_gives_one_clear_error(monkeypatch):
    from otb_tir.verl import require_verl

    monkeypatch.setitem(sys.modules, "verl", None)
    with pytest.raises(ConfigError, match=r"verl.dry_run too.*pip install -e '\.\[verl\]' in the otb-tir checkout"):
        require_verl()


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async", "legacy"])
def test_one_key_selects_the_trainer_and_the_async_modes_get_off_policy_defaults(tiny_model_dir, tmp_path, mode):
    from otb_tir.verl.compose import ASYNC_MAX_OFF_POLICY, compose_verl_config, validate_verl_config

    cfg = _cfg(tiny_model_dir, tmp_path, f"verl.trainer_mode={mode}")
    v = compose_verl_config(cfg)
    validate_verl_config(v)
    assert v.trainer.use_v1 is (mode != "legacy")
    if mode != "legacy":
        assert v.trainer.v1.trainer_mode == f"otb_{mode}"
    sampler = v.trainer.v1.sampler
    if mode in ("colocate_async", "separate_async"):  # off-policy samples: IS weights on, staleness bounded
        assert v.algorithm.rollout_correction.rollout_is == "token"
        assert v.algorithm.rollout_correction.rollout_is_threshold == cfg.algorithm.rollout_is_threshold
        assert sampler.max_off_policy_threshold == ASYNC_MAX_OFF_POLICY and sampler.max_off_policy_strategy == "wait"
    else:
        assert v.algorithm.rollout_correction.rollout_is is None
    # the user's choices win: IS off explicitly, verl's sampler keys passed through
    v = compose_verl_config(
        _cfg(
            tiny_model_dir,
            tmp_path,
            f"verl.trainer_mode={mode}",
            "algorithm.rollout_is=false",
            "verl.trainer.v1.sampler.max_off_policy_threshold=5",
        )
    )
    assert v.algorithm.rollout_correction.rollout_is is None and v.trainer.v1.sampler.max_off_policy_threshold == 5


def test_otb_with_bypass_mode_stops_at_start(tiny_model_dir, tmp_path):
    from otb_tir.verl.compose import compose_verl_config

    bypass = "verl.algorithm.rollout_correction.bypass_mode=true"
    with pytest.raises(ConfigError, match="bypass_mode=true.*sum_pi_squared"):
        compose_verl_config(_cfg(tiny_model_dir, tmp_path, bypass))
    compose_verl_config(_cfg(tiny_model_dir, tmp_path, bypass, "algorithm.adv_estimator=grpo"))  # no Σπ² needed


def test_a_resumed_run_validates_before_training_only_if_its_before_figure_is_not_logged(tiny_model_dir, tmp_path):
    """verl validates before its loop on every start; a resumed run whose killed run logged the
    held-out figure at step 0 does not do it again (the local trainer reuses its before.json), one
    without that row (or without a checkpoint to resume) does."""
    import json

    from otb_tir.verl.compose import compose_verl_config

    def val_before(*extra: str) -> bool:
        return bool(compose_verl_config(_cfg(tiny_model_dir, tmp_path, *extra)).trainer.val_before_train)

    assert val_before("trainer.resume=true")  # nothing to resume from yet
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    rows = [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert val_before("trainer.resume=true")  # the killed run logged no figure before training
    rows.insert(0, {"step": 0, "val/accuracy": 0.27})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew')
    assert not val_before("trainer.resume=true")  # it did (a line cut by the kill is skipped)
    assert val_before()  # a fresh run (resume off) over the same folder
    assert not val_before("trainer.resume=true", "eval.before=false")


def test_separate_async_on_a_cpu_gets_its_own_rollout_pool_and_the_gloo_engine(tiny_model_dir, tmp_path):
    """What verl's PPOTrainerSeparateAsync asserts (train_batch_size = parameter_sync_step x mini-batch,
    a rollout pool of its own, a checkpoint engine other than naive) and what this CPU needs (our gloo
    engine, small buckets, one vLLM: no hybrid replicas); a GPU machine gets nccl and verl's hybrid default."""
    from otb_tir.verl.compose import compose_verl_config, validate_verl_config

    cfg = _cfg(
        tiny_model_dir,
        tmp_path,
        "verl.trainer_mode=separate_async",
        "trainer.device=cpu",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
    )
    v = compose_verl_config(cfg)
    validate_verl_config(v)
    ro = v.actor_rollout_ref.rollout
    assert v.trainer.v1.trainer_mode == "otb_separate_async"
    assert v.trainer.v1.separate_async.parameter_sync_step * v.actor_rollout_ref.actor.ppo_mini_batch_size == 8
    assert ro.nnodes == 1 and ro.n_gpus_per_node == 1
    assert ro.checkpoint_engine.backend == "gloo" and ro.checkpoint_engine.update_weights_bucket_megabytes == 64
    assert v.actor_rollout_ref.hybrid_engine is False
    assert v.ray_kwargs.ray_init.num_gpus >= 2  # the trainer's pool and the standalone replica
    gpu = compose_verl_config(cfg, cpu=False)
    assert gpu.actor_rollout_ref.rollout.checkpoint_engine.backend == "nccl"
    assert gpu.actor_rollout_ref.hybrid_engine is True


def test_an_untested_verl_version_stops_at_start_unless_allowed(tiny_model_dir, tmp_path, monkeypatch):
    import verl

    from otb_tir.verl import UNTESTED_ENV, check_verl_version
    from otb_tir.verl.launch import prepare_verl

    monkeypatch.delenv(UNTESTED_ENV, raising=False)
    assert check_verl_version() == "0.9.1"
    monkeypatch.setattr(verl, "__version__", "0.10.0")
    with pytest.raises(ConfigError, match=r"tested with verl 0\.9\.1.*has verl 0\.10\.0.*allow_untested_version=true"):
        prepare_verl(_cfg(tiny_model_dir, tmp_path / "a", "verl.dry_run=true"))
    assert not (tmp_path / "a" / "verl_config.yaml").exists()  # stopped before anything was written
    info = prepare_verl(_cfg(tiny_model_dir, tmp_path / "b", "verl.dry_run=true", "verl.allow_untested_version=true"))
    assert info["env"][UNTESTED_ENV] == "1"  # the run's processes (our V1 classes) let it through too
    monkeypatch.setenv(UNTESTED_ENV, "1")
    assert check_verl_version() == "0.10.0"


def test_a_gpu_run_never_imports_the_cpu_layer(tiny_model_dir, tmp_path):
    """The GPU command is composed without importing otb_tir.verl.cpu (its patches, the CPU platform):
    in a fresh interpreter, as a user on a GPU machine would run it (trainer.device=cuda, dry run)."""
    argv = [*BASE, f"trainer.output_dir={tmp_path}", "verl.dry_run=true", "--model", str(tiny_model_dir)]
    code = (
        "import sys\n"
        "from otb_tir.train import main\n"
        f"rc = main({argv!r})\n"
        "assert rc == 0\n"
        "assert 'otb_tir.verl.cpu' not in sys.modules, 'the CPU layer was imported'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.parametrize(
    "extra, named",
    [
        ("rollout.top_p=0.9", "rollout.top_p=0.9"),
        ("rollout.top_k=20", "rollout.top_k=20"),
        ("verl.actor_rollout_ref.rollout.top_p=0.5", "rollout.top_p=0.5"),  # through verl's own key too
    ],
)
def test_truncated_sampling_is_refused_naming_the_key(tiny_model_dir, tmp_path, extra, named):
    """verl's rollout reports truncated, renormalised log-probs; its actor's are full-softmax: the lag-0
    IS ratio would be the kept mass, not 1 (measured: prob_diff_mean_lag_0 0.0078 at top_p=0.9 vs
    0.0016 at 1). Refused at start, before any work, naming the key."""
    from otb_tir.verl.compose import compose_verl_config

    with pytest.raises(ConfigError, match=rf"{re.escape(named)} .*IS ratio.*top_p=1 rollout.top_k=-1"):
        compose_verl_config(_cfg(tiny_model_dir, tmp_path, extra))
    compose_verl_config(_cfg(tiny_model_dir, tmp_path, "rollout.top_p=1.0", "rollout.top_k=-1"))


def test_grad_clip_zero_is_off_on_the_verl_path(tiny_model_dir, tmp_path):
    """``actor.grad_clip=0`` means off; verl clips with max_norm=clip_grad (0 would zero every gradient),
    so the composed config carries ∞, which verl's dataclass takes and torch's clip leaves unscaled."""
    from verl.utils.config import omega_conf_to_dataclass

    from otb_tir.verl.compose import compose_verl_config

    v = compose_verl_config(_cfg(tiny_model_dir, tmp_path, "actor.grad_clip=0"))
    clip = omega_conf_to_dataclass(v.actor_rollout_ref.actor).optim.clip_grad
    assert clip == float("inf")
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    norm = torch.nn.utils.clip_grad_norm_([p], clip)
    assert float(norm) == pytest.approx(6.0) and torch.equal(p.grad, torch.full((4,), 3.0))
    assert compose_verl_config(_cfg(tiny_model_dir, tmp_path)).actor_rollout_ref.actor.optim.clip_grad == 1.0


def test_joining_an_existing_ray_cluster_drops_the_cpu_profiles_resource_counts(tiny_model_dir, tmp_path):
    """``verl.ray_address=...``: the run joins that cluster (two nodes, say), so the
    counts a cluster of its own would declare (which ray.init refuses when it connects) are dropped,
    and the CPU environment still travels in runtime_env."""
    from otb_tir.verl.compose import compose_verl_config

    own = compose_verl_config(_cfg(tiny_model_dir, tmp_path / "own"), cpu=True)
    assert own.ray_kwargs.ray_init.address == "local" and own.ray_kwargs.ray_init.num_gpus == 4
    joined = compose_verl_config(_cfg(tiny_model_dir, tmp_path / "joined", "verl.ray_address=127.0.0.1:6390"), cpu=True)
    ray_init = joined.ray_kwargs.ray_init
    assert ray_init.address == "127.0.0.1:6390"
    assert "num_cpus" not in ray_init and "num_gpus" not in ray_init
    assert ray_init.runtime_env.env_vars["OTB_TIR_OUTPUT_DIR"] == str(tmp_path / "joined")


def test_the_runs_length_is_given_once(tiny_model_dir, tmp_path):
    """trainer.total_steps and a verl override of the run's length both given: an error, not a silent win."""
    from otb_tir.verl.compose import compose_verl_config

    with pytest.raises(
        ConfigError, match=r"trainer.total_steps=7 and the verl override\(s\) \['trainer.total_epochs'\]"
    ):
        compose_verl_config(_cfg(tiny_model_dir, tmp_path / "a", "verl.trainer.total_epochs=2"))
    v = compose_verl_config(
        _cfg(tiny_model_dir, tmp_path / "b", "trainer.total_steps=0", "verl.trainer.total_training_steps=3")
    )
    assert v.trainer.total_training_steps == 3


@pytest.mark.parametrize(
    ("given", "native", "big", "want"),
    [
        (None, "avx512_bf16", False, "fp32"),  # the tiny policy: float32 on every CPU
        ("auto", "avx512_bf16", True, "bf16"),  # >= 100M parameters where the CPU computes bf16 natively
        ("auto", "", True, "fp32"),  # an AVX2-only CPU emulates bf16: slower
        ("bfloat16", "", False, "bf16"),
        ("float32", "avx512_bf16", True, "fp32"),
    ],
)
def test_model_dtype_reaches_verls_fsdp_param_dtype_on_the_cpu(
    tiny_model_dir, tmp_path, monkeypatch, given, native, big, want
):
    """model.dtype is verl's actor and reference FSDP mixed_precision.param_dtype (verl's FSDP engine
    computes under autocast of it; reductions and buffers stay float32): auto follows the local trainer's
    rule for the model's size and this CPU, decided at start."""
    import shutil

    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.torch_dtypes import PrecisionType

    from otb_tir.defaults.shapes import shape_config
    from otb_tir.verl.compose import compose_verl_config

    model = tiny_model_dir
    if big:  # the tiny policy's tokenizer beside a config of Qwen3-0.6B's shape (counted, never loaded)
        model = tmp_path / "big"
        shutil.copytree(tiny_model_dir, model)
        shape_config("qwen3-0.6b").save_pretrained(model)
    monkeypatch.setattr("otb_tir.machine.native_bf16", lambda: native)
    extra = [] if given is None else [f"model.dtype={given}"]
    cfg = _cfg(model, tmp_path, "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1", *extra)
    v = compose_verl_config(cfg)
    mp = omega_conf_to_dataclass(v.actor_rollout_ref.actor).fsdp_config.mixed_precision  # verl's own reading
    assert PrecisionType.to_dtype(mp["param_dtype"]) == {"fp32": torch.float32, "bf16": torch.bfloat16}[want]
    for role in (v.actor_rollout_ref.actor, v.actor_rollout_ref.ref):
        mp = role.fsdp_config.mixed_precision
        assert mp.param_dtype == want and mp.reduce_dtype == mp.buffer_dtype == "fp32"


def test_a_given_model_dtype_reaches_verl_on_an_accelerator_and_auto_keeps_verls_own(tiny_model_dir, tmp_path):
    from otb_tir.verl.compose import compose_verl_config

    gpu = ("trainer.device=cuda", "trainer.n_gpus_per_node=1", "trainer.nnodes=1")
    v = compose_verl_config(_cfg(tiny_model_dir, tmp_path, *gpu, "model.dtype=float32"), cpu=False)
    assert v.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"
    assert v.actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype == "fp32"
    v = compose_verl_config(_cfg(tiny_model_dir, tmp_path, *gpu), cpu=False)
    assert OmegaConf.select(v, "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype") in (None, "bf16")
