"""How the warm-started policy uses its tools: ``python -m otb_tir.defaults.check [--task chain] --check N``.

Builds the warm start (:func:`otb_tir.defaults.warm_start.task_warm_start`) and prints its
tool-call rate and held-out accuracy with and without tool execution, read from the tool-use
evaluation's episodes (``AgentEnv``, the real tools; :func:`evaluate_tool_use`). Kept apart from
the warm start so that building a policy never imports the evaluation (no import cycle:
builders → warm_start, evaluation → builders).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from otb_tir import ConfigError
from otb_tir.defaults.traces import reference_call
from otb_tir.defaults.warm_start import CHAIN_STEPS, WarmStartSettings, task_warm_start, warm_start_policy

logger = logging.getLogger(__name__)


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
    ap.add_argument(
        "--task", default="arith", choices=["arith", "chain", "multistep"], help="+ that task's SFT stage(s)"
    )
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
        from agent_env.tasks import get_task

        items = make_split("test", args.check, seed=0, task=args.task)
        turns = get_task(args.task).settings.get("multi_turn.max_assistant_turns", 3)
        for temp in (0.0, 1.0):
            report_dir = None if args.report_dir is None else Path(args.report_dir) / f"T{temp:g}"
            report = asdict(evaluate_tool_use(path, items, temperature=temp, max_turns=turns, report_dir=report_dir))
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
