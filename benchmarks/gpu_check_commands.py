"""What each leg of the GPU check runs (``benchmarks/gpu_check_legs.py`` runs them) and how its wiring is
checked: the shared work (:func:`workload_overrides`), the command lines of the local, verl and sglang
legs, and the checks of the configs the verl and sglang legs compose (:func:`check_verl_wiring`,
:func:`check_sglang_wiring`), which ``--cpu-smoke`` applies to a GPU composition on a CPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

GPU_CHECK = Path(__file__).resolve().parent / "gpu_check.py"
VLLM_GPU_MEMORY = 0.3  # vLLM's share of the GPU (verl's rollout.gpu_memory_utilization): the actor shares it
SGLANG_GPU_MEMORY = 0.3  # sglang's mem_fraction_static, likewise
VERL_STEPS = 2  # the first step includes the warm-up; the table shows the last
SGLANG_STEPS = 2


def response_length(args: Any) -> int:
    return args.response_length or (96 if args.cpu_smoke else 512)


def workload_overrides(prompts: int, n: int, r: int, micro: int) -> list[str]:
    """The work every leg does in a step: ``prompts`` x ``n`` one-turn episodes of up to ``r`` tokens."""
    return [
        f"data.train_batch_size={prompts}",
        f"actor.ppo_mini_batch_size={prompts}",
        f"rollout.n={n}",
        f"rollout.response_length={r}",
        f"rollout.max_tokens_per_turn={r}",
        "multi_turn.max_assistant_turns=1",
        "multi_turn.tools=[calculator]",
        f"actor.ppo_micro_batch_size={micro}",
        "actor.optim.lr=1e-6",
        "trainer.save_every=0",
        "data.train_size=64",
        "data.val_size=4",
    ]


# ----------------------------------------------------------------------------- the legs' commands


def _train_argv(model: Path, out: Path, args: Any, steps: int, logger: str, leg: list[str]) -> list[str]:
    """``python -m otb_tir.train`` on the saved model with the legs' shared work on the GPU, no held-out
    evaluation, into ``out``; ``leg``: the leg's own overrides."""
    return [
        *(sys.executable, "-m", "otb_tir.train", "--model", str(model)),
        *workload_overrides(args.prompts, args.n, response_length(args), args.micro_batch_size),
        "trainer.device=cuda",
        f"trainer.total_steps={steps}",
        f"trainer.loggers=[{logger}]",
        "eval.before=false",
        "eval.after=false",
        f"trainer.output_dir={out}",
        *leg,
    ]


def verl_argv(mode: str, model: Path, out: Path, args: Any, timeout_s: float) -> list[str]:
    """``otb-tir-train trainer=verl`` in verl's V1 ``mode`` with vLLM on one GPU for the trainer."""
    leg = [
        "trainer=verl",
        "rollout.name=vllm",
        f"verl.trainer_mode={mode}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"verl.actor_rollout_ref.rollout.gpu_memory_utilization={VLLM_GPU_MEMORY}",
        "verl.actor_rollout_ref.rollout.enforce_eager=true",
        f"verl.phase_timeout_s={int(timeout_s)}",
        *(["verl.dry_run=true"] if args.cpu_smoke else []),
    ]
    return _train_argv(model, out, args, VERL_STEPS, "console", leg)


def sglang_argv(model: Path, out: Path, args: Any) -> list[str]:
    """``otb-tir-train`` (the local trainer) serving the rollout with sglang on the GPU, CUDA graphs off."""
    leg = [
        "rollout.name=sglang",
        "model.dtype=bfloat16",
        "rollout.engine_kwargs.disable_cuda_graph=true",
        f"rollout.engine_kwargs.mem_fraction_static={SGLANG_GPU_MEMORY}",
        *(["--print-config"] if args.cpu_smoke else []),
    ]
    return _train_argv(model, out, args, SGLANG_STEPS, "jsonl", leg)


def local_argv(out_json: Path, args: Any) -> list[str]:
    argv = [sys.executable, str(GPU_CHECK), "--leg", "local", "--out", str(out_json)]
    argv += ["--prompts", str(args.prompts), "--n", str(args.n), "--micro-batch-size", str(args.micro_batch_size)]
    argv += ["--response-length", str(response_length(args))]
    return argv + (["--cpu-smoke"] if args.cpu_smoke else []) + (["--no-fsdp"] if args.no_fsdp else [])


# ----------------------------------------------------------------------------- wiring checks


