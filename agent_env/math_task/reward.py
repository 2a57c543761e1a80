"""The math reward: extract the final answer from a response and check it with math-verify.

``math_reward(response, ground_truth)`` returns a :class:`RewardResult` with the reward (1.0 for a
correct answer, 0.0 otherwise, plus optional small shaping terms that are off by default) and the
details of how it was decided (what was extracted, how it was compared).

Answer extraction, in order of precedence (the *last* occurrence wins within a kind):
``\\boxed{...}`` / ``\\fbox{...}`` (nested braces handled), then phrasings such as
"The final answer is …", "Final answer: …", "The answer is …", "Answer: …".

Comparison, bounded on every thread (a model's output reaches it unfiltered):

1. plain numbers and fractions on both sides (``3``, ``-2.5``, ``1,000``, ``7/8``,
   ``\\frac{3}{4}``) are compared exactly with :class:`fractions.Fraction` (microseconds);
2. an answer that is not plausible math — longer than :data:`MAX_ANSWER_CHARS`, characters no
   math answer uses (``#``, ``@``, ``?``, ``"``, control characters …), brackets nested deeper
   than :data:`MAX_NESTING`, a power tower (an exponent inside an exponent), an exponent or a
   factorial of 5 or more digits — never reaches sympy: it is compared as a normalized string
   (so ``e^{x^2}`` still equals ``e^{x^2}``, and garbage never equals a short gold answer);
3. otherwise math-verify (sympy: ``1/2`` = ``0.5``, ``x=3`` = ``3``, ``(x+1)^2`` = ``x^2+2x+1``
   …) runs in a killable helper process (:mod:`agent_env.math_task.verify`): past ``timeout_seconds`` + 0.5 s
   the comparison is abandoned (not equal, ``comparison = "timeout"``) on the main thread, a worker
   thread or a Ray actor alike. When math-verify cannot parse one side, normalized strings are compared.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "CustomRewardFunction",
    "RewardConfig",
    "RewardResult",
    "extract_answer",
    "extract_boxed",
    "math_reward",
    "answers_match",
]


@dataclass
class CustomRewardFunction:
    """verl's ``reward.custom_reward_function``: a function ``name`` in the file or module ``path``."""

    path: str | None = None  # a .py file or an importable module; null = none
    name: str = "compute_score"  # compute_score(data_source, solution_str, ground_truth, extra_info)


@dataclass
class RewardConfig:
    """Reward settings. Shaping terms are off (0.0) by default.

    Which function scores a trajectory (:class:`agent_env.rewards.RewardScorer`):
    ``per_data_source[data_source]``, else ``custom_reward_function`` (verl's path + name), else
    ``name``, else the task's reward (``math`` for the built-in tasks). Names are those of
    :data:`agent_env.rewards.REWARDS`: ``math``, ``exact_match``, ``f1``, entry points of group
    ``otb_tir.rewards``, or paths ``pkg.mod:fn`` / ``file.py:fn``.

    ``format_bonus`` is added when a final answer could be extracted at all (even a wrong one);
    ``tool_use_bonus`` is added when the episode made at least one successful tool call;
    ``correct_reward`` / ``incorrect_reward`` are the base values (shaping applies to ``math``).
    """

    # verl's custom reward function: {path: my_reward.py, name: compute_score}
    custom_reward_function: CustomRewardFunction = field(default_factory=CustomRewardFunction)
    name: str | None = None  # a reward by name (math | exact_match | f1 | entry point | pkg.mod:fn | file.py:fn)
    per_data_source: dict[str, str] = field(default_factory=dict)  # data_source -> reward name, wins over the above

    correct_reward: float = 1.0  # reward of a correct final answer
    incorrect_reward: float = 0.0  # reward of a wrong or missing answer
    format_bonus: float = 0.0  # added when a final answer could be extracted at all (even a wrong one)
    tool_use_bonus: float = 0.0  # added when at least one tool call succeeded
    timeout_seconds: int = 5  # wall-clock bound on grading one answer (math-verify / sympy, or a user's function)

    def __post_init__(self) -> None:
        if isinstance(self.custom_reward_function, Mapping):
            self.custom_reward_function = CustomRewardFunction(**dict(self.custom_reward_function))


@dataclass
class RewardResult:
    reward: float
    correct: bool
    details: dict[str, Any] = field(default_factory=dict)


