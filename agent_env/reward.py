"""The math reward: extract the final answer from a response and check it with math-verify.

``math_reward(response, ground_truth)`` returns a :class:`RewardResult` with the reward (1.0 for a
correct answer, 0.0 otherwise, plus optional small shaping terms that are off by default) and the
details of how it was decided (what was extracted, how it was compared).

Answer extraction, in order of precedence (the *last* occurrence wins within a kind):
``\\boxed{...}`` / ``\\fbox{...}`` (nested braces handled), then phrasings such as
"The final answer is …", "Final answer: …", "The answer is …", "Answer: …".

Comparison: math-verify (sympy based: ``1/2`` = ``0.5`` = ``\\frac{1}{2}``, ``3`` = ``3.0``,
``x=3`` = ``3``, …). When math-verify cannot parse one side, plain numbers and fractions are
compared exactly with :class:`fractions.Fraction`, and otherwise normalized strings are compared.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["RewardConfig", "RewardResult", "extract_answer", "extract_boxed", "math_reward", "answers_match"]


@dataclass
class RewardConfig:
    """Reward settings. Shaping terms are off (0.0) by default.

    ``format_bonus`` is added when a final answer could be extracted at all (even a wrong one);
    ``tool_use_bonus`` is added when the episode made at least one successful tool call;
    ``correct_reward`` / ``incorrect_reward`` are the base values.
    """

    correct_reward: float = 1.0
    incorrect_reward: float = 0.0
    format_bonus: float = 0.0
    tool_use_bonus: float = 0.0
    timeout_seconds: int = 5


@dataclass
class RewardResult:
    reward: float
    correct: bool
    details: dict[str, Any] = field(default_factory=dict)


_BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``.

    Braces are matched, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. An unterminated box
    (``\\boxed{12`` at the end of a truncated response) gives ``None``.
    """
    best: tuple[int, str] | None = None
    for cmd in _BOX_COMMANDS:
        start = 0
        while True:
            i = text.find(cmd, start)
            if i < 0:
                break
            start = i + len(cmd)
            j = start
            # \boxed is a command: "\boxedfoo" is some other command.
            if j < len(text) and text[j].isalpha():
                continue
            while j < len(text) and text[j] == " ":
                j += 1
            content: str | None = None
            if j < len(text) and text[j] == "{":
                depth = 0
                k = j
                while k < len(text):
                    ch = text[k]
                    if ch == "\\" and k + 1 < len(text):  # skip escaped braces \{ \}
                        k += 2
                        continue
                    if ch == "{":
                        depth += 1
                    elif ch == "}":
                        depth -= 1
                        if depth == 0:
                            content = text[j + 1:k]
                            break
                    k += 1
            elif j > start and j < len(text):  # "\boxed 5": one token after a space
                m = re.match(r"[^\s$]+", text[j:])
                if m:
                    content = m.group(0)
            if content is not None and (best is None or i >= best[0]):
                best = (i, content.strip())
    return best[1] if best else None


_PHRASES = [
    re.compile(r"final\s+answer\s*(?:is|:)\s*:?\s*(?P<ans>.+)", re.IGNORECASE),
    re.compile(r"the\s+answer\s+is\s*:?\s*(?P<ans>.+)", re.IGNORECASE),
    re.compile(r"(?:^|\n)\s*\**answer\**\s*:\s*(?P<ans>.+)", re.IGNORECASE),
]


def _clean_phrase_answer(ans: str) -> str:
    ans = ans.strip().splitlines()[0].strip() if ans.strip() else ""
    ans = ans.strip("*").strip()
    ans = re.sub(r"[.\s]+$", "", ans)
    # Strip surrounding math delimiters and a trailing sentence period.
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if ans.startswith(left) and ans.endswith(right) and len(ans) >= len(left) + len(right):
            ans = ans[len(left):len(ans) - len(right)].strip()
            break
    ans = re.sub(r"[.\s]+$", "", ans)
    return ans


