"""What our TaskRunner adds to verl's PPO trainer (``RayPPOTrainer``), in the TaskRunner process.

:func:`install` wraps, in that process only (verl's files are untouched):

* **Progress** for the launcher's watchdog: each phase verl times (``marked_timer``: gen, reward,
  old_log_prob, adv, update_actor, update_weights, testing, ...) plus worker start-up, validation
  and the first weight sync, written to ``<output_dir>/progress.json`` as
  ``{"phase", "since", "step", "pid"}`` when it begins and ends (:class:`Progress`).
* **The batch contract**, checked on every batch verl builds (``compute_advantage``): tool tokens
  (inside the response, ``response_mask`` 0) get advantage 0; the reward sits on the row's last
  policy token; policy tokens carry non-zero advantages in groups whose rewards differ (for OTB,
  exactly where the baseline cannot equal the row's return: :func:`contested_tokens`); and, for
  the OTB estimators, verl's own implementation gives the same advantages on the same batch. The
  figures are logged per step under ``contract/``; a broken invariant stops the run
  (:class:`ContractError`).
* **Metrics**: verl's metrics plus the local trainer's names (``reward/mean``, ``tools/*`` from the
  agent loop's per-row counts, ``advantages/*``, ``timing/*_s``, ``val/accuracy``), written by the
  local trainer's :class:`~otb_tir.trainer.logging.MetricsLogger` (``metrics.jsonl``,
  TensorBoard, ``curves.png``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from otb_tir.verl.v1_metrics import prob_diff_by_lag

logger = logging.getLogger(__name__)

__all__ = ["ContractError", "Progress", "check_contract", "contested_tokens", "install", "translate_metrics"]

OTB_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")
CONTRACT_TOL = 1e-5  # fp32: ours vs verl's estimator differ by rounding only (measured ~1e-7)


class ContractError(RuntimeError):
    """verl's batch breaks the multi-turn data contract (see the module docstring)."""


