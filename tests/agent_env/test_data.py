"""The built-in math generator: determinism, disjoint splits, answers checked by sympy, parquet IO."""

from __future__ import annotations

import json
from fractions import Fraction

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_env import EnvError
from agent_env.math_task.data import DATA_SOURCE, KINDS, load_parquet, make_split, write_parquet

x = sympy.Symbol("x")


def _sympy_answer(item: dict) -> sympy.Expr:
    """Recompute the answer from the question text itself, independently of the generator's
    arithmetic: equations are solved with sympy.solve, everything else evaluated by sympy."""
    info = item["extra_info"]
    q = info["question"]
    if info["kind"] == "linear":
        eq = q.split(":", 1)[1] if ":" in q else q.split("if", 1)[1]
        lhs, rhs = eq.rstrip(".").split("=")
        (sol,) = sympy.solve(sympy.sympify(lhs) - sympy.sympify(rhs), x)
        return sol
    if info["kind"] == "quadratic":
        eq = q.split(" of ")[-1] if " of " in q else q.split(" with ")[-1]
        lhs = eq.split("=")[0]
        sols = sympy.solve(sympy.sympify(lhs), x)
        assert len(sols) == 2 and all(s.is_integer for s in sols)
        return max(sols)
    return sympy.sympify(info["expression"])


def test_deterministic_and_prefix_stable():
    a = make_split("train", 300, seed=3)
    assert a == make_split("train", 300, seed=3)
    assert make_split("train", 100, seed=3) == a[:100]
    assert a != make_split("train", 300, seed=4)
    assert make_split("test", 50, seed=3) == make_split("test", 50, seed=3)


def test_verl_format_and_distinct():
    items = make_split("test", 400, seed=0)
    keys = set()
    for i, item in enumerate(items):
        assert item["data_source"] == DATA_SOURCE and item["agent_name"] == "tool_agent"
        assert item["prompt"][0]["role"] == "user" and "\\boxed{}" in item["prompt"][0]["content"]
        assert item["reward_model"]["style"] == "rule"
        assert item["extra_info"]["index"] == i and item["extra_info"]["split"] == "test"
        keys.add(item["prompt"][0]["content"])
    assert len(keys) == len(items)
    assert {item["extra_info"]["kind"] for item in items} == set(KINDS)


def test_splits_disjoint_for_any_seeds():
    train = {i["prompt"][0]["content"] for s in (0, 1) for i in make_split("train", 1500, seed=s)}
    test = {i["prompt"][0]["content"] for s in (0, 1, 2) for i in make_split("test", 500, seed=s)}
    assert not train & test

    # the numbers alone (phrasing aside) never repeat across splits either
    def numbers(item):
        return (item["extra_info"]["kind"], item["extra_info"]["expression"])

    assert not {numbers(i) for i in make_split("train", 1500, seed=7)} & {
        numbers(i) for i in make_split("test", 500, seed=8)
    }


def test_answers_checked_by_sympy():
    for split in ("train", "test"):
        for item in make_split(split, 400, seed=11):
            truth = sympy.Rational(item["reward_model"]["ground_truth"])
            assert sympy.simplify(_sympy_answer(item) - truth) == 0, item
            # the tool expression evaluates to the answer as well
            assert sympy.sympify(item["extra_info"]["expression"]) == truth, item
            # answers are canonical: integers, or reduced fractions
            assert str(Fraction(item["reward_model"]["ground_truth"])) == item["reward_model"]["ground_truth"]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**9), kind=st.sampled_from(KINDS))
def test_any_seed_any_kind_is_sympy_correct(seed, kind):
    for item in make_split("train", 5, seed=seed, kinds=[kind]):
        assert item["extra_info"]["kind"] == kind
        assert sympy.simplify(_sympy_answer(item) - sympy.Rational(item["reward_model"]["ground_truth"])) == 0


