"""GPU check: the Qwen3-0.6B shape (random weights) through four training paths on one GPU, one table.

    python benchmarks/gpu_check.py                 # needs a CUDA GPU; within 10 minutes (GPU_CHECK_TIMEOUT)
    python benchmarks/gpu_check.py --legs local    # only some legs: local, verl_sync, verl_separate_async, sglang
    python benchmarks/gpu_check.py --cpu-smoke     # tiny shape on CPU: the local leg runs, the others are composed
    python benchmarks/gpu_check.py --no-fsdp       # the local leg's plain one-process actor instead of FSDP2

The legs (``benchmarks/gpu_check_legs.py``: each a process of its own with its own timeout; a leg
whose packages are not installed, or that needs a second GPU, is a ``skipped: ...`` row): the local
trainer (below), ``trainer=verl`` with verl's V1 trainer in ``sync`` mode and vLLM, the same in
``separate_async`` with verl's ``nccl`` checkpoint engine (two GPUs), and the local trainer with
sglang. The table: status, wall seconds, the (last) step's seconds, tokens/s, peak GPU memory,
weight-sync seconds.

The local leg (``--leg local``): the model is built locally from ``transformers.Qwen3Config`` (hidden
1024, 28 layers, 16 heads, 8 KV heads, head dim 128, intermediate 3072, vocab 151936, tied
embeddings: Qwen3-0.6B's shape) with random weights: nothing is downloaded. The tokenizer (only the
chat template and the end-of-turn token matter) is the built-in tiny one from ``otb_tir.defaults.tiny``.

What runs is the local trainer's own step (:meth:`otb_tir.trainer.trainer.Trainer.train_step`):
HF-engine rollout of multi-turn episodes (one assistant turn of up to ``--response-length``
tokens; a random policy rarely stops early) → actor forward with fused Σπ² → TIR-OTB advantages
→ PPO update → weight sync. By default the actor is FSDP2-sharded over a one-rank process group
(``otb_tir.trainer.distributed.fsdp_wrap``, bf16 parameters, fp32 reductions; the engine keeps its
own unsharded bf16 copy, synced from the full state dict), as under ``torchrun``. Then, on the same
rollout batch, the actor forward and the update are replayed with Σπ² fused from the hidden states
and unfused from the logits, each with its peak CUDA memory. It prints tokens/s, the step time per
phase and the peak memory figures, and writes them as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gpu_check_commands import response_length, workload_overrides
from gpu_check_legs import LEGS, run_legs

from otb_tir.defaults.shapes import QWEN3_0_6B, TWO_LAYERS

ROOT = Path(__file__).resolve().parents[1]  # the checkout: runs/ go here
log = logging.getLogger("gpu_check")

#: ``--cpu-smoke``: Qwen3-0.6B's settings at two layers (every code path, in seconds on a CPU)
SMOKE = {**QWEN3_0_6B, **TWO_LAYERS, "vocab_size": 4096, "max_position_embeddings": 2048}


class GPUCheckError(RuntimeError):
    pass


def require_gpu() -> None:
    if not torch.cuda.is_available():
        raise GPUCheckError(
            "no CUDA GPU is visible (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}); run on a GPU machine, or use --cpu-smoke to check the code paths"
        )


def _token_hash_reward(text, ground_truth, traj) -> float:
    """A reward that differs between any two different samples (so advantages are non-zero): a hash
    of the response tokens in [0, 1). (A distinct-token ratio was 1.0 for every short random sample.)"""
    ids = traj.response_ids
    return (sum((i + 1) * t for i, t in enumerate(ids)) % 1009) / 1009


def _mem(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
    }


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _init_one_rank_group(device: torch.device) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


class _NoStep:
    """Optimizer stand-in: the replayed update computes gradients but never applies them, so the
    fused and unfused replays see the same weights (and must give the same gradient norm)."""

    def __init__(self, model):
        self.model = model

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        pass


def replay(trainer, tensors: dict[str, torch.Tensor], fused: bool, device: torch.device) -> dict[str, Any]:
    """The actor forward (old stats) and one PPO forward/backward on ``tensors`` with fused or
    unfused Σπ² (gradients computed, not applied)."""
    import dataclasses

    from otb_tir.advantage import get_estimator
    from otb_tir.trainer.actor import compute_old_stats, ppo_update
    from otb_tir.trainer.ppo import Advantages

    s = dataclasses.replace(trainer.settings.actor, fused_token_stats=fused)
    out: dict[str, Any] = {"fused": fused}
    batch = dict(tensors)
    _reset_peak(device)
    t0 = time.perf_counter()
    old = compute_old_stats(trainer.model, batch, s)
    _sync(device)
    out["old_stats_s"] = time.perf_counter() - t0
    out["old_stats_mem"] = _mem(device)
    mask = batch["response_mask"].float()
    adv, _ = get_estimator("tir_optimal_token_baseline")(
        token_level_rewards=batch["token_level_rewards"],  # on the last policy token (collate)
        response_mask=mask,
        index=tensors["uid"],
        old_log_probs=old.log_probs,
        sum_pi_squared=old.sum_pi_squared,
    )
    _reset_peak(device)
    t0 = time.perf_counter()
    rows = torch.arange(batch["responses"].shape[0])
    m = ppo_update(trainer.model, _NoStep(trainer.model), batch, old, Advantages(adv.float() * mask, mask), [rows], s)
    trainer.model.zero_grad(set_to_none=True)
    _sync(device)
    out["update_s"] = time.perf_counter() - t0
    out["update_mem"] = _mem(device)
    out["grad_norm"] = m["actor/grad_norm"]
    out["old_log_probs"] = old.log_probs.detach().cpu()
    out["sum_pi_squared"] = old.sum_pi_squared.detach().cpu()
    return out


def run_check(args) -> dict[str, Any]:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from agent_env.engines.hf import HFEngine
    from otb_tir.builders import build_tools, seed_everything
    from otb_tir.defaults.tiny import tiny_policy_dir
    from otb_tir.trainer.config import load_config
    from otb_tir.trainer.distributed import DistInfo
    from otb_tir.trainer.parts import build_parts, trainer_settings
    from otb_tir.trainer.trainer import Trainer

    smoke = args.cpu_smoke
    if smoke:
        device = torch.device("cpu")
    else:
        require_gpu()
        device = torch.device("cuda", 0)
        torch.backends.cuda.matmul.allow_tf32 = True
    shape = dict(SMOKE if smoke else QWEN3_0_6B)
    r = response_length(args)
    n, prompts = args.n, args.prompts
    micro = args.micro_batch_size
    low = None if smoke else torch.bfloat16
    seed_everything(0)
    info: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": shape,
        "response_length": r,
        "trajectories": prompts * n,
        "fsdp": not args.no_fsdp,
        "micro_batch_size": micro,
    }
    log.info("building a random Qwen3 model %s on %s", shape, device)
    t0 = time.perf_counter()
    config = Qwen3Config(**shape)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    info["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    info["build_s"] = time.perf_counter() - t0
    tokenizer = AutoTokenizer.from_pretrained(tiny_policy_dir())
    if len(tokenizer) > shape["vocab_size"]:
        raise GPUCheckError(
            f"the tokenizer has {len(tokenizer)} tokens, more than the model's vocab {shape['vocab_size']}"
        )

    out_dir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    overrides = [
        *workload_overrides(prompts, n, r, micro),  # the work every leg does
        f"rollout.max_batch_size={prompts * n}",
        "trainer.loggers=[]",
        f"trainer.output_dir={out_dir}",
        f"trainer.device={device.type}",
        f"model.dtype={'float32' if low is None else 'bfloat16'}",
        "eval.size=4",
    ]
    cfg = load_config(None, overrides)
    tools = build_tools(cfg)
    if not args.no_fsdp:
        _init_one_rank_group(device)
    dist_info = DistInfo(0, 1, 0, device, "nccl" if device.type == "cuda" else "gloo")
    # the run's parts with this random model; FSDP2 over the one-rank group unless --no-fsdp
    parts = build_parts(
        cfg, tools, dist_info, device, _token_hash_reward, policy=(model, tokenizer), shard=not args.no_fsdp
    )
    if not args.no_fsdp and low is not None:  # the engine's own unsharded copy in bf16 (the recipe's is fp32)
        parts.engine = HFEngine(
            parts.engine.model,
            tokenizer,
            device=device,
            dtype=low,
            share_weights=False,
            max_batch_size=prompts * n,
            seed=0,
            stop_at_eos=False,
        )
    engine = parts.engine
    trainer = Trainer(trainer_settings(cfg, autocast_dtype=parts.autocast_dtype), parts)
    try:
        _reset_peak(device)
        t0 = time.perf_counter()
        res = trainer.train_step()
        _sync(device)
        step_s = time.perf_counter() - t0
        m = res.metrics
        tensors = res.batch.tensors
        sampled = int(tensors["response_mask"].sum())
        total = int(tensors["attention_mask"].sum())
        info["step"] = {k: m[k] for k in sorted(m) if k.startswith("timing/")}
        info["step"]["wall_s"] = step_s
        info["step"]["peak_mem"] = _mem(device)
        info["step"]["sampled_tokens"] = sampled
        info["step"]["rollout_tokens_per_s"] = sampled / m["timing/rollout_s"]
        info["step"]["train_tokens_per_s"] = total / (m["timing/old_log_prob_s"] + m["timing/update_s"])
        info["step"]["step_tokens_per_s"] = total / step_s
        info["step"]["policy_tokens_mean"] = m.get("response/policy_tokens_mean")
        info["step"]["grad_norm"] = m.get("actor/grad_norm")
        info["step"]["one_forward"] = m.get("actor/one_forward")  # 1: old stats from the update's forward
        info["step"]["finish"] = {k: v for k, v in m.items() if k.startswith("finish/")}
        batch = dict(tensors)
        batch["uid"] = res.batch["uid"]
        info["sum_pi_squared"] = {}
        for fused in (True, False):
            try:
                info["sum_pi_squared"]["fused" if fused else "unfused"] = replay(trainer, batch, fused, device)
            except torch.cuda.OutOfMemoryError as e:  # the unfused [micro, R, V] logits may not fit
                info["sum_pi_squared"]["fused" if fused else "unfused"] = {"fused": fused, "error": f"OOM: {e}"}
                _reset_peak(device)
        f, u = info["sum_pi_squared"]["fused"], info["sum_pi_squared"]["unfused"]
        if "error" not in f and "error" not in u:
            mask = tensors["response_mask"].bool()
            info["fused_vs_unfused"] = {
                "max_abs_diff_log_probs": float((f["old_log_probs"] - u["old_log_probs"])[mask].abs().max()),
                "max_abs_diff_sum_pi_squared": float((f["sum_pi_squared"] - u["sum_pi_squared"])[mask].abs().max()),
                "grad_norm_rel_diff": abs(f["grad_norm"] - u["grad_norm"]) / max(abs(u["grad_norm"]), 1e-30),
            }
        for r in info["sum_pi_squared"].values():
            r.pop("old_log_probs", None)
            r.pop("sum_pi_squared", None)
    finally:
        from agent_env.rollout import run_sync

        run_sync(engine.close())  # the loop the trainer's rollouts ran on
        run_sync(tools.close())
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return info


def report(info: dict[str, Any]) -> str:
    st = info["step"]
    lines = [
        f"device: {info['device']} (torch {info['torch']}); model: random Qwen3 {info['params_m']:.0f}M params "
        f"({info['shape']['num_hidden_layers']} layers, hidden {info['shape']['hidden_size']}, vocab "
        f"{info['shape']['vocab_size']}); {info['trajectories']} trajectories × ≤{info['response_length']} "
        f"response tokens; actor: {'FSDP2 (1 rank)' if info['fsdp'] else 'plain'}",
        f"one training step: {st['wall_s']:.1f} s; sampled tokens {st['sampled_tokens']} "
        f"(mean {st['policy_tokens_mean']:.0f} per trajectory); grad norm {st['grad_norm']:.3g}",
    ]
    for k, v in st.items():
        if k.startswith("timing/"):
            lines.append(f"  {k[7:]:<18} {v:8.2f} s")
    lines.append(
        f"  rollout tokens/s {st['rollout_tokens_per_s']:.0f}; actor (fwd + update) tokens/s "
        f"{st['train_tokens_per_s']:.0f}; whole step tokens/s {st['step_tokens_per_s']:.0f}"
    )
    if st["peak_mem"]:
        lines.append(
            f"  peak CUDA memory in the step: {st['peak_mem']['peak_allocated_gib']:.2f} GiB allocated, "
            f"{st['peak_mem']['peak_reserved_gib']:.2f} GiB reserved"
        )
    lines.append("Σπ² on the same batch (actor forward for old stats, then one PPO forward/backward, no step):")
    lines.append(
        f"  {'path':<9} {'old stats s':>12} {'peak GiB':>9} {'fwd+bwd s':>9} {'peak GiB':>9} {'grad norm':>10}"
    )
    for name, r in info["sum_pi_squared"].items():
        if "error" in r:
            lines.append(f"  {name:<9} {r['error'][:100]}")
            continue
        pk = lambda m: f"{m['peak_allocated_gib']:.2f}" if m else "n/a"  # noqa: E731
        lines.append(
            f"  {name:<9} {r['old_stats_s']:>12.2f} {pk(r['old_stats_mem']):>9} {r['update_s']:>9.2f} "
            f"{pk(r['update_mem']):>9} {r['grad_norm']:>10.4g}"
        )
    f, u = info["sum_pi_squared"].get("fused", {}), info["sum_pi_squared"].get("unfused", {})
    if f.get("update_mem") and u.get("update_mem"):
        lines.append(
            f"  unfused / fused peak memory: forward "
            f"{u['old_stats_mem']['peak_allocated_gib'] / f['old_stats_mem']['peak_allocated_gib']:.2f}×, "
            f"update {u['update_mem']['peak_allocated_gib'] / f['update_mem']['peak_allocated_gib']:.2f}×"
        )
    if "fused_vs_unfused" in info:
        d = info["fused_vs_unfused"]
        lines.append(
            f"  fused vs unfused: max |Δ log π| {d['max_abs_diff_log_probs']:.2e}, max |Δ Σπ²| "
            f"{d['max_abs_diff_sum_pi_squared']:.2e}, grad-norm rel. diff {d['grad_norm_rel_diff']:.2e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU (checks the code paths, no GPU needed)")
    p.add_argument("--no-fsdp", action="store_true", help="the local leg's plain actor (no FSDP2 wrapping)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument(
        "--response-length", type=int, default=None, help="response tokens (default 512; 96 with --cpu-smoke)"
    )
    p.add_argument("--micro-batch-size", type=int, default=2, help="trajectories per actor forward/backward")
    p.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated, of {', '.join(LEGS)} (default all)")
    p.add_argument(
        "--leg-timeout", type=float, default=None, help="seconds for each leg (default its own; the budget caps it)"
    )
    p.add_argument("--leg", choices=["all", "local"], default="all", help="local: the local leg in this process")
    p.add_argument("--work", default=None, help="the legs' model and run folders (default runs/gpu_check[_cpu_smoke]/)")
    p.add_argument("--out", default=None, help="JSON file for the figures (default runs/gpu_check[_cpu_smoke].json)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    suffix = "_cpu_smoke" if args.cpu_smoke else ""
    out = Path(args.out or ROOT / "runs" / f"gpu_check{suffix}.json")
    try:
        if not args.cpu_smoke:
            require_gpu()
        if args.leg == "local":
            info = run_check(args)
            text = report(info)
        else:
            names = [x for x in args.legs.split(",") if x]
            unknown = sorted(set(names) - set(LEGS))
            if unknown or not names:
                raise GPUCheckError(f"--legs {args.legs!r}: unknown {unknown}; choose from {', '.join(LEGS)}")
            budget = float(os.environ.get("GPU_CHECK_TIMEOUT", "600")) - 30  # the rest: printing, writing
            work = Path(args.work or ROOT / "runs" / f"gpu_check{suffix}")
            info = run_legs(args, names, work, budget, SMOKE)
            text = info["table"]
            if info["local"]:
                text += "\n\nthe local leg:\n" + info["local"]["report"]
    except GPUCheckError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**info, "report": text}, indent=1, default=str))
    print(f"written: {out}")
    return 1 if info.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
