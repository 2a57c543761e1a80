"""The chat template core (agent_env.template.ChatTemplate): rendering, the round-trip check, the
inserted delta and the mismatch checks that make token-in-token-out hold, on the real tiny
tokenizer and its chat template (and broken variants of it)."""

from __future__ import annotations

import copy

import pytest

from agent_env import AgentEnv, EnvError, EpisodeConfig
from agent_env.template import ChatTemplate
from tests.agent_env.test_episode import EchoTool, ScriptedEngine, real_tools, run, tc  # noqa: F401 (real_tools: a fixture)

SCHEMAS = [EchoTool().schema()]


def _tokenizer_with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def _sample(tpl: ChatTemplate, content: str) -> list[int]:
    """The ids a model writing ``content`` and stopping samples."""
    return tpl.encode(content) + [tpl.stop_ids[0]]


# ----------------------------------------------------------------------------- the basics


def test_closing_stop_ids_and_content_ids(tiny_tokenizer):
    tpl = ChatTemplate(tiny_tokenizer, SCHEMAS)
    assert tpl.stop_ids == [tiny_tokenizer.eos_token_id]
    assert tpl.closing == "<|im_end|>\n"
    ids = tpl.encode("hi")
    assert tpl.content_ids(ids + tpl.stop_ids) == ids and tpl.content_ids(ids) == ids and tpl.content_ids([]) == []
    assert ChatTemplate(tiny_tokenizer, SCHEMAS, stop_token_ids=[7, 8]).stop_ids == [7, 8]
    assert tpl.initial_messages("q", "sys") == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]
    with pytest.raises(EnvError, match="prompt must be"):
        tpl.initial_messages([])


def test_prompt_ids_are_the_rendered_prompts_tokens_each_time_and_a_fresh_list(tiny_tokenizer):
    """prompt_ids remembers recent conversations (a group's samples share one): what it returns is
    always the template's rendering of *these* messages, encoded, and the caller's to change."""
    tpl = ChatTemplate(tiny_tokenizer, SCHEMAS)
    convs = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "What is 2+3?"}],
    ]
    for _ in range(3):
        for messages in convs:
            want = tpl.encode(tpl.render(messages, add_generation_prompt=True))
            got = tpl.prompt_ids(messages)
            assert got == want
            got.append(-1)  # the caller's own list: the next call is unchanged
    assert tpl.prompt_ids(convs[0]) == tpl.encode(tpl.render(convs[0], add_generation_prompt=True))
    # conversations that differ only in a dict's key order render differently (the template's tojson
    # keeps the order): each gets its own tokens, not the other's remembered ones (issue 59)
    call = {"name": "calculator", "arguments": {"expression": "2+2", "precision": 3}}
    swapped = {"arguments": {"precision": 3, "expression": "2+2"}, "name": "calculator"}
    pair = [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [c]}]
        for c in ({"type": "function", "function": call}, {"type": "function", "function": swapped})
    ]
    rendered = [tpl.render(m, add_generation_prompt=True) for m in pair]
    assert rendered[0] != rendered[1], "the template ignores key order: the case below shows nothing"
    for messages, text in zip(pair, rendered):
        assert tpl.prompt_ids(messages) == tpl.encode(text)
    # a lossy tokenizer is refused on every call, not only the first
    lossy = ChatTemplate(_LossyTokenizer(tiny_tokenizer), SCHEMAS)
    for _ in range(2):
        with pytest.raises(EnvError, match="does not round-trip the prompt"):
            lossy.prompt_ids([{"role": "user", "content": "q"}])


def test_a_tokenizer_without_template_or_eos_is_refused(tiny_tokenizer):
    with pytest.raises(EnvError, match="no chat template"):
        ChatTemplate(_tokenizer_with_template(tiny_tokenizer, None))
    no_eos = _LossyTokenizer(tiny_tokenizer)
    no_eos.eos_token_id = None
    with pytest.raises(EnvError, match="no eos token"):
        ChatTemplate(no_eos)
    assert ChatTemplate(no_eos, stop_token_ids=[5]).stop_ids == [5]


