"""The built-in math task: a deterministic generator of word problems with exact answers, and a
loader for verl-format parquet files.

Every item is a dict in verl's RL-dataset format::

    {"data_source": "otb_tir/arith",
     "prompt": [{"role": "user", "content": "..."}],
     "reward_model": {"style": "rule", "ground_truth": "56088"},
     "extra_info": {"split": "train", "index": 0, "kind": "mul", "expression": "123*456",
                    "question": "..."},
     "agent_name": "tool_agent"}

``extra_info["expression"]`` is a calculator/sympy expression whose value is the answer (the
calculator tool can evaluate it as is; Python can too, except ``sqrt``). Problems are sized so a
tool call clearly helps a tiny model: 3-5 digit products, 4-5 digit sums, large powers, modular
arithmetic on big numbers, fractions and small equations. The stepped tasks ``chain`` and
``multistep`` (:mod:`agent_env.math_task.chains`) go through the same splits and format, with the
calculator steps in ``extra_info["steps"]``.

Train and held-out problems are disjoint *by construction*: each candidate problem is assigned to
a split by a hash of its canonical key (kind + numbers), independently of the seed, so no seed of
``make_split("train", ...)`` can ever produce a problem that ``make_split("test", ...)`` can.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterable

from agent_env.errors import EnvError
from agent_env.math_task.chains import (
    CHAIN_DATA_SOURCE,
    CHAIN_GENERATORS,
    CHAIN_KINDS,
    MULTISTEP_DATA_SOURCE,
    MULTISTEP_GENERATORS,
    MULTISTEP_KINDS,
)
from agent_env.math_task.problem import Problem, fmt, pick

logger = logging.getLogger(__name__)

DATA_SOURCE = "otb_tir/arith"
AGENT_NAME = "tool_agent"
SPLITS = ("train", "test")
#: share of the hash space that belongs to the held-out split (in percent)
TEST_PERCENT = 20

INSTRUCTION = "Put the final answer in \\boxed{}."


# --- one generator per kind -------------------------------------------------------------------
# Each takes an RNG and returns a Problem. Phrasings are short and fixed-shape so a tiny model can
# learn to copy the numbers into a tool call.


def _gen_mul(rng: random.Random) -> Problem:
    a = rng.randint(100, 9999)
    b = rng.randint(12, 999)
    q = pick(
        rng,
        [
            f"A farm packs {a} crates with {b} apples in each crate. How many apples are packed in total?",
            f"A factory makes {a} boxes and puts {b} screws in each box. How many screws does it use?",
            f"A theater sells {a} tickets at {b} dollars each. How many dollars does it take in?",
            f"What is {a} times {b}?",
        ],
    )
    return Problem("mul", q, f"{a}*{b}", fmt(a * b), f"mul:{a}:{b}")


def _gen_add(rng: random.Random) -> Problem:
    a = rng.randint(10000, 99999)
    b = rng.randint(1000, 99999)
    c = rng.randint(1000, a + b - 1)
    q = pick(
        rng,
        [
            f"A library had {a} books, bought {b} more and gave away {c}. How many books does it have now?",
            f"A tank holds {a} liters. {b} liters are added and {c} liters are drained. How many liters are left?",
            f"What is {a} plus {b} minus {c}?",
        ],
    )
    return Problem("add", q, f"{a}+{b}-{c}", fmt(a + b - c), f"add:{a}:{b}:{c}")


def _gen_div(rng: random.Random) -> Problem:
    d = rng.randint(13, 997)
    quotient = rng.randint(101, 9999)
    n = d * quotient
    q = pick(
        rng,
        [
            f"{n} candies are shared equally among {d} children. How many candies does each child get?",
            f"A road of {n} meters is split into {d} equal parts. How many meters long is each part?",
            f"What is {n} divided by {d}?",
        ],
    )
    return Problem("div", q, f"{n}/{d}", fmt(quotient), f"div:{n}:{d}")


def _gen_frac(rng: random.Random) -> Problem:
    while True:
        p, q_ = rng.randint(1, 19), rng.randint(2, 29)
        r, s = rng.randint(1, 19), rng.randint(2, 29)
        if p % q_ and r % s:
            break
    op = rng.choice(["+", "*", "-"])
    x, y = Fraction(p, q_), Fraction(r, s)
    value = x + y if op == "+" else x * y if op == "*" else x - y
    word = {"+": "plus", "*": "times", "-": "minus"}[op]
    q = pick(
        rng,
        [
            f"What is {p}/{q_} {word} {r}/{s}? Give the answer as a reduced fraction.",
            f"Compute {p}/{q_} {op} {r}/{s} as a reduced fraction.",
        ],
    )
    return Problem("frac", q, f"{p}/{q_}{op}{r}/{s}", fmt(value), f"frac:{p}:{q_}:{op}:{r}:{s}")


def _gen_pow(rng: random.Random) -> Problem:
    a = rng.randint(3, 29)
    b = rng.randint(3, 7)
    q = pick(
        rng,
        [
            f"A colony of cells grows {a} times larger every hour, starting from one cell. "
            f"How many cells are there after {b} hours?",
            f"What is {a} to the power of {b}?",
            f"Compute {a}**{b}.",
        ],
    )
    return Problem("pow", q, f"{a}**{b}", fmt(a**b), f"pow:{a}:{b}")


def _gen_mod(rng: random.Random) -> Problem:
    m = rng.randint(7, 97)
    if rng.random() < 0.5:
        a, b = rng.randint(1000, 99999), rng.randint(100, 9999)
        q = pick(
            rng,
            [
                f"What is the remainder when {a} times {b} is divided by {m}?",
                f"Compute ({a}*{b}) mod {m}.",
            ],
        )
        return Problem("mod", q, f"({a}*{b}) % {m}", fmt((a * b) % m), f"modmul:{a}:{b}:{m}")
    a, b = rng.randint(2, 99), rng.randint(5, 30)
    q = pick(
        rng,
        [
            f"What is the remainder when {a} to the power of {b} is divided by {m}?",
            f"Compute ({a}**{b}) mod {m}.",
        ],
    )
    return Problem("mod", q, f"({a}**{b}) % {m}", fmt(pow(a, b, m)), f"modpow:{a}:{b}:{m}")


def _signed(value: int) -> str:
    return f"+ {value}" if value >= 0 else f"- {-value}"


def _gen_linear(rng: random.Random) -> Problem:
    a = rng.randint(3, 99)
    x = rng.randint(-999, 999)
    b = rng.randint(-9999, 9999)
    c = a * x + b
    q = pick(
        rng,
        [
            f"Solve for x: {a}*x {_signed(b)} = {c}.",
            f"Find x if {a}*x {_signed(b)} = {c}.",
        ],
    )
    expr = f"({c} - {b})/{a}" if b >= 0 else f"({c} + {-b})/{a}"
    return Problem("linear", q, expr, fmt(x), f"linear:{a}:{b}:{c}")


def _gen_quadratic(rng: random.Random) -> Problem:
    while True:
        r1, r2 = rng.randint(-60, 60), rng.randint(-60, 60)
        if r1 != r2:
            break
    s, p = r1 + r2, r1 * r2  # x^2 - s x + p = 0
    bx = -s
    lhs = "x**2" + (f" {_signed(bx)}*x" if bx else "") + (f" {_signed(p)}" if p else "")
    q = pick(
        rng,
        [
            f"Find the larger solution of {lhs} = 0.",
            f"What is the largest x with {lhs} = 0?",
        ],
    )
    expr = f"({s} + sqrt(({s})**2 - 4*({p})))/2"
    return Problem("quadratic", q, expr, fmt(max(r1, r2)), f"quadratic:{s}:{p}")


GENERATORS: dict[str, Callable[[random.Random], Problem]] = {
    "mul": _gen_mul,
    "add": _gen_add,
    "div": _gen_div,
    "frac": _gen_frac,
    "pow": _gen_pow,
    "mod": _gen_mod,
    "linear": _gen_linear,
    "quadratic": _gen_quadratic,
}
KINDS = tuple(GENERATORS)


#: The built-in tasks (``data.task``): their problem generators and data source.
TASKS: dict[str, tuple[dict[str, Callable[[random.Random], Problem]], str]] = {
    "arith": (GENERATORS, DATA_SOURCE),
    "chain": (CHAIN_GENERATORS, CHAIN_DATA_SOURCE),
    "multistep": (MULTISTEP_GENERATORS, MULTISTEP_DATA_SOURCE),
}
#: The kinds whose problems are solved in dependent steps (``Problem.steps``).
STEPPED_KINDS = CHAIN_KINDS + MULTISTEP_KINDS


def split_of(key: str) -> str:
    """The split a problem belongs to, from a hash of its canonical key (independent of any seed)."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 100
    return "test" if bucket < TEST_PERCENT else "train"


