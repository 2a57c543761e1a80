"""One generated problem of the built-in tasks (:class:`Problem`), before it is wrapped in verl's
format by :mod:`agent_env.math_task.data`, and the two helpers every generator uses."""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["Problem", "fmt", "pick"]


@dataclass(frozen=True)
class Problem:
    """One generated problem before it is wrapped in verl's format."""

    kind: str
    question: str
    expression: str  # evaluates (sympy) to the answer
    answer: str  # canonical exact answer: an integer or a reduced fraction "p/q"
    key: str  # canonical identity of the problem (kind + numbers), used for the split hash
    #: the stepped tasks' calculator steps (chain: 2, multistep: 3-4): each step after the first
    #: refers to the previous step's result as ``{r}`` (empty for the single-step arith task)
    steps: tuple[str, ...] = ()


def fmt(value: Fraction | int) -> str:
    """The canonical exact answer: an integer, or a reduced fraction ``p/q``."""
    value = Fraction(value)
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def pick(rng: random.Random, options: list[str]) -> str:
    """One of ``options`` (one draw of ``rng``)."""
    return options[rng.randrange(len(options))]