_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _brace_matches(text: str) -> dict[int, int]:
    """Position of each ``{`` → position of its matching ``}`` (escaped ``\\{`` / ``\\}`` skipped),
    in one linear pass: extraction stays linear on adversarial text (thousands of open boxes)."""
    match: dict[int, int] = {}
    stack: list[int] = []
    k, n = 0, len(text)
    while k < n:
        ch = text[k]
        if ch == "\\" and k + 1 < n:
            k += 2
            continue
        if ch == "{":
            stack.append(k)
        elif ch == "}" and stack:
            match[stack.pop()] = k
        k += 1
    return match


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``.

    Braces are matched, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. An unterminated box
    (``\\boxed{12`` at the end of a truncated response) gives ``None``.
    """
    best: tuple[int, str] | None = None
    matches: dict[int, int] | None = None
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
                if matches is None:
                    matches = _brace_matches(text)
                end = matches.get(j)
                if end is not None:
                    content = text[j + 1 : end]
            elif j > start and j < len(text):  # "\boxed 5": one token after a space
                m = re.match(r"[^\s$]+", text[j : j + MAX_ANSWER_CHARS + 1])
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
            ans = ans[len(left) : len(ans) - len(right)].strip()
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


MAX_ANSWER_CHARS = 300
MAX_NESTING = 12
_NON_MATH = re.compile(r'[#@?"`\x00-\x08\x0b-\x1f\x7f]')
_BIG_EXPONENT = re.compile(r"\^\s*\{?\s*[-+]?\d{5,}|\d{5,}\s*!")


def implausible_answer(s: str) -> str | None:
    """Why ``s`` is not sent to sympy (see the module docstring), or None. Linear in ``len(s)``."""
    if len(s) > MAX_ANSWER_CHARS:
        return f"longer than {MAX_ANSWER_CHARS} characters"
    m = _NON_MATH.search(s)
    if m:
        return f"character {m.group(0)!r} is not math"
    if _BIG_EXPONENT.search(s):
        return "an exponent or factorial of 5+ digits"
    depth = max_depth = 0
    exp_levels: list[int] = []  # bracket depths at which an exponent's braces opened
    tower = 0
    i, n = 0, len(s)
    while i < n:
        ch = s[i]
        if ch in "{([":
            depth += 1
            max_depth = max(max_depth, depth)
        elif ch in "})]":
            if exp_levels and exp_levels[-1] == depth:
                exp_levels.pop()
            depth -= 1
        elif ch == "^":
            j = i + 1
            while j < n and s[j] == " ":
                j += 1
            if exp_levels:  # an exponent inside an exponent: a power tower
                tower = max(tower, len(exp_levels) + 1)
            if j < n and s[j] == "{":
                exp_levels.append(depth + 1)
            elif j + 1 < n and s[j + 1] == "^":  # x^2^3: also a tower
                tower = max(tower, 2)
        i += 1
    if max_depth > MAX_NESTING:
        return f"brackets nested {max_depth} deep (more than {MAX_NESTING})"
    if tower >= 2:
        return "a power tower (an exponent inside an exponent)"
    return None


def answers_match(pred: str, gold: str, *, timeout_seconds: int = 5) -> tuple[bool, str]:
    """``(equal, method)``: compare a predicted answer with the gold answer (module docstring).

    ``method``: ``"fraction"`` (both plain numbers), ``"math_verify"`` (both parsed by
    math-verify), ``"string"`` (normalized strings: math-verify could not parse one side, or an
    answer was not plausible math), ``"timeout"`` (math-verify did not finish in time: not equal).
    Never takes longer than ``timeout_seconds`` + 0.5 s once the helper process runs.
    """
    from agent_env.math_task.verify import VerifyTimeout, verify_in_child

    fp, fg = _plain_number(pred), _plain_number(gold)
    if fp is not None and fg is not None:
        return fp == fg, "fraction"
    if implausible_answer(pred) or implausible_answer(gold):
        return _normalize_str(pred) == _normalize_str(gold), "string"
    try:
        res = verify_in_child(pred, gold, float(timeout_seconds))
    except VerifyTimeout:
        logger.debug("math-verify timed out on %r vs %r", pred[:100], gold[:100])
        return False, "timeout"
    if res.get("parsed"):
        return bool(res["equal"]), "math_verify"
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
    details: dict[str, Any] = {
        "extracted": answer,
        "extraction": method,
        "ground_truth": None if ground_truth is None else str(ground_truth),
    }
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
