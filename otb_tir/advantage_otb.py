"""The Optimal Token Baseline estimators (dense and multi-turn TIR), exported by
:mod:`otb_tir.advantage`. Per group ``g`` of one prompt's samples and per position ``t``::

    w_t = (1 − 2·exp(old_log_prob_t) + Σπ²_t) · ρ_t²        (ρ = 1 without IS weights)
    W_t = Σ_{j ≤ t, mask_j = 1} w_j                         (cumulative path-variance proxy)
    G_t = Σ_{j ≥ t} reward_j · mask_j                        (reward-to-go, returned as ``returns``)
    B*_t = Σ_{i ∈ g} G_t·W_t·mask_t / (Σ_{i ∈ g} W_t·mask_t + ε)
    A_t = (G_t − B*_t) · mask_t

``optimal_token_baseline`` indexes ``t`` by absolute column; ``tir_optimal_token_baseline`` by the
k-th *policy* token of each row (tool tokens do not shift a row against the others in its group).
Groups of one sample get baseline 0 (advantage = return); rows without policy tokens stay zero
(and, in the TIR variant, do not count as group members). With ``handle_zero_tail`` the part of
a group's unique longest row beyond the second-longest length gets baseline 0. Per-position group
sums are ``bincount`` over dense keys (group · R + position), the TIR variant's positions come from
:func:`otb_tir.layout.policy_counts_into` (the running count of policy tokens), and on CPU the
fused kernel (:mod:`otb_tir.fused`) computes the same in the same floating-point order where it
applies.
"""

from __future__ import annotations

from typing import Any

import torch

from otb_tir import fused
from otb_tir.advantage_inputs import group_ids, log_ignored, prepare_inputs
from otb_tir.layout import policy_counts_into

__all__ = ["optimal_token_baseline", "path_weights", "tir_optimal_token_baseline"]