class _LossyTokenizer:
    """The tiny tokenizer, except that decoding loses a character: no round trip."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode(self, ids, **kw):
        return self._tok.decode(ids, **kw).replace("\n", " ")


def test_a_tokenizer_that_does_not_round_trip_is_refused(tiny_tokenizer):
    tpl = ChatTemplate(_LossyTokenizer(tiny_tokenizer), SCHEMAS)
    with pytest.raises(EnvError, match="does not round-trip the prompt"):
        tpl.prompt_ids([{"role": "user", "content": "q"}])
    with pytest.raises(EnvError, match="does not round-trip text"):
        tpl.encode_exact("a\nb")
    good = ChatTemplate(tiny_tokenizer, SCHEMAS)
    assert good.decode(good.encode_exact("a\nb")) == "a\nb"
    # in an episode: refused before anything is sampled
    env = AgentEnv(_LossyTokenizer(tiny_tokenizer), [EchoTool()], EpisodeConfig())
    eng = ScriptedEngine(tiny_tokenizer, ["\\boxed{1}"])
    with pytest.raises(EnvError, match="does not round-trip the prompt"):
        run(env, eng)
    assert eng.calls == []


def test_truncate_property_unicode(tiny_tokenizer):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    tpl = ChatTemplate(tiny_tokenizer, SCHEMAS)
    marker = EpisodeConfig().truncation_marker

    @settings(max_examples=30, deadline=None)
    @given(st.text(max_size=300), st.integers(1, 30), st.sampled_from(["head", "tail", "middle"]))
    def check(text, cap, side):
        out, cut, n = tpl.truncate(text, cap, side, marker)
        assert n == len(tiny_tokenizer.encode(text, add_special_tokens=False))
        if not cut:
            assert out == text and n <= cap
        else:
            marker_tokens = len(tiny_tokenizer.encode(marker, add_special_tokens=False))
            assert len(tiny_tokenizer.encode(out, add_special_tokens=False)) <= max(cap, marker_tokens)
            assert marker in out

    check()


# ----------------------------------------------------------------------------- the delta


def test_delta_inserted_and_sampled_tokens_re_render_the_conversation(tiny_tokenizer):
    """Property: over random turns (unicode text, several tool messages each), the prompt ids +
    sampled ids + delta ids decode to the template's rendering of the conversation at every step,
    with no mismatch, and the delta starts with the newline after the sampled stop token."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    tpl = ChatTemplate(tiny_tokenizer, SCHEMAS)
    text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30).map(
        lambda s: s.replace("<", "(").replace("`", "'")
    )
    turn = st.tuples(text, st.lists(text, min_size=1, max_size=3))

    @settings(max_examples=40, deadline=None)
    @given(text, st.lists(turn, min_size=1, max_size=4), text)
    def check(question, turns, answer):
        messages = tpl.initial_messages(question)
        stream = tpl.prompt_ids(messages)
        for content, results in turns:
            stream = stream + _sample(tpl, content)
            messages.append({"role": "assistant", "content": content})
            obs = [{"role": "tool", "content": r} for r in results]
            delta, mismatch = tpl.delta(stream, messages, obs)
            assert mismatch is None
            assert delta.startswith("\n<|im_start|>user\n<tool_response>") and delta.endswith("<|im_start|>assistant\n")
            stream = stream + tpl.encode_exact(delta)
            messages.extend(obs)
            assert tpl.decode(stream) == tpl.render(messages, add_generation_prompt=True)
        # the last turn (no tool call): the conversation's rendering continues the token stream
        stream = stream + _sample(tpl, answer)
        messages.append({"role": "assistant", "content": answer})
        assert tpl.final_mismatch(stream, messages) is None

    check()


