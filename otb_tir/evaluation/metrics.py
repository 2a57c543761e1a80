"""Evaluation figures of a set of episodes: accuracy (mean@n, unbiased pass@k), tool use, error
kinds, turns, void turns, tool-token share, response lengths and finish reasons.

Every figure is a plain float keyed by a flat name (``accuracy/pass@2``, ``tools/call_rate``,
``errors/syntax_error``…). The tool-use names shared with training come from
:func:`otb_tir.metrics.trajectory_metrics`, so a training curve and an evaluation report
use the same definitions.

Definitions (an *episode* is one sampled trajectory; a *call* is one parsed tool call, malformed or not):

- ``accuracy/mean@n``: share of correct episodes (``reward_details["correct"]``), i.e. the mean over
  problems of c/n. ``accuracy/pass@k``: mean over problems of the unbiased estimator
  1 - C(n-c, k)/C(n, k) (Chen et al. 2021).
- ``tools/*`` and ``errors/*``: the tool-use figures of :mod:`agent_env.tool_metrics` (one
  definition for training, evaluation and verl: ``tools/success_rate`` = ok / (ok + failed), calls
  written on the last allowed turn are ``tools/not_executed``, neither ok nor failed), plus
  ``tools/by_name/<name>`` (calls per tool name).
- ``turns/mean`` and ``turns/hist/<t>`` (share of episodes with t assistant turns).
- ``episode/void_turn_rate``: share of episodes with at least one void turn (neither a call nor an
  answer); ``episode/void_turns_per_turn``: void turns / all turns.
- ``response/tool_token_share``: response tokens inserted by the environment (mask 0) / all
  response tokens, summed over episodes.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from agent_env import Trajectory
from agent_env.tool_metrics import ERROR_KINDS, SHOWN_ERROR_KINDS, calls_of, classify_call
from otb_tir.metrics import trajectory_metrics

__all__ = [
    "pass_at_k",
    "classify_call",
    "ERROR_KINDS",
    "ISSUE_ERROR_KINDS",
    "is_correct",
    "figures",
    "group_figures",
    "episode_record",
]

#: the kinds the report always shows (zero when absent); the definitions live in agent_env.tool_metrics
ISSUE_ERROR_KINDS = SHOWN_ERROR_KINDS


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct out of ``n`` samples:
    ``1 - C(n-c, k) / C(n, k)``, computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (no huge binomials)."""
    if not (isinstance(n, (int, np.integer)) and isinstance(c, (int, np.integer)) and isinstance(k, (int, np.integer))):
        raise TypeError(f"pass_at_k needs integers, got n={n!r}, c={c!r}, k={k!r}")
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def is_correct(t: Trajectory) -> bool:
    return bool(t.reward_details.get("correct", False))


