"""SFT warm start of the tiny policy on generated tool-use traces, cached on disk.

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

For the chain task (``data.task=chain``, two dependent steps) a ``tool`` trace makes one
calculator call per step, the second on the first call's output, and ``stop_early`` boxes the
first step's result instead; :func:`task_warm_start` builds that policy from the arith one.

The mixture deliberately leaves the policy *inconsistent* at using tools, so that RL has room to
improve it. :func:`warm_start_policy` trains briefly on CPU, in two phases (``copy_steps`` on the
tool-call traces only, where the policy learns to copy the question into its calls, then
``steps`` on the whole mixture), and caches the result under the user's
cache directory keyed by every setting; ``python -m otb_tir.defaults.warm_start --check`` builds it
and prints its tool-call rate and held-out accuracy with and without tool execution, read from the
tool-use evaluation's episodes (``AgentEnv``, the real tools; :func:`evaluate_tool_use`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from otb_tir import ConfigError
from otb_tir.trainer.sft import SFTConfig, sft_train, tokenize_conversation
from tools.assembly import DEFAULT_TOOLS

logger = logging.getLogger(__name__)

#: Bump when trace generation or training code changes: cached folders are keyed on it.
WARM_VERSION = 3
#: Kinds whose expression Python's ``print`` evaluates to the exact answer.
_PYTHON_KINDS = ("mul", "add", "pow", "mod")
_MARKER = "otb_tir_warm_start.json"


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
    #: the chain task only: make the first step's call, then box its result (the intermediate,
    #: a wrong answer) instead of calling the tool for the second step
    stop_early: float = 0.0
    guess_right: float = 0.25
    tool_share: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TOOL_SHARE))

    def validate(self) -> None:
        weights = (self.tool, self.python, self.guess, self.wrong_tool, self.stop_early)
        if any(not isinstance(w, (int, float)) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"trace mixture weights must be >= 0 with a positive sum, got {self}")
        if not 0 <= self.guess_right <= 1:
            raise ConfigError(f"guess_right must be in [0, 1], got {self.guess_right}")
        from agent_env.math_task.data import CHAIN_KINDS, KINDS

        for kind, share in self.tool_share.items():
            if kind not in KINDS + CHAIN_KINDS:
                raise ConfigError(
                    f"tool_share names unknown problem kind {kind!r}; kinds: {', '.join(KINDS + CHAIN_KINDS)}"
                )
            if not isinstance(share, (int, float)) or not 0 <= share <= 1:
                raise ConfigError(f"tool_share[{kind!r}] must be in [0, 1], got {share!r}")
        if any(self.tool_share.get(k, 0) > 0 for k in KINDS) and self.tool + self.python + self.wrong_tool <= 0:
            raise ConfigError("tool_share > 0 needs a positive tool, python or wrong_tool weight")

    def mode_weights(self, kind: str) -> dict[str, float]:
        """Probabilities of ``tool`` / ``python`` / ``guess`` / ``wrong_tool`` / ``stop_early`` for one
        problem kind (``stop_early`` only for the chain task's kinds, ``python`` only where ``print``
        of the expression is the answer)."""
        from agent_env.math_task.data import CHAIN_KINDS

        w = {
            "tool": self.tool,
            "python": self.python if kind in _PYTHON_KINDS else 0.0,
            "guess": self.guess,
            "wrong_tool": self.wrong_tool,
            "stop_early": self.stop_early if kind in CHAIN_KINDS else 0.0,
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
    #: the chain task: calculator expressions of the later steps, ``{r}`` standing for the previous
    #: step's result (filled in, and run, by ``_run_plans``)
    follow: list[str] = field(default_factory=list)
    follow_calls: list[dict[str, Any]] = field(default_factory=list)
    follow_results: list[str] = field(default_factory=list)


def plan_trace(item: dict[str, Any], rng: random.Random, mixture: TraceMixture) -> _Plan:
    """Pick a trace type for one built-in problem and its tool call (if any)."""
    kind = item["extra_info"]["kind"]
    expr = item["extra_info"]["expression"]
    truth = item["reward_model"]["ground_truth"]
    modes, w = zip(*mixture.mode_weights(kind).items())
    mode = rng.choices(modes, weights=w)[0]
    steps = list(item["extra_info"].get("steps") or [])
    if steps:  # the chain task: one calculator call per step, each on the previous step's result
        first = steps[0] if mode != "wrong_tool" else _perturb_number(steps[0], rng)
        if mode in ("tool", "wrong_tool", "stop_early"):
            follow = [] if mode == "stop_early" else steps[1:]
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
            for template in plan.follow:  # the chain task: the next step on this step's result
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


@dataclass(frozen=True)
class WarmStartSettings:
    """Everything that determines a warm start (its cache key, with the base model's config)."""

    steps: int = 400
    #: steps of a first phase on the tool-call traces only: the policy learns to copy the
    #: question's numbers into the call (an induction-style skill that appears abruptly, after
    #: ~600 steps here) before the full mixture sets when it calls a tool
    copy_steps: int = 800
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 1.0  # learning rate after the cosine decay, relative to ``lr`` (1 = constant)
    n_traces: int = 3000
    seed: int = 0
    hidden_size: int = 128  # the built-in base model's size (ignored with an explicit ``base``)
    layers: int = 4
    mixture: TraceMixture = field(default_factory=TraceMixture)
    task: str = "arith"  # the built-in task whose train problems the traces solve (arith | chain)

    def validate(self) -> None:
        from agent_env.math_task.data import TASKS

        if self.task not in TASKS:
            raise ConfigError(f"warm start task must be one of {list(TASKS)}, got {self.task!r}")
        if not isinstance(self.copy_steps, int) or isinstance(self.copy_steps, bool) or self.copy_steps < 0:
            raise ConfigError(f"warm start copy_steps must be an int >= 0, got {self.copy_steps!r}")
        for name in ("steps", "batch_size", "n_traces", "hidden_size", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"warm start {name} must be a positive int, got {value!r}")
        if self.hidden_size % 64:
            raise ConfigError(
                f"warm start hidden_size must be a multiple of 64 (the head size), got {self.hidden_size}"
            )
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.steps:
            raise ConfigError(f"warm start warmup_steps must be in [0, steps), got {self.warmup_steps!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"warm start min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        self.mixture.validate()
        from agent_env.math_task.data import KINDS

        if self.copy_steps and not any(self.mixture.mode_weights(k)["guess"] < 1 for k in KINDS):
            raise ConfigError(
                "copy_steps > 0 needs a mixture with tool-call traces (every kind only guesses); "
                "set copy_steps=0 or give some kind a tool share"
            )
        self.sft_config().validate()

    def sft_config(self, progress: bool = False) -> SFTConfig:
        return SFTConfig(
            steps=self.steps,
            batch_size=self.batch_size,
            lr=self.lr,
            seed=self.seed,
            warmup_steps=self.warmup_steps,
            min_lr_ratio=self.min_lr_ratio,
            progress=progress,
        )

    def copy_sft_config(self, progress: bool = False) -> SFTConfig:
        """The first (tool traces only) phase: same optimiser settings, ``copy_steps`` steps."""
        return replace(
            self.sft_config(progress),
            steps=self.copy_steps,
            seed=self.seed + 1,
            warmup_steps=min(self.warmup_steps, self.copy_steps - 1),
            min_lr_ratio=1.0,
        )

    def base_model_overrides(self) -> dict[str, int]:
        """Keyword arguments of ``otb_tir.defaults.tiny.tiny_policy_dir`` for this base size."""
        return {
            "hidden_size": self.hidden_size,
            "layers": self.layers,
            "heads": self.hidden_size // 64,
            "kv_heads": max(1, self.hidden_size // 128),
            "head_dim": 64,
            "intermediate_size": 3 * self.hidden_size,
        }


def warm_start_policy(
    cache_dir: str | os.PathLike | None = None,
    *,
    steps: int | None = None,
    seed: int = 0,
    n_traces: int | None = None,
    batch_size: int | None = None,
    copy_steps: int | None = None,
    lr: float | None = None,
    hidden_size: int | None = None,
    layers: int | None = None,
    warmup_steps: int | None = None,
    mixture: TraceMixture | None = None,
    base: str | os.PathLike | None = None,
    task: str = "arith",
    progress: bool = True,
) -> Path:
    """The tiny policy after a short SFT on generated traces: an HF folder (model + tokenizer with
    its chat template) loadable by ``AutoModelForCausalLM`` / ``AutoTokenizer`` and vLLM.

    Arguments left as ``None`` take :class:`WarmStartSettings`' defaults. Built once and cached as
    ``<cache root>/warm-<hash of every setting>`` (``cache_dir`` overrides the root, default
    ``$OTB_TIR_CACHE`` or ``~/.cache/otb_tir``) by :func:`agent_env.cache.publish` (one build under
    a lock, written to a temporary sibling and renamed into place). ``base`` is the folder to start
    from (default: the built-in tiny model of ``hidden_size`` × ``layers``,
    ``otb_tir.defaults.tiny.tiny_policy_dir(cache_dir, ...)``). A ``otb_tir_warm_start.json`` in the
    folder records the settings, the loss curve and the build times. Bad settings raise
    :class:`ConfigError` before any work.
    """
    from agent_env.cache import artifact_dir, publish
    from otb_tir.defaults.tiny import tiny_policy_dir

    given = {
        "steps": steps,
        "copy_steps": copy_steps,
        "n_traces": n_traces,
        "batch_size": batch_size,
        "lr": lr,
        "hidden_size": hidden_size,
        "layers": layers,
        "warmup_steps": warmup_steps,
    }
    settings = WarmStartSettings(
        seed=seed, mixture=mixture or TraceMixture(), task=task, **{k: v for k, v in given.items() if v is not None}
    )
    settings.validate()
    base_path = Path(base) if base is not None else tiny_policy_dir(cache_dir, **settings.base_model_overrides())
    if not (base_path / "config.json").is_file():
        raise ConfigError(f"base policy folder {base_path} has no config.json (not an HF model folder)")
    schemas = tool_schemas()
    key = {
        "version": WARM_VERSION,
        "settings": asdict(settings),
        "base": str(base_path.resolve()),
        "base_config": (base_path / "config.json").read_text(),
        "tools": schemas,
    }
    final = artifact_dir(cache_dir, "warm", key)

    def build(tmp: Path) -> dict[str, Any]:
        model, tokenizer, record = _train(settings, base_path, schemas, progress)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        losses = record["losses"]
        logger.info(
            "warm start cached in %s (traces %.1f s, training %.1f s, final loss %.3f)",
            final,
            record["trace_seconds"],
            record["train_seconds"],
            sum(losses[-10:]) / len(losses[-10:]),
        )
        return record

    return publish(final, _MARKER, build, {"key": key | {"base_config": None}})


def _train(
    settings: WarmStartSettings, base_path: Path, schemas: list[dict[str, Any]], progress: bool
) -> tuple[Any, Any, dict[str, Any]]:
    """Both SFT phases from ``base_path``: the trained model, its tokenizer and the build's record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    logger.info("warm start: generating %d traces", settings.n_traces)
    traces = make_traces(settings.n_traces, seed=settings.seed, mixture=settings.mixture, task=settings.task)
    examples = [tokenize_conversation(tokenizer, m, tools=schemas) for m in traces]
    t1 = time.perf_counter()
    losses: list[float] = []
    if settings.copy_steps:
        with_call = [e for e, m in zip(examples, traces) if any(x.get("tool_calls") for x in m)]
        if not with_call:
            raise ConfigError("copy_steps > 0 needs traces with tool calls (the mixture has none)")
        logger.info("warm start phase 1: %d steps on the %d tool-call traces", settings.copy_steps, len(with_call))
        losses += sft_train(model, with_call, tokenizer.pad_token_id, settings.copy_sft_config(progress=progress))
    logger.info("warm start phase 2: %d steps on all %d traces", settings.steps, len(examples))
    losses += sft_train(model, examples, tokenizer.pad_token_id, settings.sft_config(progress=progress))
    t2 = time.perf_counter()
    return (
        model,
        tokenizer,
        {
            "losses": losses,
            "trace_seconds": t1 - t0,
            "train_seconds": t2 - t1,
            "tokens_per_example": sum(len(e.input_ids) for e in examples) / len(examples),
        },
    )


#: The chain task's trace mixture: both steps' calls (``tool``) less often than stopping after
#: the first step's call and boxing its intermediate result (``stop_early``, wrong), so greedy
#: decoding starts mostly wrong and RL has to learn to make the second call; direct guesses of
#: an unguessable answer are always wrong.
CHAIN_MIXTURE = TraceMixture(
    tool=0.3, python=0.0, guess=0.2, wrong_tool=0.0, stop_early=0.5, guess_right=0.0, tool_share={}
)
#: SFT steps and traces of the chain task's warm start (continued from the arith warm start).
CHAIN_STEPS = 400
CHAIN_TRACES = 2000


def task_warm_start(
    task: str = "arith",
    cache_dir: str | os.PathLike | None = None,
    *,
    steps: int | None = None,
    copy_steps: int | None = None,
    n_traces: int | None = None,
    chain_steps: int = CHAIN_STEPS,
    progress: bool = True,
) -> Path:
    """The built-in policy warm-started for ``task`` (``data.task``): the arith warm start
    (:func:`warm_start_policy` with ``steps`` / ``copy_steps`` / ``n_traces``), and for ``chain`` that policy after
    ``chain_steps`` more SFT steps on chain-task traces (:data:`CHAIN_MIXTURE`; cached likewise)."""
    warmup = None if steps is None else min(WarmStartSettings.warmup_steps, steps - 1)  # short test builds
    base = warm_start_policy(
        cache_dir, steps=steps, copy_steps=copy_steps, n_traces=n_traces, warmup_steps=warmup, seed=0, progress=progress
    )
    if task == "arith":
        return base
    return warm_start_policy(
        cache_dir,
        base=base,
        task=task,
        steps=chain_steps,
        copy_steps=0,
        n_traces=CHAIN_TRACES,
        warmup_steps=min(50, chain_steps - 1),
        mixture=CHAIN_MIXTURE,
        seed=0,
        progress=progress,
    )


# ----------------------------------------------------------------------------- quick check


@dataclass
class ToolUseReport:
    """Figures of :func:`evaluate_tool_use` (rates in [0, 1]), read from the episodes of an
    evaluation run (:func:`tool_use_report`)."""

    n: int
    temperature: float
    accuracy: float  # with the tool calls executed (up to ``max_turns`` assistant turns)
    accuracy_without_tools: float  # first-turn direct answers only (tool calls not executed)
    tool_call_rate: float  # episodes whose first turn makes a tool call
    #: tool calls that parse, name a tool of the set and pass its arguments (none of
    #: ``agent_env.tool_metrics.MALFORMED_KINDS``; a call on the last allowed turn is not executed,
    #: so only its parse and its tool name count)
    well_formed_rate: float
    tool_success_rate: float  # executed calls that returned ok (the evaluation's tools/executed_success_rate)
    by_kind: dict[str, float] = field(default_factory=dict)  # accuracy with tools, per problem kind
    #: per problem kind: ``n``, ``accuracy``, ``tool_call_rate`` (first turn calls a tool),
    #: ``call_exact`` (of first calls: the argument is the reference call, or its result contains the
    #: answer), ``copy_out`` (of episodes whose first call returned the answer: the boxed answer is
    #: right), ``guess_rate`` / ``guess_accuracy`` (first turn answers without a tool)
    breakdown: dict[str, dict[str, float]] = field(default_factory=dict)


def tool_use_report(report: dict[str, Any], items: list[dict[str, Any]]) -> ToolUseReport:
    """The :class:`ToolUseReport` of an evaluation report (:func:`otb_tir.evaluation.evaluate`, with
    its per-episode ``records``, one sample per problem) over ``items``, the problems it ran."""
    from agent_env.tool_metrics import MALFORMED_KINDS

    if "records" not in report:
        raise ConfigError("the evaluation report has no per-episode records (output.records=false)")
    recs = sorted(report["records"]["with_tools"], key=lambda r: (r["problem_index"], r["sample_index"]))
    if [r["problem_index"] for r in recs] != list(range(len(items))):
        raise ConfigError(f"expected one episode per problem for {len(items)} problems, got {len(recs)} episodes")
    tools = set(report["meta"]["tools"])
    first_calls = [r["turns"][0]["tool_calls"] if r["turns"] else [] for r in recs]
    correct = [bool(r["correct"]) for r in recs]
    first_call = [bool(calls) for calls in first_calls]
    # a first turn without a tool call ends the episode: its answer is the episode's
    first_correct = [ok and not called for ok, called in zip(correct, first_call)]
    first_args = [
        {"name": calls[0]["name"], **(calls[0]["arguments"] or {})} if calls else None for calls in first_calls
    ]
    first_result = [calls[0]["result"] if calls and calls[0]["executed"] else None for calls in first_calls]
    calls = [c for r in recs for turn in r["turns"] for c in turn["tool_calls"]]
    well_formed = sum(c["error"] not in MALFORMED_KINDS and c["name"] in tools for c in calls)
    overall = report["with_tools"]["overall"]
    n = len(items)
    return ToolUseReport(
        n=n,
        temperature=float(report["meta"]["temperature"]),
        accuracy=sum(correct) / n,
        accuracy_without_tools=sum(first_correct) / n,
        tool_call_rate=sum(first_call) / n,
        well_formed_rate=well_formed / len(calls) if calls else 0.0,
        tool_success_rate=overall.get("tools/executed_success_rate") or 0.0,
        by_kind={k: f["accuracy/mean@n"] for k, f in sorted((report["with_tools"].get("by_kind") or {}).items())},
        breakdown=_breakdown(items, correct, first_call, first_correct, first_args, first_result),
    )


def _numbers(text: str | None) -> list[str]:
    return re.findall(r"-?\d+(?:/\d+)?", text or "")


def _breakdown(items, correct, first_call, first_correct, first_args, first_result) -> dict[str, dict[str, float]]:
    """Where the errors are, per problem kind: translating/copying the question into the call,
    copying the result out, or guessing."""
    rows: dict[str, dict[str, int]] = {}
    for i, it in enumerate(items):
        kind = it["extra_info"].get("kind", "?")
        truth = it["reward_model"]["ground_truth"]
        r = rows.setdefault(
            kind,
            {
                "n": 0,
                "correct": 0,
                "calls": 0,
                "exact": 0,
                "answer_in_result": 0,
                "copied_out": 0,
                "guesses": 0,
                "guesses_right": 0,
            },
        )
        r["n"] += 1
        r["correct"] += int(correct[i])
        if first_call[i]:
            r["calls"] += 1
            refs = {reference_call(it)[1], f"print({it['extra_info'].get('expression')})"}
            refs |= set((it["extra_info"].get("steps") or [])[:1])  # the chain task: its first step
            arg = first_args[i] or {}
            given = arg.get("expression", arg.get("code"))
            has_answer = first_result[i] is not None and _numbers(first_result[i])[-1:] == [truth]
            r["exact"] += int(
                isinstance(given, str) and given.replace(" ", "") in {x.replace(" ", "") for x in refs} or has_answer
            )
            r["answer_in_result"] += int(has_answer)
            r["copied_out"] += int(has_answer and correct[i])
        else:
            r["guesses"] += 1
            r["guesses_right"] += int(first_correct[i])
    out = {}
    for kind, r in sorted(rows.items()):
        out[kind] = {
            "n": r["n"],
            "accuracy": r["correct"] / r["n"],
            "tool_call_rate": r["calls"] / r["n"],
            "call_exact": r["exact"] / r["calls"] if r["calls"] else float("nan"),
            "copy_out": r["copied_out"] / r["answer_in_result"] if r["answer_in_result"] else float("nan"),
            "guess_rate": r["guesses"] / r["n"],
            "guess_accuracy": r["guesses_right"] / r["guesses"] if r["guesses"] else float("nan"),
        }
    return out


def check_config(
    path: str | os.PathLike,
    n: int,
    *,
    temperature: float = 1.0,
    max_turns: int = 3,
    max_new_tokens: int = 96,
    seed: int = 0,
    output_dir: str | os.PathLike = "runs/warm_start_check",
):
    """The evaluation config of :func:`evaluate_tool_use`: the shipped ``eval_tool_use.yaml`` (its
    tools, tool-response truncation and timeouts, the HF engine) with one sample per problem, the
    given temperature, seed and turn caps, a response budget that never binds before them, and no
    tools-disabled pass."""
    from otb_tir.evaluation import load_eval_config
    from otb_tir.evaluation.config import DEFAULT_CONFIG

    overrides = [
        f"model.path={Path(path)}",
        f"data.size={n}",
        "rollout.n=1",
        f"rollout.temperature={temperature}",
        f"rollout.max_tokens_per_turn={max_new_tokens}",
        f"multi_turn.max_assistant_turns={max_turns}",
        "eval.pass_k=[1]",
        "eval.without_tools=false",
        f"eval.seed={seed}",
        f"output.dir={output_dir}",
        "output.name=warm_start_check",
        "output.records=true",
        "output.plots=false",
        "output.progress=false",
    ]
    tool_tokens = load_eval_config(DEFAULT_CONFIG, overrides).multi_turn.max_tool_response_length
    budget = max_turns * max_new_tokens + (max_turns - 1) * (tool_tokens + 32)  # + the template's markup
    return load_eval_config(DEFAULT_CONFIG, overrides + [f"rollout.response_length={budget}"])


def evaluate_tool_use(
    path: str | os.PathLike,
    items: list[dict[str, Any]],
    *,
    temperature: float = 1.0,
    max_turns: int = 3,
    max_new_tokens: int = 96,
    seed: int = 0,
    report_dir: str | os.PathLike | None = None,
) -> ToolUseReport:
    """Run the policy at ``path`` on ``items`` with the tool-use evaluation
    (:func:`otb_tir.evaluation.evaluate`: ``AgentEnv`` episodes with the real tools, scored by the
    math reward; one sample per problem, config :func:`check_config`) and read the report's
    figures (:func:`tool_use_report`). ``temperature=0`` is greedy decoding. The evaluation's
    own report is written to ``report_dir`` (default: a temporary folder, removed).
    """
    from otb_tir.evaluation import evaluate, prepare

    with tempfile.TemporaryDirectory(prefix="warm_start_check-") as tmp:
        cfg = check_config(
            path,
            len(items),
            temperature=temperature,
            max_turns=max_turns,
            max_new_tokens=max_new_tokens,
            seed=seed,
            output_dir=report_dir or tmp,
        )
        prep = replace(prepare(cfg), items=list(items), data_desc=f"{len(items)} given problems")
        report = evaluate(cfg, prep)
    return tool_use_report(report, list(items))


def main(argv: list[str] | None = None) -> None:
    import argparse

    from agent_env.math_task.data import make_split

    ap = argparse.ArgumentParser(description="Build (or reuse) the cached warm-start policy and check it.")
    d = WarmStartSettings()
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--copy-steps", type=int, default=d.copy_steps)
    ap.add_argument("--n-traces", type=int, default=d.n_traces)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    ap.add_argument("--hidden-size", type=int, default=d.hidden_size)
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", default="arith", choices=["arith", "chain"], help="chain: + the chain task's SFT")
    ap.add_argument("--chain-steps", type=int, default=CHAIN_STEPS)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--check", type=int, default=0, metavar="N", help="evaluate on N held-out problems")
    ap.add_argument("--report-dir", default=None, help="keep the check's evaluation reports here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t = time.perf_counter()
    path = warm_start_policy(
        args.cache_dir,
        steps=args.steps,
        copy_steps=args.copy_steps,
        seed=args.seed,
        n_traces=args.n_traces,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        hidden_size=args.hidden_size,
        layers=args.layers,
    )
    if args.task != "arith":
        path = task_warm_start(
            args.task,
            args.cache_dir,
            steps=args.steps,
            copy_steps=args.copy_steps,
            n_traces=args.n_traces,
            chain_steps=args.chain_steps,
        )
    logger.info("policy: %s (%.1f s)", path, time.perf_counter() - t)
    if args.check:
        items = make_split("test", args.check, seed=0, task=args.task)
        for temp in (0.0, 1.0):
            report_dir = None if args.report_dir is None else Path(args.report_dir) / f"T{temp:g}"
            report = asdict(evaluate_tool_use(path, items, temperature=temp, report_dir=report_dir))
            breakdown = report.pop("breakdown")
            logger.info("%s", json.dumps(report))
            logger.info("%s", format_breakdown(breakdown))


def format_breakdown(breakdown: dict[str, dict[str, float]]) -> str:
    """The per-kind figures of :class:`ToolUseReport` as a text table."""
    cols = ["n", "accuracy", "tool_call_rate", "call_exact", "copy_out", "guess_rate", "guess_accuracy"]
    lines = [f"{'kind':10s} " + " ".join(f"{c:>14s}" for c in cols)]
    for kind, row in breakdown.items():
        lines.append(f"{kind:10s} " + " ".join(f"{row[c]:>14.2f}" if c != "n" else f"{row[c]:>14d}" for c in cols))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