def _returns_and_weights(
    token_level_rewards: torch.Tensor,
    maskf: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(G, W·mask, scratch): reward-to-go, masked cumulative path-variance proxy, a free [B, R] buffer.

    Written with in-place ops and ``out=`` buffers: at [1024, 8192] every fresh 32 MB tensor
    costs a round of page faults comparable to the arithmetic itself.
    """
    scratch = torch.empty_like(maskf)
    resp = maskf.shape[1]
    # W_t = Σ_{j≤t} (1 − 2·π_j + Σπ²_j)·ρ_j²·mask_j, then masked (same op order as verl).
    weights = torch.exp(old_log_probs.to(dtype))
    weights.mul_(-2).add_(1).add_(sum_pi_squared.to(dtype))
    if rollout_is_weights is not None:
        rho = rollout_is_weights.to(dtype)
        weights.mul_(torch.mul(rho, rho, out=scratch))
    weights.mul_(maskf).cumsum_(-1).mul_(maskf)
    # G_t = Σ_{j≥t} r_j·mask_j: a cumulative sum over reversed columns, in verl's summation order
    # (bit-identical returns). The reversals are index_selects into existing buffers; torch.flip
    # would allocate. (S − prefix sum would save two passes but drifts by ulps of |S| on dense rewards.)
    returns = torch.mul(token_level_rewards.to(dtype), maskf)
    if resp:
        reverse = torch.arange(resp - 1, -1, -1, device=maskf.device)
        torch.index_select(returns, 1, reverse, out=scratch)
        scratch.cumsum_(-1)
        torch.index_select(scratch, 1, reverse, out=returns)
    return returns, weights, scratch


def path_weights(
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``W_t·mask_t`` ([B, R], float32): the cumulative path-variance proxy both OTB estimators weight
    a group's returns by (the same values: tool tokens add nothing to a row's running sum)."""
    zeros = torch.zeros_like(response_mask, dtype=torch.float32)
    return returns_and_path_weights(zeros, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights)[1]


def returns_and_path_weights(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G_t·mask_t, W_t·mask_t)`` ([B, R], float32): the reward-to-go and the path-variance proxy the
    OTB estimators compute, in their summation order (G bit-identical to verl's returns)."""
    maskf = response_mask.to(torch.float32)
    returns, weights, _ = _returns_and_weights(
        token_level_rewards, maskf, old_log_probs, sum_pi_squared, rollout_is_weights, torch.float32
    )
    return returns, weights


def _contiguous_group_size(group: torch.Tensor, n_groups: int, members: torch.Tensor) -> int:
    """``n`` if the rows form blocks of ``n`` adjacent rows, one whole group per block; else 0."""
    batch = group.shape[0]
    if batch == 0:
        return 0
    size = int(members[group[0]])
    if batch % size or n_groups * size != batch:
        return 0
    blocks = group.view(-1, size)
    return size if bool((blocks == blocks[:, :1]).all()) else 0


def _zero_tail_start(lengths: torch.Tensor, group: torch.Tensor, n_groups: int, members: torch.Tensor) -> torch.Tensor:
    """Per row: first position whose baseline ``handle_zero_tail`` zeroes, or -1 for none.

    A row qualifies when it is the unique longest of a group with ≥ 2 members; its tail starts at
    the group's second-longest length. One scatter-max for the longest, one for the runner-up.
    """
    lengths = lengths.to(torch.long)
    longest = torch.full((n_groups,), -1, dtype=torch.long, device=lengths.device)
    longest.scatter_reduce_(0, group, lengths, reduce="amax")
    is_longest = lengths == longest[group]
    n_longest = torch.zeros(n_groups, dtype=torch.long, device=lengths.device).index_add_(0, group, is_longest.long())
    runner_up = torch.full((n_groups,), -1, dtype=torch.long, device=lengths.device)
    runner_up.scatter_reduce_(0, group, torch.where(is_longest, -1, lengths), reduce="amax")
    unique_tail = is_longest & (n_longest[group] == 1) & (members[group] >= 2)
    return torch.where(unique_tail, runner_up[group].clamp_min(0), -1)


def _empty(token_level_rewards: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.zeros(token_level_rewards.shape, dtype=out_dtype, device=token_level_rewards.device),
        torch.zeros(token_level_rewards.shape, dtype=out_dtype, device=token_level_rewards.device),
    )


def _finish(returns: torch.Tensor, baselines: torch.Tensor, maskf: torch.Tensor, out_dtype: torch.dtype):
    """A = (G − B)·mask, written into the baselines buffer; results cast to the output dtype."""
    advantages = torch.sub(returns, baselines, out=baselines).mul_(maskf)
    return advantages.to(out_dtype), returns.to(out_dtype)


def _fused_or_none(
    tir: bool,
    token_level_rewards: torch.Tensor,
    maskf: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    group: torch.Tensor,
    n_groups: int,
    handle_zero_tail: bool,
    epsilon: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fused CPU kernel's result (:mod:`otb_tir.fused`) where it applies, else ``None``.

    It applies on CPU when the compute dtype is float32 (float32 or half-precision inputs) and the
    kernel is built; it computes in the same floating-point order as the PyTorch code below.
    """
    if maskf.device.type != "cpu" or maskf.dtype != torch.float32 or not fused.fused_available():
        return None
    f32 = torch.float32
    adv, ret = fused.fused_otb(
        token_level_rewards.to(f32),
        maskf,
        old_log_probs.to(f32),
        sum_pi_squared.to(f32),
        rollout_is_weights.to(f32) if rollout_is_weights is not None else None,
        group,
        n_groups,
        tir=tir,
        handle_zero_tail=handle_zero_tail,
        epsilon=epsilon,
    )
    return adv.to(out_dtype), ret.to(out_dtype)


@torch.no_grad()
def optimal_token_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline over absolute positions (verl's ``optimal_token_baseline``).

    Returns ``(advantages, returns)``, both ``[B, R]``. Single-turn data; for multi-turn rows with
    tool segments use :func:`tir_optimal_token_baseline`. ``handle_zero_tail`` here counts a row's
    length in policy tokens but zeroes from that *absolute column* on, as verl does (the two agree
    when every row's policy tokens are a prefix). ``norm_adv_by_std_in_grpo`` and extra keyword
    arguments are accepted for a uniform calling convention and ignored.
    """
    log_ignored("optimal_token_baseline", kwargs)
    maskf, cdt, out_dt = prepare_inputs(
        token_level_rewards,
        response_mask,
        {"old_log_probs": old_log_probs, "sum_pi_squared": sum_pi_squared, "rollout_is_weights": rollout_is_weights},
        required=True,
    )
    batch, resp = token_level_rewards.shape
    device = token_level_rewards.device
    group, n_groups = group_ids(index, batch, device)
    if token_level_rewards.numel() == 0:
        return _empty(token_level_rewards, out_dt)
    done = _fused_or_none(
        False, token_level_rewards, maskf, old_log_probs, sum_pi_squared, rollout_is_weights,
        group, n_groups, handle_zero_tail, epsilon, out_dt,
    )  # fmt: skip
    if done is not None:
        return done
    returns, weights, scratch = _returns_and_weights(
        token_level_rewards, maskf, old_log_probs, sum_pi_squared, rollout_is_weights, cdt
    )
    # Per group and column: B* = Σ G·W / (Σ W + ε); groups of one sample get 0.
    members = torch.bincount(group, minlength=n_groups)
    block = _contiguous_group_size(group, n_groups, members)
    if block:
        # Fast path (verl's interleaved repeat): each group is one block of `block` adjacent rows,
        # so the group sums are a plain reduction over a view, with no keys at all.
        n_blocks = batch // block
        den = weights.view(n_blocks, block, resp).sum(dim=1)
        num = weights.mul_(returns).view(n_blocks, block, resp).sum(dim=1)
        table = num.div_(den.add_(epsilon))
        row_table = torch.arange(batch, device=device) // block
        if block < 2:
            table.zero_()
    else:
        # General path: bincount on keys group·R + column, written into the scratch buffer (no new
        # [B, R] tensor); on CPU several times faster than index_add_ over rows.
        n_keys = n_groups * resp
        key_dtype = torch.int32 if cdt == torch.float32 else torch.int64
        if n_keys > torch.iinfo(key_dtype).max:
            keys = torch.empty((batch, resp), dtype=torch.int64, device=device)
        else:
            keys = scratch.view(key_dtype)
        torch.add(
            torch.arange(resp, dtype=keys.dtype, device=device).unsqueeze(0),
            (group * resp).to(keys.dtype).unsqueeze(1),
            out=keys,
        )
        keys = keys.view(-1)
        den = torch.bincount(keys, weights=weights.view(-1), minlength=n_keys)
        num = torch.bincount(keys, weights=weights.mul_(returns).view(-1), minlength=n_keys)
        table = num.div_(den.add_(epsilon)).view(n_groups, resp).to(cdt)
        table.masked_fill_((members < 2).unsqueeze(1), 0.0)
        row_table = group
    # The weights buffer is free now: gather each row's baselines into it.
    baselines = torch.index_select(table, 0, row_table, out=weights)
    if handle_zero_tail and batch:
        start = _zero_tail_start(maskf.sum(-1), group, n_groups, members)
        rows = (start >= 0).nonzero().squeeze(1)  # at most one row per group
        if rows.numel():
            tails = baselines.index_select(0, rows)
            tails.masked_fill_(torch.arange(resp, device=device).unsqueeze(0) >= start[rows].unsqueeze(1), 0.0)
            baselines.index_copy_(0, rows, tails)
    return _finish(returns, baselines, maskf, out_dt)


@torch.no_grad()
def tir_optimal_token_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-turn (TIR) Optimal Token Baseline (verl's ``tir_optimal_token_baseline``).

    Baselines are computed over the k-th policy token of each row: B*_k is taken across the
    group's rows at their k-th ``mask == 1`` token, whatever its absolute column. ``returns`` is
    the reward-to-go over the full ``[B, R]`` layout (nonzero on tool tokens too, as in verl).
    Rows without policy tokens are not group members.

    Equivalent to packing every row to its policy tokens (:func:`otb_tir.layout.pack_policy_tokens`),
    taking per-column baselines and unpacking; the compact arrays are not materialized: the
    group sums are keyed on ``(group, k)`` from :func:`otb_tir.layout.policy_counts` with one
    ``bincount`` each, and the baselines are gathered straight back into ``[B, R]``.
    ``norm_adv_by_std_in_grpo`` and extra keyword arguments are accepted and ignored.
    """
    log_ignored("tir_optimal_token_baseline", kwargs)
    maskf, cdt, out_dt = prepare_inputs(
        token_level_rewards,
        response_mask,
        {"old_log_probs": old_log_probs, "sum_pi_squared": sum_pi_squared, "rollout_is_weights": rollout_is_weights},
        required=True,
    )
    batch = token_level_rewards.shape[0]
    device = token_level_rewards.device
    group, n_groups = group_ids(index, batch, device)
    if token_level_rewards.numel() == 0:
        return _empty(token_level_rewards, out_dt)
    done = _fused_or_none(
        True, token_level_rewards, maskf, old_log_probs, sum_pi_squared, rollout_is_weights,
        group, n_groups, handle_zero_tail, epsilon, out_dt,
    )  # fmt: skip
    if done is not None:
        return done
    returns, weights, scratch = _returns_and_weights(
        token_level_rewards, maskf, old_log_probs, sum_pi_squared, rollout_is_weights, cdt
    )
    # Slot of each token: c = running count of policy tokens (policy token k of a row → c = k + 1;
    # an environment token shares the slot of the policy token before it, or slot 0, and adds 0).
    counts = policy_counts_into(maskf, scratch)  # reuses the scratch buffer: no new [B, R] tensor
    if counts.shape[1]:
        lengths = counts[:, -1].to(torch.long)
    else:
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
    slots = int(lengths.max()) + 1 if batch else 1
    n_keys = n_groups * slots
    if n_keys > torch.iinfo(counts.dtype).max:
        counts = counts.to(torch.int64)
    keys = counts.add_((group * slots).to(counts.dtype).unsqueeze(1)).view(-1)
    # Rows without policy tokens are not members of their group (verl skips them).
    members = torch.zeros(n_groups, dtype=torch.long, device=device).index_add_(0, group, (lengths > 0).long())
    den = torch.bincount(keys, weights=weights.view(-1), minlength=n_keys)
    num = torch.bincount(keys, weights=weights.mul_(returns).view(-1), minlength=n_keys)
    table = num.div_(den.add_(epsilon)).view(n_groups, slots).to(cdt)
    table.masked_fill_((members < 2).unsqueeze(1), 0.0)
    if handle_zero_tail and batch:
        # Beyond the runner-up length only the unique longest row has tokens, so its tail can be
        # zeroed in the group's table: slots k + 1 for k ≥ runner-up.
        start = _zero_tail_start(lengths, group, n_groups, members)
        tail_start = torch.full((n_groups,), slots, dtype=torch.long, device=device)
        tail_start.scatter_reduce_(0, group, torch.where(start >= 0, start + 1, slots), reduce="amin")
        table.masked_fill_(torch.arange(slots, device=device).unsqueeze(0) >= tail_start.unsqueeze(1), 0.0)
    # The weights buffer is free now: gather the baselines into it (it becomes the advantages).
    baselines = torch.index_select(table.view(-1), 0, keys, out=weights.view(-1)).view_as(returns)
    return _finish(returns, baselines, maskf, out_dt)