def check_verl_wiring(mode: str, v: Any, info: dict[str, Any], model: Path, args: Any) -> list[str]:
    """What is wrong with the verl config a leg composed (``verl_config.yaml``, ``verl_run.json``): verl's
    V1 trainer in ``mode`` with vLLM for one trainer GPU and our settings, nothing of the CPU profile."""
    from omegaconf import OmegaConf

    from otb_tir.verl.cpu import profile_leaks

    ro = v.actor_rollout_ref.rollout
    problems = []

    def want(what: str, ok: bool) -> None:
        if not ok:
            problems.append(what)

    want("trainer.device cuda, a GPU run", v.trainer.device == "cuda" and info.get("device") == "gpu")
    want(f"verl's V1 trainer in otb_{mode}", bool(v.trainer.use_v1) and v.trainer.v1.trainer_mode == f"otb_{mode}")
    want("vLLM, async", ro.name == "vllm" and ro.mode == "async")
    want("the saved model", v.actor_rollout_ref.model.path == str(model.resolve()))
    want("1 node x 1 trainer GPU", v.trainer.n_gpus_per_node == 1 and v.trainer.nnodes == 1)
    want(f"vLLM at {VLLM_GPU_MEMORY} of the GPU", ro.gpu_memory_utilization == VLLM_GPU_MEMORY)
    want("eager vLLM (no CUDA graphs)", ro.enforce_eager is True)
    batch, mini = int(v.data.train_batch_size), int(v.actor_rollout_ref.actor.ppo_mini_batch_size)
    want(f"{args.prompts} prompts x {args.n}", batch == args.prompts and ro.n == args.n)
    want(f"{VERL_STEPS} steps", v.trainer.total_training_steps == VERL_STEPS)
    if mode == "sync":
        want("the rollout colocated with the actor (hybrid engine)", bool(v.actor_rollout_ref.hybrid_engine))
        want("on-policy: no IS weights", v.algorithm.rollout_correction.rollout_is is None)
    elif mode == "separate_async":
        want("verl's nccl checkpoint engine", ro.checkpoint_engine.backend == "nccl")
        want("a rollout pool of its own (1 node x 1 GPU)", ro.nnodes == 1 and ro.n_gpus_per_node == 1)
        sync_step = int(v.trainer.v1.separate_async.parameter_sync_step)
        want("parameter_sync_step x mini-batch = batch", sync_step * mini == batch)
        want("truncated IS weights (off-policy samples)", v.algorithm.rollout_correction.rollout_is == "token")
    # the CPU profile's settings (otb_tir.verl.cpu), but for eager vLLM, which this check asks for itself
    envs = (info.get("env", {}), v.ray_kwargs.ray_init.runtime_env.env_vars)
    max_len = int(v.data.max_prompt_length) + int(ro.response_length)
    problems += profile_leaks(
        v, envs, max_model_len=max_len, allow=frozenset({"actor_rollout_ref.rollout.enforce_eager"})
    )
    if "num_gpus" in v.ray_kwargs.ray_init:
        problems.append("logical Ray GPUs (the CPU profile's)")
    if "gloo" in json.dumps(OmegaConf.to_container(v)):
        problems.append("gloo (the CPU's process groups or checkpoint engine)")
    return problems


def check_sglang_wiring(cfg: Any, model: Path, args: Any) -> list[str]:
    """What is wrong with the local trainer's config for the sglang leg (``config.yaml``, or ``--print-config``)."""
    kw = cfg.rollout.get("engine_kwargs") or {}
    problems = []
    checks = [
        ("the local trainer", cfg.trainer.name == "local"),
        ("rollout.name=sglang", cfg.rollout.name == "sglang"),
        ("trainer.device=cuda", cfg.trainer.device == "cuda"),
        ("the saved model", Path(str(cfg.model.path)).resolve() == model.resolve()),
        ("bf16", cfg.model.dtype == "bfloat16"),
        ("CUDA graphs off", kw.get("disable_cuda_graph") is True),
        (f"mem_fraction_static {SGLANG_GPU_MEMORY}", kw.get("mem_fraction_static") == SGLANG_GPU_MEMORY),
        (f"{args.prompts} prompts x {args.n}", cfg.data.train_batch_size == args.prompts and cfg.rollout.n == args.n),
        (f"{SGLANG_STEPS} steps", cfg.trainer.total_steps == SGLANG_STEPS),
    ]
    problems += [what for what, ok in checks if not ok]
    return problems
