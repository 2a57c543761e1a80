"""The PPO policy loss of the trainer, readable top to bottom.

All losses are token-means over response tokens with ``mask == 1`` (policy tokens); tool tokens
inserted by the environment (mask 0) never contribute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, num_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``x`` over ``mask == 1``; 0 when the mask is empty (never NaN).

    ``num_tokens`` overrides the denominator: pass the mask=1 count of the whole mini-batch so
    that summing the losses of its micro-batches gives the exact token-mean (gradient accumulation).
    """
    mask = mask.to(x.dtype)
    denom = mask.sum().clamp_min(1.0) if num_tokens is None else num_tokens
    return (x * mask).sum() / denom


@dataclass(frozen=True)
class Advantages:
    """What the loss needs besides the policy's own statistics, ``[B, R]`` each, built once by
    :func:`otb_tir.trainer.step.advantages`: the estimator's advantages (× the loss mask), the loss
    mask (the response mask after the trajectory filters), and the truncated rollout IS weights that
    multiply the per-token surrogate (``None`` when ``algorithm.rollout_is`` is off)."""

    advantages: torch.Tensor
    loss_mask: torch.Tensor
    rollout_is_weights: torch.Tensor | None = None
    kept_frac: float = 1.0  # the share of rows the filters kept (filter/kept_frac)


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    pg_loss: torch.Tensor
    clip_frac: torch.Tensor
    approx_kl: torch.Tensor
    kl_loss: torch.Tensor
    entropy: torch.Tensor


def kl_low_var(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π‖π_ref), per token, non-negative (verl's ``low_var_kl``)."""
    log_ratio = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(max=10.0)


def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    rollout_is_weights: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Clipped PPO surrogate (asymmetric clip, optional dual clip), token-mean over mask = 1.

    loss = pg_loss + kl_coef·KL(π‖π_ref) − entropy_coef·H.
    ``clip_ratio_c`` is the dual-clip bound for negative advantages (None disables it).
    ``rollout_is_weights`` (optional) multiply the per-token surrogate (rollout correction).
    ``num_tokens``: denominator of the token-mean (see :func:`masked_mean`). The diagnostics
    (clip fraction, KL) are always means over this micro-batch.
    """
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    surr1 = -advantages * ratio
    surr2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = torch.maximum(surr1, surr2)
    if clip_ratio_c is not None:
        dual = torch.minimum(-advantages * clip_ratio_c, pg)
        pg = torch.where(advantages < 0, dual, pg)
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    pg_loss = masked_mean(pg, mask, num_tokens)
    clip_frac = masked_mean((surr2 > surr1).float(), mask)
    approx_kl = masked_mean(-log_ratio.detach(), mask)  # first-order KL(π_old‖π), verl's ppo_kl

    loss = pg_loss
    kl_loss = torch.zeros((), dtype=pg_loss.dtype)
    if ref_log_probs is not None and kl_coef > 0:
        kl_loss = masked_mean(kl_low_var(log_probs, ref_log_probs), mask, num_tokens)
        loss = loss + kl_coef * kl_loss
    ent = torch.zeros((), dtype=pg_loss.dtype)
    if entropy is not None:
        ent = masked_mean(entropy, mask, num_tokens)
        if entropy_coef > 0:
            loss = loss - entropy_coef * ent
    return PolicyLossOutput(loss, pg_loss.detach(), clip_frac.detach(), approx_kl, kl_loss.detach(), ent.detach())


def truncated_is_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, threshold: float = 2.0
) -> torch.Tensor:
    """Token-level truncated importance weights π_old / π_rollout, capped at ``threshold``.

    Corrects the mismatch between the rollout engine's sampling distribution and the trainer's
    (different kernels, precision, or stale weights). 1 where mask = 0.
    """
    w = (old_log_probs - rollout_log_probs).clamp(-20.0, 20.0).exp().clamp(max=threshold)
    return torch.where(mask.bool(), w, torch.ones_like(w))
