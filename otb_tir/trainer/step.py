"""The algorithm of one training step, apart from the loop that drives it: ``score`` → ``advantages``
→ ``update``, each a function of what came before it, each returning a typed record.

    RolloutBatch (agent_env: the rollout's tensors, written once by ``collate``)
      ─► score(model, batch)                        TokenStats: old log-probs, entropy, Σπ²
      ─► advantages(batch, old, estimator, ...)     Advantages: A_t, loss mask, IS weights
      ─► update(model, optimizer, batch, old, adv)  the update's metrics

On an exactly on-policy step (:func:`~otb_tir.trainer.actor.on_policy_micro_batches`) the old
statistics come from the update's own forwards: :func:`~otb_tir.trainer.actor.on_policy_update` runs
each micro-batch's forward, :func:`estimate` on its rows (whole groups), its loss and backward.
The trainer (:mod:`otb_tir.trainer.trainer`) drives rollout → these → weight sync → :func:`step_metrics`;
none of them calls back into it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

from agent_env import RolloutBatch
from otb_tir.metrics import (
    advantage_stats,
    equal_reward_group_frac,
    rollout_actor_gap,
    trajectory_metrics,
    variance_proxy_metrics,
)
from otb_tir.token_stats import TokenStats
from otb_tir.trainer.actor import ActorSettings, compute_old_stats, ppo_update
from otb_tir.trainer.config import FilterConfig
from otb_tir.trainer.distributed import gather_objects, gather_tensors
from otb_tir.trainer.ppo import Advantages, truncated_is_weights
from otb_tir.trainer.settings import TrainerSettings

__all__ = ["Advantages", "advantages", "estimate", "filter_loss_mask", "score", "step_metrics", "update"]


def score(model, batch: RolloutBatch, s: ActorSettings) -> TokenStats:
    """The policy's log-probs, entropy and Σπ² on the batch's responses (one pass, no gradient)."""
    return compute_old_stats(model, batch.tensors, s)


def filter_loss_mask(batch: RolloutBatch, f: FilterConfig) -> tuple[torch.Tensor, float]:
    """The loss mask after the optional trajectory filters (void turns, overlong, flat groups), and
    the share of rows kept."""
    mask = batch["response_mask"].clone().float()
    keep = torch.ones(mask.shape[0], dtype=torch.bool)
    trajs = batch.trajectories
    if f.void_turns:
        keep &= torch.tensor([t.void_turns == 0 for t in trajs])
    if f.overlong:
        keep &= torch.tensor([t.finish_reason not in ("length", "turn_length", "tool_overflow") for t in trajs])
    if f.all_equal_reward_groups:
        _, inv = np.unique(batch["uid"], return_inverse=True)
        inv_t = torch.as_tensor(inv)
        r = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
        g = int(inv.max()) + 1
        rmin = torch.full((g,), math.inf, dtype=torch.float64).scatter_reduce(0, inv_t, r, "amin")
        rmax = torch.full((g,), -math.inf, dtype=torch.float64).scatter_reduce(0, inv_t, r, "amax")
        keep &= (rmax > rmin)[inv_t]
    mask *= keep[:, None].float()
    return mask, float(keep.float().mean())


def estimate(
    batch: RolloutBatch, old: TokenStats, estimator: Any, s: TrainerSettings, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The estimator's advantages on the old statistics (the reward sits on each row's last policy
    token, placed by ``collate``) and the truncated rollout IS weights when ``algorithm.rollout_is``
    (else None), ``[b, R]`` each, before the filters. ``rows``: only those rows (``old`` holds theirs:
    whole groups, for a group-local estimator); all by default."""
    mask = batch["response_mask"].float()
    rewards, uid, rollout_lp = batch["token_level_rewards"], batch["uid"], batch["rollout_log_probs"]
    if rows is not None:
        mask, rewards, rollout_lp = mask[rows], rewards[rows], rollout_lp[rows]
        uid = np.asarray(uid, dtype=object)[rows.numpy()]
    is_weights = None
    if s.rollout_is:
        is_weights = truncated_is_weights(old.log_probs, rollout_lp, mask, s.rollout_is_threshold)
    adv, _returns = estimator(
        token_level_rewards=rewards,
        response_mask=mask,
        index=uid,
        old_log_probs=old.log_probs,
        sum_pi_squared=old.sum_pi_squared,
        rollout_is_weights=is_weights,
        handle_zero_tail=s.handle_zero_tail,
        norm_adv_by_std_in_grpo=s.norm_adv_by_std_in_grpo,
    )
    return adv, is_weights


def advantages(batch: RolloutBatch, old: TokenStats, estimator: Any, s: TrainerSettings) -> Advantages:
    """:func:`estimate` on the whole batch, and the loss mask after the filters (advantages × it)."""
    adv, is_weights = estimate(batch, old, estimator, s)
    loss_mask, kept = filter_loss_mask(batch, s.filters)
    return Advantages(adv.float() * loss_mask, loss_mask, is_weights, kept)


