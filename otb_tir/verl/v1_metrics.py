"""The figures our verl V1 trainer modes log on every step (:mod:`otb_tir.verl.v1`): samples per
model-version lag, |π_rollout − π_actor| per lag (the weight sync's effect), the IS weights' stats;
the two tensor helpers the mixin uses on TransferQueue's nested tensors, and :func:`moe_counts_aside`."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import numpy as np
import torch

__all__ = [
    "is_weight_stats",
    "lengths_mask",
    "moe_counts_aside",
    "pad_nested",
    "prob_diff_by_lag",
    "staleness_metrics",
]


def staleness_metrics(tags: list[dict], global_steps: int) -> dict[str, float]:
    """Samples per model-version lag (``staleness/lag_<k>``), mean and max, from the TransferQueue
    tags verl's V1 agent loop writes (``min_global_steps`` / ``max_global_steps``: the weight
    versions a trajectory was generated with). Lag = the versions between the freshest weights a
    trajectory used and the policy being updated (verl's ``trajectory_staleness``)."""
    rows = [t for t in tags if not t.get("is_padding", False)]
    if not rows:
        return {}
    lag = np.array([(global_steps - 1) - int(t["max_global_steps"]) for t in rows])
    worst = np.array([(global_steps - 1) - int(t["min_global_steps"]) for t in rows])
    out = {f"staleness/lag_{k}": float((lag == k).sum()) for k in range(int(lag.min()), int(lag.max()) + 1)}
    out.update(
        {
            "staleness/mean": float(lag.mean()),
            "staleness/max": float(lag.max()),
            "staleness/worst_mean": float(worst.mean()),
            "staleness/worst_max": float(worst.max()),
            "staleness/stale_frac": float((lag > 0).mean()),
            "staleness/samples": float(len(rows)),
        }
    )
    return out


def prob_diff_by_lag(
    tags: list[dict],
    global_steps: int,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, float]:
    """``sync/prob_diff_mean_lag_<k>``: mean |π_rollout − π_actor| over the policy tokens of the rows
    whose *oldest* weights were ``k`` versions behind the policy being updated (``min_global_steps``:
    a row generated across a weight sync counts at the older version), and ``sync/tokens_lag_<k>``.

    At lag 0 the whole row came from the weights the actor holds, so the figure is the two engines'
    numerical difference (≈ 1e-3 in fp32 on CPU) when the weight sync took effect and the size of
    the last updates when it did not; at lag > 0 it mixes the sync with the updates in between
    (a CI run had rows begun before a sync and finished after it: 0.25 by their newest version).
    verl's ``training/rollout_actor_probs_pearson_corr`` pools every lag (stale rows are off-policy
    by design in the async modes) and is undefined once the probabilities saturate at 1."""
    keep = [i for i, t in enumerate(tags) if not t.get("is_padding", False)]
    if not keep:
        return {}
    rows = torch.as_tensor(keep)
    lag = torch.as_tensor([(global_steps - 1) - int(tags[i]["min_global_steps"]) for i in keep])
    m = mask[rows].bool()
    diff = (torch.exp(rollout_log_probs[rows].float()) - torch.exp(old_log_probs[rows].float())).abs()
    out: dict[str, float] = {}
    for k in sorted(set(lag.tolist())):
        tok = m & (lag == k)[:, None]
        n = int(tok.sum())
        out[f"sync/tokens_lag_{k}"] = float(n)
        if n:
            out[f"sync/prob_diff_mean_lag_{k}"] = float(diff[tok].mean())
    return out


def is_weight_stats(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None
) -> dict[str, float]:
    """Token-level IS weights on policy tokens: the raw ratio π_old/π_rollout and the weights the
    estimator received (mean, max, the fraction the truncation changed)."""
    m = mask.bool()
    if not m.any():
        return {}
    raw = torch.exp((old_log_probs - rollout_log_probs).float())[m]
    out = {"is/ratio_mean": float(raw.mean()), "is/ratio_max": float(raw.max()), "is/applied": 0.0}
    if weights is not None:
        w = weights.float()[m]
        out.update(
            {
                "is/applied": 1.0,
                "is/weight_mean": float(w.mean()),
                "is/weight_max": float(w.max()),
                "is/truncated_frac": float((w < raw - 1e-6 * raw.abs().clamp(min=1.0)).float().mean()),
            }
        )
    return out


def pad_nested(nested: torch.Tensor, width: int) -> torch.Tensor:
    padded = nested.to_padded_tensor(0.0)
    if padded.shape[-1] < width:
        padded = torch.nn.functional.pad(padded, (0, width - padded.shape[-1]))
    return padded[:, :width]


def lengths_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < lengths[:, None]


@contextlib.contextmanager
def moe_counts_aside(trainer: Any) -> Iterator[None]:
    """Inside, ``trainer`` counts verl's rollout MoE routed experts on a copy of its accumulator
    (``_rollout_moe_lb_metrics_accumulator``, which sums the counts over verl's logging interval and
    pops them when it is reached): a metrics row computed besides verl's own (the one logged before a
    checkpoint) shows what verl's row will show and leaves the counts to verl's row alone."""
    attr = "_rollout_moe_lb_metrics_accumulator"
    real = getattr(trainer, attr, None)
    if real is None:
        yield
        return
    scratch = copy.copy(real)
    scratch.load_counts = None if real.load_counts is None else real.load_counts.clone()
    setattr(trainer, attr, scratch)
    try:
        yield
    finally:
        setattr(trainer, attr, real)
