"""Metrics of a run: of its episodes (:func:`trajectory_metrics`, the figures training, the
evaluation and ``summary.json`` share) and of its advantages (gradient-variance proxies and
summary statistics).

The variance proxies (named as verl 0.9.1 logs them, ``variance_proxy/...``) work for any
advantage estimator; they approximate the squared norm of one trajectory's policy-gradient
estimate by ``A² · W(τ)`` with the score-norm proxy ``W(τ) = Σ_t (1 − 2π_t + Σπ²_t)`` over the
policy tokens (the per-token ``‖∇ log π‖²`` of a softmax policy w.r.t. its logits):

- ``proxy1_signal_strength`` = ‖ḡ‖², the squared norm of the batch-mean gradient (pass the
  measured ``gradient_norm``; 0 when not given);
- ``proxy2_total_power`` = E_τ[Ā(τ)² · W(τ)] (Ā = the trajectory's mean advantage over its policy
  tokens); with rollout IS weights ρ: E_τ[ρ̄(τ)² · Ā(τ)² · W(τ)], ρ̄ the trajectory's mean ρ;
- ``proxy3_pure_noise`` = max(0, (proxy2 − proxy1) / (N − 1)), the variance of the mean gradient
  (0 when ``gradient_norm`` is not given or N = 1);
- ``expected_a_squared`` = E[Ā²], ``expected_w`` = E[W] (with IS weights W includes ρ²).

A lower total power for the same signal means a lower-variance estimator: log these for OTB and
for GRPO on the same batch to compare them.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from agent_env.rewards import reward_error_counts
from agent_env.tool_metrics import tool_metrics
from otb_tir import ConfigError

__all__ = ["advantage_stats", "summary_figures", "trajectory_metrics", "variance_proxy_metrics"]

_PREFIX = "variance_proxy/"


def _masked_row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _masked_row_sum(values, mask) / (mask.sum(dim=-1) + 1e-8)


def _masked_row_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where() first, so that NaN/inf outside the mask cannot leak into the sum.
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(dim=-1)


def _check(name: str, t: torch.Tensor | None, shape: torch.Size) -> None:
    if t is not None and (not isinstance(t, torch.Tensor) or t.shape != shape):
        raise ConfigError(
            f"{name} must be a tensor of shape {tuple(shape)} like advantages, got "
            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
        )


@torch.no_grad()
def variance_proxy_metrics(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    gradient_norm: float | None = None,
) -> dict[str, float]:
    """The variance-proxy metrics of one batch as a dict of floats (keys ``variance_proxy/...``).

    All tensors are ``[B, R]``; ``gradient_norm`` is the norm of the batch policy gradient
    (e.g. the value the optimizer step clipped), if known.
    """
    if not isinstance(advantages, torch.Tensor) or advantages.dim() != 2:
        raise ConfigError("advantages must be a 2-D [batch, response_length] tensor")
    for name, t in (
        ("response_mask", response_mask),
        ("old_log_probs", old_log_probs),
        ("sum_pi_squared", sum_pi_squared),
        ("rollout_is_weights", rollout_is_weights),
    ):
        _check(name, t, advantages.shape)
    if response_mask is None or old_log_probs is None or sum_pi_squared is None:
        raise ConfigError("variance_proxy_metrics needs response_mask, old_log_probs and sum_pi_squared")

    w_token = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w_token = w_token * rollout_is_weights.square()
    a_traj = _masked_row_mean(advantages, response_mask)  # Ā(τ)
    w_traj = _masked_row_sum(w_token, response_mask)  # W(τ), with ρ² when IS weights are given

    if rollout_is_weights is not None:
        rho_traj = _masked_row_mean(rollout_is_weights, response_mask)
        # Undo the per-token ρ² (guarding ρ = 0) to get the plain W, then weight by the mean ρ².
        w_plain = _masked_row_sum(w_token / rollout_is_weights.square().clamp_min(1e-10), response_mask)
        total_power = (rho_traj.square() * a_traj.square() * w_plain.clamp_min(0.0)).mean()
    else:
        total_power = (a_traj.square() * w_traj.clamp_min(0.0)).mean()

    n = a_traj.shape[0]
    signal = float(gradient_norm) ** 2 if gradient_norm is not None else None
    noise = 0.0
    if signal is not None and n > 1:
        noise = max(0.0, (float(total_power) - signal) / (n - 1))
    return {
        _PREFIX + "proxy1_signal_strength": signal if signal is not None else 0.0,
        _PREFIX + "proxy2_total_power": float(total_power),
        _PREFIX + "proxy3_pure_noise": noise,
        _PREFIX + "expected_a_squared": float(a_traj.square().mean()),
        _PREFIX + "expected_w": float(w_traj.mean()),
    }


@torch.no_grad()
def advantage_stats(
    advantages: torch.Tensor, response_mask: torch.Tensor, prefix: str = "advantages/"
) -> dict[str, float]:
    """Mean, std (unbiased), min and max of the advantages over mask = 1 tokens, plus their count.

    With no policy token in the batch every statistic is 0.0 and ``num_tokens`` is 0.
    """
    if not isinstance(advantages, torch.Tensor) or not isinstance(response_mask, torch.Tensor):
        raise ConfigError("advantages and response_mask must be tensors")
    if advantages.shape != response_mask.shape:
        raise ConfigError(
            f"advantages {tuple(advantages.shape)} and response_mask {tuple(response_mask.shape)} differ in shape"
        )
    values = advantages[response_mask.bool()].to(torch.float64)
    count = values.numel()
    if count == 0:
        stats = {"mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0}
    else:
        stats = {
            "mean": float(values.mean()),
            "std": float(values.std()) if count > 1 else 0.0,
            "min": float(values.min()),
            "max": float(values.max()),
        }
    out = {prefix + k: v for k, v in stats.items()}
    out[prefix + "num_tokens"] = float(count)
    return out


def equal_reward_group_frac(trajs: Sequence[Any]) -> float:
    """The fraction of groups (samples of one prompt, same ``uid``) whose rewards are all equal: a
    group baseline gives them zero advantages, so they teach nothing (1.0: the step moved nothing)."""
    groups: dict[Any, set[float]] = {}
    for t in trajs:
        groups.setdefault(t.uid, set()).add(float(t.reward))
    return sum(len(r) == 1 for r in groups.values()) / max(len(groups), 1)


def trajectory_metrics(trajs: Sequence[Any], prefix: str = "") -> dict[str, float]:
    """Reward, accuracy, episode and tool-use figures of a set of episodes (the tool figures are
    :func:`agent_env.tool_metrics.tool_metrics`, the definition the evaluation and verl share)."""
    if not trajs:
        return {}
    n = len(trajs)
    sampled = np.array([sum(t.response_mask) for t in trajs], dtype=float)
    total = np.array([len(t.response_ids) for t in trajs], dtype=float)
    out = {
        "reward/mean": float(np.mean([t.reward for t in trajs])),
        "reward/accuracy": float(np.mean([bool(t.reward_details.get("correct", False)) for t in trajs])),
        **reward_error_counts(trajs),
        **tool_metrics(trajs),
        "episode/turns_mean": float(np.mean([t.num_turns for t in trajs])),
        "episode/void_turn_rate": sum(t.void_turns > 0 for t in trajs) / n,
        "episode/template_mismatch_rate": sum(t.template_mismatch is not None for t in trajs) / n,
        "response/length_mean": float(total.mean()),
        "response/policy_tokens_mean": float(sampled.mean()),
        "response/tool_token_share": float((total - sampled).sum() / max(total.sum(), 1.0)),
        # per-episode means of where an episode's time went (verl's agent-loop timings, same names)
        **{
            f"timing/episode_{k}_s": float(np.mean([t.timings.get(f"{k}_s", 0.0) for t in trajs]))
            for k in ("generate", "tools", "reward")
        },
    }
    reasons: dict[str, int] = {}
    for t in trajs:
        reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
    out.update({f"finish/{k}": v / n for k, v in sorted(reasons.items())})
    return {prefix + k: v for k, v in out.items()}


def summary_figures(trajs: Sequence[Any]) -> dict[str, float]:
    """The before/after figures of ``summary.json``."""
    m = trajectory_metrics(trajs)
    return {
        "accuracy": m["reward/accuracy"],
        "tool_call_rate": m["tools/call_rate"],
        "tool_success_rate": m["tools/success_rate"],
        "mean_turns": m["episode/turns_mean"],
        "mean_reward": m["reward/mean"],
        "n": len(trajs),
    }


def rollout_actor_gap(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> dict:
    """How far the rollout engine's log-probs are from the actor's on the same tokens, under verl's
    names (``verl.utils.debug.metrics.calculate_debug_metrics``): |π_rollout − π_actor| over the
    policy tokens (mean, max, std) and the Pearson correlation of the two probabilities. At lag 0
    (the engine holds the weights the actor scores with) the gap is numerical noise; a gap that grows
    is a weight sync that did not land, a mask off by a turn, or an engine that samples another
    distribution (truncation, a wrong temperature)."""
    keep = mask.bool()
    names = ("valid", "max", "mean", "std")
    if not keep.any():
        out = {f"training/rollout_probs_diff_{k}": float("nan") for k in names}
        out["training/rollout_probs_diff_valid"] = 0.0
        out["training/rollout_actor_probs_pearson_corr"] = float("nan")
        return out
    actor = old_log_probs.double().exp()[keep]
    rollout = rollout_log_probs.double().exp()[keep]
    diff = (actor - rollout).abs()
    corr = torch.corrcoef(torch.stack([actor, rollout]))[0, 1].item() if actor.numel() > 1 else float("nan")
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": diff.max().item(),
        "training/rollout_probs_diff_mean": diff.mean().item(),
        "training/rollout_probs_diff_std": diff.std().item() if diff.numel() > 1 else float("nan"),
        "training/rollout_actor_probs_pearson_corr": corr,
    }
