"""Tool-use traces for the SFT warm start of the tiny policy (:mod:`otb_tir.defaults.warm_start`).

The traces are chat conversations in the default hermes format, rendered by the policy's chat
template with the ``python`` and ``calculator`` tool schemas (taken from ``tools.get_tool``, the
same schemas an episode puts in the system prompt). A :class:`TraceMixture` sets how often a trace

* solves the problem with a correct ``calculator`` call (``tool``) or a ``python`` ``print(...)``
  (``python``): the real tool is run and its output returned in a ``tool`` message, then the
  assistant writes ``The answer is \\boxed{<result>}.``;
* answers directly without a tool (``guess``): right with probability ``guess_right``, otherwise a
  near miss (one digit changed);
* calls the calculator with a corrupted expression (``wrong_tool``: one digit of the expression
  changed) and boxes the wrong result the tool returns.

For the stepped tasks (``data.task=chain``: two dependent steps; ``multistep``: three or four) a
``tool`` trace makes one calculator call per step, each on the previous call's output, and
``stop_early`` boxes the first step's result instead (chain); a multistep trace stops after each
call with probability ``STOP_HAZARD`` and boxes the last result it has (right only after every call).
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from otb_tir import ConfigError
from tools.assembly import DEFAULT_TOOLS

logger = logging.getLogger(__name__)

#: Kinds whose expression Python's ``print`` evaluates to the exact answer.
_PYTHON_KINDS = ("mul", "add", "pow", "mod")

#: Default per-kind probability that a trace uses a tool (the rest are direct guesses): kinds
#: where the warm start mostly calls a tool, and "guess-leaning" kinds where greedy decoding
#: guesses (and is wrong) but sampling at T=1 still calls the tool often enough for RL to
#: reinforce it.
DEFAULT_TOOL_SHARE: dict[str, float] = {
    "linear": 0.9,
    "pow": 0.9,
    "mod": 0.9,
    "mul": 0.3,
    "add": 0.3,
    "div": 0.3,
    "frac": 0.3,
    "quadratic": 0.3,
}


@dataclass(frozen=True)
class TraceMixture:
    """Relative weights of the trace types, and how often a direct guess is right.

    ``tool_share`` (per problem kind, in [0, 1]) overrides the weights' overall tool share for the
    kinds it names: a trace of such a kind uses a tool with that probability (split between
    ``tool``, ``python`` and ``wrong_tool`` in their weights' proportions) and guesses otherwise.
    """

    tool: float = 0.9
    python: float = 0.1
    guess: float = 1.0
    wrong_tool: float = 0.0
    #: the chain task: make the first step's call, then box its result (a wrong answer) instead
    #: of calling the tool for the second step (multistep traces stop by ``STOP_HAZARD`` instead)
    stop_early: float = 0.0
    guess_right: float = 0.25
    tool_share: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TOOL_SHARE))

    def validate(self) -> None:
        weights = (self.tool, self.python, self.guess, self.wrong_tool, self.stop_early)
        if any(not isinstance(w, (int, float)) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"trace mixture weights must be >= 0 with a positive sum, got {self}")
        if not 0 <= self.guess_right <= 1:
            raise ConfigError(f"guess_right must be in [0, 1], got {self.guess_right}")
        from agent_env.math_task.data import KINDS, STEPPED_KINDS

        for kind, share in self.tool_share.items():
            if kind not in KINDS + STEPPED_KINDS:
                raise ConfigError(
                    f"tool_share names unknown problem kind {kind!r}; kinds: {', '.join(KINDS + STEPPED_KINDS)}"
                )
            if not isinstance(share, (int, float)) or not 0 <= share <= 1:
                raise ConfigError(f"tool_share[{kind!r}] must be in [0, 1], got {share!r}")
        if any(self.tool_share.get(k, 0) > 0 for k in KINDS) and self.tool + self.python + self.wrong_tool <= 0:
            raise ConfigError("tool_share > 0 needs a positive tool, python or wrong_tool weight")

    def mode_weights(self, kind: str) -> dict[str, float]:
        """Probabilities of ``tool`` / ``python`` / ``guess`` / ``wrong_tool`` / ``stop_early`` for one
        problem kind (``stop_early`` only for the stepped tasks' kinds, ``python`` only where ``print``
        of the expression is the answer)."""
        from agent_env.math_task.data import STEPPED_KINDS

        w = {
            "tool": self.tool,
            "python": self.python if kind in _PYTHON_KINDS else 0.0,
            "guess": self.guess,
            "wrong_tool": self.wrong_tool,
            "stop_early": self.stop_early if kind in STEPPED_KINDS else 0.0,
        }
        if kind in self.tool_share:
            tools = w["tool"] + w["python"] + w["wrong_tool"] + w["stop_early"]
            share = self.tool_share[kind] if tools > 0 else 0.0
            w = {m: (v / tools * share if tools > 0 else 0.0) for m, v in w.items() if m != "guess"} | {
                "guess": 1 - share
            }
        total = sum(w.values())
        if total <= 0:
            return {"tool": 1.0, "python": 0.0, "guess": 0.0, "wrong_tool": 0.0, "stop_early": 0.0}
        return {m: v / total for m, v in w.items()}


_EQUATION = re.compile(r"(?:Solve for x: |Find x if |solution of |largest x with )(.+ = -?\d+)[.?]$")


def reference_call(item: dict[str, Any]) -> tuple[str, str]:
    """The ``calculator`` expression a trace uses for a built-in problem: the question's equation
    copied verbatim for ``linear`` / ``quadratic`` (the calculator solves ``=``; the answer is the
    last root it prints), else ``extra_info["expression"]`` (its numbers are the question's, in
    order). Returns ``("calculator", expression)``."""
    info = item["extra_info"]
    if info.get("kind") in ("linear", "quadratic"):
        m = _EQUATION.search(info.get("question", ""))
        if m:
            return "calculator", m.group(1)
    return "calculator", info["expression"]


def final_answer_from_result(result: str) -> str:
    """What a trace boxes after a tool call: the tool output, or for an equation's solutions
    (``x = -12, x = 5``) the last (largest) root."""
    text = result.strip()
    if text.startswith("x = "):
        return text.rsplit("x = ", 1)[-1].strip()
    return text


def tool_schemas(names: Sequence[str] = DEFAULT_TOOLS) -> list[dict[str, Any]]:
    """OpenAI-style schemas of the named tools, exactly as an episode renders them."""
    from tools import get_tool  # tools.registry

    return [get_tool(name).schema() for name in names]


def _perturb_number(text: str, rng: random.Random) -> str:
    """Change one digit of ``text`` (a different digit; no new leading zero)."""
    digits = [i for i, ch in enumerate(text) if ch.isdigit()]
    if not digits:
        return text + "1"
    i = rng.choice(digits)
    leading = (i == 0 or not text[i - 1].isdigit()) and i + 1 < len(text) and text[i + 1].isdigit()
    choices = [d for d in "0123456789" if d != text[i] and not (leading and d == "0")]
    return text[:i] + rng.choice(choices) + text[i + 1 :]


@dataclass
class _Plan:
    """A trace before its tool results are known."""

    item: dict[str, Any]
    mode: str
    call: dict[str, Any] | None = None
    answer: str | None = None  # final boxed answer for traces without a call
    result: str | None = None  # filled in by running the tool
    #: the stepped tasks: calculator expressions of the later steps, ``{r}`` standing for the previous
    #: step's result (filled in, and run, by ``_run_plans``)
    follow: list[str] = field(default_factory=list)
    follow_calls: list[dict[str, Any]] = field(default_factory=list)
    follow_results: list[str] = field(default_factory=list)


#: multistep (three or four steps): a calculator trace stops after each call with this
#: probability (so the warm start's policy, like the traces, stops more often than it goes on at
#: every step: greedy decoding stops after the first call, sampling finishes some problems, and RL
#: has each later call to learn; docs/training.md has the measured accuracy before RL)
STOP_HAZARD = 0.4


def _calls_made(n_steps: int, rng: random.Random) -> int:
    """How many of its ``n_steps`` calls a multistep trace makes: it stops after each with
    probability :data:`STOP_HAZARD` (one draw per call made before the last)."""
    made = 1
    while made < n_steps and rng.random() >= STOP_HAZARD:
        made += 1
    return made


def plan_trace(item: dict[str, Any], rng: random.Random, mixture: TraceMixture) -> _Plan:
    """Pick a trace type for one built-in problem and its tool call (if any)."""
    kind = item["extra_info"]["kind"]
    expr = item["extra_info"]["expression"]
    truth = item["reward_model"]["ground_truth"]
    modes, w = zip(*mixture.mode_weights(kind).items())
    mode = rng.choices(modes, weights=w)[0]
    steps = list(item["extra_info"].get("steps") or [])
    if steps:  # the stepped tasks: one calculator call per step, each on the previous step's result
        first = steps[0] if mode != "wrong_tool" else _perturb_number(steps[0], rng)
        if mode in ("tool", "wrong_tool", "stop_early"):
            follow = steps[1:]
            if len(steps) > 2 and mode in ("tool", "stop_early"):  # multistep: stop after each call w.p. h
                follow = steps[1 : _calls_made(len(steps), rng)]
            elif mode == "stop_early":  # chain: stop after the first call
                follow = []
            return _Plan(item, mode, {"name": "calculator", "arguments": {"expression": first}}, follow=follow)
    name, call_expr = reference_call(item)
    if mode == "tool":
        return _Plan(item, mode, {"name": name, "arguments": {"expression": call_expr}})
    if mode == "python":
        return _Plan(item, mode, {"name": "python", "arguments": {"code": f"print({expr})"}})
    if mode == "wrong_tool":
        return _Plan(item, mode, {"name": name, "arguments": {"expression": _perturb_number(call_expr, rng)}})
    answer = truth if rng.random() < mixture.guess_right else _perturb_number(truth, rng)
    return _Plan(item, mode, answer=answer)


def _final(answer: str) -> dict[str, Any]:
    return {"role": "assistant", "content": f"The answer is \\boxed{{{answer}}}."}


def plan_messages(plan: _Plan) -> list[dict[str, Any]]:
    """The conversation of a planned trace (tool results must be filled in already)."""
    messages: list[dict[str, Any]] = [dict(m) for m in plan.item["prompt"]]
    if plan.call is None:
        return messages + [_final(plan.answer)]
    if plan.result is None:
        raise ConfigError("run the tool calls (run_plans) before rendering a tool trace")
    if len(plan.follow_results) != len(plan.follow):
        raise ConfigError("run the tool calls (run_plans) before rendering a chain trace")
    result = plan.result
    for call, res in [(plan.call, plan.result), *zip(plan.follow_calls, plan.follow_results)]:
        messages.append({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]})
        messages.append({"role": "tool", "content": res})
        result = res
    messages.append(_final(final_answer_from_result(result)))
    return messages


async def _run_plans(plans: list[_Plan], concurrency: int = 8, in_process: bool = True) -> None:
    """Fill in the plans' tool results. ``python`` calls run in the real tool's sandbox; with
    ``in_process`` the ``calculator`` calls run its evaluator here (``tools.calculator.calculate``,
    the code the tool's sandboxed snippet runs, with the tool's result cap), the same text for
    these small trusted expressions (a test checks it against the tool) without a sandboxed
    process per call: ~20 s less on the 2-core VM for the default 3,000 traces."""
    from tools import get_tool
    from tools.calculator import calculate

    names = sorted({p.call["name"] for p in plans if p.call is not None} | {"calculator" for p in plans if p.follow})
    if in_process:
        names = [n for n in names if n != "calculator"]
    tools = {name: get_tool(name) for name in names}
    calc_chars = get_tool("calculator").max_result_chars if in_process else 0
    sem = asyncio.Semaphore(concurrency)

    async def run(call: dict[str, Any]) -> str:
        if in_process and call["name"] == "calculator":
            return calculate(call["arguments"]["expression"], max_chars=calc_chars)[2]
        return (await tools[call["name"]].call(call["arguments"])).text

    async def one(plan: _Plan) -> None:
        async with sem:
            text = await run(plan.call)
            plan.result = text
            for template in plan.follow:  # the stepped tasks: the next step on this step's result
                call = {
                    "name": "calculator",
                    "arguments": {"expression": template.format(r=final_answer_from_result(text))},
                }
                text = await run(call)
                plan.follow_calls.append(call)
                plan.follow_results.append(text)

    try:
        await asyncio.gather(*(one(p) for p in plans if p.call is not None))
    finally:
        for tool in tools.values():
            await tool.close()


def make_traces(
    n: int, seed: int = 0, mixture: TraceMixture | None = None, task: str = "arith", *, in_process: bool = True
) -> list[list[dict[str, Any]]]:
    """``n`` SFT conversations on built-in *train* problems of ``task``, tool results from the real
    tools (``calculator`` evaluated in this process with ``in_process``: see ``_run_plans``)."""
    from agent_env.math_task.data import make_split

    mixture = mixture or TraceMixture()
    mixture.validate()
    rng = random.Random(f"warm-start-traces:{seed}" if task == "arith" else f"warm-start-traces:{task}:{seed}")
    plans = [plan_trace(item, rng, mixture) for item in make_split("train", n, seed=seed, task=task)]
    asyncio.run(_run_plans(plans, in_process=in_process))
    return [plan_messages(p) for p in plans]


# ----------------------------------------------------------------------------- cached policy
