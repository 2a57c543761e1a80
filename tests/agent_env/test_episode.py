"""Episodes on the real tiny tokenizer / chat template and the real tools, driven by a scripted
engine (chosen token ids) so every tool path runs deterministically.

The drift / log-prob test on the real tiny model and HFEngine is in test_rollout.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from agent_env import AgentEnv, EnvError, EpisodeConfig
from agent_env.engines.base import GenerationOutput, SamplingParams
from agent_env.rollout import run_sync
from tools.base import Tool, ToolResult

# budgets roomy enough for the long scripted turns below (the defaults are the tiny CPU task's)
ROOMY = dict(response_length=1024, max_tokens_per_turn=256, max_tool_response_length=256)


class ScriptedEngine:
    """An Engine test double that "samples" chosen turns: each turn is a string (encoded with the
    tokenizer, then the stop token is appended) or a list of ids taken as they are. It honours
    ``max_tokens`` (cut → finish "length", no stop token), records every prompt it was given, and
    returns distinct fake log-probs so the episode's bookkeeping can be checked position by position.
    ``script`` may be a list (shared by all prompts) or a function(prompt_ids, call_index) → turn."""

    def __init__(self, tokenizer, script, stop_id: int | None = None):
        self.tok = tokenizer
        self.script = script
        self.stop_id = tokenizer.eos_token_id if stop_id is None else stop_id
        self.calls: list[tuple[list[int], SamplingParams, GenerationOutput]] = []
        self._per_prompt: dict[tuple[int, ...], int] = {}
        self.counter = 0

    def _turn(self, prompt_ids: list[int]) -> Any:
        if callable(self.script):
            return self.script(prompt_ids, len(self.calls))
        # Episodes are identified by their prompt prefix: count turns per first-turn prompt.
        key = None
        for k in self._per_prompt:
            if tuple(prompt_ids[: len(k)]) == k:
                key = k
                break
        if key is None:
            key = tuple(prompt_ids)
            self._per_prompt[key] = 0
        i = self._per_prompt[key]
        self._per_prompt[key] += 1
        return self.script[min(i, len(self.script) - 1)]

    async def generate(self, prompt_ids, params):
        await asyncio.sleep(0)
        turn = self._turn(list(prompt_ids))
        if isinstance(turn, str):
            ids = self.tok.encode(turn, add_special_tokens=False) + [self.stop_id]
        else:
            ids = list(turn)
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        if not ids and finish == "stop":
            finish = "abort"
        lps = []
        for _ in ids:
            self.counter += 1
            lps.append(-0.001 * self.counter)
        out = GenerationOutput(token_ids=ids, logprobs=lps, finish_reason=finish)
        self.calls.append((list(prompt_ids), params, out))
        return out

    async def update_weights(self, named_tensors):
        pass

    async def close(self):
        pass


def tc(name, **args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def real_tools():
    import tools

    ts = {"python": tools.get_tool("python", stateful=True), "calculator": tools.get_tool("calculator")}
    yield ts

    async def close():
        for t in ts.values():
            await t.close()

    run_sync(close())


def run(env, engine, prompt="What is 2+2?", **kw):
    return run_sync(env.run(engine, prompt, **kw))


def check_token_bookkeeping(env: AgentEnv, engine: ScriptedEngine, traj) -> None:
    """The invariants of token-in-token-out, checked against what the engine actually returned."""
    tok = env.tokenizer
    # mask=1 tokens are exactly the engine's ids, in order, with the engine's log-probs.
    sampled = [i for _, _, o in engine.calls for i in o.token_ids]
    sampled_lp = [x for _, _, o in engine.calls for x in o.logprobs]
    got = [i for i, m in zip(traj.response_ids, traj.response_mask) if m == 1]
    got_lp = [x for x, m in zip(traj.rollout_logprobs, traj.response_mask) if m == 1]
    assert got == sampled and got_lp == sampled_lp
    assert all(x == 0.0 for x, m in zip(traj.rollout_logprobs, traj.response_mask) if m == 0)
    # Each generate call saw exactly the prompt + the response so far.
    for turn, (prompt, _, _) in zip(traj.turns, engine.calls):
        assert prompt == traj.prompt_ids + traj.response_ids[: turn.start]
    # mask=0 spans are exactly the template's delta: rendering with the inserted messages and the
    # next assistant header, minus the rendering of everything before.
    msgs = traj.messages
    n_obs_turns = 0
    for turn in traj.turns:
        if turn.obs_end > turn.obs_start:
            n_obs_turns += 1
            assert all(m == 0 for m in traj.response_mask[turn.obs_start : turn.obs_end])
            # the conversation up to this turn's tool messages
            k = _index_after_turn(msgs, turn.index)
            before = tok.decode(traj.prompt_ids + traj.response_ids[: turn.obs_start], skip_special_tokens=False)
            with_obs = tok.apply_chat_template(
                msgs[:k], tools=env.template.tool_schemas, add_generation_prompt=True, tokenize=False
            )
            assert with_obs.startswith(before)
            inserted = tok.decode(traj.response_ids[turn.obs_start : turn.obs_end], skip_special_tokens=False)
            assert inserted == with_obs[len(before) :]
            assert inserted.startswith("\n<|im_start|>user\n<tool_response>")  # the newline after <|im_end|>
            assert inserted.endswith("<|im_start|>assistant\n")
            assert traj.response_ids[turn.obs_start : turn.obs_end] == tok.encode(inserted, add_special_tokens=False)
    # decode(prompt + response) is the template's rendering of the final conversation (up to the
    # template's closing of a turn whose stop token was sampled).
    final = tok.apply_chat_template(msgs, tools=env.template.tool_schemas, add_generation_prompt=False, tokenize=False)
    stream = tok.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    assert traj.template_mismatch is None
    assert final.startswith(stream) and final[len(stream) :] in ("\n", "<|im_end|>\n")


def _index_after_turn(msgs, turn_index):
    """Index in messages just after the tool messages that follow assistant turn ``turn_index``."""
    seen = -1
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            seen += 1
            if seen == turn_index:
                j = i + 1
                while j < len(msgs) and msgs[j]["role"] == "tool":
                    j += 1
                return j
    raise AssertionError("turn not found")


# ----------------------------------------------------------------------------- tool paths


def test_calculator_call_then_answer(tiny_tokenizer, real_tools):
    env = AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig())
    eng = ScriptedEngine(
        tiny_tokenizer, ["I will compute.\n" + tc("calculator", expression="2+2"), "The tool says 4, so \\boxed{4}."]
    )
    traj = run(env, eng, ground_truth="4", uid="u1")
    assert traj.finish_reason == "answer" and traj.num_turns == 2
    assert traj.reward == 1.0 and traj.reward_details["correct"]
    call = traj.turns[0].tool_calls[0]
    assert (call.name, call.ok, call.text.strip(), call.error) == ("calculator", True, "4", None)
    assert call.latency_ms > 0 and traj.malformed_calls == 0 and traj.void_turns == 0
    assert traj.messages[-2] == {"role": "tool", "content": call.text}
    check_token_bookkeeping(env, eng, traj)


def test_stateful_python_session_and_release(tiny_tokenizer, real_tools):
    released = []
    py = real_tools["python"]
    orig = py.release

    async def spy(session_id):
        released.append(session_id)
        await orig(session_id)

    py.release = spy
    try:
        env = AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig())
        eng = ScriptedEngine(
            tiny_tokenizer, [tc("python", code="x = 21"), tc("python", code="print(x * 2)"), "\\boxed{42}"]
        )
        traj = run(env, eng, ground_truth="42")
    finally:
        del py.release
    assert traj.finish_reason == "answer" and traj.reward == 1.0
    assert traj.turns[1].tool_calls[0].text.strip() == "42"  # state kept across turns
    assert len(released) == 1 and released[0].startswith(traj.uid)
    check_token_bookkeeping(env, eng, traj)


def test_episodes_do_not_share_python_state(tiny_tokenizer, real_tools):
    env = AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig())
    eng = ScriptedEngine(tiny_tokenizer, [tc("python", code="y = 5"), "\\boxed{5}"])
    run(env, eng)
    eng2 = ScriptedEngine(tiny_tokenizer, [tc("python", code="print(y)"), "\\boxed{5}"])
    traj = run(env, eng2)
    res = traj.turns[0].tool_calls[0]
    assert not res.ok and "NameError" in res.text


class ConcurrencyProbe(Tool):
    name = "probe"
    description = "records how many calls run at once"
    parameters = {"type": "object", "properties": {"i": {"type": "integer"}}, "required": ["i"]}

    def __init__(self):
        self.active = 0
        self.max_active = 0
        self.order: list[int] = []

    async def call(self, args, *, session_id=None):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        await asyncio.sleep(0.05)
        self.active -= 1
        self.order.append(args["i"])
        return ToolResult(text=f"done {args['i']}")


@pytest.mark.parametrize("cap", [1, 2, 8])
def test_calls_in_one_turn_run_concurrently_up_to_the_cap(tiny_tokenizer, cap):
    probe = ConcurrencyProbe()
    env = AgentEnv(tiny_tokenizer, [probe], EpisodeConfig(max_parallel_calls=cap, **ROOMY))
    eng = ScriptedEngine(tiny_tokenizer, ["".join(tc("probe", i=i) for i in range(5)), "\\boxed{0}"])
    traj = run(env, eng)
    assert probe.max_active == min(cap, 5)
    # results come back in call order whatever the completion order
    assert [c.text for c in traj.turns[0].tool_calls] == [f"done {i}" for i in range(5)]
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == [f"done {i}" for i in range(5)]
    check_token_bookkeeping(env, eng, traj)


def test_malformed_calls_become_error_observations_and_are_counted(tiny_tokenizer, real_tools):
    env = AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig(**ROOMY))
    bad = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'  # bad JSON
        + tc("wolfram", query="2+2")  # unknown tool
        + tc("calculator", expr="2+2")  # wrong argument
        + tc("calculator", expression="6*7")
    )  # fine
    eng = ScriptedEngine(tiny_tokenizer, [bad, "\\boxed{42}"])
    traj = run(env, eng, ground_truth="42")
    calls = traj.turns[0].tool_calls
    assert [c.error for c in calls] == ["malformed_call", "unknown_tool", "bad_arguments", None]
    assert traj.malformed_calls == 3 and traj.num_tool_calls == 4
    assert "not valid JSON" in calls[0].text and "unknown tool 'wolfram'" in calls[1].text
    assert "calculator" in calls[1].text and "expression" in calls[2].text
    assert calls[3].text.strip() == "42"
    assert traj.finish_reason == "answer" and traj.reward == 1.0
    # the model reads the errors
    assert (
        sum("<tool_response>" in tiny_tokenizer.decode(traj.response_ids[t.obs_start : t.obs_end]) for t in traj.turns)
        == 1
    )
    check_token_bookkeeping(env, eng, traj)


class SlowTool(Tool):
    name = "slow"
    description = "never answers in time"
    parameters = {"type": "object", "properties": {}}

    async def call(self, args, *, session_id=None):
        await asyncio.sleep(60)
        return ToolResult(text="too late")


def test_tool_timeout_mid_episode(tiny_tokenizer, real_tools):
    env = AgentEnv(
        tiny_tokenizer, {"slow": SlowTool(), "calculator": real_tools["calculator"]}, EpisodeConfig(tool_timeout=0.3)
    )
    eng = ScriptedEngine(tiny_tokenizer, [tc("slow"), "\\boxed{1}"])
    traj = run(env, eng, ground_truth="1")
    c0 = traj.turns[0].tool_calls[0]
    assert not c0.ok and c0.error == "timeout" and "timed out" in c0.text
    assert traj.tool_errors == 1 and traj.finish_reason == "answer" and traj.reward == 1.0
    check_token_bookkeeping(env, eng, traj)


def test_tool_failures_mid_episode(tiny_tokenizer, real_tools):
    env = AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig())
    eng = ScriptedEngine(
        tiny_tokenizer,
        [
            tc("python", code="1/0") + tc("calculator", expression="1/0 +* 2"),
            tc("python", code="print('still alive')"),
            "\\boxed{1}",
        ],
    )
    traj = run(env, eng, ground_truth="1")
    c1, c2 = traj.turns[0].tool_calls
    assert not c1.ok and c1.error == "runtime_error" and "ZeroDivisionError" in c1.text
    assert not c2.ok and c2.error is not None
    assert traj.turns[1].tool_calls[0].text.strip() == "still alive"
    assert traj.tool_errors == 2 and traj.malformed_calls == 0
    assert traj.finish_reason == "answer" and traj.reward == 1.0
    check_token_bookkeeping(env, eng, traj)


def test_code_block_parser_episode(tiny_tokenizer, real_tools):
    env = AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig(format="code_block"))
    eng = ScriptedEngine(tiny_tokenizer, ["Compute:\n```python\nprint(6 * 7)\n```", "So \\boxed{42}."])
    traj = run(env, eng, ground_truth="42")
    assert traj.finish_reason == "answer" and traj.reward == 1.0
    assert traj.messages[2] == {"role": "tool", "content": "```output\n42\n```"}
    check_token_bookkeeping(env, eng, traj)


def test_code_block_needs_python_tool(tiny_tokenizer, real_tools):
    with pytest.raises(EnvError, match="python"):
        AgentEnv(tiny_tokenizer, {"calculator": real_tools["calculator"]}, EpisodeConfig(format="code_block"))


# ----------------------------------------------------------------------------- endings and budgets


def test_void_turn_ends_episode_and_is_recorded(tiny_tokenizer, real_tools):
    env = AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig())
    eng = ScriptedEngine(tiny_tokenizer, [tc("calculator", expression="1+1"), "Hmm, let me think about it."])
    traj = run(env, eng, ground_truth="2")
    assert traj.finish_reason == "void_turn" and traj.void_turns == 1
    assert [t.void for t in traj.turns] == [False, True] and traj.reward == 0.0
    check_token_bookkeeping(env, eng, traj)


def test_max_turns(tiny_tokenizer, real_tools):
    env = AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig(max_assistant_turns=3))
    eng = ScriptedEngine(tiny_tokenizer, [tc("calculator", expression="1+1")])
    traj = run(env, eng)
    assert traj.finish_reason == "max_turns" and traj.num_turns == 3
    assert len(eng.calls) == 3
    assert not traj.turns[-1].tool_calls[0].executed  # nobody would read its result
    assert traj.turns[-1].obs_end == traj.turns[-1].obs_start == len(traj.response_ids)
    check_token_bookkeeping(env, eng, traj)


def test_per_turn_cap_and_total_budget(tiny_tokenizer, real_tools):
    long_text = "word " * 100
    env = AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig(max_tokens_per_turn=30, response_length=1000))
    eng = ScriptedEngine(tiny_tokenizer, [long_text])
    traj = run(env, eng)
    assert traj.finish_reason == "turn_length" and len(traj.response_ids) == 30 and traj.void_turns == 1
    assert eng.calls[0][1].max_tokens == 30

    # total budget: the second turn may only use what remains of R
    env = AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig(max_tokens_per_turn=200, response_length=120))
    eng = ScriptedEngine(tiny_tokenizer, [tc("calculator", expression="1+1"), long_text])
    traj = run(env, eng)
    first_turn_and_obs = traj.turns[0].obs_end
    assert eng.calls[1][1].max_tokens == 120 - first_turn_and_obs
    assert traj.finish_reason == "length" and len(traj.response_ids) == 120
    check_token_bookkeeping(env, eng, traj)


def test_tool_response_overflowing_the_budget_ends_the_episode(tiny_tokenizer, real_tools):
    call = tc("python", code="print('x' * 3000)")
    n_call = len(tiny_tokenizer.encode(call, add_special_tokens=False)) + 1
    cfg = EpisodeConfig(response_length=n_call + 20, max_tool_response_length=500)
    env = AgentEnv(tiny_tokenizer, real_tools, cfg)
    eng = ScriptedEngine(tiny_tokenizer, [call, "\\boxed{1}"])
    traj = run(env, eng)
    assert traj.finish_reason == "tool_overflow" and len(eng.calls) == 1
    assert traj.response_mask == [1] * n_call  # nothing inserted that nobody reads
    assert traj.turns[0].tool_calls[0].ok


@pytest.mark.parametrize("side", ["head", "tail", "middle"])
def test_tool_response_truncation_in_tokens(tiny_tokenizer, real_tools, side):
    cfg = EpisodeConfig(max_tool_response_length=40, tool_response_truncate_side=side, truncation_marker="[cut]")
    env = AgentEnv(tiny_tokenizer, real_tools, cfg)
    code = "print(''.join(f'<{i}>' for i in range(400)))"
    eng = ScriptedEngine(tiny_tokenizer, [tc("python", code=code), "\\boxed{1}"])
    traj = run(env, eng)
    rec = traj.turns[0].tool_calls[0]
    assert rec.truncated and rec.result_tokens > 40
    assert len(tiny_tokenizer.encode(rec.text, add_special_tokens=False)) <= 40
    assert rec.text.count("[cut]") == 1
    if side == "head":
        assert rec.text.startswith("<0><1>") and rec.text.endswith("[cut]")
    elif side == "tail":
        assert rec.text.startswith("[cut]") and rec.text.rstrip().endswith("<399>")
    else:
        assert rec.text.startswith("<0>") and rec.text.rstrip().endswith("<399>")
    check_token_bookkeeping(env, eng, traj)


def test_engine_abort_and_empty_output(tiny_tokenizer, real_tools):
    env = AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig())
    eng = ScriptedEngine(tiny_tokenizer, [[]])
    traj = run(env, eng)
    assert traj.finish_reason == "abort" and traj.response_ids == [] and traj.reward == 0.0


# ----------------------------------------------------------------------------- configuration
# (the chat template's own tests: test_template.py)


def _tokenizer_with_template(tokenizer, template):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def test_configuration_errors(tiny_tokenizer, real_tools):
    with pytest.raises(EnvError, match="response_length"):
        AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig(response_length=0))
    with pytest.raises(EnvError, match="tool_response_truncate_side"):
        AgentEnv(tiny_tokenizer, real_tools, EpisodeConfig(tool_response_truncate_side="left"))
    with pytest.raises(EnvError, match="unknown episode config keys"):
        EpisodeConfig.from_dict({"max_turns": 3})
    tok = _tokenizer_with_template(tiny_tokenizer, None)
    with pytest.raises(EnvError, match="no chat template"):
        AgentEnv(tok, real_tools)
    env = AgentEnv(tiny_tokenizer, real_tools)
    with pytest.raises(EnvError, match="prompt must be"):
        run(env, ScriptedEngine(tiny_tokenizer, ["x"]), prompt=42)


class EchoTool(Tool):
    name = "echo"
    description = "returns its text"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    async def call(self, args, *, session_id=None):
        return ToolResult(text=args["text"])


def test_token_bookkeeping_property(tiny_tokenizer):
    """Random scripts (text with unicode, well-formed / malformed / unknown calls, several per turn,
    answers, long tool outputs that get truncated): the token invariants hold for every episode."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=25).map(
        lambda s: s.replace("<", "(").replace("`", "'")
    )
    action = st.one_of(
        text.map(lambda s: tc("echo", text=s)),
        st.integers(0, 300).map(lambda k: tc("echo", text="ab" * k)),
        text.map(lambda s: tc("nope", text=s)),
        st.just('<tool_call>{"name": "echo", "arguments": {"text": </tool_call>'),
        st.just(tc("echo", wrong=1)),
    )
    turn = st.tuples(text, st.lists(action, max_size=3), st.booleans()).map(
        lambda t: t[0] + "".join(t[1]) + ("\\boxed{1}" if t[2] and not t[1] else "")
    )

    @settings(max_examples=25, deadline=None)
    @given(st.lists(turn, min_size=1, max_size=4), st.integers(20, 400), st.sampled_from(["head", "tail", "middle"]))
    def check(script, budget, side):
        cfg = EpisodeConfig(
            response_length=budget,
            max_tokens_per_turn=120,
            max_tool_response_length=30,
            tool_response_truncate_side=side,
            max_assistant_turns=3,
        )
        env = AgentEnv(tiny_tokenizer, [EchoTool()], cfg)
        eng = ScriptedEngine(tiny_tokenizer, script)
        traj = run(env, eng)
        assert len(traj.response_ids) <= budget
        assert traj.finish_reason in ("answer", "void_turn", "max_turns", "length", "turn_length", "tool_overflow")
        assert traj.malformed_calls == sum(
            c.error in ("malformed_call", "unknown_tool", "bad_arguments") for t in traj.turns for c in t.tool_calls
        )
        if traj.response_mask:
            assert traj.response_mask[-1] == 1 or traj.finish_reason not in ("tool_overflow",)
        check_token_bookkeeping(env, eng, traj)

    check()