def update(
    model,
    optimizer,
    batch: RolloutBatch,
    old: TokenStats,
    adv: Advantages,
    s: TrainerSettings,
    *,
    step: int,
    world: int = 1,
    ref_log_probs: torch.Tensor | None = None,
) -> dict[str, float]:
    """PPO over the batch: ``s.ppo_epochs`` passes, each over mini-batches of ``ppo_mini_batch_size × n
    / world`` rows in an order drawn from ``(s.seed, step)``; returns the last pass's metrics."""
    rows = batch["responses"].shape[0]
    per_mini = s.ppo_mini_batch_size * s.n // world
    g = torch.Generator().manual_seed(s.seed * 7919 + step)
    out: dict[str, float] = {}
    for _ in range(s.ppo_epochs):
        perm = torch.randperm(rows, generator=g)
        minis = [perm[i : i + per_mini] for i in range(0, rows, per_mini)]
        out = ppo_update(model, optimizer, batch.tensors, old, adv, minis, s.actor, ref_log_probs)
    return out


def step_metrics(
    batch: RolloutBatch,
    old: TokenStats,
    adv: Advantages,
    actor_metrics: Mapping[str, float],
    timing: Mapping[str, float],
    s: TrainerSettings,
    *,
    world: int = 1,
    lr: float,
) -> dict[str, float]:
    """One row of the training curve, over all ranks' rows (rank order = the one-process row order):
    the trajectories' figures, the update's, the advantages' and the variance proxy's, the rollout's
    throughput and the step's timing so far."""
    trajs = gather_objects(batch.trajectories, world)
    local = {
        "advantages": adv.advantages,
        "loss_mask": adv.loss_mask,
        "old_log_probs": old.log_probs,
        "sum_pi_squared": old.sum_pi_squared,
        "rollout_log_probs": batch["rollout_log_probs"],
        "response_mask": batch["response_mask"],
    }
    if adv.rollout_is_weights is not None:
        local["is_weights"] = adv.rollout_is_weights
    g_all = gather_tensors(local, world)
    metrics = trajectory_metrics(trajs)
    metrics["train/zero_advantage_frac"] = equal_reward_group_frac(trajs)
    metrics.update(actor_metrics)
    metrics["filter/kept_frac"] = float(np.mean(gather_objects([adv.kept_frac], world)))  # equal rows per rank
    metrics.update(advantage_stats(g_all["advantages"], g_all["loss_mask"]))
    metrics.update(
        variance_proxy_metrics(
            g_all["advantages"],
            g_all["loss_mask"],
            g_all["old_log_probs"],
            g_all["sum_pi_squared"],
            rollout_is_weights=g_all.get("is_weights"),
            gradient_norm=actor_metrics.get("actor/grad_norm"),
        )
    )
    # the engine's log-probs against the actor's on the same tokens (lag 0: noise; one step off-policy: lag 1)
    metrics.update(rollout_actor_gap(g_all["rollout_log_probs"], g_all["old_log_probs"], g_all["response_mask"]))
    metrics["actor/lr"] = lr
    metrics["rollout/gen_waited_on_tools_frac"] = batch.stats.get("gen_waited_on_tools_frac", float("nan"))
    metrics["rollout/sampled_tokens_per_s"] = batch.stats.get("sampled_tokens_per_s", float("nan"))
    # this step's tokens, all ranks: sampled by the policy, and inserted by tools (observations)
    metrics["rollout/sampled_tokens"] = float(sum(sum(t.response_mask) for t in trajs))
    metrics["rollout/tool_tokens"] = float(sum(len(t.response_ids) - sum(t.response_mask) for t in trajs))
    # the step's tokens (prompt + response, padding excluded), all ranks; pad_frac: the share of
    # padding in the columns the update's forwards ran (trimmed or packed); shared_prompt_frac: the
    # share of the step's tokens the forwards did not run again (a group's prompt once)
    real = float(sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs))
    per_pass = world / max(s.ppo_epochs, 1)
    ran = actor_metrics.get("actor/forward_tokens", 0.0) * per_pass
    ran_real = actor_metrics.get("actor/forward_real_tokens", 0.0) * per_pass
    metrics["perf/pad_frac"] = max(1.0 - ran_real / ran, 0.0) if ran else 0.0
    metrics["perf/shared_prompt_frac"] = max(1.0 - ran_real / real, 0.0) if ran and real else 0.0
    metrics["perf/rollout_sampled_tokens_per_s"] = metrics["rollout/sampled_tokens"] / max(
        timing["timing/rollout_s"], 1e-9
    )
    metrics["perf/update_tokens_per_s"] = real * s.ppo_epochs / max(timing["timing/update_s"], 1e-9)
    metrics.update(timing)
    return metrics
