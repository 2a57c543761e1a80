"""Rewards by name, in verl's ``custom_reward_function`` shape, bounded.

A reward function is verl's contract::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

returning a number, or a dict with a numeric ``"score"`` (other numeric keys, such as ``"acc"``,
are kept in the trajectory's ``reward_details``; ``"acc"``, when given, decides ``correct``,
otherwise ``correct`` means ``score >= correct_reward``). ``solution_str`` is what the model wrote
(every assistant turn, tool output excluded), ``extra_info`` the data row's ``extra_info`` plus
``num_turns``, ``num_tool_calls`` and ``num_successful_tool_calls``.

Names resolve through :data:`REWARDS`, the one plugin mechanism (:class:`tools.plugins.Registry`):
the built-ins ``math`` (:func:`agent_env.math_task.reward.math_reward`, with the reward section's
shaping terms), ``exact_match`` and ``f1`` (on the extracted final answer), functions registered
with ``REWARDS.register(fn, name)``, entry points of group ``otb_tir.rewards``, and paths
``package.module:fn`` / ``path/to/file.py:fn``. The reward section chooses per data source
(:class:`RewardScorer`): ``per_data_source[data_source]``, else ``custom_reward_function``
(verl's ``path`` + ``name``), else ``name``, else the task's reward.

**Bounded.** A user's function runs on its own daemon thread and the episode waits at most
``timeout_seconds``: one that hangs, raises, or returns NaN, infinity or a non-number gives the
trajectory the incorrect reward and ``reward_details["reward_error"]`` (``timeout``,
``exception``, ``nan``, ``not_a_number``; counted as ``reward/errors/<kind>`` in the metrics),
and the run goes on. A hung thread cannot be killed: it is abandoned, and after
:data:`MAX_ABANDONED` of them further calls of that function fail at once (``stuck``) instead of
piling up threads. A function that fails to *import* is an :class:`~agent_env.EnvError` when the
scorer is built, at the start of the run, naming the file and the error.

**Off the episode's thread.** The built-in ``math`` compares answers with math-verify in a helper
process (:mod:`agent_env.math_task.verify`, bounded there); :class:`RewardScorer` calls it from one
thread of its own (:func:`math_thread`), so an episode awaiting a comparison (0.2 s for some
model-written junk) does not stop the event loop, and with it the local trainer's engine and every
other episode. :meth:`RewardScorer.prewarm` starts that thread's helper when an episode starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import os
import re
import string
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any, Callable

from agent_env.errors import EnvError
from agent_env.math_task.reward import RewardConfig, RewardResult, extract_answer, math_reward
from tools.plugins import Registry

__all__ = [
    "ERROR_KINDS",
    "REWARDS",
    "MAX_ABANDONED",
    "RewardConfig",
    "RewardResult",
    "RewardScorer",
    "exact_match",
    "f1",
    "math_score",
    "reward_error_counts",
    "reward_spec",
]

#: hung calls of one function abandoned before its further calls fail at once (``stuck``)
MAX_ABANDONED = 8
ERROR_KINDS = ("timeout", "exception", "nan", "not_a_number", "stuck")


_MATH_THREAD: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_MATH_LOCK = threading.Lock()


def math_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread (per process) that runs the built-in ``math`` reward for :class:`RewardScorer`:
    its math-verify helper process is that thread's (one helper, comparisons in order)."""
    global _MATH_THREAD
    with _MATH_LOCK:
        if _MATH_THREAD is None or _MATH_THREAD[0] != os.getpid():  # none yet, or inherited by a fork
            _MATH_THREAD = (os.getpid(), concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="math-reward"))
        return _MATH_THREAD[1]


def reward_error_counts(trajs: Any) -> dict[str, float]:
    """``reward/errors/<kind>``: how many of ``trajs`` got no reward from their function, per kind
    (every kind present, zeros included) — the one definition training, the eval and verl report."""
    counts = dict.fromkeys(ERROR_KINDS, 0.0)
    for t in trajs:
        kind = (getattr(t, "reward_details", None) or {}).get("reward_error")
        if kind in counts:
            counts[kind] += 1.0
    return {f"reward/errors/{k}": v for k, v in counts.items()}


def math_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None, **_: Any) -> dict:
    """The math reward in verl's shape (default :class:`RewardConfig`; the episode applies the
    reward section's own settings when it runs the built-in ``math``)."""
    res = math_reward(solution_str, ground_truth)
    return {"score": float(res.reward), "acc": float(res.correct)}


