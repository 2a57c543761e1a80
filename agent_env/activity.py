"""What a batch of episodes spends its time on: an :class:`Activity` profiler shared by the episodes
of one rollout (``agent_env.rollout`` reports its :meth:`~Activity.summary` in the rollout stats)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

__all__ = ["Activity", "tracking"]


class Activity:
    """Counts in-flight generate calls and tool executions over time (see rollout's stats)."""

    def __init__(self) -> None:
        self.gen = 0
        self.tool = 0
        self.last = time.perf_counter()
        self.reward = 0
        self.waiting_on_tools = 0.0  # no generate in flight while some tool runs
        self.generating = 0.0
        self.scoring = 0.0  # the reward function runs, no generate or tool in flight
        self.idle = 0.0  # none of the above: parsing, templating, tokenizing, scheduling

    def _tick(self) -> None:
        now = time.perf_counter()
        dt = now - self.last
        self.last = now
        if self.gen > 0:
            self.generating += dt
        elif self.tool > 0:
            self.waiting_on_tools += dt
        elif self.reward > 0:
            self.scoring += dt
        else:
            self.idle += dt

    def enter(self, kind: str) -> None:
        self._tick()
        setattr(self, kind, getattr(self, kind) + 1)

    def leave(self, kind: str) -> None:
        self._tick()
        setattr(self, kind, getattr(self, kind) - 1)

    def summary(self) -> dict[str, float]:
        self._tick()
        total = self.generating + self.waiting_on_tools + self.scoring + self.idle
        return {
            "generating_s": self.generating,
            "waiting_on_tools_s": self.waiting_on_tools,
            "scoring_s": self.scoring,
            "idle_s": self.idle,
            "gen_waited_on_tools_frac": self.waiting_on_tools / total if total > 0 else 0.0,
        }


@contextlib.contextmanager
def tracking(activity: Activity | None, kind: str) -> Iterator[None]:
    """``activity.enter(kind)`` … ``activity.leave(kind)`` around a block (nothing when ``activity`` is None)."""
    if activity is None:
        yield
        return
    activity.enter(kind)
    try:
        yield
    finally:
        activity.leave(kind)
