"""Tool-use figures with one definition, reported by training, evaluation and the verl agent loop.

A *call* is one tool call the parser found in an assistant turn, well-formed or not. Each call
falls in exactly one of three classes:

- **ok**: it ran and its tool returned ``ok`` (an output cut short still counts as ok);
- **not executed**: it was well-formed but the episode never ran it, because it was written on the
  last allowed assistant turn (``multi_turn.max_assistant_turns``) — a budget decision, neither a
  success nor a failure of the model's tool use;
- **failed**: everything else — malformed calls, unknown tools, bad arguments (the model's fault)
  and calls the tool answered with an error (syntax/runtime errors, timeouts, memory, …).

Figures (:func:`tool_metrics`):

- ``tools/calls`` (all calls), ``tools/ok``, ``tools/failed``, ``tools/not_executed``;
- ``tools/success_rate`` = ok / (ok + failed), i.e. over the calls that counted;
- ``tools/executed_success_rate`` = ok / calls that reached a tool;
- ``tools/call_rate`` (share of episodes with at least one call), ``tools/calls_per_episode``,
  ``tools/errors_per_episode`` (executed calls that failed), ``tools/malformed_per_episode``;
- ``tools/infra_retries``: calls the tool ran again after an infrastructure failure (a sandbox
  worker killed from outside); a stateful session that lost its process is ``errors/session_lost``;
- ``errors/<kind>``: calls per kind (:func:`classify_call`; ``output_cut`` counts ok calls whose
  output was cut, every other kind is a failure), the kinds of :data:`SHOWN_ERROR_KINDS` always
  present, and ``errors/<kind>_per_call`` over all calls; ``errors/total`` = failed calls.

:func:`episode_counts` gives one trajectory's counts as flat numbers; the verl agent loop reports
them per row (``tool_<count>`` in verl's reward extra info) and :func:`pooled_tool_metrics` turns
rows back into the same figures, so a verl run and the local trainer report one definition.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any, Mapping, Sequence

__all__ = [
    "COUNT_KEYS",
    "ERROR_KINDS",
    "SHOWN_ERROR_KINDS",
    "MALFORMED_KINDS",
    "calls_of",
    "classify_call",
    "call_counts",
    "episode_counts",
    "pooled_tool_metrics",
    "tool_metrics",
]

#: the kinds every report shows (zero when absent), in this order
SHOWN_ERROR_KINDS = (
    "syntax_error",
    "runtime_error",
    "timeout",
    "memory",
    "output_cut",
    "malformed_call",
    "unknown_tool",
)
#: every kind :func:`classify_call` returns for a call that is not ok
ERROR_KINDS = SHOWN_ERROR_KINDS + ("bad_arguments", "sandbox_error", "session_lost", "blocked", "not_executed", "other")
#: kinds that are the model's fault, not the tool's
MALFORMED_KINDS = ("malformed_call", "unknown_tool", "bad_arguments")

# The exception named on the last "Name: message" line of a Python traceback.
_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Interrupt|Exit))\b", re.M)
_SYNTAX_EXC = {"SyntaxError", "IndentationError", "TabError"}


def _exception_name(text: str) -> str | None:
    names = _EXC_LINE.findall(text or "")
    return names[-1] if names else None


def _kind_from_text(text: str) -> str | None:
    name = _exception_name(text)
    if name is None:
        return None
    if name in _SYNTAX_EXC:
        return "syntax_error"
    if name == "MemoryError":
        return "memory"
    if name == "TimeoutError":
        return "timeout"
    return "runtime_error"


def classify_call(call: Any) -> str | None:
    """The kind of one call (a :class:`~agent_env.ToolCallRecord`): ``None`` when it is ok,
    ``"output_cut"`` when it is ok but its output was cut short (counted, not a failure),
    ``"not_executed"`` when the episode never ran it, else one of :data:`ERROR_KINDS`.

    The tool's own ``error`` (an ``ErrorKind`` value) is taken as it is, except that a
    ``runtime_error`` whose text ends on a ``SyntaxError``/``IndentationError`` traceback counts as
    ``syntax_error``, and one ending on ``MemoryError`` as ``memory``.
    """
    err = call.error
    if err is None:
        if call.ok:
            return None
        if not call.executed:
            return "not_executed"
        return _kind_from_text(call.text) or "other"
    if err == "runtime_error":
        name = _exception_name(call.text)
        if name in _SYNTAX_EXC:
            return "syntax_error"
        if name == "MemoryError":
            return "memory"
        return "runtime_error"
    return err if err in ERROR_KINDS else "other"


def calls_of(traj: Any) -> list[Any]:
    """Every tool call of a trajectory, turn by turn."""
    return [c for tr in traj.turns for c in tr.tool_calls]


def call_counts(traj: Any) -> dict[str, Any]:
    """``{"calls", "ok", "failed", "not_executed", "executed", "executed_ok", "infra_retries", "kinds": Counter}``
    of one trajectory."""
    calls = calls_of(traj)
    kinds = Counter(classify_call(c) for c in calls)
    kinds.pop(None, 0)
    ok = sum(bool(c.ok) for c in calls)
    not_executed = kinds.pop("not_executed", 0)
    return {
        "calls": len(calls),
        "ok": ok,
        "failed": len(calls) - ok - not_executed,
        "not_executed": not_executed,
        "executed": sum(bool(c.executed) for c in calls),
        "executed_ok": sum(bool(c.executed and c.ok) for c in calls),
        "infra_retries": sum(getattr(c, "infra_retries", 0) for c in calls),
        "kinds": kinds,
    }


#: the keys of :func:`episode_counts`
COUNT_KEYS = (
    "calls",
    "ok",
    "failed",
    "not_executed",
    "executed",
    "executed_ok",
    "errors",
    "malformed",
    "infra_retries",
) + tuple(f"kind_{k}" for k in ERROR_KINDS if k != "not_executed")


def episode_counts(traj: Any) -> dict[str, float]:
    """One trajectory's tool-use counts as flat numbers (a row of a verl batch's reward extra info);
    :func:`pooled_tool_metrics` turns rows of them into the figures."""
    c = call_counts(traj)
    row = {
        **{k: v for k, v in c.items() if k != "kinds"},
        "errors": traj.tool_errors,
        "malformed": traj.malformed_calls,
    }
    for kind in ERROR_KINDS:
        if kind != "not_executed":
            row[f"kind_{kind}"] = c["kinds"].get(kind, 0)
    return {k: float(row[k]) for k in COUNT_KEYS}


def pooled_tool_metrics(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The tool-use figures (see the module docstring) of episodes given by their
    :func:`episode_counts` rows."""
    n = len(rows)
    if not n:
        return {}

    def total(key: str) -> float:
        return float(sum(float(r.get(key, 0.0)) for r in rows))

    calls, ok, failed, executed = total("calls"), total("ok"), total("failed"), total("executed")
    out = {
        "tools/calls": calls,
        "tools/ok": ok,
        "tools/failed": failed,
        "tools/not_executed": total("not_executed"),
        "tools/success_rate": ok / (ok + failed) if ok + failed else math.nan,
        "tools/executed_success_rate": total("executed_ok") / executed if executed else math.nan,
        "tools/call_rate": sum(float(r.get("calls", 0.0)) > 0 for r in rows) / n,
        "tools/calls_per_episode": calls / n,
        "tools/errors_per_episode": total("errors") / n,
        "tools/malformed_per_episode": total("malformed") / n,
        "errors/total": failed,
        # infrastructure events the model did not see: calls re-run after their worker was killed
        "tools/infra_retries": total("infra_retries"),
    }
    for kind in ERROR_KINDS:
        if kind == "not_executed":
            continue
        count = total(f"kind_{kind}")
        if kind in SHOWN_ERROR_KINDS or count:
            out[f"errors/{kind}"] = count
            out[f"errors/{kind}_per_call"] = count / calls if calls else math.nan
    return out


def tool_metrics(trajs: Sequence[Any]) -> dict[str, float]:
    """The tool-use figures of a set of trajectories (see the module docstring)."""
    return pooled_tool_metrics([episode_counts(t) for t in trajs])
