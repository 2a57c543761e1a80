"""The outcome-reward estimators GRPO and RLOO, exported by :mod:`otb_tir.advantage`: each row's
score is the sum of its token rewards; its advantage, computed from the scores of its group (one
prompt's samples) in float64 and broadcast over the row's policy tokens, is (score − group mean) /
(group std + ε) for GRPO and the score minus the mean of the group's *other* scores for RLOO,
as in verl 0.9.1.
"""

from __future__ import annotations

from typing import Any

import torch

from otb_tir.advantage_inputs import group_ids, log_ignored, prepare_inputs

__all__ = ["grpo", "rloo"]


def _group_scores(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.dtype]:
    """Scalar score per row (sum of its token rewards, float64), group ids, group sizes."""
    _, _, out_dt = prepare_inputs(token_level_rewards, response_mask, {}, required=False)
    batch = token_level_rewards.shape[0]
    group, n_groups = group_ids(index, batch, token_level_rewards.device)
    # Row sums in the input dtype (as verl), group statistics in float64: for a group of equal
    # scores the mean is then exact and the advantage exactly 0.
    scores = token_level_rewards.sum(dim=-1).to(torch.float64)
    members = torch.bincount(group, minlength=n_groups)
    return scores, group, members, n_groups, out_dt


@torch.no_grad()
def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: (score − group mean) / (group std + ε), broadcast over the mask.

    score = sum of the row's token rewards; std is the unbiased sample std; a group of one sample
    uses mean 0 and std 1 (as verl). ``norm_adv_by_std_in_grpo=False`` gives Dr.GRPO (no division).
    Returns ``(advantages, advantages)`` like verl. OTB-only arguments are accepted and ignored.
    """
    log_ignored("grpo", kwargs)
    scores, group, members, n_groups, out_dt = _group_scores(token_level_rewards, response_mask, index)
    sums = torch.zeros(n_groups, dtype=torch.float64, device=scores.device).index_add_(0, group, scores)
    count = members.to(torch.float64)
    single = members < 2
    mean = torch.where(single, 0.0, sums / count)
    centered = scores - mean[group]
    sq = torch.zeros_like(sums).index_add_(0, group, centered.square())
    std = torch.where(single, 1.0, (sq / (count - 1).clamp_min(1)).sqrt())
    adv = centered / (std[group] + epsilon) if norm_adv_by_std_in_grpo else centered
    adv = adv.to(out_dt).unsqueeze(-1) * response_mask.to(out_dt)
    return adv, adv


@torch.no_grad()
def rloo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO outcome advantage: score minus the mean score of the *other* samples of the group.

    Written as verl does, ``n/(n−1)·(score − group mean)``; a group of one sample keeps its score.
    Returns ``(advantages, advantages)``. OTB/GRPO-only arguments are accepted and ignored.
    """
    log_ignored("rloo", kwargs)
    scores, group, members, n_groups, out_dt = _group_scores(token_level_rewards, response_mask, index)
    sums = torch.zeros(n_groups, dtype=torch.float64, device=scores.device).index_add_(0, group, scores)
    n = members.to(torch.float64)[group]
    mean = sums[group] / n
    adv = torch.where(n > 1, scores * n / (n - 1).clamp_min(1) - mean * n / (n - 1).clamp_min(1), scores)
    adv = adv.to(out_dt).unsqueeze(-1) * response_mask.to(out_dt)
    return adv, adv