def test_bad_arguments():
    with pytest.raises(EnvError, match="unknown split"):
        make_split("valid", 3)
    with pytest.raises(EnvError, match="unknown problem kinds"):
        make_split("train", 3, kinds=["calculus"])
    with pytest.raises(EnvError, match="non-negative"):
        make_split("train", -1)


def test_parquet_round_trip(tmp_path):
    items = make_split("train", 50, seed=2)
    path = write_parquet(items, tmp_path / "d" / "arith.parquet")
    back = load_parquet(path)
    assert back == items
    # read by plain pyarrow (what verl's RLHFDataset does) the columns are the verl ones
    table = pq.read_table(path)
    assert {"data_source", "prompt", "reward_model", "extra_info", "agent_name"} <= set(table.column_names)


def test_load_parquet_errors(tmp_path):
    with pytest.raises(EnvError, match="not found"):
        load_parquet(tmp_path / "nope.parquet")
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "hi"}]}]), bad)
    with pytest.raises(EnvError, match=r"lacks the verl column\(s\) \['data_source', 'reward_model'\]"):
        load_parquet(bad)
    no_truth = tmp_path / "no_truth.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"data_source": "x", "prompt": [{"role": "user", "content": "hi"}], "reward_model": {"style": "rule"}}]
        ),
        no_truth,
    )
    with pytest.raises(EnvError, match="ground_truth"):
        load_parquet(no_truth)
    text = tmp_path / "text.parquet"
    text.write_text("not parquet")
    with pytest.raises(EnvError, match="not a readable parquet"):
        load_parquet(text)


def test_load_parquet_defaults_and_json_extra_info(tmp_path):
    path = tmp_path / "min.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "data_source": "s",
                    "prompt": [{"role": "user", "content": "1+1?"}],
                    "reward_model": {"style": "rule", "ground_truth": "2"},
                    "extra_info": json.dumps({"a": 1}),
                }
            ]
        ),
        path,
    )
    (row,) = load_parquet(path)
    assert row["extra_info"] == {"a": 1} and row["agent_name"] == "tool_agent"


# --- the chain task (data.task=chain) ----------------------------------------------------------

_CHAIN_PATTERNS = {
    # kind: (regex over the question, how the numbers combine), written from the question's words
    "chain_add": [
        (r"sells (\d+) boxes with (\d+) pens in each box, then (\d+) loose pens", lambda a, b, c: a * b + c),
        (r"Compute (\d+) times (\d+), then add (\d+) to the result", lambda a, b, c: a * b + c),
    ],
    "chain_sub": [
        (r"grows (\d+) times larger every hour for (\d+) hours, then (\d+) cells die", lambda a, b, c: a**b - c),
        (r"Compute (\d+) to the power of (\d+), then subtract (\d+) from the result", lambda a, b, c: a**b - c),
    ],
    "chain_div": [
        (
            r"packs (\d+) crates with (\d+) apples in each crate and shares the apples equally among (\d+) stores",
            lambda a, b, d: Fraction(a * b, d),
        ),
        (r"Compute (\d+) times (\d+), then divide the result by (\d+)", lambda a, b, d: Fraction(a * b, d)),
    ],
    "chain_mod": [
        (
            r"Compute (\d+) times (\d+), then find the remainder when the result is divided by (\d+)",
            lambda a, b, m: (a * b) % m,
        ),
        (r"Compute (\d+) times (\d+), then take the result modulo (\d+)", lambda a, b, m: (a * b) % m),
    ],
}


def _brute_force_chain(item: dict) -> Fraction:
    """The answer recomputed from the question's words alone (one pattern per phrasing)."""
    import re

    info = item["extra_info"]
    for pattern, combine in _CHAIN_PATTERNS[info["kind"]]:
        m = re.search(pattern, info["question"])
        if m:
            return Fraction(combine(*map(int, m.groups())))
    raise AssertionError(f"no phrasing of {info['kind']} matches {info['question']!r}")


