"""A cached tiny policy that calls the ``lookup`` tool on every assistant turn.

Subprocess tests use it to check that a user's plugin tool really gets called during training
rollouts and eval: with this policy every assistant turn is (deterministically, also at
temperature 1) ``<tool_call>\\n{"name": "lookup", "arguments": {"query": "otb"}}\\n</tool_call>``,
whatever the tool answered before.

It is the built-in tiny Qwen3 policy (:func:`otb_tir.defaults.tiny.tiny_policy_dir`) after a short SFT
(:func:`otb_tir.trainer.sft.sft_train`) on conversations rendered with ``tools=[LOOKUP_SCHEMA]``:
the built-in task's train prompts, then three such assistant turns with varied tool responses
between them. The build checks the result with real episodes (:class:`agent_env.AgentEnv` +
:class:`agent_env.engines.hf.HFEngine`) on held-out prompts before publishing the folder to the
cache (``<cache root>/tool-caller-<hash of the build settings>``) with
:func:`agent_env.cache.publish`, like :func:`otb_tir.defaults.tiny.tiny_policy_dir`.

Typical use::

    from tests.support.tool_caller import tool_caller_policy
    path = tool_caller_policy()          # built once (~1 min on a small CPU), then cached
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "LOOKUP_SCHEMA",
    "LOOKUP_CALL",
    "ToolCallerSettings",
    "tool_caller_policy",
    "lookup_tool",
    "check_tool_caller",
    "lookup_call_figures",
]

#: Bump when the build changes in a way the cache key (settings, schema, texts, base) misses.
BUILD_VERSION = 1

LOOKUP_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a query and return a short note.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to look up"}},
            "required": ["query"],
        },
    },
}

#: The content of every assistant turn: the hermes markup, exactly as the tiny chat template
#: renders an assistant message ``{"content": "", "tool_calls": [{"function": {"name": "lookup",
#: "arguments": {"query": "otb"}}}]}`` (and as the hermes parser reads it).
LOOKUP_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"query": "otb"}}\n</tool_call>'

_MARKER = "otb_tir_tool_caller.json"

_WORDS = ["otb", "alpha", "river", "seven", "delta", "query", "apple", "north", "tool", "cache", "blue", "zeta"]


@dataclass(frozen=True)
class ToolCallerSettings:
    """Everything that determines the build (part of the cache key)."""

    n_conversations: int = 256
    #: 400 steps of 4 at a constant 1e-2 reach a loss of ~1e-5 per assistant token (~1 min on 2
    #: CPU cores); 300 steps of 8 at 3e-3 (loss ~2e-4) still misspelled one call in ~50 at T=1
    steps: int = 400
    batch_size: int = 4
    lr: float = 1e-2
    warmup_steps: int = 20
    min_lr_ratio: float = 1.0
    seed: int = 0
    turns: int = 3
    #: the build's own check (real episodes on held-out prompts)
    check_episodes: int = 16


def _tool_response(rng: random.Random) -> str:
    """A short, varied tool response (the policy must call again whatever came back)."""
    n = rng.randint(0, 999)
    word = rng.choice(_WORDS)
    kind = rng.randrange(8)
    if kind == 0:
        return f"note {n}"
    if kind == 1:
        return f"Error: {rng.choice(['no entry for', 'timeout while looking up', 'bad query'])} '{word}'"
    if kind == 2:
        return f"note {n}\nsee also: {word}\nsource: index {rng.randint(1, 9)}"
    if kind == 3:
        return f"{word} = {n}"
    if kind == 4:
        return ""
    if kind == 5:
        return f"Error: tool 'lookup' failed: RuntimeError: {word} {n}"
    if kind == 6:
        return json.dumps({"query": word, "note": n})
    return f"{word.capitalize()} is {n} units.\n{rng.choice(_WORDS)} {rng.randint(0, 99)}"


def training_conversations(n: int, seed: int = 0, turns: int = 3) -> list[list[dict[str, Any]]]:
    """``n`` conversations: a built-in train prompt, then ``turns`` lookup calls with tool
    responses between them (none after the last call)."""
    from agent_env.math_task.data import make_split

    rng = random.Random(f"tool-caller:{seed}")
    out = []
    for item in make_split("train", n, seed=seed):
        messages = [dict(m) for m in item["prompt"]]
        for t in range(turns):
            messages.append({"role": "assistant", "content": LOOKUP_CALL})
            if t < turns - 1:
                messages.append({"role": "tool", "content": _tool_response(rng)})
        out.append(messages)
    return out


def lookup_tool(reply: str = "note {n}"):
    """A ``lookup`` tool with exactly :data:`LOOKUP_SCHEMA` that answers ``reply`` (``{n}``: a
    running call count, ``{query}``: the query)."""
    from tools import Tool, ToolResult

    class LookupTool(Tool):
        name = LOOKUP_SCHEMA["function"]["name"]
        description = LOOKUP_SCHEMA["function"]["description"]
        parameters = copy.deepcopy(LOOKUP_SCHEMA["function"]["parameters"])

        def __init__(self) -> None:
            self.calls = 0

        async def call(self, args: dict[str, Any], *, session_id: str | None = None) -> ToolResult:
            self.calls += 1
            return ToolResult(text=reply.format(n=self.calls, query=args.get("query")))

    return LookupTool()


def lookup_call_figures(trajectories) -> dict[str, Any]:
    """How many assistant turns make exactly good ``lookup`` calls, and the finish reasons."""
    turns = good = 0
    finish: dict[str, int] = {}
    bad: list[str] = []
    for traj in trajectories:
        finish[traj.finish_reason] = finish.get(traj.finish_reason, 0) + 1
        for tr in traj.turns:
            turns += 1
            calls = tr.tool_calls
            ok = bool(calls) and all(
                c.name == "lookup" and c.error is None and isinstance(c.arguments.get("query"), str) for c in calls
            )
            good += ok
            if not ok and len(bad) < 3:
                bad.append(tr.text)
    episodes = len(trajectories)
    return {
        "episodes": episodes,
        "turns": turns,
        "turns_calling_lookup": good,
        "call_rate": good / turns if turns else 0.0,
        "finish_reasons": finish,
        "max_turns_rate": finish.get("max_turns", 0) / episodes if episodes else 0.0,
        "bad_turns": bad,
    }


def check_tool_caller(
    model,
    tokenizer,
    *,
    episodes: int = 16,
    temperature: float = 1.0,
    seed: int = 0,
    max_assistant_turns: int = 3,
    reply: str = "note {n}",
) -> dict[str, Any]:
    """Run ``episodes`` real episodes (held-out prompts, a ``lookup`` tool answering ``reply``)
    with an :class:`~agent_env.engines.hf.HFEngine` over ``model`` and return
    :func:`lookup_call_figures` of them."""
    from agent_env import AgentEnv, EpisodeConfig
    from agent_env.engines.hf import HFEngine
    from agent_env.math_task.data import make_split
    from agent_env.rollout import rollout_async, run_sync

    cfg = EpisodeConfig(
        max_assistant_turns=max_assistant_turns, response_length=192, max_tokens_per_turn=48, temperature=temperature
    )
    env = AgentEnv(tokenizer, tools=[lookup_tool(reply)], config=cfg)
    engine = HFEngine(model, tokenizer, share_weights=True, seed=seed, stop_at_eos=False)
    prompts = make_split("test", episodes, seed=seed)

    async def go():
        try:
            return await rollout_async(engine, env, prompts, 1, seed=seed, progress=False)
        finally:
            await engine.close()

    batch = run_sync(go())
    return lookup_call_figures(batch.trajectories)


def tool_caller_policy(cache_root: Path | None = None, *, settings: ToolCallerSettings | None = None) -> Path:
    """The tool-calling tiny policy: a ``save_pretrained`` folder (model + tokenizer), built once
    and cached under ``cache_root`` (default :func:`agent_env.cache.default_cache_root`).

    Raises ``RuntimeError`` (and caches nothing) if the trained policy does not call ``lookup`` on
    every turn of the build's check episodes, at temperature 0 and 1.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_env.cache import artifact_dir, publish
    from otb_tir.defaults.tiny import tiny_policy_dir
    from otb_tir.trainer.sft import SFTConfig, sft_train, tokenize_conversation

    s = settings or ToolCallerSettings()
    base = tiny_policy_dir(cache_root)
    probe = training_conversations(4, seed=s.seed, turns=s.turns)
    key = {
        "build_version": BUILD_VERSION,
        "settings": asdict(s),
        "schema": LOOKUP_SCHEMA,
        "call": LOOKUP_CALL,
        "base": base.name,
        "base_config": (base / "config.json").read_text(),
        "probe_sha": hashlib.sha256(json.dumps(probe, sort_keys=True).encode()).hexdigest(),
    }
    final = artifact_dir(cache_root, "tool-caller", key)

    def build(tmp: Path) -> dict[str, Any]:
        logger.info("building the tool-caller policy into %s", final)
        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        convs = training_conversations(s.n_conversations, seed=s.seed, turns=s.turns)
        examples = [tokenize_conversation(tokenizer, m, tools=[LOOKUP_SCHEMA]) for m in convs]
        sft = SFTConfig(
            steps=s.steps,
            batch_size=s.batch_size,
            lr=s.lr,
            warmup_steps=s.warmup_steps,
            min_lr_ratio=s.min_lr_ratio,
            seed=s.seed,
            progress=False,
        )
        state = torch.random.get_rng_state()
        try:
            losses = sft_train(model, examples, tokenizer.pad_token_id, sft)
        finally:
            torch.random.set_rng_state(state)
        t1 = time.perf_counter()
        checks = {}
        for temperature in (0.0, 1.0):
            figures = check_tool_caller(
                model,
                tokenizer,
                episodes=s.check_episodes,
                temperature=temperature,
                seed=s.seed,
                max_assistant_turns=s.turns,
            )
            checks[str(temperature)] = figures
            if figures["call_rate"] < 1.0 or figures["max_turns_rate"] < 1.0:
                raise RuntimeError(
                    f"the tool-caller policy does not call 'lookup' on every turn at temperature {temperature}: "
                    f"{figures['turns_calling_lookup']}/{figures['turns']} turns, finish reasons "
                    f"{figures['finish_reasons']}, e.g. {figures['bad_turns']!r} (final SFT loss "
                    f"{sum(losses[-10:]) / len(losses[-10:]):.4f}); retune ToolCallerSettings"
                )
        t2 = time.perf_counter()
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        logger.info("tool-caller policy cached in %s (training %.1f s, check %.1f s)", final, t1 - t0, t2 - t1)
        return {
            "losses": losses,
            "checks": checks,
            "train_seconds": t1 - t0,
            "check_seconds": t2 - t1,
            "tokens_per_example": sum(len(e.input_ids) for e in examples) / len(examples),
        }

    return publish(final, _MARKER, build, {"key": key | {"base_config": None}})
