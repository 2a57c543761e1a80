"""The cached tool-caller policy (``tests/support/tool_caller.py``) calls ``lookup`` on every turn.

The subprocess tests of users' plugin tools rely on it: a training rollout or an eval with that
policy must reach the plugin on every assistant turn. Checked here with real episodes
(:class:`agent_env.AgentEnv` + :class:`agent_env.engines.hf.HFEngine`) on held-out prompts at
temperature 1.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_tool_caller_policy_calls_lookup_on_every_turn():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_env import AgentEnv, EpisodeConfig
    from agent_env.engines.hf import HFEngine
    from agent_env.math_task.data import make_split
    from agent_env.rollout import rollout_async, run_sync
    from tests.support.tool_caller import LOOKUP_SCHEMA, lookup_tool, tool_caller_policy

    path = tool_caller_policy()
    assert (path / "config.json").is_file()
    assert tool_caller_policy() == path  # cached: the second call finds the folder

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tool = lookup_tool("note {n}")
    assert tool.schema() == LOOKUP_SCHEMA
    cfg = EpisodeConfig(max_assistant_turns=3, response_length=192, max_tokens_per_turn=48, temperature=1.0)
    env = AgentEnv(tokenizer, tools=[tool], config=cfg)
    engine = HFEngine(model, tokenizer, share_weights=True, seed=123, stop_at_eos=False)
    prompts = make_split("test", 8, seed=123)

    async def go():
        try:
            return await rollout_async(engine, env, prompts, 1, seed=123, progress=False)
        finally:
            await engine.close()

    trajs = run_sync(go()).trajectories
    assert len(trajs) == 8
    for traj in trajs:
        assert traj.finish_reason == "max_turns", (traj.finish_reason, [t.text for t in traj.turns])
        assert traj.num_turns == 3
        assert traj.template_mismatch is None
        for turn in traj.turns:
            assert turn.tool_calls, turn.text
            for call in turn.tool_calls:
                assert call.name == "lookup" and call.error is None, (call, turn.text)
                assert isinstance(call.arguments.get("query"), str), call
        # the calls of the first two turns ran (the last turn's call ends the episode unexecuted)
        assert all(c.executed and c.ok for tr in traj.turns[:-1] for c in tr.tool_calls)
    assert tool.calls == sum(len(tr.tool_calls) for t in trajs for tr in t.turns[:-1]) >= 16