def _run_steps(steps: list[str]) -> Fraction:
    """The chain's calculator steps run one after the other, each on the previous result."""
    value = None
    for step in steps:
        value = sympy.sympify(step.format(r=value))
    return Fraction(str(value))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), split=st.sampled_from(["train", "test"]))
def test_chain_answers_match_brute_force_and_their_steps(seed, split):
    from agent_env.math_task.data import CHAIN_DATA_SOURCE, CHAIN_KINDS

    items = make_split(split, 40, seed=seed, task="chain")
    assert {i["extra_info"]["kind"] for i in items} <= set(CHAIN_KINDS)
    for item in items:
        info = item["extra_info"]
        truth = Fraction(item["reward_model"]["ground_truth"])
        assert item["data_source"] == CHAIN_DATA_SOURCE and info["split"] == split
        assert _brute_force_chain(item) == truth
        assert _run_steps(info["steps"]) == truth  # the two steps, chained
        assert Fraction(str(sympy.sympify(info["expression"]))) == truth  # the one-expression form
        assert truth.denominator == 1 and truth >= 0
        # the intermediate is not the answer: stopping after the first call is wrong
        assert _run_steps(info["steps"][:1]) != truth
        assert len(info["steps"]) == 2 and "{r}" in info["steps"][1] and "{r}" not in info["steps"][0]


def test_chain_splits_disjoint_deterministic_and_graded_by_the_math_reward():
    from agent_env.math_task.data import CHAIN_KINDS
    from agent_env.math_task.reward import math_reward

    train = make_split("train", 2000, seed=1, task="chain")
    test = make_split("test", 400, seed=2, task="chain")
    key = lambda i: i["prompt"][0]["content"]  # noqa: E731
    assert not {key(i) for i in train} & {key(i) for i in test}
    assert len({key(i) for i in train}) == len(train)
    assert make_split("test", 50, seed=2, task="chain") == test[:50]
    assert {i["extra_info"]["kind"] for i in test} == set(CHAIN_KINDS)
    assert make_split("train", 50, seed=1) != train[:50]  # the default task is untouched
    for item in test[:50]:
        truth = item["reward_model"]["ground_truth"]
        intermediate = str(_run_steps(item["extra_info"]["steps"][:1]))
        assert math_reward(f"The answer is \\boxed{{{truth}}}.", truth).correct
        assert not math_reward(f"The answer is \\boxed{{{intermediate}}}.", truth).correct
    with pytest.raises(EnvError, match="unknown task"):
        make_split("test", 5, task="chains")
    with pytest.raises(EnvError, match="unknown problem kinds"):
        make_split("test", 5, task="chain", kinds=["mul"])


def test_chain_parquet_round_trip_keeps_the_steps(tmp_path):
    items = make_split("test", 20, task="chain")
    path = write_parquet(items, tmp_path / "chain.parquet")
    assert load_parquet(path) == items


# --- the multistep task (data.task=multistep) --------------------------------------------------