class Progress:
    """``progress.json``: the phase the trainer is in, for the launcher's watchdog (atomic writes)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.step = 0
        self.stack: list[str] = []
        self._failed: tuple[BaseException, str] | None = None  # an exception and the phase it left

    def write(self, phase: str, failed: str | None = None) -> None:
        tmp = self.path.with_suffix(".tmp")
        row = {"phase": phase, "since": time.time(), "step": self.step, "pid": os.getpid()}
        if failed:
            row["failed"] = failed  # the phase that raised (the watchdog names it)
        tmp.write_text(json.dumps(row))
        os.replace(tmp, self.path)

    def enter(self, name: str) -> None:
        """A phase begins (for phases verl opens and closes in two different hooks)."""
        self.stack.append(name)
        self.write(name)

    def fail(self, exc: BaseException, name: str) -> None:
        """``exc`` escapes the phase ``name`` through a hook that closes it (verl's ``on_sample_end``
        closes ``gen``, and may itself raise: a replica that died answers its sleep call with
        ActorDiedError): the phases around it name ``name`` as where the run failed."""
        if self._failed is None or self._failed[0] is not exc:
            self._failed = (exc, name)

    def leave(self, name: str, failed: str | None = None) -> None:
        """The phase ``name`` ends (and any phase opened inside it and left open)."""
        while self.stack:
            if self.stack.pop() == name:
                break
        self.write(self.stack[-1] if self.stack else "between_phases", failed=failed)

    @contextlib.contextmanager
    def phase(self, name: str):
        self.enter(name)
        failed = None
        try:
            yield
        except BaseException as exc:
            # the innermost phase still open: one verl opens and closes in two hooks (``gen``) is left
            # open by the exception, and it is where the run failed; or the phase whose closing hook
            # raised it (:meth:`fail`)
            if self._failed is not None and self._failed[0] is exc:
                failed = self._failed[1]
            else:
                failed = self.stack[-1] if self.stack else name
            raise
        finally:
            self.leave(name, failed=failed)


def _response_attention(batch: Any) -> torch.Tensor:
    T = batch["responses"].shape[-1]
    return batch["attention_mask"][:, -T:]


#: a row carries weight at an index when its W is at least this share of the group's sum there
CARRYING_SHARE = 1e-3


def contested_tokens(
    mask: torch.Tensor,
    group: torch.Tensor,
    rewards: torch.Tensor,
    weights: torch.Tensor,
    by_policy_rank: bool,
) -> torch.Tensor:
    """Policy tokens (bool ``[B, R]``) at which an OTB advantage cannot be zero.

    At one index of a group (the k-th policy token for the TIR estimator, the column for the dense
    one), OTB's baseline is the W-weighted mean of the returns of the group's rows present there.
    When two rows that carry weight there (W at least :data:`CARRYING_SHARE` of the index's sum)
    have different rewards, that mean lies strictly between their rewards, away from each by more
    than fp32 rounding, so every row present there gets a non-zero advantage (rewards that fall on
    the mean by coincidence aside). Elsewhere a zero is legitimate: one row left (a length-capped
    tail, ``handle_zero_tail``), rows that agree, or rows whose W vanished (probabilities at 1).
    The reward sits on the last policy token, so a row's return is its reward at every token."""
    m = mask.bool()
    B, T = m.shape
    if by_policy_rank:
        idx = (m.long().cumsum(-1) - 1).clamp_min(0)
    else:
        idx = torch.arange(T, device=m.device).expand(B, T)
    n_groups = int(group.max()) + 1 if B else 0
    key = (group[:, None] * T + idx)[m]
    w = weights.float()[m]
    r = rewards.float()[:, None].expand(B, T)[m]
    n = n_groups * T
    total = torch.zeros(n, dtype=torch.float32, device=m.device).index_add_(0, key, w)
    carrying = w >= CARRYING_SHARE * total[key]
    carrying &= w > 0
    k, rc = key[carrying], r[carrying]
    rmin = torch.full((n,), math.inf, device=m.device).scatter_reduce(0, k, rc, "amin")
    rmax = torch.full((n,), -math.inf, device=m.device).scatter_reduce(0, k, rc, "amax")
    out = torch.zeros_like(m)
    out[m] = (rmax > rmin)[key]
    return out


def check_contract(
    data: Any,
    adv_estimator: str,
    verl_estimator: Callable[..., Any] | None,
    config: Any = None,
    inside: torch.Tensor | None = None,
) -> dict[str, float]:
    """The contract figures of a batch after ``compute_advantage`` (raises :class:`ContractError`).

    ``inside``: which response positions hold a token of the row (bool ``[B, R]``); by default the
    response part of the batch's ``attention_mask`` (verl's legacy trainer; its V1 trainer keeps
    responses as nested tensors and passes their lengths instead)."""
    b = data.batch
    mask = b["response_mask"].bool()
    adv = b["advantages"]
    scores = b["token_level_rewards"]
    inside = _response_attention(b).bool() if inside is None else inside.bool()
    tool = inside & ~mask
    out: dict[str, float] = {"contract/tool_tokens": float(tool.sum()), "contract/policy_tokens": float(mask.sum())}
    out["contract/tool_token_adv_max_abs"] = float(adv[tool].abs().max()) if tool.any() else 0.0
    out["contract/pad_adv_max_abs"] = float(adv[~inside].abs().max()) if (~inside).any() else 0.0
    # the reward sits on the last policy token of its row
    T = mask.shape[-1]
    pos = torch.arange(T).expand_as(mask)
    last = torch.where(mask, pos, torch.full_like(pos, -1)).max(dim=-1).values
    off_last = (scores != 0) & (pos != last[:, None])
    out["contract/reward_off_last_policy_token"] = float(off_last.sum())
    # non-zero advantages where the group's rewards differ
    uid = data.non_tensor_batch.get("uid")
    rewards = scores.sum(-1)
    if uid is not None:
        _, inv = np.unique(np.asarray(uid), return_inverse=True)
        inv_t = torch.as_tensor(inv)
        g = int(inv.max()) + 1
        rmin = torch.full((g,), math.inf, dtype=rewards.dtype).scatter_reduce(0, inv_t, rewards, "amin")
        rmax = torch.full((g,), -math.inf, dtype=rewards.dtype).scatter_reduce(0, inv_t, rewards, "amax")
        informative = (rmax > rmin)[inv_t]
        rows = informative[:, None] & mask
        out["contract/informative_groups"] = float((rmax > rmin).sum())
        out["contract/groups"] = float(g)
        out["contract/informative_policy_adv_nonzero_frac"] = (
            float((adv[rows] != 0).float().mean()) if rows.any() else math.nan
        )
        if adv_estimator in OTB_ESTIMATORS and "sum_pi_squared" in b.keys():
            from otb_tir.advantage_otb import path_weights

            W = path_weights(
                b["response_mask"], b["old_log_probs"], b["sum_pi_squared"], b.get("rollout_is_weights", None)
            )
            by_rank = adv_estimator == "tir_optimal_token_baseline"
            contested = contested_tokens(mask, inv_t, rewards, W, by_policy_rank=by_rank)
            out["contract/contested_tokens"] = float(contested.sum())
            out["contract/contested_adv_nonzero_frac"] = (
                float((adv[contested] != 0).float().mean()) if contested.any() else math.nan
            )
    if verl_estimator is not None and adv_estimator in OTB_ESTIMATORS:
        out["contract/is_weights_in_estimator"] = float(b.get("rollout_is_weights", None) is not None)
        theirs, _ = verl_estimator(
            token_level_rewards=scores,
            response_mask=b["response_mask"],
            config=config,
            index=data.non_tensor_batch.get("uid"),
            sum_pi_squared=b["sum_pi_squared"],
            old_log_probs=b["old_log_probs"],
            rollout_is_weights=b.get("rollout_is_weights", None),
        )
        out["contract/adv_max_abs_diff_vs_verl"] = float((adv - theirs).abs().max())
    problems = []
    if out["contract/tool_token_adv_max_abs"] != 0.0:
        problems.append(f"tool tokens carry advantages (max |A| {out['contract/tool_token_adv_max_abs']:.3g})")
    if out["contract/reward_off_last_policy_token"]:
        problems.append(f"{int(out['contract/reward_off_last_policy_token'])} rewards are not on the last policy token")
    if out.get("contract/adv_max_abs_diff_vs_verl", 0.0) > CONTRACT_TOL:
        problems.append(f"our {adv_estimator} differs from verl's by {out['contract/adv_max_abs_diff_vs_verl']:.3g}")
    if out.get("contract/informative_groups", 0) and out["contract/informative_policy_adv_nonzero_frac"] == 0.0:
        problems.append("groups with different rewards got all-zero advantages")
    if problems:
        raise ContractError("verl's batch breaks the multi-turn contract: " + "; ".join(problems))
    return out


def _mean(values: Any) -> float:
    arr = np.asarray(values, dtype=float)
    return float(arr.mean()) if arr.size else math.nan


def batch_metrics(data: Any) -> dict[str, float]:
    """The local trainer's figures computed from verl's batch (rewards, tools, episodes, advantages)."""
    from agent_env.tool_metrics import COUNT_KEYS, pooled_tool_metrics

    b, nt = data.batch, data.non_tensor_batch
    out: dict[str, float] = {}
    scores = b["token_level_scores"].sum(-1) if "token_level_scores" in b.keys() else None
    if scores is not None:
        out["reward/mean"] = float(scores.float().mean())
    if "acc" in nt:
        out["reward/accuracy"] = _mean(nt["acc"])
    counts = [k for k in COUNT_KEYS if f"tool_{k}" in nt]  # the agent loop's per-row counts
    if counts:
        n = len(nt[f"tool_{counts[0]}"])
        rows = [{k: float(nt[f"tool_{k}"][i]) for k in counts} for i in range(n)]
        out.update(pooled_tool_metrics(rows))
    for key in [k for k in nt.keys() if k.startswith("reward_error_")]:  # the agent loop's per-row 0/1
        out[f"reward/errors/{key[len('reward_error_') :]}"] = float(np.asarray(nt[key], float).sum())
    if "assistant_turns" in nt:
        out["episode/turns_mean"] = _mean(nt["assistant_turns"])
    if "void_turns" in nt:
        out["episode/void_turn_rate"] = float((np.asarray(nt["void_turns"], float) > 0).mean())
    mask = b["response_mask"].float()
    inside = _response_attention(b).float()
    out["response/length_mean"] = float(inside.sum(-1).mean())
    out["response/policy_tokens_mean"] = float(mask.sum(-1).mean())
    out["response/tool_token_share"] = float((inside - mask).sum() / inside.sum().clamp(min=1))
    if "rollout_log_probs" in b.keys() and "old_log_probs" in b.keys():
        # the legacy trainer is synchronous: every row came from the weights the actor held (lag 0), so
        # |π_rollout − π_actor| is the engines' numerical difference when the weight sync took effect
        lag_0 = [{"min_global_steps": 0}] * mask.shape[0]
        out.update(prob_diff_by_lag(lag_0, 1, b["old_log_probs"], b["rollout_log_probs"], mask))
    if "advantages" in b.keys():
        a = b["advantages"][mask.bool()]
        if a.numel():
            out["advantages/mean"] = float(a.mean())
            out["advantages/std"] = float(a.std()) if a.numel() > 1 else 0.0
            out["advantages/abs_max"] = float(a.abs().max())
    return out


# verl name → the local trainer's name (for curves.png, summary.json and side-by-side comparisons)
_RENAMES = {
    "actor/pg_loss": "actor/pg_loss",
    "actor/entropy": "actor/entropy",
    "actor/grad_norm": "actor/grad_norm",
    "actor/pg_clipfrac": "actor/clip_frac",
    "actor/ppo_kl": "actor/approx_kl",
}


def translate_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """verl's step metrics plus the local trainer's names for the same figures."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue
    for src, dst in _RENAMES.items():
        if src in out and dst not in out:
            out[dst] = out[src]
    for k, v in list(out.items()):
        phase = k[len("timing_s/") :]
        if k.startswith("timing_s/") and "/" not in phase:  # gen, reward, old_log_prob, adv, update_actor, ...
            out[f"timing/{phase}_s"] = v
    # verl's agent-loop timings per episode → the local trainer's per-episode means
    for ours, theirs in (("generate", "generate_sequences"), ("tools", "tool_calls"), ("reward", "compute_score")):
        if f"timing_s/agent_loop/{theirs}/mean" in out:
            out[f"timing/episode_{ours}_s"] = out[f"timing_s/agent_loop/{theirs}/mean"]
    acc = [v for k, v in out.items() if k.startswith("val-core/") and "/acc/mean@" in k]
    if acc:
        out["val/accuracy"] = acc[0]
    return out


def install(output_dir: str | Path, loggers: list[str] | None = None, resume: bool = False) -> Progress:
    """Wrap verl's trainer functions in this process (see the module docstring)."""
    from verl.trainer.ppo import ray_trainer as rt
    from verl.utils import tracking

    from otb_tir.trainer.logging import MetricsLogger
    from otb_tir.verl import plugin

    out = Path(output_dir)
    progress = Progress(out / "progress.json")
    progress.write("init")
    chosen = ["jsonl", "tensorboard"] if loggers is None else list(loggers)
    sink = MetricsLogger(out, loggers=sorted({"jsonl", *chosen} - {"console"}), plot_every=1, resume=resume)
    verl_originals = plugin.install()
    pending: dict[str, float] = {}

    original_timer = rt.marked_timer

    @contextlib.contextmanager
    def marked_timer(name: str, timing_raw: dict, *args: Any, **kwargs: Any):
        if name == "step":  # a training step begins: the one after the last step logged
            progress.step += 1
        with progress.phase(name), original_timer(name, timing_raw, *args, **kwargs):
            yield

    rt.marked_timer = marked_timer

    def phased(cls: type, method: str, phase: str) -> None:
        fn = getattr(cls, method)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            with progress.phase(phase):
                return fn(self, *args, **kwargs)

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        setattr(cls, method, wrapper)

    phased(rt.RayPPOTrainer, "init_workers", "init_workers")
    phased(rt.RayPPOTrainer, "_validate", "validate")
    phased(rt.RayPPOTrainer, "_load_checkpoint", "load_checkpoint")

    original_fit = rt.RayPPOTrainer.fit

    def fit(self: Any) -> Any:
        manager = self.checkpoint_manager
        update = manager.update_weights

        def update_weights(*args: Any, **kwargs: Any) -> Any:
            with progress.phase("update_weights"):
                return update(*args, **kwargs)

        manager.update_weights = update_weights
        try:
            result = original_fit(self)
            progress.write("finished")  # the watchdog gives the exit its teardown time from here
            return result
        finally:
            manager.update_weights = update
            sink.close()

    rt.RayPPOTrainer.fit = fit

    original_adv = rt.compute_advantage

    def compute_advantage(data: Any, adv_estimator: Any, *args: Any, config: Any = None, **kwargs: Any) -> Any:
        data = original_adv(data, adv_estimator, *args, config=config, **kwargs)
        name = str(getattr(adv_estimator, "value", adv_estimator))
        pending.clear()
        pending.update(check_contract(data, name, verl_originals.get(name), config))
        return data

    rt.compute_advantage = compute_advantage

    original_data_metrics = rt.compute_data_metrics

    def compute_data_metrics(batch: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        metrics = original_data_metrics(batch, *args, **kwargs)
        metrics.update(batch_metrics(batch))
        metrics.update(pending)
        pending.clear()
        return metrics

    rt.compute_data_metrics = compute_data_metrics

    original_log = tracking.Tracking.log

    def log(self: Any, data: Mapping[str, Any], step: int, *args: Any, **kwargs: Any) -> Any:
        result = original_log(self, data, step, *args, **kwargs)
        progress.step = int(step)
        sink.log(translate_metrics(data), step=int(step))
        return result

    tracking.Tracking.log = log
    logger.info("otb_tir hooks installed in the TaskRunner (pid %d)", os.getpid())
    return progress