def to_verl_item(problem: Problem, split: str, index: int, data_source: str = DATA_SOURCE) -> dict[str, Any]:
    """Wrap a :class:`Problem` in verl's RL-dataset dict format."""
    extra = {"steps": list(problem.steps)} if problem.steps else {}
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{problem.question} {INSTRUCTION}"}],
        "reward_model": {"style": "rule", "ground_truth": problem.answer},
        "extra_info": {
            "split": split,
            "index": index,
            "kind": problem.kind,
            "expression": problem.expression,
            "question": problem.question,
            **extra,
        },
        "agent_name": AGENT_NAME,
    }


def _task(task: str) -> tuple[dict[str, Callable[[random.Random], Problem]], str]:
    if task not in TASKS:
        raise EnvError(f"unknown task {task!r}: choose one of {list(TASKS)}")
    return TASKS[task]


def iter_problems(
    split: str, seed: int = 0, kinds: Iterable[str] | None = None, task: str = "arith"
) -> Iterable[Problem]:
    """Endless stream of distinct problems of ``split``, deterministic in ``(split, seed, kinds, task)``."""
    if split not in SPLITS:
        raise EnvError(f"unknown split {split!r}: choose one of {list(SPLITS)}")
    generators, _ = _task(task)
    chosen = list(generators if kinds is None else kinds)
    unknown = [k for k in chosen if k not in generators]
    if unknown or not chosen:
        raise EnvError(f"unknown problem kinds {unknown or chosen!r} for task {task!r}: choose from {list(generators)}")
    # str seeds hash deterministically; the arith task keeps its historical stream
    rng = random.Random(f"otb_tir/arith:{split}:{seed}" if task == "arith" else f"otb_tir/{task}:{split}:{seed}")
    seen: set[str] = set()
    misses = 0
    while True:
        problem = generators[chosen[rng.randrange(len(chosen))]](rng)
        if problem.key in seen or split_of(problem.key) != split:
            misses += 1
            if misses > 100_000:
                raise EnvError(f"cannot generate more distinct {split} problems of kinds {chosen}")
            continue
        misses = 0
        seen.add(problem.key)
        yield problem


