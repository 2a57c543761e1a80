"""What the tests that walk a user's path share (tests/recipes/test_user_tools.py,
tests/recipes/test_user_plugins.py): a one-step training run's settings and a reader of the JSON-lines
logs the users' plugins write."""

from __future__ import annotations

import json
from pathlib import Path

#: One training step of 2 prompts × 2 samples, 2 held-out problems after, metrics to JSONL only.
TRAIN = [
    "trainer.total_steps=1",
    "data.train_size=8",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    "eval.size=2",
    "eval.before=false",
    "rollout.response_length=192",
    "rollout.max_tokens_per_turn=48",
    "multi_turn.max_assistant_turns=3",
    "trainer.loggers=[jsonl]",
    "trainer.save_every=0",
]


def read_log(path: Path) -> list[dict]:
    """The records of a plugin's JSON-lines log (none when it was never written)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