def test_history_rewriting_template_gives_a_mismatch_and_the_templates_closing(tiny_tokenizer):
    from otb_tir.defaults.tiny import chat_template

    stripping = chat_template().replace(
        "{{- text(message.content) -}}", "{{- text(message.content).split('</think>')[-1] | trim -}}", 1
    )
    assert stripping != chat_template()
    tpl = ChatTemplate(_tokenizer_with_template(tiny_tokenizer, stripping), SCHEMAS)
    messages = tpl.initial_messages("q")
    content = "<think>hmm</think>" + tc("echo", text="x")
    stream = tpl.prompt_ids(messages) + _sample(tpl, content)
    messages.append({"role": "assistant", "content": content})
    delta, mismatch = tpl.delta(stream, messages, [{"role": "tool", "content": "x"}])
    assert mismatch is not None and "first difference" in mismatch
    # the sampled stop token stays; what the template writes after it, then the new messages
    assert delta == "\n<|im_start|>user\n<tool_response>\nx\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tpl.final_mismatch(stream, messages) is not None


def test_history_rewriting_template_is_detected(tiny_tokenizer, real_tools):  # noqa: F811
    """A template that strips reasoning from assistant turns renders something other than what the
    model produced: the mismatch is recorded (or raised), the inserted tokens stay correct."""
    from otb_tir.defaults.tiny import chat_template

    stripping = chat_template().replace(
        "{{- text(message.content) -}}", "{{- text(message.content).split('</think>')[-1] | trim -}}", 1
    )
    assert stripping != chat_template()
    tok = _tokenizer_with_template(tiny_tokenizer, stripping)
    script = ["<think>let me use the calculator</think>" + tc("calculator", expression="3*3"), "\\boxed{9}"]
    env = AgentEnv(tok, real_tools, EpisodeConfig())
    eng = ScriptedEngine(tok, script)
    traj = run(env, eng, ground_truth="9")
    assert traj.template_mismatch is not None and "turn 0" in traj.template_mismatch
    assert traj.reward == 1.0
    # mask=1 still exactly the sampled ids; the inserted tokens are the template's closing newline,
    # the tool response and the next assistant header
    t0 = traj.turns[0]
    inserted = tok.decode(traj.response_ids[t0.obs_start : t0.obs_end], skip_special_tokens=False)
    assert inserted == "\n<|im_start|>user\n<tool_response>\n9\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert [i for i, m in zip(traj.response_ids, traj.response_mask) if m] == [
        i for _, _, o in eng.calls for i in o.token_ids
    ]

    strict = AgentEnv(tok, real_tools, EpisodeConfig(on_template_mismatch="error"))
    with pytest.raises(EnvError, match="renders the conversation differently"):
        run(strict, ScriptedEngine(tok, script))


def _marks_the_last_message():
    from otb_tir.defaults.tiny import chat_template

    # Marks the last message specially: adding a tool message changes the earlier rendering.
    bad = chat_template().replace(
        "{{- '<|im_end|>\\n' -}}\n    {%- elif message.role == 'tool' -%}",
        "{%- if loop.last -%}{{- ' (last)' -}}{%- endif -%}{{- '<|im_end|>\\n' -}}\n"
        "    {%- elif message.role == 'tool' -%}",
        1,
    )
    assert bad != chat_template()
    return bad


def test_non_prefix_preserving_template_raises(tiny_tokenizer, real_tools):  # noqa: F811
    tok = _tokenizer_with_template(tiny_tokenizer, _marks_the_last_message())
    tpl = ChatTemplate(tok, SCHEMAS)
    messages = tpl.initial_messages("q") + [{"role": "assistant", "content": "a"}]
    with pytest.raises(EnvError, match="not prefix-preserving"):
        tpl.delta(tpl.encode("x"), messages, [{"role": "tool", "content": "r"}])
    env = AgentEnv(tok, real_tools, EpisodeConfig())
    with pytest.raises(EnvError, match="not prefix-preserving"):
        run(env, ScriptedEngine(tok, [tc("calculator", expression="1+1"), "\\boxed{2}"]))