def test_config_from_omegaconf_section():
    from omegaconf import OmegaConf

    section = OmegaConf.create(
        {
            "format": "code_block",
            "tools": ["python"],
            "max_assistant_turns": 3,
            "tool_config": {"python": {"stateful": True}},
            "reward": {"format_bonus": 0.1},
        }
    )
    cfg = EpisodeConfig.from_dict(section)
    assert cfg.format == "code_block" and cfg.tools == ["python"] and cfg.max_assistant_turns == 3
    assert cfg.reward.format_bonus == 0.1 and cfg.tool_config == {"python": {"stateful": True}}
    assert type(cfg.tool_config["python"]) is dict and type(cfg.tools) is list
    with pytest.raises(EnvError, match="bad reward config"):
        EpisodeConfig.from_dict({"reward": {"bonus": 1}})
    with pytest.raises(EnvError, match="unknown tool-call format"):
        EpisodeConfig.from_dict({"format": "xml"})


def test_unknown_settings_are_refused():
    with pytest.raises(TypeError, match="max_tokens"):
        EpisodeConfig(max_tokens=3)
    with pytest.raises(EnvError, match=r"unknown episode config keys \['max_response_tokens'\]"):
        EpisodeConfig.from_dict({"max_response_tokens": 77})


def test_the_defaults_are_the_trainer_configs_and_from_sections_reads_its_names():
    """One vocabulary: EpisodeConfig's defaults are the trainer's ``rollout`` / ``multi_turn`` /
    ``reward`` defaults, and from_sections of the default config gives the default EpisodeConfig."""
    from omegaconf import OmegaConf

    from otb_tir.trainer.config import Config, load_config

    assert (
        EpisodeConfig.from_sections(
            OmegaConf.structured(Config).rollout,
            OmegaConf.structured(Config).multi_turn,
            OmegaConf.structured(Config).reward,
        )
        == EpisodeConfig()
    )
    cfg = load_config(
        None,
        [
            "trainer=verl",  # the local trainer refuses truncated sampling; the key's mapping is what's tested
            "rollout.response_length=300",
            "rollout.top_k=5",
            "multi_turn.format=code_block",
            "multi_turn.max_tool_response_length=17",
            "multi_turn.tools=[python]",
            "multi_turn.tool_timeout=2.5",
            "reward.format_bonus=0.25",
        ],
    )
    ep = EpisodeConfig.from_sections(cfg.rollout, cfg.multi_turn, cfg.reward, temperature=0.0)
    assert (
        ep.response_length,
        ep.top_k,
        ep.format,
        ep.max_tool_response_length,
        ep.tools,
        ep.tool_timeout,
        ep.reward.format_bonus,
        ep.temperature,
    ) == (300, 5, "code_block", 17, ["python"], 2.5, 0.25, 0.0)
    # plain attribute objects (verl's dataclass configs) and mappings alike; a missing key keeps the default
    from types import SimpleNamespace

    ep = EpisodeConfig.from_sections(
        SimpleNamespace(response_length=64, temperature=0.7), {"format": "hermes", "max_parallel_calls": 2}
    )
    assert (ep.response_length, ep.temperature, ep.max_parallel_calls, ep.max_tokens_per_turn) == (64, 0.7, 2, 96)


