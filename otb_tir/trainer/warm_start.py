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

The mixture deliberately leaves the policy *inconsistent* at using tools, so that RL has room to
improve it. :func:`warm_start_policy` trains briefly on CPU and caches the result under the user's
cache directory keyed by every setting; ``python -m otb_tir.trainer.warm_start --check`` builds it
and prints its tool-call rate and held-out accuracy with and without tool execution.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from otb_tir import ConfigError
from otb_tir.trainer.sft import SFTConfig, SFTExample, sft_train, tokenize_conversation

logger = logging.getLogger(__name__)

#: Bump when trace generation or training code changes: cached folders are keyed on it.
WARM_VERSION = 1
#: The tools of the default recipe, in the order an episode lists them.
DEFAULT_TOOLS = ("python", "calculator")
#: Kinds whose expression Python's ``print`` evaluates to the exact answer.
_PYTHON_KINDS = ("mul", "add", "pow", "mod")
_MARKER = "otb_tir_warm_start.json"


@dataclass(frozen=True)
class TraceMixture:
    """Relative weights of the trace types, and how often a direct guess is right."""

    tool: float = 0.40
    python: float = 0.15
    guess: float = 0.35
    wrong_tool: float = 0.10
    guess_right: float = 0.25

    def validate(self) -> None:
        weights = (self.tool, self.python, self.guess, self.wrong_tool)
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"trace mixture weights must be >= 0 with a positive sum, got {self}")
        if not 0 <= self.guess_right <= 1:
            raise ConfigError(f"guess_right must be in [0, 1], got {self.guess_right}")


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
    return text[:i] + rng.choice(choices) + text[i + 1:]


@dataclass
class _Plan:
    """A trace before its tool results are known."""

    item: dict[str, Any]
    mode: str
    call: dict[str, Any] | None = None
    answer: str | None = None  # final boxed answer for traces without a call
    result: str | None = None  # filled in by running the tool


def plan_trace(item: dict[str, Any], rng: random.Random, mixture: TraceMixture) -> _Plan:
    """Pick a trace type for one built-in problem and its tool call (if any)."""
    kind = item["extra_info"]["kind"]
    expr = item["extra_info"]["expression"]
    truth = item["reward_model"]["ground_truth"]
    weights = {"tool": mixture.tool, "python": mixture.python if kind in _PYTHON_KINDS else 0.0,
               "guess": mixture.guess, "wrong_tool": mixture.wrong_tool}
    if sum(weights.values()) <= 0:
        weights["tool"] = 1.0
    modes, w = zip(*weights.items())
    mode = rng.choices(modes, weights=w)[0]
    if mode == "tool":
        return _Plan(item, mode, {"name": "calculator", "arguments": {"expression": expr}})
    if mode == "python":
        return _Plan(item, mode, {"name": "python", "arguments": {"code": f"print({expr})"}})
    if mode == "wrong_tool":
        return _Plan(item, mode, {"name": "calculator", "arguments": {"expression": _perturb_number(expr, rng)}})
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
    messages.append({"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": plan.call}]})
    messages.append({"role": "tool", "content": plan.result})
    messages.append(_final(plan.result.strip()))
    return messages


async def _run_plans(plans: list[_Plan], concurrency: int = 8) -> None:
    from tools import get_tool

    names = sorted({p.call["name"] for p in plans if p.call is not None})
    tools = {name: get_tool(name) for name in names}
    sem = asyncio.Semaphore(concurrency)

    async def one(plan: _Plan) -> None:
        async with sem:
            res = await tools[plan.call["name"]].call(plan.call["arguments"])
        plan.result = res.text

    try:
        await asyncio.gather(*(one(p) for p in plans if p.call is not None))
    finally:
        for tool in tools.values():
            await tool.close()


def make_traces(n: int, seed: int = 0, mixture: TraceMixture | None = None) -> list[list[dict[str, Any]]]:
    """``n`` SFT conversations on built-in *train* problems, tool results from the real tools."""
    from agent_env.data import make_split

    mixture = mixture or TraceMixture()
    mixture.validate()
    rng = random.Random(f"warm-start-traces:{seed}")
    plans = [plan_trace(item, rng, mixture) for item in make_split("train", n, seed=seed)]
    asyncio.run(_run_plans(plans))
    return [plan_messages(p) for p in plans]


# ----------------------------------------------------------------------------- cached policy


