"""The stepped tasks: problems solved by dependent calculator steps, each on the previous step's
result (``Problem.steps``, ``{r}`` standing for that result).

* ``chain`` (``data.task=chain``): two steps, an intermediate the model cannot guess (a 5-7 digit
  product or a power), then one operation on it;
* ``multistep`` (``data.task=multistep``): three or four steps (four or five assistant turns with
  the answer), so episodes are longer and vary in length; the task's episode settings give it the
  turns and the token budget (:data:`agent_env.tasks.MULTISTEP`).

The whole computation is also one expression (``Problem.expression``), so an answer can be checked
exactly; ``tests/agent_env/test_data.py`` checks every kind against a step-by-step evaluation.
"""

from __future__ import annotations

import random
from typing import Callable

from agent_env.math_task.problem import Problem, fmt, pick

# --- the chain task: two dependent computations ------------------------------------------------
# Each problem chains two calculator steps: the first computes an intermediate the model cannot
# guess (a 5-7 digit product or a power), the second applies an operation to that result. The
# warm start's traces make one call per step, copying the first call's output into the second.
# The whole chain is also one expression (``expression``), so an answer can be checked exactly.

CHAIN_DATA_SOURCE = "otb_tir/chain"


def _gen_chain_add(rng: random.Random) -> Problem:
    a, b, c = rng.randint(100, 999), rng.randint(12, 99), rng.randint(100, 9999)
    q = pick(
        rng,
        [
            f"A shop sells {a} boxes with {b} pens in each box, then {c} loose pens. How many pens does it sell?",
            f"Compute {a} times {b}, then add {c} to the result.",
        ],
    )
    return Problem("chain_add", q, f"{a}*{b}+{c}", fmt(a * b + c), f"chain_add:{a}:{b}:{c}", (f"{a}*{b}", f"{{r}}+{c}"))


def _gen_chain_sub(rng: random.Random) -> Problem:
    a, b = rng.randint(5, 29), rng.randint(3, 6)
    c = rng.randint(10, min(9999, a**b - 1))
    q = pick(
        rng,
        [
            f"A colony starts from one cell and grows {a} times larger every hour for {b} hours, "
            f"then {c} cells die. How many cells are left?",
            f"Compute {a} to the power of {b}, then subtract {c} from the result.",
        ],
    )
    return Problem(
        "chain_sub", q, f"{a}**{b}-{c}", fmt(a**b - c), f"chain_sub:{a}:{b}:{c}", (f"{a}**{b}", f"{{r}}-{c}")
    )


