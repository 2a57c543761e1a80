"""What our verl V1 trainer modes (:mod:`otb_tir.verl.v1`) record besides verl's own metrics.

* :func:`batch_figures` — each step's variance proxies (verl's ``compute_variance_proxy_metrics``,
  given Σπ²), rewards, tool use, advantages and the rollout engine's probabilities against the actor's
  per staleness lag, from the batch's rows in TransferQueue.
* :class:`RecipeRun` — when the recipe launched the run (``OTB_TIR_OUTPUT_DIR``, set by
  :func:`otb_tir.verl.launch.run_verl`): ``progress.json`` for the watchdog and the local trainer's
  metric files, as :mod:`otb_tir.verl.hooks` does for the legacy trainer.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from otb_tir.verl.v1_metrics import lengths_mask, prob_diff_by_lag

__all__ = ["RecipeRun", "batch_figures"]


def batch_figures(
    batch: Any, grad_norm: Any, global_steps: int, *, spi2_field: str | None, rollout_log_probs: bool
) -> dict[str, float]:
    """Variance proxies (verl's function, given Σπ²), rewards, tool use, advantages and the
    rollout engine's probabilities against the actor's per staleness lag, from ``batch``'s rows in
    TransferQueue. ``spi2_field``: the field holding Σπ² over the response (None when the run does not
    compute it); ``rollout_log_probs``: whether the rollout engine stored its log-probs."""
    import transfer_queue as tq
    from verl.protocol import DataProto
    from verl.trainer.ppo.metric_utils import compute_variance_proxy_metrics

    from otb_tir.verl.hooks import batch_metrics

    keep = np.array([not t.get("is_padding", False) for t in batch.tags], dtype=bool)
    fields = ["response_mask", "advantages", "old_log_probs", "rm_scores", "extra_fields"]
    if spi2_field:
        fields.append(spi2_field)
    if rollout_log_probs:
        fields.append("rollout_log_probs")
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    lengths = data["response_mask"].offsets().diff()
    extra_fields = data.pop("extra_fields").tolist() if "extra_fields" in data.keys() else None
    padded = data.to_padded_tensor()
    tensors = {k: (padded[k].float() if padded[k].is_floating_point() else padded[k]) for k in padded.keys()}
    sync: dict[str, float] = {}
    if "rollout_log_probs" in tensors:  # per staleness lag: did the rollout engine serve the actor's weights?
        rollout_lp = tensors.pop("rollout_log_probs")
        sync = prob_diff_by_lag(
            list(batch.tags), global_steps, tensors["old_log_probs"], rollout_lp, tensors["response_mask"]
        )
    if spi2_field in tensors:
        tensors["sum_pi_squared"] = tensors.pop(spi2_field)
    tensors["token_level_scores"] = tensors.pop("rm_scores")
    width = tensors["response_mask"].shape[-1]
    tensors["attention_mask"] = lengths_mask(lengths, width).long()
    tensors["responses"] = torch.zeros_like(tensors["attention_mask"])
    non_tensor: dict[str, np.ndarray] = {}
    infos = [((e or {}).get("reward_extra_info") or {}) for e in (extra_fields or [])]
    if infos and all(infos):
        for key in infos[0]:
            non_tensor[key] = np.array([i.get(key, math.nan) for i in infos], dtype=float)
    dp = DataProto.from_dict(tensors=tensors, non_tensors=non_tensor or None)
    if not keep.all() and keep.any():
        dp = dp.select_idxs(keep)
    out = batch_metrics(dp)
    out.update(compute_variance_proxy_metrics(batch=dp, gradient_norm=grad_norm))
    out.update(sync)
    return out


class RecipeRun:
    """``progress.json`` and the metric files when the recipe launched the run (``OTB_TIR_OUTPUT_DIR``)."""

    def __init__(self, out: str, loggers: list[str], resume: bool) -> None:
        from pathlib import Path

        from otb_tir.trainer.logging import MetricsLogger
        from otb_tir.verl.hooks import Progress

        self.progress = Progress(Path(out) / "progress.json")
        self.progress.write("init")
        self.sink = MetricsLogger(
            Path(out), loggers=sorted({"jsonl", *loggers} - {"console"}), plot_every=1, resume=resume
        )
        self._rewind = resume  # the first row of a resumed run decides what the killed run's rows keep

    def log(self, metrics: dict, step: int, *, before_fit: bool = False, provisional: bool = False) -> None:
        """One row of ``metrics.jsonl`` (and TensorBoard, the curves). A resumed run restarts at its
        checkpoint's step k: its first row drops the killed run's rows past k (steps it re-does; in
        TensorBoard too), and the validation verl runs before resuming the loop, at step k, is not
        logged again when step k already has its row (every step once; verl logs it a second time).
        ``provisional``: a step's row logged before its checkpoint, replaced by the full one
        (:meth:`MetricsLogger.log`)."""
        if self._rewind:
            self._rewind = False
            self.sink.truncate(step if before_fit else step - 1)
            if before_fit and any(h["step"] == step for h in self.sink.history):
                return
        self.sink.log(metrics, step=step, provisional=provisional)

    @classmethod
    def from_env(cls) -> "RecipeRun | None":
        out = os.environ.get("OTB_TIR_OUTPUT_DIR")
        if not out:
            return None
        loggers = [x for x in os.environ.get("OTB_TIR_LOGGERS", "jsonl,tensorboard").split(",") if x]
        return cls(out, loggers, resume=os.environ.get("OTB_TIR_RESUME") == "1")