def make_split(
    split: str = "train", n: int = 1000, seed: int = 0, kinds: Iterable[str] | None = None, task: str = "arith"
) -> list[dict[str, Any]]:
    """``n`` distinct problems of ``split`` ("train" or "test") of the built-in ``task`` ("arith",
    one computation; "chain", two dependent ones) in verl's dict format.

    Deterministic in ``(split, n, seed, kinds, task)`` (a larger ``n`` extends a smaller one). Train
    and test never share a problem, whatever the seeds.
    """
    if not isinstance(n, int) or n < 0:
        raise EnvError(f"n must be a non-negative int, got {n!r}")
    _, data_source = _task(task)
    items = []
    for index, problem in zip(range(n), iter_problems(split, seed, kinds, task)):
        items.append(to_verl_item(problem, split, index, data_source))
    return items


# --- verl parquet -----------------------------------------------------------------------------

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")


def _check_item(item: dict[str, Any], where: str) -> None:
    prompt = item.get("prompt")
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    ):
        raise EnvError(f"{where}: 'prompt' must be a non-empty list of {{role, content}} messages, got {prompt!r:.200}")
    rm = item.get("reward_model")
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise EnvError(f"{where}: 'reward_model' must be a struct with a 'ground_truth' field, got {rm!r:.200}")


def load_parquet(path: str | Path) -> list[dict[str, Any]]:
    """Read a verl-format parquet file into the same dicts :func:`make_split` returns.

    Requires the columns ``data_source``, ``prompt`` (list of ``{role, content}``) and
    ``reward_model`` (struct with ``ground_truth``); ``extra_info`` and ``agent_name`` are kept
    when present (``extra_info`` defaults to ``{}``, ``agent_name`` to ``"tool_agent"``).
    Raises :class:`EnvError` with the file name and what is missing.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise EnvError(f"dataset file not found: {path}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise EnvError(f"{path} is not a readable parquet file: {exc}") from exc
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise EnvError(
            f"{path} lacks the verl column(s) {missing}; it has {table.column_names}. "
            "Expected data_source, prompt, reward_model (with ground_truth), "
            "extra_info, agent_name (see recipes/prepare_data.py)."
        )
    rows = table.to_pylist()
    for i, row in enumerate(rows):
        if isinstance(row.get("extra_info"), str):  # some producers store it as JSON text
            try:
                row["extra_info"] = json.loads(row["extra_info"])
            except json.JSONDecodeError:
                pass
        if row.get("extra_info") is None:
            row["extra_info"] = {}
        if not row.get("agent_name"):
            row["agent_name"] = AGENT_NAME
        _check_item(row, f"{path} row {i}")
    logger.info("loaded %d rows from %s", len(rows), path)
    return rows


def write_parquet(items: list[dict[str, Any]], path: str | Path) -> Path:
    """Write verl-format dicts to a parquet file (atomically: a temp file then rename)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not items:
        raise EnvError(f"refusing to write an empty dataset to {path}")
    for i, item in enumerate(items):
        _check_item(item, f"item {i}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(items)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path
