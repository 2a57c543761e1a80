"""The seed's canonical run, shipped as ``--config tir_math_qwen3_8b_gpu``, checked key by key on this CPU.

The seed is verl's ``examples/otb_trainer/run_qwen3_8b_fsdp.sh`` (verl-project/verl tag v0.9.0, commit
483b8a0; the same values on main, where only its launcher changed; the pin here, 0.9.1, is a patch
release in between)
with ``ADV_ESTIMATOR=tir_optimal_token_baseline`` (the variant its README names for TIR). The shipped
config is composed for a GPU cluster exactly as ``otb-tir-train --config tir_math_qwen3_8b_gpu
verl.dry_run=true trainer.device=cuda`` does (verl 0.9.1's hydra composition, ``validate_config`` and
config dataclasses; nothing starts), with data from ``otb-tir-prepare-data`` under the file names the
config expects and the tests' tiny model in place of Qwen3-8B. Then:

* every key the script sets has the script's value (:data:`SEED`, each row citing the script's line);
* every other key of ``actor_rollout_ref``, ``data``, ``algorithm`` and ``trainer`` equals what verl
  itself composes from the script's command line, except the recipe's own keys (:data:`DEPARTURES`,
  each with its reason);
* nothing of the CPU profile (:mod:`otb_tir.verl.cpu`) is in the config or in the run's environment.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from tests.support.optional import need

need("verl")

pytestmark = pytest.mark.slow  # one composition: 5-20 s on 2 cores (verl's import, hydra, the tools' check)

SCRIPT = "run_qwen3_8b_fsdp.sh"  # verl-project/verl v0.9.0 examples/otb_trainer/
SECTIONS = ("actor_rollout_ref", "data", "algorithm", "trainer")

#: (verl key, the seed's value, where run_qwen3_8b_fsdp.sh sets it: line, and the default of its variable)
SEED: list[tuple[str, Any, str]] = [
    ("algorithm.adv_estimator", "tir_optimal_token_baseline", "l.11+44, ADV_ESTIMATOR as its README sets for TIR"),
    ("algorithm.use_kl_in_reward", False, "l.45"),
    ("data.train_files", ["gsm8k/train.parquet", "math/train.parquet"], "l.34-39, under $HOME/data"),
    ("data.val_files", ["gsm8k/test.parquet", "math/test.parquet"], "l.34-40, under $HOME/data"),
    ("data.train_batch_size", 128, "l.13+48 TRAIN_BATCH_SIZE:-128"),
    ("data.max_prompt_length", 1024, "l.15+49 MAX_PROMPT_LENGTH:-1024"),
    ("data.max_response_length", 2048, "l.16+50 MAX_RESPONSE_LENGTH:-2048"),
    ("data.filter_overlong_prompts", True, "l.51"),
    ("data.truncation", "error", "l.52"),
    ("actor_rollout_ref.model.path", "Qwen/Qwen3-8B", "l.7+56 MODEL_PATH:-Qwen/Qwen3-8B"),
    ("actor_rollout_ref.model.use_remove_padding", True, "l.57"),
    ("actor_rollout_ref.model.enable_gradient_checkpointing", True, "l.58"),
    ("actor_rollout_ref.actor.optim.lr", 1e-6, "l.19+62 ACTOR_LR:-1e-6"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", 128, "l.14+63 PPO_MINI_BATCH_SIZE:-128"),
    ("actor_rollout_ref.actor.use_dynamic_bsz", True, "l.64"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 24576, "l.17+65 PPO_MAX_TOKEN_LEN_PER_GPU:-24576"),
    ("actor_rollout_ref.actor.use_kl_loss", False, "l.66"),
    ("actor_rollout_ref.actor.entropy_coeff", 0, "l.20+67 ENTROPY_COEFF:-0"),
    ("actor_rollout_ref.actor.calculate_sum_pi_squared", True, "l.68"),
    ("actor_rollout_ref.actor.fsdp_config.param_offload", False, "l.69"),
    ("actor_rollout_ref.actor.fsdp_config.optimizer_offload", False, "l.70"),
    ("actor_rollout_ref.rollout.name", "vllm", "l.74"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size", 2, "l.22+75 ROLLOUT_TP:-2"),
    ("actor_rollout_ref.rollout.gpu_memory_utilization", 0.75, "l.23+76 ROLLOUT_GPU_MEM_UTIL:-0.75"),
    ("actor_rollout_ref.rollout.n", 8, "l.24+77 ROLLOUT_N:-8"),
    ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", True, "l.78"),
    ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", 24576, "l.79 ppo_max_token_len_per_gpu"),
    ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", True, "l.83"),
    ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", 24576, "l.84 ppo_max_token_len_per_gpu"),
    ("actor_rollout_ref.ref.fsdp_config.param_offload", True, "l.85"),
    ("trainer.balance_batch", True, "l.89"),
    ("trainer.critic_warmup", 0, "l.90"),
    ("trainer.logger", ["console", "wandb"], "l.91"),
    ("trainer.project_name", "verl_otb_gsm8k_math", "l.30+92 PROJECT_NAME"),
    ("trainer.experiment_name", "qwen3_8b_vllm_fsdp", "l.31+93 EXPERIMENT_NAME"),
    ("trainer.n_gpus_per_node", 8, "l.9+94 NGPUS_PER_NODE:-8"),
    ("trainer.nnodes", 1, "l.8+95 NNODES:-1"),
    ("trainer.save_freq", 20, "l.27+96 SAVE_FREQ:-20"),
    ("trainer.test_freq", 5, "l.28+97 TEST_FREQ:-5"),
    ("trainer.total_epochs", 15, "l.26+98 TOTAL_EPOCHS:-15"),
]

#: keys whose value is a place on this machine: checked by their own tests below
PLACES = ("actor_rollout_ref.model.path", "data.train_files", "data.val_files")

#: what the recipe sets differently from verl's composition of the script's command line, and why
DEPARTURES = {
    **{k: "a place on this machine (the tiny model; otb-tir-prepare-data's files)" for k in PLACES},
    "actor_rollout_ref.rollout.multi_turn.enable": "TIR: multi-turn episodes with tool calls",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "TIR: multi_turn.max_assistant_turns",
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": "TIR: multi_turn.max_parallel_calls",
    "actor_rollout_ref.rollout.agent.default_agent_loop": "TIR: our agent loop (otb_tir.verl.agent_loop)",
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": "TIR: its YAML (tools, budgets) in the run folder",
    "trainer.v1.trainer_mode": "otb_sync: verl's sync V1 trainer plus the Σπ² step its own lacks",
    "trainer.default_local_dir": "checkpoints in the run folder (trainer.output_dir)",
    "trainer.max_actor_ckpt_to_keep": "2 (~100 GB each for an 8B actor); the script keeps every one",
    "trainer.resume_mode": "resuming is asked for (--resume); the script resumes automatically",
    "data.seed": "the data order follows trainer.seed; the script's is unseeded",
}

#: the multi-turn TIR settings the script lacks (its run is single-turn), as the shipped YAML sets them
TIR = [
    ("actor_rollout_ref.rollout.multi_turn.enable", True),
    ("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", 5),
    ("actor_rollout_ref.rollout.multi_turn.max_tool_response_length", 256),
    ("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side", "middle"),
    ("actor_rollout_ref.rollout.multi_turn.format", "hermes"),
    ("actor_rollout_ref.rollout.agent.default_agent_loop", "otb_tir_agent"),
    ("actor_rollout_ref.rollout.calculate_log_probs", True),
]


@pytest.fixture(scope="module")
def seed_run(tiny_model_dir, tmp_path_factory):
    """``otb-tir-train --config tir_math_qwen3_8b_gpu`` as a GPU dry run, from a folder whose ``data/``
    holds the four files ``otb-tir-prepare-data`` writes."""
    from otb_tir.prepare_data import main as prepare_data
    from otb_tir.train import main as train_main

    root = tmp_path_factory.mktemp("seed_gpu")
    # 64 + 64 records: one batch of 128 prompts (otb-tir-train refuses a batch larger than the data)
    gsm8k = [{"question": f"What is {i}+3?", "answer": f"{i}+3={i + 3}\n#### {i + 3}"} for i in range(64)]
    math = [{"problem": f"What is {i}/2+{i}/2?", "solution": f"It is $\\boxed{{{i}}}$."} for i in range(64)]
    (root / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm8k))
    (root / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in math))
    cwd = os.getcwd()
    os.chdir(root)  # the config's data/ and runs/ are relative to where the user launches
    try:
        for split in ("train", "test"):
            prepare_data(["--gsm8k", "gsm8k.jsonl", "--math", "math.jsonl", "--split", split, "--out", "data"])
        args = ["--config", "tir_math_qwen3_8b_gpu", "--model", str(tiny_model_dir)]
        assert train_main([*args, "trainer.device=cuda", "verl.dry_run=true"]) == 0
    finally:
        os.chdir(cwd)
    out = root / "runs" / "tir_math_qwen3_8b"
    return root, OmegaConf.load(out / "verl_config.yaml"), json.loads((out / "verl_run.json").read_text())


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def test_every_key_the_seed_script_sets_has_its_value(seed_run):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import FSDPActorConfig, RolloutConfig

    from otb_tir.verl.compose import validate_verl_config

    _, v, info = seed_run
    validate_verl_config(v)  # verl's own checks (validate_config) on the saved config
    wrong = [
        f"{key}: {OmegaConf.select(v, key)!r}, the seed's is {want!r} ({SCRIPT} {where})"
        for key, want, where in SEED
        if key not in PLACES and OmegaConf.select(v, key) != want
    ]
    wrong += [
        f"{key}: {OmegaConf.select(v, key)!r}, the YAML's is {want!r}"
        for key, want in TIR
        if OmegaConf.select(v, key) != want
    ]
    assert not wrong, "\n".join(wrong)
    # through verl's own config classes: Σπ² on, never with the fused kernels (they return no logits)
    actor = omega_conf_to_dataclass(v.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(v.actor_rollout_ref.rollout)
    assert isinstance(actor, FSDPActorConfig) and isinstance(rollout, RolloutConfig)
    assert actor.calculate_sum_pi_squared is True and actor.use_fused_kernels is False
    assert v.actor_rollout_ref.model.use_fused_kernels is False
    assert actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu == 24576
    assert rollout.tensor_model_parallel_size == 2 and rollout.gpu_memory_utilization == 0.75
    # epochs decide, as in the script (no step count of ours)
    assert v.trainer.total_training_steps is None and v.trainer.total_epochs == 15
    assert info["nnodes"] == 1 and info["n_gpus_per_node"] == 8 and info["rollout"] == "vllm"
    # the agent loop's tools and per-turn settings (the TIR part the script lacks)
    for entry in OmegaConf.load(v.actor_rollout_ref.rollout.agent.agent_loop_config_path):
        assert list(entry.otb_tools) == ["python", "calculator"] and entry.otb_format == "hermes"
        assert entry.max_tokens_per_turn == 1024 and entry.tool_timeout == 10.0


def test_every_other_key_is_what_verl_composes_from_the_seed_command_line(seed_run):
    """verl's ``ppo_trainer`` config with the script's overrides (as ``main_ppo`` composes it) is the
    reference: besides :data:`DEPARTURES`, each key of the four sections must equal it."""
    from otb_tir.verl.compose_overrides import compose_base

    _, v, _ = seed_run
    seed = compose_base([f"{key}={json.dumps(value)}" for key, value, _ in SEED])
    ours = _flat(OmegaConf.to_container(v))
    theirs = _flat(OmegaConf.to_container(seed))
    keys = sorted(k for k in {*ours, *theirs} if k.split(".")[0] in SECTIONS)
    differ = {k for k in keys if ours.get(k, "<absent>") != theirs.get(k, "<absent>")}
    unexplained = sorted(differ - set(DEPARTURES))
    assert not unexplained, "\n".join(f"{k}: ours {ours.get(k)!r}, the seed's {theirs.get(k)!r}" for k in unexplained)
    assert differ == set(DEPARTURES), f"departures that are no longer: {sorted(set(DEPARTURES) - differ)}"


def test_the_model_and_data_are_the_given_folder_and_prepare_datas_files(seed_run, tiny_model_dir):
    import pyarrow.parquet as pq

    root, v, _ = seed_run
    assert v.actor_rollout_ref.model.path == str(Path(tiny_model_dir).resolve())
    data = (root / "data").resolve()
    # GSM8K then MATH, as the script lists them, in the names otb-tir-prepare-data writes
    assert list(v.data.train_files) == [str(data / "gsm8k_train.parquet"), str(data / "math_train.parquet")]
    assert list(v.data.val_files) == [str(data / "gsm8k_test.parquet"), str(data / "math_test.parquet")]
    sources = [pq.read_table(f).column("data_source").to_pylist() for f in v.data.train_files]
    assert [set(s) for s in sources] == [{"openai/gsm8k"}, {"DigitalLearningGmbH/MATH-lighteval"}]


def test_nothing_of_the_cpu_profile_reaches_the_gpu_config_or_its_environment(seed_run):
    from otb_tir.verl.cpu import MODULE, cpu_env, profile_leaks

    _, v, info = seed_run
    assert v.trainer.device == "cuda" and info["device"] == "gpu"
    envs = (info["env"], v.ray_kwargs.ray_init.runtime_env.env_vars)
    leaked = profile_leaks(v, envs, max_model_len=1024 + 2048)
    assert not leaked, f"the CPU profile in the GPU config or its environment: {leaked}"
    for env in envs:
        shared = {"TOKENIZERS_PARALLELISM", "VERL_USE_EXTERNAL_MODULES"}  # both profiles set these
        assert not {k for k in cpu_env() if k not in shared} & set(env), f"CPU variables in the GPU env: {env}"
    # no gloo anywhere (the CPU's process groups and checkpoint engine), no CPU module, no CPU platform
    values = [str(x) for x in _flat(OmegaConf.to_container(v)).values()]
    assert not [x for x in values if x == "gloo" or MODULE in x or "cpu_platform" in x]
    assert "num_gpus" not in v.ray_kwargs.ray_init and v.ray_kwargs.ray_init.get("address") != "local"