def _normalize_text(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _answer(solution_str: str, extra_info: Any) -> str:
    """The task's extracted answer (``extra_info["extracted_answer"]``, set by the episode), else
    the math extraction's."""
    if isinstance(extra_info, Mapping) and "extracted_answer" in extra_info:
        return str(extra_info["extracted_answer"] or "")
    answer, _ = extract_answer(solution_str)
    return answer if answer is not None else ""


def exact_match(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None, **_: Any) -> dict:
    """1.0 when the extracted final answer equals one of the gold answers (a string or a list),
    after SQuAD normalization (case, punctuation, articles, spaces); else 0.0."""
    golds = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    pred = _normalize_text(_answer(solution_str, extra_info))
    hit = bool(pred) and any(pred == _normalize_text(str(g)) for g in golds if g is not None)
    return {"score": float(hit), "acc": float(hit)}


def f1(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None, **_: Any) -> dict:
    """Token F1 (SQuAD) of the extracted final answer against the best gold answer; ``acc`` is
    exact match."""
    golds = [str(g) for g in (ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth])]
    pred = _normalize_text(_answer(solution_str, extra_info)).split()
    best, exact = 0.0, False
    for gold in golds:
        gt = _normalize_text(gold).split()
        exact = exact or (bool(pred) and pred == gt)
        common = sum((Counter(pred) & Counter(gt)).values())
        if common:
            p, r = common / len(pred), common / len(gt)
            best = max(best, 2 * p * r / (p + r))
    return {"score": best, "acc": float(exact)}


def _check_reward(obj: Any, name: str) -> None:
    if not callable(obj):
        raise EnvError(f"reward {name!r} resolved to {obj!r}, which is not callable")


REWARDS = Registry(
    "reward",
    "otb_tir.rewards",
    {"math": f"{__name__}:math_score", "exact_match": f"{__name__}:exact_match", "f1": f"{__name__}:f1"},
    error=EnvError,
    check=_check_reward,
)


def reward_spec(path: str | None, name: str | None) -> str | None:
    """verl's ``custom_reward_function`` (``path`` to a file or module, ``name`` of the function,
    default ``compute_score``) as one registry name (``path:name``); None when no path is set."""
    if not path:
        return None
    return f"{path}:{name or 'compute_score'}"


class _Bounded:
    """One reward function called on daemon threads with a deadline."""

    def __init__(self, fn: Callable[..., Any], spec: str) -> None:
        self.fn = fn
        self.spec = spec
        self.abandoned = 0
        self._lock = threading.Lock()

    async def __call__(self, args: tuple[Any, ...], timeout: float) -> tuple[Any, str | None, str]:
        with self._lock:
            if self.abandoned >= MAX_ABANDONED:
                return None, "stuck", f"{self.abandoned} earlier calls of {self.spec} never returned; not called"
        if inspect.iscoroutinefunction(self.fn):  # an async reward (verl allows them): awaited here
            try:
                return await asyncio.wait_for(self.fn(*args), timeout), None, ""
            except (TimeoutError, asyncio.TimeoutError):
                return None, "timeout", f"{self.spec} did not return within {timeout:g} s"
            except Exception as exc:  # noqa: BLE001
                return None, "exception", f"{self.spec} raised {type(exc).__name__}: {exc}"
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def target() -> None:
            try:
                value = self.fn(*args)
            except BaseException as exc:  # noqa: BLE001 - the user's function, reported per sample
                outcome = (fut.set_exception, exc)
            else:
                outcome = (fut.set_result, value)
            try:
                outcome[0](outcome[1])
            except concurrent.futures.InvalidStateError:
                pass  # the episode stopped waiting (timed out): nobody reads it

        threading.Thread(target=target, name=f"reward:{self.spec}", daemon=True).start()
        try:
            value = await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            with self._lock:
                self.abandoned += 1
            return None, "timeout", f"{self.spec} did not return within {timeout:g} s"
        except Exception as exc:  # noqa: BLE001
            return None, "exception", f"{self.spec} raised {type(exc).__name__}: {exc}"
        return value, None, ""