def extract_answer(text: str) -> tuple[str | None, str]:
    """``(answer, method)``: the final answer written in ``text`` and how it was found
    (``"boxed"``, ``"phrase"`` or ``"none"``)."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    for pat in _PHRASES:
        matches = list(pat.finditer(text))
        if matches:
            inner = extract_boxed(matches[-1].group("ans"))
            ans = inner if inner is not None else _clean_phrase_answer(matches[-1].group("ans"))
            if ans:
                return ans, "phrase"
    return None, "none"


def _plain_number(s: str) -> Fraction | None:
    s = s.strip().replace(",", "").replace(" ", "").strip("$")
    m = re.fullmatch(r"([+-]?\d+(?:\.\d+)?)/([+-]?\d+(?:\.\d+)?)", s)
    try:
        if m:
            den = Fraction(m.group(2))
            return Fraction(m.group(1)) / den if den != 0 else None
        m = re.fullmatch(r"\\d?frac\{([^{}]+)\}\{([^{}]+)\}", s)
        if m:
            den = Fraction(m.group(2))
            return Fraction(m.group(1)) / den if den != 0 else None
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _normalize_str(s: str) -> str:
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("\\ ", "")
    return re.sub(r"\s+", "", s).strip("$.").lower()


def answers_match(pred: str, gold: str, *, timeout_seconds: int = 5) -> tuple[bool, str]:
    """``(equal, method)``: compare a predicted answer with the gold answer.

    ``method`` is ``"math_verify"`` when both sides parsed with math-verify, ``"fraction"`` for
    the exact plain-number fallback, ``"string"`` for the normalized-string fallback.
    """
    from math_verify import parse, verify  # imported lazily: ~0.3 s (sympy, latex2sympy)

    # math-verify's timeouts use signal.alarm(), which only works in the main thread.
    main = threading.current_thread() is threading.main_thread()
    ptimeout = timeout_seconds if main else None
    try:
        g = parse("\\boxed{" + gold + "}", parsing_timeout=ptimeout)
        p = parse("\\boxed{" + pred + "}", parsing_timeout=ptimeout)
        if g and p:
            return bool(verify(g, p, timeout_seconds=ptimeout)), "math_verify"
    except Exception as e:  # math-verify raises on pathological input; fall back below
        logger.debug("math-verify failed on %r vs %r: %s", pred, gold, e)
    fp, fg = _plain_number(pred), _plain_number(gold)
    if fp is not None and fg is not None:
        return fp == fg, "fraction"
    return _normalize_str(pred) == _normalize_str(gold), "string"


def math_reward(
    response: str,
    ground_truth: str | float | int | None,
    *,
    config: RewardConfig | None = None,
    num_successful_tool_calls: int = 0,
) -> RewardResult:
    """Score one response against its ground truth (see the module docstring).

    ``ground_truth=None`` (no label) gives the incorrect reward plus shaping, with
    ``details["reason"] = "no ground truth"``.
    """
    cfg = config or RewardConfig()
    answer, method = extract_answer(response)
    details: dict[str, Any] = {"extracted": answer, "extraction": method,
                               "ground_truth": None if ground_truth is None else str(ground_truth)}
    correct = False
    if answer is None:
        details["reason"] = "no final answer found"
    elif ground_truth is None:
        details["reason"] = "no ground truth"
    else:
        gold = str(ground_truth).strip()
        gold_boxed = extract_boxed(gold)
        if gold_boxed is not None:
            gold = gold_boxed
        correct, how = answers_match(answer, gold, timeout_seconds=cfg.timeout_seconds)
        details["comparison"] = how
    reward = cfg.correct_reward if correct else cfg.incorrect_reward
    shaping = 0.0
    if answer is not None and cfg.format_bonus:
        shaping += cfg.format_bonus
    if num_successful_tool_calls > 0 and cfg.tool_use_bonus:
        shaping += cfg.tool_use_bonus
    details["shaping"] = shaping
    details["correct"] = correct
    return RewardResult(reward=reward + shaping, correct=correct, details=details)