def _gen_chain_div(rng: random.Random) -> Problem:
    d = rng.randint(13, 97)
    a = d * rng.randint(11, 99)  # a*b is divisible by d
    b = rng.randint(12, 99)
    q = pick(
        rng,
        [
            f"A farm packs {a} crates with {b} apples in each crate and shares the apples equally "
            f"among {d} stores. How many apples does each store get?",
            f"Compute {a} times {b}, then divide the result by {d}.",
        ],
    )
    return Problem(
        "chain_div", q, f"{a}*{b}/{d}", fmt(a * b // d), f"chain_div:{a}:{b}:{d}", (f"{a}*{b}", f"{{r}}/{d}")
    )


def _gen_chain_mod(rng: random.Random) -> Problem:
    a, b, m = rng.randint(100, 9999), rng.randint(12, 999), rng.randint(7, 97)
    q = pick(
        rng,
        [
            f"Compute {a} times {b}, then find the remainder when the result is divided by {m}.",
            f"Compute {a} times {b}, then take the result modulo {m}.",
        ],
    )
    return Problem(
        "chain_mod", q, f"({a}*{b}) % {m}", fmt(a * b % m), f"chain_mod:{a}:{b}:{m}", (f"{a}*{b}", f"{{r}} % {m}")
    )


CHAIN_GENERATORS: dict[str, Callable[[random.Random], Problem]] = {
    "chain_add": _gen_chain_add,
    "chain_sub": _gen_chain_sub,
    "chain_div": _gen_chain_div,
    "chain_mod": _gen_chain_mod,
}
CHAIN_KINDS = tuple(CHAIN_GENERATORS)


# --- the multistep task: three or four dependent computations -----------------------------------
# Each step's result is a number the model cannot guess; the warm start's traces make one call per
# step, copying the previous call's output into the next. Its ``stop_early`` traces stop after a
# random step before the last and box that intermediate (wrong), so RL has steps left to learn.

MULTISTEP_DATA_SOURCE = "otb_tir/multistep"


def _stepped(kind: str, question: str, expression: str, key: str, steps: tuple[str, ...], values: list[int]):
    """The problem, or None when it is degenerate: an answer of 0, or an intermediate result equal
    to the answer (stopping early would then be right). ``values``: each step's result."""
    if values[-1] == 0 or values[-1] in values[:-1]:
        return None
    return Problem(kind, question, expression, fmt(values[-1]), key, steps)


def _redraw(gen: Callable[[random.Random], Problem | None]) -> Callable[[random.Random], Problem]:
    """A generator that draws again (same RNG stream, so still deterministic) until it is not degenerate."""

    def draw(rng: random.Random) -> Problem:
        while (problem := gen(rng)) is None:
            pass
        return problem

    draw.__name__ = gen.__name__
    return draw


@_redraw
def _gen_ms_add_mod(rng: random.Random) -> Problem | None:
    a, b, c, m = rng.randint(100, 9999), rng.randint(12, 999), rng.randint(100, 9999), rng.randint(7, 97)
    q = pick(
        rng,
        [
            f"Compute {a} times {b}, then add {c}, then take the result modulo {m}.",
            f"A shop sells {a} boxes with {b} pens in each box and {c} loose pens, then packs all the pens "
            f"in cartons of {m}. How many pens are left over?",
        ],
    )
    steps = (f"{a}*{b}", f"{{r}}+{c}", f"{{r}} % {m}")
    values = [a * b, a * b + c, (a * b + c) % m]
    return _stepped("ms_add_mod", q, f"({a}*{b}+{c}) % {m}", f"ms_add_mod:{a}:{b}:{c}:{m}", steps, values)


@_redraw
def _gen_ms_sub_div(rng: random.Random) -> Problem | None:
    a, b, d = rng.randint(5, 29), rng.randint(3, 6), rng.randint(13, 97)
    c = rng.randint(10, min(9999, a**b - 1 - d))
    c += (a**b - c) % d  # a**b - c is divisible by d
    q = pick(
        rng,
        [
            f"Compute {a} to the power of {b}, then subtract {c}, then divide the result by {d}.",
            f"A colony grows {a} times larger every hour for {b} hours from one cell, then {c} cells die and "
            f"the rest are split equally among {d} dishes. How many cells does each dish get?",
        ],
    )
    steps = (f"{a}**{b}", f"{{r}}-{c}", f"{{r}}/{d}")
    values = [a**b, a**b - c, (a**b - c) // d]
    return _stepped("ms_sub_div", q, f"({a}**{b}-{c})/{d}", f"ms_sub_div:{a}:{b}:{c}:{d}", steps, values)


@_redraw
def _gen_ms_mul_sub(rng: random.Random) -> Problem | None:
    a, b, c = rng.randint(100, 999), rng.randint(12, 99), rng.randint(3, 9)
    e = rng.randint(100, min(9999, a * b * c - 1))
    q = pick(
        rng,
        [
            f"Compute {a} times {b}, then multiply the result by {c}, then subtract {e}.",
            f"A farm has {a} rows of {b} trees, each tree gives {c} baskets of fruit, and {e} baskets are sold. "
            f"How many baskets are left?",
        ],
    )
    steps = (f"{a}*{b}", f"{{r}}*{c}", f"{{r}}-{e}")
    values = [a * b, a * b * c, a * b * c - e]
    return _stepped("ms_mul_sub", q, f"{a}*{b}*{c}-{e}", f"ms_mul_sub:{a}:{b}:{c}:{e}", steps, values)


@_redraw
def _gen_ms_four_mod(rng: random.Random) -> Problem | None:
    a, b, c = rng.randint(100, 9999), rng.randint(12, 999), rng.randint(100, 9999)
    d, m = rng.randint(3, 9), rng.randint(101, 997)
    q = f"Compute {a} times {b}, then add {c}, then multiply the result by {d}, then take it modulo {m}."
    steps = (f"{a}*{b}", f"{{r}}+{c}", f"{{r}}*{d}", f"{{r}} % {m}")
    values = [a * b, a * b + c, (a * b + c) * d, (a * b + c) * d % m]
    key = f"ms_four_mod:{a}:{b}:{c}:{d}:{m}"
    return _stepped("ms_four_mod", q, f"(({a}*{b}+{c})*{d}) % {m}", key, steps, values)


@_redraw
def _gen_ms_four_pow(rng: random.Random) -> Problem | None:
    a, b, c = rng.randint(5, 29), rng.randint(3, 6), rng.randint(100, 9999)
    m, d = rng.randint(101, 997), rng.randint(3, 9)
    q = f"Compute {a} to the power of {b}, then add {c}, then take the result modulo {m}, then multiply it by {d}."
    steps = (f"{a}**{b}", f"{{r}}+{c}", f"{{r}} % {m}", f"{{r}}*{d}")
    values = [a**b, a**b + c, (a**b + c) % m, (a**b + c) % m * d]
    key = f"ms_four_pow:{a}:{b}:{c}:{m}:{d}"
    return _stepped("ms_four_pow", q, f"(({a}**{b}+{c}) % {m})*{d}", key, steps, values)


MULTISTEP_GENERATORS: dict[str, Callable[[random.Random], Problem]] = {
    "ms_add_mod": _gen_ms_add_mod,
    "ms_sub_div": _gen_ms_sub_div,
    "ms_mul_sub": _gen_ms_mul_sub,
    "ms_four_mod": _gen_ms_four_mod,
    "ms_four_pow": _gen_ms_four_pow,
}
MULTISTEP_KINDS = tuple(MULTISTEP_GENERATORS)
