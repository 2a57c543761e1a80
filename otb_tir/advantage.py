"""Advantage estimators: Optimal Token Baseline (dense and multi-turn TIR), GRPO, RLOO.

All estimators share verl 0.9.1's calling convention and keyword set, so a trainer can call any
of them by name (:func:`get_estimator`)::

    advantages, returns = estimator(
        token_level_rewards,   # [B, R] float
        response_mask,         # [B, R] 0/1 (bool, int or float): 1 = token sampled by the policy
        index,                 # [B] group ids (uid), numpy object array of str/int, list, or tensor
        old_log_probs=None,    # [B, R] log π_old(y_t)          (OTB only)
        sum_pi_squared=None,   # [B, R] Σ_v π_old(v)²           (OTB only)
        rollout_is_weights=None,  # [B, R] truncated IS weights ρ (OTB only)
        handle_zero_tail=True, epsilon=..., norm_adv_by_std_in_grpo=True,  # each uses what it needs
    )

This module is their public home: the registry (:data:`ESTIMATORS`, :func:`register_estimator`,
:func:`get_estimator`), :func:`place_reward_on_last_policy_token`, and the four built-ins, which
live in :mod:`otb_tir.advantage_otb` (the Optimal Token Baseline pair, with its formulas) and
:mod:`otb_tir.advantage_outcome` (GRPO, RLOO) and share :mod:`otb_tir.advantage_inputs` (group
ids, validation, precision: half-precision inputs are computed in float32 and the results cast
back to the dtype verl would return).

Every estimator is vectorized over rows and groups: uids are mapped to dense group ids with
``np.unique(..., return_inverse=True)``, group and per-position sums use ``torch.bincount`` on
dense keys (``index_add_`` for a few per-group counts), the TIR variant indexes each row's k-th
policy token through :func:`otb_tir.layout.policy_counts_into`. The results equal verl 0.9.1's
estimators (tests use verl as the oracle).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from agent_env.records import last_policy_token
from otb_tir import ConfigError
from otb_tir.advantage_inputs import check_2d
from otb_tir.advantage_otb import optimal_token_baseline, tir_optimal_token_baseline
from otb_tir.advantage_outcome import grpo, rloo
from tools.plugins import Registry

__all__ = [
    "ESTIMATORS",
    "AdvantageEstimator",
    "get_estimator",
    "grpo",
    "list_estimators",
    "optimal_token_baseline",
    "place_reward_on_last_policy_token",
    "register_estimator",
    "rloo",
    "tir_optimal_token_baseline",
]


class AdvantageEstimator(Protocol):
    def __call__(
        self,
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: Any,
        old_log_probs: torch.Tensor | None = None,
        sum_pi_squared: torch.Tensor | None = None,
        rollout_is_weights: torch.Tensor | None = None,
        handle_zero_tail: bool = True,
        epsilon: float = ...,
        norm_adv_by_std_in_grpo: bool = True,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def _check_estimator(obj: Any, name: str) -> None:
    if not callable(obj):
        raise ConfigError(f"advantage estimator {name!r} resolved to {obj!r}, which is not callable")


#: Every estimator name: the built-ins below, :func:`register_estimator`, entry points of group
#: ``otb_tir.estimators`` and paths (``pkg.mod:fn`` / ``file.py:fn``), resolved by the one plugin
#: mechanism (:class:`tools.plugins.Registry`).
ESTIMATORS = Registry(
    "advantage estimator",
    "otb_tir.estimators",
    {
        name: f"otb_tir.advantage:{name}"
        for name in ("optimal_token_baseline", "tir_optimal_token_baseline", "grpo", "rloo")
    },
    error=ConfigError,
    check=_check_estimator,
)


# Each built-in's advantages of a group depend on that group's rows only: a step may compute them a
# micro-batch of whole groups at a time, inside the update's own forwards (actor.on_policy_micro_batches).
# A registered estimator says the same with ``fn.group_local = True``; without it the two-pass update runs.
for _fn in (optimal_token_baseline, tir_optimal_token_baseline, grpo, rloo):
    _fn.group_local = True


def register_estimator(name: str, *, replace: bool = False) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: make an estimator available to :func:`get_estimator` (and to
    ``algorithm.adv_estimator``) under ``name``."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"estimator name must be a non-empty string, got {name!r}")

    def decorate(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ESTIMATORS.builtins and not replace:
            raise ConfigError(f"an advantage estimator named {name!r} is built in; pick another name")
        ESTIMATORS.register(fn, name, replace=replace)
        return fn

    return decorate


def list_estimators() -> list[str]:
    """Names accepted by :func:`get_estimator` (besides paths), sorted."""
    return ESTIMATORS.names()


def get_estimator(name: str) -> AdvantageEstimator:
    """The estimator called ``name`` (``algorithm.adv_estimator`` in configs): a built-in, one
    registered with :func:`register_estimator`, an ``otb_tir.estimators`` entry point, or a path
    ``package.module:fn`` / ``path/to/file.py:fn``."""
    key = getattr(name, "value", name)  # accept verl's AdvantageEstimator enum members too
    return ESTIMATORS.resolve(key)


# --------------------------------------------------------------------------------------------
# reward placement


@torch.no_grad()
def place_reward_on_last_policy_token(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Move each row's total reward onto its last ``mask == 1`` token.

    verl forms returns from ``token_level_rewards * response_mask``, so a reward sitting on a
    mask-0 token (the last token of a multi-turn row is often a tool response or an appended
    end-of-turn token) is silently dropped. Call this before any estimator: every row's rewards
    are summed and placed on its last policy token, the rest of the row becomes 0. Rows without
    policy tokens are returned unchanged (no token could carry their reward; no gradient flows
    through them). Returns a new tensor; the inputs are not modified.
    """
    if not isinstance(token_level_rewards, torch.Tensor) or token_level_rewards.dim() != 2:
        raise ConfigError("token_level_rewards must be a 2-D [batch, response_length] tensor")
    check_2d("response_mask", response_mask, token_level_rewards.shape, True)
    mask = response_mask != 0
    if mask.numel() == 0:
        return token_level_rewards.clone()
    last, has_policy = last_policy_token(mask)  # the position collate puts the reward at
    out = torch.zeros_like(token_level_rewards)
    out.scatter_(1, last.unsqueeze(1), token_level_rewards.sum(dim=-1, keepdim=True))
    return torch.where(has_policy.unsqueeze(1), out, token_level_rewards)