def figures(trajs: Sequence[Trajectory], pass_k: Iterable[int] = (1,), group_key: str = "uid") -> dict[str, float]:
    """Every evaluation figure of ``trajs`` (see the module docstring). Problems are the groups of
    equal ``group_key`` (the uid shared by the n samples of a prompt)."""
    if not trajs:
        return {}
    out: dict[str, float] = {}
    base = trajectory_metrics(trajs)
    n_ep = len(trajs)
    groups: dict[Any, list[bool]] = defaultdict(list)
    for t in trajs:
        groups[getattr(t, group_key)].append(is_correct(t))
    out["problems"] = float(len(groups))
    out["episodes"] = float(n_ep)
    out["accuracy/mean@n"] = float(np.mean([is_correct(t) for t in trajs]))
    for k in pass_k:
        vals = []
        for key, cs in groups.items():
            if k > len(cs):
                raise ValueError(f"pass@{k} needs k <= samples per problem; problem {key!r} has {len(cs)}")
            vals.append(pass_at_k(len(cs), sum(cs), int(k)))
        out[f"accuracy/pass@{k}"] = float(np.mean(vals))
    out["accuracy/any_correct"] = float(np.mean([any(cs) for cs in groups.values()]))
    out["reward/mean"] = base["reward/mean"]

    calls = [c for t in trajs for c in calls_of(t)]
    out.update({k: v for k, v in base.items() if k.startswith(("tools/", "errors/", "reward/errors/"))})
    for name, count in sorted(Counter(c.name or "<none>" for c in calls).items()):
        out[f"tools/by_name/{name}"] = float(count)

    turns = np.array([t.num_turns for t in trajs], dtype=float)
    out["turns/mean"] = float(turns.mean())
    out["turns/max"] = float(turns.max())
    for value, count in sorted(Counter(int(x) for x in turns).items()):
        out[f"turns/hist/{value}"] = count / n_ep
    n_turns = int(turns.sum())
    out["episode/void_turn_rate"] = base["episode/void_turn_rate"]
    out["episode/void_turns_per_turn"] = sum(t.void_turns for t in trajs) / n_turns if n_turns else math.nan
    out["episode/template_mismatch_rate"] = base["episode/template_mismatch_rate"]

    lengths = np.array([len(t.response_ids) for t in trajs], dtype=float)
    out["response/tool_token_share"] = base["response/tool_token_share"]
    out["response/length_mean"] = float(lengths.mean())
    out["response/length_p50"] = float(np.percentile(lengths, 50))
    out["response/length_p90"] = float(np.percentile(lengths, 90))
    out["response/length_max"] = float(lengths.max())
    out["response/policy_tokens_mean"] = base["response/policy_tokens_mean"]
    out.update({k: v for k, v in base.items() if k.startswith("finish/")})
    return out


def group_figures(
    trajs: Sequence[Trajectory], labels: Sequence[str], pass_k: Iterable[int]
) -> dict[str, dict[str, float]]:
    """:func:`figures` per label (e.g. data source); ``labels[i]`` belongs to ``trajs[i]``."""
    if len(labels) != len(trajs):
        raise ValueError(f"{len(labels)} labels for {len(trajs)} trajectories")
    by: dict[str, list[Trajectory]] = defaultdict(list)
    for t, label in zip(trajs, labels):
        by[str(label)].append(t)
    return {label: figures(ts, pass_k) for label, ts in sorted(by.items())}


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    parts = [m.get("content", "") for m in prompt if isinstance(m, Mapping) and m.get("role") != "system"]
    return "\n".join(str(p) for p in parts)


def episode_record(t: Trajectory, item: Mapping[str, Any], problem_index: int) -> dict[str, Any]:
    """One JSON-ready record: prompt, turns (text), tool calls, answer, correct, finish reason."""
    return {
        "problem_index": problem_index,
        "sample_index": t.sample_index,
        "data_source": str(item.get("data_source", "unknown")),
        "prompt": _prompt_text(item.get("prompt", "")),
        "ground_truth": None if t.ground_truth is None else str(t.ground_truth),
        "turns": [
            {
                "text": tr.text,
                "void": tr.void,
                "has_answer": tr.has_answer,
                "engine_finish_reason": tr.engine_finish_reason,
                "tool_calls": [
                    {
                        "name": c.name,
                        "arguments": c.arguments,
                        "ok": c.ok,
                        "error": c.error,
                        "error_kind": classify_call(c),
                        "executed": c.executed,
                        "truncated": c.truncated,
                        "result": c.text,
                        "latency_ms": round(c.latency_ms, 3),
                    }
                    for c in tr.tool_calls
                ],
            }
            for tr in t.turns
        ],
        "answer": t.reward_details.get("extracted"),
        "correct": is_correct(t),
        "reward": t.reward,
        "finish_reason": t.finish_reason,
        "num_turns": t.num_turns,
        "response_tokens": len(t.response_ids),
        "tool_tokens": len(t.response_ids) - sum(t.response_mask),
        "template_mismatch": t.template_mismatch,
    }