_MULTISTEP_PATTERNS = {
    # kind: (regex over the question, how the numbers combine), written from the question's words
    "ms_add_mod": [
        (
            r"Compute (\d+) times (\d+), then add (\d+), then take the result modulo (\d+)",
            lambda a, b, c, m: (a * b + c) % m,
        ),
        (
            r"sells (\d+) boxes with (\d+) pens in each box and (\d+) loose pens, "
            r"then packs all the pens in cartons of (\d+)",
            lambda a, b, c, m: (a * b + c) % m,
        ),
    ],
    "ms_sub_div": [
        (
            r"Compute (\d+) to the power of (\d+), then subtract (\d+), then divide the result by (\d+)",
            lambda a, b, c, d: Fraction(a**b - c, d),
        ),
        (
            r"grows (\d+) times larger every hour for (\d+) hours from one cell, then (\d+) cells die and the rest "
            r"are split equally among (\d+) dishes",
            lambda a, b, c, d: Fraction(a**b - c, d),
        ),
    ],
    "ms_mul_sub": [
        (
            r"Compute (\d+) times (\d+), then multiply the result by (\d+), then subtract (\d+)",
            lambda a, b, c, e: a * b * c - e,
        ),
        (
            r"has (\d+) rows of (\d+) trees, each tree gives (\d+) baskets of fruit, and (\d+) baskets are sold",
            lambda a, b, c, e: a * b * c - e,
        ),
    ],
    "ms_four_mod": [
        (
            r"Compute (\d+) times (\d+), then add (\d+), then multiply the result by (\d+), then take it modulo (\d+)",
            lambda a, b, c, d, m: (a * b + c) * d % m,
        )
    ],
    "ms_four_pow": [
        (
            r"Compute (\d+) to the power of (\d+), then add (\d+), "
            r"then take the result modulo (\d+), then multiply it by (\d+)",
            lambda a, b, c, m, d: (a**b + c) % m * d,
        )
    ],
}


def _brute_force_multistep(item: dict) -> Fraction:
    import re

    info = item["extra_info"]
    for pattern, combine in _MULTISTEP_PATTERNS[info["kind"]]:
        m = re.search(pattern, info["question"])
        if m:
            return Fraction(combine(*map(int, m.groups())))
    raise AssertionError(f"no phrasing of {info['kind']} matches {info['question']!r}")


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), split=st.sampled_from(["train", "test"]))
def test_multistep_answers_match_brute_force_their_steps_and_the_calculator(seed, split):
    """Each answer recomputed from the question's words, from its steps run one after the other
    (by sympy and by the calculator tool's own evaluator, as an episode would), and from its
    one-expression form; no intermediate is the answer (stopping early is wrong) and none is 0."""
    from agent_env.math_task.data import MULTISTEP_DATA_SOURCE, MULTISTEP_KINDS
    from tools.calculator import calculate

    items = make_split(split, 40, seed=seed, task="multistep")
    assert {i["extra_info"]["kind"] for i in items} <= set(MULTISTEP_KINDS)
    for item in items:
        info = item["extra_info"]
        truth = Fraction(item["reward_model"]["ground_truth"])
        steps = info["steps"]
        assert item["data_source"] == MULTISTEP_DATA_SOURCE and info["split"] == split
        assert len(steps) in (3, 4) and "{r}" not in steps[0] and all("{r}" in s for s in steps[1:])
        assert _brute_force_multistep(item) == truth
        assert _run_steps(steps) == truth
        assert Fraction(str(sympy.sympify(info["expression"]))) == truth
        value = None
        for step in steps:  # the calculator tool's evaluator, each step on the previous result's text
            ok, _, text = calculate(step.format(r=value))
            assert ok, text
            value = text.strip()
        assert Fraction(value) == truth
        intermediates = [_run_steps(steps[:k]) for k in range(1, len(steps))]
        assert truth.denominator == 1 and truth > 0 and truth not in intermediates


def test_multistep_is_its_own_task_with_longer_episodes():
    from agent_env.math_task.data import MULTISTEP_KINDS
    from agent_env.tasks import get_task

    train = make_split("train", 2000, seed=1, task="multistep")
    test = make_split("test", 400, seed=2, task="multistep")
    key = lambda i: i["prompt"][0]["content"]  # noqa: E731
    assert not {key(i) for i in train} & {key(i) for i in test}
    assert make_split("test", 50, seed=2, task="multistep") == test[:50]
    assert {i["extra_info"]["kind"] for i in test} == set(MULTISTEP_KINDS)
    lengths = {len(i["extra_info"]["steps"]) for i in test}
    assert lengths == {3, 4}  # episodes of four and five assistant turns
    task = get_task("multistep")
    assert task.settings["multi_turn.max_assistant_turns"] >= 5
    assert make_split("test", 50, seed=2, task="chain")[0] != test[0]
