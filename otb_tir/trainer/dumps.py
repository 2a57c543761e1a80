"""Every step's trajectories on disk (``trainer.rollout_data_dir``, verl's name): what the policy
wrote, what the tools answered, and what the estimator did to each token.

One Apache Parquet file per dumped step, ``<dir>/step_000012.parquet``, one row per trajectory:
columnar and compressed (zstd; a token column of floats costs ~3 bytes a token, where verl's JSONL
dumps the text alone), typed (list columns of int32 / float32, not strings of numbers) and read
whole or by column with ``pyarrow.parquet.read_table`` / ``pandas.read_parquet`` (:func:`read_step`) — the columns a
question needs without parsing the rest.

Per trajectory (:data:`TRAJECTORY_COLUMNS`): the step, the policy version that sampled it (the
number of updates its weights had seen: one less than the step when one step off-policy), the uid
(one per prompt: the group), the sample index, data source and ground truth, the prompt's token ids,
the conversation (``messages``, JSON), each assistant turn (``turns``, JSON: its text, its finish
reason, its tool calls with name, arguments, result, ok and error kind), the reward and its parts,
the finish reason and the episode's counts. Per token of the response (:data:`TOKEN_COLUMNS`,
lists as long as ``response_ids``): the id, the policy-or-tool mask, the rollout's log-prob, the
old log-prob and Σπ² the estimator saw, the cumulative path-variance proxy ``W_t`` (TIR-OTB's:
policy tokens only, ρ² applied when IS weights exist), the reward-to-go ``G_t``, the baseline
``B_t = G_t − A_t`` on policy tokens (the estimator's own for OTB; for an estimator that scales
advantages — GRPO's std — the baseline that scaling implies), the advantage ``A_t``, the loss mask
after the filters and the IS weight (NaN without one).

Bounded: every ``rollout_data_every`` steps (and the last), and no more files once the folder holds
``rollout_data_max_bytes`` (a warning names the step). Under torchrun the rows of every rank are
gathered and rank 0 writes them, in the one-process row order.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)

__all__ = ["DumpSettings", "StepDumper", "TOKEN_COLUMNS", "TRAJECTORY_COLUMNS", "read_step"]

DUMP_VERSION = 1
TRAJECTORY_COLUMNS = (
    "step",
    "policy_version",
    "uid",
    "sample_index",
    "data_source",
    "ground_truth",
    "prompt_ids",
    "messages",
    "turns",
    "reward",
    "reward_details",
    "finish_reason",
    "num_turns",
    "num_tool_calls",
    "tool_errors",
    "malformed_calls",
    "void_turns",
)
TOKEN_COLUMNS = (
    "response_ids",
    "response_mask",
    "rollout_log_probs",
    "old_log_probs",
    "sum_pi_squared",
    "path_weight",
    "returns",
    "baseline",
    "advantages",
    "loss_mask",
    "is_weights",
)


@dataclass(frozen=True)
class DumpSettings:
    """``trainer.rollout_data_*``: the folder (None: no dumps), every how many steps, the byte bound."""

    dir: Path | None = None
    every: int = 1
    max_bytes: int = 1 << 30


def _json(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


def _rows(
    trajectories: Sequence[Any], tensors: dict[str, torch.Tensor], step: int, policy_version: int
) -> dict[str, list]:
    """The step's columns: one entry per trajectory, the token columns cut to each response's length."""
    cols: dict[str, list] = {c: [] for c in (*TRAJECTORY_COLUMNS, *TOKEN_COLUMNS)}
    for i, t in enumerate(trajectories):
        n = len(t.response_ids)
        cols["step"].append(step)
        cols["policy_version"].append(policy_version)
        cols["uid"].append(str(t.uid))
        cols["sample_index"].append(int(t.sample_index))
        cols["data_source"].append(t.data_source)
        cols["ground_truth"].append(None if t.ground_truth is None else str(t.ground_truth))
        cols["prompt_ids"].append([int(x) for x in t.prompt_ids])
        cols["messages"].append(_json(t.messages))
        cols["turns"].append(_json([dataclasses.asdict(turn) for turn in t.turns]))
        cols["reward"].append(float(t.reward))
        cols["reward_details"].append(_json(t.reward_details))
        cols["finish_reason"].append(str(t.finish_reason))
        for key in ("num_turns", "num_tool_calls", "tool_errors", "malformed_calls", "void_turns"):
            cols[key].append(int(getattr(t, key)))
        cols["response_ids"].append([int(x) for x in t.response_ids])
        cols["response_mask"].append([int(x) for x in t.response_mask])
        for key in TOKEN_COLUMNS[2:]:
            cols[key].append(tensors[key][i, :n].tolist())
    return cols


def token_tensors(batch: Any, old: Any, adv: Any) -> dict[str, torch.Tensor]:
    """The per-token ``[b, R]`` columns of a step from its batch, old statistics and advantages."""
    from otb_tir.advantage_otb import returns_and_path_weights

    mask = batch["response_mask"].float()
    is_w = adv.rollout_is_weights
    # G_t = Σ_{j ≥ t} r_j·mask_j and W_t, as the OTB estimators compute them
    returns, weights = returns_and_path_weights(
        batch["token_level_rewards"], mask, old.log_probs, old.sum_pi_squared, is_w
    )
    a = adv.advantages.float()
    return {
        "rollout_log_probs": batch["rollout_log_probs"].float(),
        "old_log_probs": old.log_probs.float(),
        "sum_pi_squared": old.sum_pi_squared.float(),
        "path_weight": weights,
        "returns": returns,
        "baseline": (returns - a) * mask,
        "advantages": a,
        "loss_mask": adv.loss_mask.float(),
        "is_weights": is_w.float() if is_w is not None else torch.full_like(mask, math.nan),
    }


class StepDumper:
    """Writes a step's rows when it is due (:meth:`due`), within the byte bound."""

    def __init__(self, settings: DumpSettings, total_steps: int, writer: bool = True):
        self.settings, self.total_steps = settings, total_steps
        self.dir = settings.dir
        self.full = False  # the writer's: the bound was reached (the others keep gathering on due steps)
        if self.dir is not None and writer:
            self.dir.mkdir(parents=True, exist_ok=True)

    def bytes_written(self) -> int:
        return sum(p.stat().st_size for p in self.dir.glob("step_*.parquet")) if self.dir is not None else 0

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is dumped: every ``every`` steps and the last (the byte bound is
        the writer's, in :meth:`write`)."""
        s = self.settings
        if self.dir is None or s.every <= 0:
            return False
        return step % s.every == 0 or step == self.total_steps

    def write(self, step: int, trajectories: Sequence[Any], tensors: dict[str, torch.Tensor], policy_version: int):
        """The step's file (written whole under a temporary name, then renamed), or None when the
        folder is full (a warning, once)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self.full:
            return None
        used = self.bytes_written()
        if used >= self.settings.max_bytes:
            self.full = True
            log.warning(
                "trainer.rollout_data_max_bytes: %s holds %d bytes (the bound is %d): no dumps from step %d on",
                self.dir,
                used,
                self.settings.max_bytes,
                step,
            )
            return None
        cols = _rows(trajectories, tensors, step, policy_version)
        floats = pa.list_(pa.float32())
        types = {
            "prompt_ids": pa.list_(pa.int32()),
            "response_ids": pa.list_(pa.int32()),
            "response_mask": pa.list_(pa.int8()),
            **{k: floats for k in TOKEN_COLUMNS[2:]},
        }
        table = pa.table({k: pa.array(v, type=types.get(k)) for k, v in cols.items()})
        table = table.replace_schema_metadata({"otb_tir_dump_version": str(DUMP_VERSION)})
        path = self.dir / f"step_{step:06d}.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(table, tmp, compression="zstd")
        tmp.replace(path)
        return path


def read_step(path: str | Path) -> list[dict[str, Any]]:
    """A dumped step's trajectories, one dict each (``messages``, ``turns`` and ``reward_details``
    decoded from JSON); ``pandas.read_parquet(path)`` reads the same file as a DataFrame."""
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    for row in rows:
        for key in ("messages", "turns", "reward_details"):
            row[key] = json.loads(row[key])
    return rows
