"""verl ``reward.custom_reward_function`` for the math task (a fallback: the agent loop scores its
own trajectories, so verl only calls this for rows run by another agent loop).

``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`` returns
``{"score": reward, "acc": 0/1}`` with :func:`agent_env.math_task.reward.math_reward`.
"""

from __future__ import annotations

from typing import Any

from agent_env.math_task.reward import math_reward


def compute_score(
    data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> dict[str, float]:
    res = math_reward(solution_str, ground_truth)
    return {"score": float(res.reward), "acc": float(bool(res.correct))}
