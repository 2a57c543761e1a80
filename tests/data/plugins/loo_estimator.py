"""A user's own advantage estimator, outside the project (named by path:
``algorithm.adv_estimator=code/loo_estimator.py:leave_one_out``).

Leave-one-out: each sample's baseline is the mean score of the other samples of its group; the
advantage is spread over the sample's policy tokens. Every call appends one JSON line to
``$EST_LOG`` (pid, batch shape, the keywords it was given): its own record of the calls.
"""

import json
import os

import torch


def leave_one_out(token_level_rewards, response_mask, index, **kwargs):
    path = os.environ.get("EST_LOG")
    if path:
        with open(path, "a") as f:
            record = {"pid": os.getpid(), "shape": list(token_level_rewards.shape), "keys": sorted(kwargs)}
            f.write(json.dumps(record) + "\n")
    scores = token_level_rewards.sum(-1)
    ids = {}
    group = torch.tensor([ids.setdefault(str(u), len(ids)) for u in index])
    total = torch.zeros(len(ids), dtype=scores.dtype).index_add_(0, group, scores)
    count = torch.zeros(len(ids), dtype=scores.dtype).index_add_(0, group, torch.ones_like(scores))
    others = (count[group] - 1).clamp(min=1)
    baseline = torch.where(count[group] > 1, (total[group] - scores) / others, torch.zeros_like(scores))
    advantages = (scores - baseline).unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages
