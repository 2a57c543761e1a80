"""verl ``reward.custom_reward_function``: the run's reward, in verl's reward workers.

Our agent loop scores its own trajectories (by the reward section's functions, resolved in the
agent-loop worker: :class:`agent_env.rewards.RewardScorer`), so verl's reward workers only call
this for rows another agent loop ran. They then get the *same* functions: the launcher puts the
run's reward section and task in :data:`REWARD_ENV` (every Ray worker's environment), and
:func:`compute_score` scores with a :class:`~agent_env.rewards.RewardScorer` built from it —
bounded, per data source, the user's ``custom_reward_function`` included. Without the variable
(this file named in a hand-written verl config) it is the math reward.

``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`` returns
``{"score": reward, "acc": 0/1, "reward_error_<kind>": 0/1 ...}`` (the same keys for every row,
as verl's reward extra info needs).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from agent_env.rewards import ERROR_KINDS, RewardScorer

REWARD_ENV = "OTB_TIR_REWARD"  # JSON: {"reward": <reward section>, "task": <data.task>}

_lock = threading.Lock()
_scorers: dict[str, RewardScorer] = {}


def scorer_from_env() -> RewardScorer:
    """The scorer of :data:`REWARD_ENV` (built once per process and value)."""
    raw = os.environ.get(REWARD_ENV, "")
    with _lock:
        if raw not in _scorers:
            from agent_env.math_task.reward import RewardConfig
            from agent_env.tasks import get_task

            spec = json.loads(raw) if raw else {}
            task = get_task(spec["task"]) if spec.get("task") else None
            _scorers[raw] = RewardScorer(
                RewardConfig(**spec.get("reward", {})),
                default=task.reward if task else None,
                extract=task.extract_answer if task else None,
            )
        return _scorers[raw]


async def compute_score(
    data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> dict[str, float]:
    res = await scorer_from_env().score_row(data_source, solution_str, ground_truth, extra_info)
    kind = res.details.get("reward_error")
    return {
        "score": float(res.reward),
        "acc": float(bool(res.correct)),
        **{f"reward_error_{k}": float(kind == k) for k in ERROR_KINDS},
    }
