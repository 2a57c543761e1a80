"""Batch rollout and collation; token drift and log-probs on the real tiny model with HFEngine."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from agent_env import AgentEnv, EnvError, EpisodeConfig, rollout
from agent_env.engines.base import GenerationOutput
from agent_env.rollout import collate, run_sync
from tests.agent_env.test_episode import ScriptedEngine, tc
from tests.support.batch_logprobs import recomputed_at_real_turns


@pytest.fixture(scope="module")
def real_tools():
    import tools

    ts = {"python": tools.get_tool("python"), "calculator": tools.get_tool("calculator")}
    yield ts

    async def close():
        for t in ts.values():
            await t.close()

    run_sync(close())


PROMPTS = [
    {"prompt": "What is 2+2?", "ground_truth": "4", "uid": "a"},
    {"prompt": "Compute 6 times 7, please, and show the work with a tool if you like.", "ground_truth": "42"},
    "Say something.",
]


def scripted_by_prompt(tok):
    """Prompt 0: calculator then a correct answer; prompt 1: python then a wrong answer;
    prompt 2: the engine returns nothing (a zero-length response)."""

    def script(prompt_ids, k):
        text = tok.decode(prompt_ids)
        n_turns = text.count("<|im_start|>assistant")
        if "2+2" in text:
            return [tc("calculator", expression="2+2"), "\\boxed{4}"][min(n_turns - 1, 1)]
        if "6 times 7" in text:
            return [tc("python", code="print(6*7)"), "\\boxed{41}"][min(n_turns - 1, 1)]
        return []

    return script


@pytest.mark.slow
def test_collated_batch_layout(tiny_tokenizer, real_tools):
    env = AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig(response_length=160))
    eng = ScriptedEngine(tiny_tokenizer, scripted_by_prompt(tiny_tokenizer))
    batch = rollout(eng, env, PROMPTS, n=2, progress=False)
    B, R = 6, 160
    P = max(len(t.prompt_ids) for t in batch.trajectories)
    assert batch["prompts"].shape == (B, P) and batch["responses"].shape == (B, R)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert batch[key].shape == (B, P + R)
    for key in ("response_mask", "rollout_log_probs", "token_level_rewards"):
        assert batch[key].shape == (B, R)
    assert batch["rollout_log_probs"].dtype == torch.float32 and batch["responses"].dtype == torch.long
    # prompt-major order and uid groups
    uid = batch["uid"]
    assert isinstance(uid, np.ndarray) and uid.dtype == object
    assert list(uid[:2]) == ["a", "a"] and uid[2] == uid[3] != uid[4] == uid[5] and uid[2] != "a"
    assert [t.sample_index for t in batch.trajectories] == [0, 1] * 3
    assert [t.ground_truth for t in batch.trajectories] == ["4", "4", "42", "42", None, None]
    pad = tiny_tokenizer.pad_token_id
    for i, t in enumerate(batch.trajectories):
        lp, lr = len(t.prompt_ids), len(t.response_ids)
        row_p, row_r = batch["prompts"][i], batch["responses"][i]
        assert row_p[P - lp :].tolist() == t.prompt_ids and (row_p[: P - lp] == pad).all()  # left-padded
        assert row_r[:lr].tolist() == t.response_ids and (row_r[lr:] == pad).all()  # right-padded
        assert batch["response_mask"][i, :lr].tolist() == t.response_mask
        assert (batch["response_mask"][i, lr:] == 0).all()
        assert torch.allclose(batch["rollout_log_probs"][i, :lr], torch.tensor(t.rollout_logprobs))
        am = batch["attention_mask"][i]
        assert am.tolist() == [0] * (P - lp) + [1] * lp + [1] * lr + [0] * (R - lr)
        assert batch["input_ids"][i].tolist() == row_p.tolist() + row_r.tolist()
        pos = batch["position_ids"][i]
        assert pos[P - lp : P + lr].tolist() == list(range(lp + lr))
        # the reward sits on the last mask=1 token, and nowhere else
        tlr = batch["token_level_rewards"][i]
        ones = [k for k, m in enumerate(t.response_mask) if m]
        if ones:
            assert tlr[ones[-1]] == t.reward and tlr.sum() == t.reward
        else:
            assert (tlr == 0).all()
    rewards = batch["reward"].tolist()
    assert rewards == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert list(batch["finish_reason"]) == ["answer"] * 4 + ["abort"] * 2
    assert batch.trajectories[4].response_ids == []  # zero-length responses handled
    assert (batch["token_level_rewards"][:2].sum(dim=1) == 1.0).all()
    assert batch.stats["episodes"] == 6 and batch.stats["tool_calls"] == 4
    # a training loop calls rollout again with the same env and tools (same persistent loop)
    again = rollout(eng, env, PROMPTS[:2], n=1, progress=False)
    assert again["reward"].tolist() == [1.0, 0.0] and all(t.tool_errors == 0 for t in again.trajectories)


def test_reward_lands_on_last_policy_token_even_when_mask0_tokens_follow():
    from agent_env.records import Trajectory

    t = Trajectory(
        uid="u",
        prompt_ids=[5, 6],
        response_ids=[7, 8, 9, 10],
        response_mask=[1, 1, 0, 0],
        rollout_logprobs=[-1.0, -2.0, 0.0, 0.0],
        turns=[],
        messages=[],
        reward=0.5,
        reward_details={},
        finish_reason="x",
        num_turns=1,
        void_turns=0,
        malformed_calls=0,
        num_tool_calls=0,
        tool_errors=0,
        template_mismatch=None,
        timings={},
    )
    b = collate([t], pad_token_id=0, response_length=6)
    assert b["token_level_rewards"].tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0, 0.0]]
    b = collate([t], pad_token_id=0)  # longest
    assert b["responses"].shape == (1, 4)
    with pytest.raises(EnvError, match="more than the batch width"):
        collate([t], pad_token_id=0, response_length=3)


def test_pad_to_longest_and_config_forms(tiny_tokenizer, real_tools):
    eng = ScriptedEngine(tiny_tokenizer, ["\\boxed{4}"])
    eng.tokenizer = tiny_tokenizer  # rollout takes the tokenizer from the engine
    batch = rollout(
        eng,
        {"response_length": 64, "tools": ["calculator"]},
        ["2+2?"],
        n=3,
        tools=[real_tools["calculator"]],
        pad_to="longest",
        progress=False,
    )
    assert batch["responses"].shape[1] == len(batch.trajectories[0].response_ids)
    assert len(set(batch["uid"])) == 1
    with pytest.raises(EnvError, match="n \\(samples per prompt\\)"):
        rollout(eng, EpisodeConfig(), ["x"], n=0)
    with pytest.raises(EnvError, match="needs a tokenizer"):
        rollout(ScriptedEngine(tiny_tokenizer, ["x"]), EpisodeConfig(), ["x"], tools=[])
    with pytest.raises(EnvError, match="unknown episode config keys"):
        rollout(eng, {"max_turns": 2}, ["x"])

    async def inside_loop():
        rollout(eng, EpisodeConfig(), ["x"])

    with pytest.raises(EnvError, match="rollout_async"):
        asyncio.run(inside_loop())


# ----------------------------------------------------------------------------- real model


class FirstTurnScripted:
    """Wraps a real engine: the first turn of some episodes is a scripted tool call (the random
    tiny model almost never writes one), every other turn is sampled by the real engine. Records
    each real output, so the test knows which positions the real model sampled."""

    def __init__(self, engine, tokenizer, first_turns: dict[str, str]):
        self.engine = engine
        self.tok = tokenizer
        self.first_turns = first_turns
        self.real_outputs: list[tuple[list[int], GenerationOutput]] = []

    async def generate(self, prompt_ids, params):
        text = self.tok.decode(prompt_ids)
        if text.count("<|im_start|>assistant") == 1:
            for key, turn in self.first_turns.items():
                if key in text:
                    ids = self.tok.encode(turn, add_special_tokens=False) + [self.tok.eos_token_id]
                    assert len(ids) <= params.max_tokens, "scripted turn longer than the per-turn cap"
                    return GenerationOutput(ids, [0.0] * len(ids), "stop")
        out = await self.engine.generate(prompt_ids, params)
        self.real_outputs.append((list(prompt_ids), out))
        return out

    async def update_weights(self, named_tensors):
        await self.engine.update_weights(named_tensors)

    async def close(self):
        await self.engine.close()


@pytest.mark.slow  # ~10-25 s each on a busy 2-core machine
@pytest.mark.parametrize("seed", [0, 1])
def test_token_drift_and_logprobs_on_the_real_model(tiny_tokenizer, tiny_model, tiny_model_dir, real_tools, seed):
    """For every episode: mask=1 tokens are exactly what the real engine sampled (in order, with its
    log-probs); mask=0 tokens are exactly the template's rendering of the inserted messages; the
    decoded stream equals the template's rendering of the final conversation; and a forward pass
    of the same model over the *collated batch* (left-padded prompts, attention mask, position
    ids, as a trainer does it) gives the engine's log-probs at every mask=1 position."""
    from agent_env.engines import HFEngine

    rng = random.Random(seed)
    temperature = 0.8
    questions = [f"Question {i}: what is {rng.randint(2, 99)} plus {rng.randint(2, 99)}?" for i in range(4)]
    calls = [
        tc("calculator", expression="17*3"),
        tc("python", code="print(sum(range(10)))"),
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',  # malformed
        "```python\nprint(1)\n```",
    ]
    first = {q: rng.choice(calls[:3]) for q in questions[:3]}  # the 4th question: real sampling only
    cfg = EpisodeConfig(
        max_assistant_turns=3,
        max_tokens_per_turn=40,
        response_length=240,
        temperature=temperature,
        max_tool_response_length=32,
    )
    env = AgentEnv(tiny_tokenizer, real_tools, cfg)
    base = HFEngine(tiny_model_dir, tokenizer=tiny_tokenizer, seed=seed, stop_at_eos=False)
    eng = FirstTurnScripted(base, tiny_tokenizer, first)
    try:
        batch = rollout(
            eng, env, [{"prompt": q, "ground_truth": "1"} for q in questions], n=2, seed=seed, progress=False
        )
    finally:
        run_sync(base.close())
    trajs = batch.trajectories
    assert len(trajs) == 8
    assert sum(t.num_turns >= 2 for t in trajs) >= 6  # the tool paths ran with real sampling after them
    real: dict[tuple, list[GenerationOutput]] = {}  # n samples of a prompt share their first context
    for p, o in eng.real_outputs:
        real.setdefault(tuple(p), []).append(o)
    n_checked = 0
    for t in trajs:
        assert t.template_mismatch is None, t.template_mismatch
        for turn in t.turns:
            context = tuple(t.prompt_ids + t.response_ids[: turn.start])
            sampled = t.response_ids[turn.start : turn.end]
            assert t.response_mask[turn.start : turn.end] == [1] * len(sampled)
            if context in real:  # sampled by the real model: exactly its ids and log-probs
                got = (sampled, t.rollout_logprobs[turn.start : turn.end])
                assert got in [(o.token_ids, o.logprobs) for o in real[context]]
                n_checked += 1
            if turn.obs_end > turn.obs_start:
                before = tiny_tokenizer.decode(t.prompt_ids + t.response_ids[: turn.obs_start])
                k = [i for i, m in enumerate(t.messages) if m["role"] == "assistant"][turn.index] + 1
                while k < len(t.messages) and t.messages[k]["role"] == "tool":
                    k += 1
                rendered = tiny_tokenizer.apply_chat_template(
                    t.messages[:k], tools=env.template.tool_schemas, add_generation_prompt=True, tokenize=False
                )
                assert rendered.startswith(before)
                assert tiny_tokenizer.decode(t.response_ids[turn.obs_start : turn.obs_end]) == rendered[len(before) :]
                assert set(t.response_mask[turn.obs_start : turn.obs_end]) == {0}
        final = tiny_tokenizer.apply_chat_template(t.messages, tools=env.template.tool_schemas, tokenize=False)
        stream = tiny_tokenizer.decode(t.prompt_ids + t.response_ids)
        assert final.startswith(stream)
        assert final[len(stream) :] in ("\n", "<|im_end|>\n")  # sampled stop token, or a cut turn
    assert n_checked >= len(trajs)
    # log-probs recomputed over the collated batch, as the trainer does
    recomputed, sel = recomputed_at_real_turns(tiny_model, batch, trajs, real, temperature)
    mask = batch["response_mask"].bool()
    assert sel.sum() > 100
    err = (recomputed[sel] - batch["rollout_log_probs"][sel]).abs().max().item()
    assert err < 1e-4, err  # measured: ~1e-6 (fp32)
    assert torch.equal(batch["rollout_log_probs"][~mask], torch.zeros_like(batch["rollout_log_probs"][~mask]))


def test_rollout_overlaps_tools_with_generation(tiny_tokenizer):
    """While one episode's tool runs, the others keep generating: with 8 episodes whose tool takes
    a while and an engine that is always busy, generation rarely waits on tools."""
    from tests.agent_env.test_episode import ConcurrencyProbe

    probe = ConcurrencyProbe()
    env = AgentEnv(tiny_tokenizer, [probe], EpisodeConfig(max_parallel_calls=8))
    eng = ScriptedEngine(tiny_tokenizer, [tc("probe", i=1), "\\boxed{1}"])
    batch = rollout(eng, env, [f"q{i}" for i in range(8)], n=1, progress=False)
    assert probe.max_active == 8  # the 8 episodes' tool calls ran concurrently
    s = batch.stats
    assert {"generating_s", "waiting_on_tools_s", "idle_s", "gen_waited_on_tools_frac"} <= set(s)
    assert 0.0 <= s["gen_waited_on_tools_frac"] <= 1.0
    assert all(t.finish_reason == "answer" for t in batch.trajectories)
