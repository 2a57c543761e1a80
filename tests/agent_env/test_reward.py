"""The math reward: answer extraction and math-verify checking."""

from __future__ import annotations

import threading
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_env.math_task.reward import RewardConfig, answers_match, extract_answer, extract_boxed, math_reward


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\left\\{1, 2\\right\\}}", "\\left\\{1, 2\\right\\}"),
        ("first \\boxed{1} then \\boxed{ 2 }", "2"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5 is it", "5"),
        ("\\boxed{{a}{b}}", "{a}{b}"),
        ("\\boxed{12", None),  # truncated
        ("\\boxedfoo{3}", None),  # another command
        ("no box", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text,expected,method",
    [
        ("The answer is 42.", "42", "phrase"),
        ("Thus the final answer is $\\frac{3}{4}$.", "\\frac{3}{4}", "phrase"),
        ("Final answer: 17", "17", "phrase"),
        ("**Answer:** 9\nmore text", "9", "phrase"),
        ("The answer is \\boxed{5}", "5", "boxed"),
        ("I think it's big.", None, "none"),
    ],
)
def test_extract_answer_phrasings(text, expected, method):
    assert extract_answer(text) == (expected, method)


@pytest.mark.parametrize(
    "pred,gold",
    [
        ("1/2", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("\\frac12", "1/2"),
        ("3", "3.0"),
        ("3.0", "3"),
        ("\\dfrac{3}{4}", "0.75"),
        ("x=3", "3"),
        ("1,000", "1000"),
        ("(x+1)^2", "x^2+2x+1"),
        ("\\sqrt{2}", "2^{1/2}"),
    ],
)
def test_equivalent_forms_are_correct(pred, gold):
    ok, method = answers_match(pred, gold)
    assert ok and method in ("math_verify", "fraction")
    r = math_reward(f"so \\boxed{{{pred}}}", gold)
    assert r.reward == 1.0 and r.correct and r.details["extracted"] == pred


@pytest.mark.parametrize("pred,gold", [("4", "5"), ("1/3", "0.33"), ("-2", "2"), ("\\frac{1}{2}", "0.25")])
def test_wrong_answers(pred, gold):
    r = math_reward(f"The answer is \\boxed{{{pred}}}.", gold)
    assert r.reward == 0.0 and not r.correct and r.details["comparison"] in ("math_verify", "fraction")


def test_no_answer_and_no_ground_truth():
    r = math_reward("I don't know", "3")
    assert r.reward == 0.0 and r.details["reason"] == "no final answer found"
    r = math_reward("\\boxed{3}", None)
    assert r.reward == 0.0 and r.details["reason"] == "no ground truth"


def test_gold_in_boxed_and_numeric_gold():
    assert math_reward("\\boxed{6}", "\\boxed{6}").correct
    assert math_reward("\\boxed{6}", 6).correct
    assert math_reward("\\boxed{0.25}", Fraction(1, 4)).correct


def test_shaping_off_by_default_and_on_when_asked():
    assert math_reward("\\boxed{4}", "5").reward == 0.0
    cfg = RewardConfig(format_bonus=0.1, tool_use_bonus=0.05)
    assert math_reward("\\boxed{4}", "5", config=cfg, num_successful_tool_calls=1).reward == pytest.approx(0.15)
    assert math_reward("nothing", "5", config=cfg).reward == 0.0
    assert math_reward("\\boxed{5}", "5", config=cfg).reward == pytest.approx(1.1)


def test_fallbacks_for_unparseable_text():
    ok, method = answers_match("blue", "Blue")
    assert ok
    ok, _ = answers_match("\\text{red}", "blue")
    assert not ok


def test_works_outside_the_main_thread():
    """math-verify's signal-based timeouts only work in the main thread: the reward must still work."""
    out = {}
    th = threading.Thread(target=lambda: out.update(r=math_reward("\\boxed{1/2}", "0.5")))
    th.start()
    th.join()
    assert out["r"].correct


@settings(max_examples=40, deadline=None)
@given(st.integers(-(10**6), 10**6), st.integers(1, 999))
def test_fraction_forms_property(num, den):
    """p/q, \\frac{p}{q} and its decimal (when exact) agree; p/q+1 never does (Fraction oracle)."""
    f = Fraction(num, den)
    frac = f"\\frac{{{f.numerator}}}{{{f.denominator}}}" if f.denominator != 1 else str(f.numerator)
    assert math_reward(f"\\boxed{{{num}/{den}}}", frac).correct
    assert not math_reward(f"\\boxed{{{num}/{den} + 1}}", frac).correct