def _as_score(value: Any) -> tuple[float | None, dict[str, float], str | None, str]:
    """(score, extra numeric fields, error kind, message) of a reward function's return value."""
    extra: dict[str, float] = {}
    raw = value
    if isinstance(value, Mapping):
        if "score" not in value:
            return None, extra, "not_a_number", f"returned a dict without 'score' (keys {sorted(map(str, value))})"
        raw = value["score"]
        for k, v in value.items():
            if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                extra[str(k)] = float(v)
            elif k != "score" and isinstance(v, bool):
                extra[str(k)] = float(v)
    if hasattr(raw, "item") and callable(raw.item):  # numpy / torch scalars
        try:
            raw = raw.item()
        except (TypeError, ValueError):
            pass
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None, extra, "not_a_number", f"returned {type(raw).__name__} {str(raw)[:80]!r}, not a number"
    if not math.isfinite(raw):
        return None, extra, "nan", f"returned {raw!r}"
    return float(raw), extra, None, ""


class RewardScorer:
    """The rewards a reward section chooses (see the module doc), resolved once, at construction:
    a function that does not import is an :class:`EnvError` here, at the start of a run.

    ``default``: the reward when the section names none (the task's; ``math`` for the built-in
    tasks). :attr:`resolved` records every function in use and where it came from.
    """

    def __init__(
        self,
        config: RewardConfig | None = None,
        default: str | None = None,
        extract: Callable[[str], str | None] | None = None,
    ) -> None:
        self.config = config or RewardConfig()
        self.extract = extract
        c = self.config
        custom = reward_spec(c.custom_reward_function.path, c.custom_reward_function.name)
        self.default_spec = custom or c.name or default or "math"
        self.by_source = {str(k): str(v) for k, v in (c.per_data_source or {}).items()}
        self._fns: dict[str, _Bounded] = {}
        self._prewarmed = False
        self.resolved: dict[str, dict[str, str]] = {}
        for where, spec in [("default", self.default_spec)] + [
            (f"data_source {k}", v) for k, v in self.by_source.items()
        ]:
            if spec not in self._fns:
                fn = REWARDS.resolve(spec)
                self._fns[spec] = _Bounded(fn, spec)
            self.resolved[where] = {"reward": spec, "source": REWARDS.source(spec)}

    def _extracted(self, text: str) -> str | None:
        if self.extract is None:
            return extract_answer(text)[0]
        try:
            found = self.extract(text)
        except Exception:  # noqa: BLE001 - the episode reported it already
            return None
        return found if isinstance(found, str) and found else None

    def prewarm(self) -> None:
        """Start the math-verify helper process of :func:`math_thread` now, without waiting, when a
        reward in use is the built-in ``math`` (its comparisons run there; see
        :mod:`agent_env.math_task.verify`). The episode calls this when it starts; once per scorer."""
        if self._prewarmed or not (self.default_spec == "math" or "math" in self.by_source.values()):
            return
        from agent_env.math_task.verify import prewarm

        self._prewarmed = True
        math_thread().submit(prewarm)

    def spec_for(self, data_source: Any) -> str:
        return self.by_source.get(str(data_source), self.default_spec) if data_source is not None else self.default_spec

    async def score(self, text: str, traj: Any) -> RewardResult:
        """Score the trajectory ``traj`` whose assistant text is ``text``."""
        n_ok = sum(call.ok for tr in traj.turns for call in tr.tool_calls)
        extra_info = dict(getattr(traj, "extra_info", None) or {})
        extra_info.update(num_turns=traj.num_turns, num_tool_calls=traj.num_tool_calls)
        return await self.score_row(getattr(traj, "data_source", None), text, traj.ground_truth, extra_info, n_ok)

    async def score_row(
        self, data_source: Any, text: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None, n_ok: int = 0
    ) -> RewardResult:
        """Score one row in verl's terms (what :mod:`otb_tir.verl.reward_fn` calls in verl's reward workers)."""
        c = self.config
        spec = self.spec_for(data_source)
        if spec == "math":  # the built-in: its own settings and shaping, already bounded (a helper process)
            fut = math_thread().submit(math_reward, text, ground_truth, config=c, num_successful_tool_calls=n_ok)
            return await asyncio.wrap_future(fut)
        info = dict(extra_info or {})
        info.update(num_successful_tool_calls=n_ok, extracted_answer=self._extracted(text))
        value, kind, message = await self._fns[spec]((data_source, text, ground_truth, info), float(c.timeout_seconds))
        details: dict[str, Any] = {"reward_fn": spec}
        if kind is None:
            score, extra, kind, message = _as_score(value)
            details.update(extra)
        if kind is not None:
            details.update(reward_error=kind, reward_error_message=message, correct=False)
            return RewardResult(reward=c.incorrect_reward, correct=False, details=details)
        assert score is not None
        correct = bool(details["acc"]) if "acc" in details else score >= c.correct_reward
        details["correct"] = correct
        return RewardResult(reward=score, correct=correct, details=details)
