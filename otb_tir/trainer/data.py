"""A restorable data cursor: shuffled epochs over prompt items, deterministic in the seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from otb_tir import ConfigError


@dataclass
class DataCursor:
    """Yields batches of items; ``state()``/``load_state()`` make a resumed run see the same data."""

    items: Sequence[dict[str, Any]]
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        if not self.items:
            raise ConfigError("the training set is empty: check data.train_files / data.train_size")
        if self.batch_size > len(self.items):
            raise ConfigError(
                f"data.train_batch_size ({self.batch_size}) exceeds the number of training prompts ({len(self.items)})"
            )

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.items))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.items))

    def next_batch(self) -> list[dict[str, Any]]:
        if self.position + self.batch_size > len(self.items):
            self.epoch += 1
            self.position = 0
        idx = self._order()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [self.items[i] for i in idx]

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