@dataclass(frozen=True)
class WarmStartSettings:
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    n_traces: int = 2000
    seed: int = 0
    mixture: TraceMixture = field(default_factory=TraceMixture)


def _default_cache_root() -> Path:
    from agent_env.tiny import default_cache_root

    return default_cache_root()


def warm_start_policy(cache_dir: str | os.PathLike | None = None, *, steps: int = 300, seed: int = 0,
                      n_traces: int = 2000, batch_size: int = 16, lr: float = 3e-3,
                      mixture: TraceMixture | None = None, base: str | os.PathLike | None = None,
                      progress: bool = True) -> Path:
    """The tiny policy after a short SFT on generated traces: an HF folder (model + tokenizer with
    its chat template) loadable by ``AutoModelForCausalLM`` / ``AutoTokenizer`` and vLLM.

    Built once and cached as ``<cache root>/warm-<hash of every setting>`` (``cache_dir``
    overrides the root, default ``$OTB_TIR_CACHE`` or ``~/.cache/otb_tir``); the folder is written
    to a temporary sibling and renamed into place. ``base`` is the folder to start from (default:
    ``agent_env.tiny.tiny_policy_dir(cache_dir)``). A ``otb_tir_warm_start.json`` in the folder
    records the settings, the loss curve and the training time.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_env.tiny import tiny_policy_dir

    settings = WarmStartSettings(steps=steps, batch_size=batch_size, lr=lr, n_traces=n_traces,
                                 seed=seed, mixture=mixture or TraceMixture())
    settings.mixture.validate()
    SFTConfig(steps=steps, batch_size=batch_size, lr=lr).validate()
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_root()
    base_path = Path(base) if base is not None else tiny_policy_dir(cache_dir)
    if not (base_path / "config.json").is_file():
        raise ConfigError(f"base policy folder {base_path} has no config.json (not an HF model folder)")
    schemas = tool_schemas()
    key = {"version": WARM_VERSION, "settings": asdict(settings), "base": str(base_path.resolve()),
           "base_config": (base_path / "config.json").read_text(),
           "tools": schemas}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    final = root / f"warm-{digest}"
    if (final / _MARKER).is_file():
        return final

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    logger.info("warm start: generating %d traces", n_traces)
    traces = make_traces(n_traces, seed=seed, mixture=settings.mixture)
    examples = [tokenize_conversation(tokenizer, m, tools=schemas) for m in traces]
    t1 = time.perf_counter()
    cfg = SFTConfig(steps=steps, batch_size=batch_size, lr=lr, seed=seed, progress=progress)
    losses = sft_train(model, examples, tokenizer.pad_token_id, cfg)
    t2 = time.perf_counter()

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record = {"key": key | {"base_config": None}, "losses": losses, "trace_seconds": t1 - t0,
                  "train_seconds": t2 - t1, "tokens_per_example": sum(len(e.input_ids) for e in examples) / len(examples)}
        (tmp / _MARKER).write_text(json.dumps(record, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first (or a stale unmarked folder)
            if not (final / _MARKER).is_file():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("warm start cached in %s (traces %.1f s, training %.1f s, final loss %.3f)",
                final, t1 - t0, t2 - t1, sum(losses[-10:]) / len(losses[-10:]))
    return final


# ----------------------------------------------------------------------------- quick check


@dataclass
class ToolUseReport:
    """Figures of :func:`evaluate_tool_use` (rates in [0, 1])."""

    n: int
    temperature: float
    accuracy: float  # with the tool calls executed (up to ``max_turns`` assistant turns)
    accuracy_without_tools: float  # first-turn direct answers only (tool calls not executed)
    tool_call_rate: float  # episodes whose first turn makes a tool call
    well_formed_rate: float  # tool-call attempts that parse, name a known tool and its argument
    tool_success_rate: float  # executed calls that returned ok
    by_kind: dict[str, float] = field(default_factory=dict)  # accuracy with tools, per problem kind


async def _evaluate(path: Path, items: list[dict[str, Any]], temperature: float, max_turns: int,
                    max_new_tokens: int, seed: int) -> ToolUseReport:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_env.parsers import HermesParser
    from agent_env.reward import math_reward
    from tools import get_tool

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    schemas = tool_schemas()
    tools = {name: get_tool(name) for name in DEFAULT_TOOLS}
    args_key = {"python": "code", "calculator": "expression"}
    parser = HermesParser()
    torch.manual_seed(seed)
    convs = [[dict(m) for m in it["prompt"]] for it in items]
    final: list[str | None] = [None] * len(items)
    first_call = [False] * len(items)
    first_correct = [False] * len(items)
    attempts = well_formed = executed = succeeded = 0
    active = list(range(len(items)))
    try:
        for turn in range(max_turns):
            if not active:
                break
            texts = [tokenizer.apply_chat_template(convs[i], tools=schemas, tokenize=False,
                                                   add_generation_prompt=True) for i in active]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                     temperature=temperature if temperature > 0 else None, top_k=0, top_p=1.0,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            replies = tokenizer.batch_decode(out[:, enc["input_ids"].size(1):], skip_special_tokens=True)
            still = []
            for i, reply in zip(active, replies):
                calls = parser.parse(reply) if "<tool_call>" in reply else []
                if turn == 0:
                    first_call[i] = bool(calls)
                    if not calls:
                        first_correct[i] = math_reward(reply, items[i]["reward_model"]["ground_truth"]).correct
                if not calls:
                    final[i] = reply
                    continue
                attempts += len(calls)
                good = [c for c in calls if c.ok and c.name in tools and args_key[c.name] in c.arguments]
                well_formed += len(good)
                content = reply[: reply.find("<tool_call>")].strip()
                convs[i].append({"role": "assistant", "content": content, "tool_calls": [
                    {"type": "function", "function": {"name": c.name or "", "arguments": c.arguments}} for c in calls]})
                for c in calls:
                    if c in good:
                        res = await tools[c.name].call(c.arguments)
                        executed += 1
                        succeeded += int(res.ok)
                        text = res.text
                    else:
                        text = f"Error: malformed tool call ({c.error_message or 'unknown tool or missing argument'})"
                    convs[i].append({"role": "tool", "content": text})
                still.append(i)
            active = still
    finally:
        for tool in tools.values():
            await tool.close()
    correct = [final[i] is not None and math_reward(final[i], it["reward_model"]["ground_truth"]).correct
               for i, it in enumerate(items)]
    kinds: dict[str, list[bool]] = {}
    for it, ok in zip(items, correct):
        kinds.setdefault(it["extra_info"].get("kind", "?"), []).append(ok)
    n = len(items)
    return ToolUseReport(
        n=n, temperature=temperature, accuracy=sum(correct) / n,
        accuracy_without_tools=sum(first_correct) / n, tool_call_rate=sum(first_call) / n,
        well_formed_rate=well_formed / attempts if attempts else 0.0,
        tool_success_rate=succeeded / executed if executed else 0.0,
        by_kind={k: sum(v) / len(v) for k, v in sorted(kinds.items())})


def evaluate_tool_use(path: str | os.PathLike, items: list[dict[str, Any]], *, temperature: float = 1.0,
                      max_turns: int = 3, max_new_tokens: int = 96, seed: int = 0) -> ToolUseReport:
    """Sample the policy at ``path`` on ``items`` (one batch per turn, HF ``generate``), execute
    its hermes tool calls with the real tools, and score the final answers with the math reward.

    A quick check of a warm start, independent of the episode/rollout code (which the evaluation
    recipe uses); ``temperature=0`` is greedy decoding.
    """
    return asyncio.run(_evaluate(Path(path), items, temperature, max_turns, max_new_tokens, seed))


def main(argv: list[str] | None = None) -> None:
    import argparse

    from agent_env.data import make_split

    ap = argparse.ArgumentParser(description="Build (or reuse) the cached warm-start policy and check it.")
    ap.add_argument("--steps", type=int, default=WarmStartSettings.steps)
    ap.add_argument("--n-traces", type=int, default=WarmStartSettings.n_traces)
    ap.add_argument("--batch-size", type=int, default=WarmStartSettings.batch_size)
    ap.add_argument("--lr", type=float, default=WarmStartSettings.lr)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--check", type=int, default=0, metavar="N", help="evaluate on N held-out problems")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t = time.perf_counter()
    path = warm_start_policy(args.cache_dir, steps=args.steps, seed=args.seed, n_traces=args.n_traces,
                             batch_size=args.batch_size, lr=args.lr)
    logger.info("policy: %s (%.1f s)", path, time.perf_counter() - t)
    if args.check:
        items = make_split("test", args.check, seed=0)
        for temp in (0.0, 1.0):
            logger.info("%s", json.dumps(asdict(evaluate_tool_use(path, items, temperature=temp))))


if __name__ == "__main__":
    main()
