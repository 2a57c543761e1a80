"""benchmarks/bench_scale.py's reward: a seeded uniform number in [0, 1) per sample, the same function in
both trainers (ours as ``reward.name=<this file>:random_reward``, TRL through ``bench_peers.make_reward``
on the same decoded text).

Random weights never solve a problem, so a correctness reward would be 0 for every sample: every group's
advantages 0, and a trainer that skips such batches (or their backward) would do less work than the
other. A hash of (seed, ground truth, what the model wrote) is deterministic — the same sample always
gets the same reward — and differs from sample to sample, so every group has a spread and both
trainers run the full update. The seed is ``$OTB_BENCH_SCALE_SEED`` (default 0), which bench_scale sets
for both trainers' processes. Only the standard library: the reward registry loads this file by path.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

SEED_ENV = "OTB_BENCH_SCALE_SEED"


def random_reward(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None, **_: Any) -> float:
    """U[0, 1) from blake2b of the seed, the ground truth and the sample's text (verl's reward signature)."""
    key = "\0".join((os.environ.get(SEED_ENV, "0"), str(ground_truth), solution_str))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2.0**64