class SessionRecorder(Tool):
    """A stateful tool that records its sessions: created on first call, released at the end."""

    name = "note"
    parameters = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}

    def __init__(self):
        self.events: list[tuple[str, str]] = []
        self.state: dict[str, int] = {}

    async def call(self, args, *, session_id=None):
        self.state[session_id] = self.state.get(session_id, 0) + 1
        self.events.append(("call", session_id))
        return ToolResult(text=f"call {self.state[session_id]}")

    async def release(self, session_id):
        self.state.pop(session_id, None)
        self.events.append(("release", session_id))


@pytest.mark.parametrize("ending", ["answer", "max_turns", "length", "engine_error", "cancelled"])
def test_a_stateful_session_is_released_however_the_trajectory_ends(tiny_tokenizer, ending):
    """One session per trajectory, never shared, released on every way an episode can end:
    an answer, the turn budget, the token budget, an engine failure, a cancelled rollout."""
    tool = SessionRecorder()
    gate = asyncio.Event()

    def script(prompt_ids, i):
        if i < 2:
            return tc("note", x=str(i))
        if ending == "engine_error":
            raise RuntimeError("the engine died")
        if ending == "length":
            return list(range(500, 900))  # no stop token: runs past the response budget
        return "\\boxed{2}"

    class Engine(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            if ending == "cancelled" and len(self.calls) == 2:
                await gate.wait()  # never set: the rollout is cancelled while waiting for the third turn
            return await super().generate(prompt_ids, params)

    engines = [Engine(tiny_tokenizer, script) for _ in range(2)]  # one per episode: its own turn count
    turns = 2 if ending == "max_turns" else 4
    env = AgentEnv(
        tiny_tokenizer,
        tools={"note": tool},
        config=EpisodeConfig(max_assistant_turns=turns, response_length=256, max_tokens_per_turn=256),
    )

    async def go():
        tasks = [
            asyncio.ensure_future(env.run(eng, f"question {k}", ground_truth="2")) for k, eng in enumerate(engines)
        ]
        if ending == "cancelled":
            for _ in range(200):
                if sum(e[0] == "call" for e in tool.events) >= 4:
                    break
                await asyncio.sleep(0.01)
            for t in tasks:
                t.cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = run_sync(go())
    sessions = {sid for _, sid in tool.events}
    calls = [sid for kind, sid in tool.events if kind == "call"]
    released = [sid for kind, sid in tool.events if kind == "release"]
    assert sorted(released) == sorted(sessions) and len(released) == len(set(released))  # each once
    assert tool.state == {}  # nothing left behind
    if ending == "cancelled":
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
    elif ending == "engine_error":
        assert all(isinstance(r, RuntimeError) for r in results)
    else:
        assert len(sessions) == 2  # one per trajectory
        assert all(calls.count(s) == (1 if ending == "max_turns" else 2) for s in sessions)
        expected = {"answer": "answer", "max_turns": "max_turns", "length": "length"}[ending]
        assert [r.finish_reason for r in results] == [expected] * 2
