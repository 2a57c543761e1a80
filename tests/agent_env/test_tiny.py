"""The tiny local policy: tokenizer, chat template, model, cached folder."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otb_tir.defaults.tiny import (
    IM_END,
    IM_START,
    MARKUP_TOKENS,
    PAD_TOKEN,
    build_tiny_model,
    build_tiny_tokenizer,
    tiny_policy_dir,
)

CALC_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
PY_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code; returns stdout.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}


def render(tok, messages, **kw) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- tokenizer


def test_special_and_markup_tokens_are_single_ids(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.eos_token == IM_END and tok.pad_token == PAD_TOKEN
    for t in [PAD_TOKEN, IM_START, IM_END, *MARKUP_TOKENS]:
        enc = ids(tok, f"a{t}b")
        assert tok.convert_tokens_to_ids(t) in enc, t
        assert len(ids(tok, t)) == 1, t
    # markup survives skip_special_tokens (as in Qwen), control tokens do not
    text = f"{IM_START}assistant\n<tool_call>\n{{}}\n</tool_call>{IM_END}"
    assert tok.decode(ids(tok, text), skip_special_tokens=True) == "assistant\n<tool_call>\n{}\n</tool_call>"
    assert 2000 <= len(tok) <= 4096


def test_tokenizer_is_deterministic_and_compresses_domain_text():
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert a.get_vocab() == b.get_vocab()
    text = 'The answer is the product of the two numbers, so I will use the calculator tool.'
    assert len(ids(a, text)) < len(text) / 3  # learned merges, not bytes
    # digits are split one by one (as in Qwen), which keeps arithmetic tokenization regular
    assert a.convert_ids_to_tokens(ids(a, "12345")) == list("12345")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_tokenizer_round_trips_any_unicode(tiny_tokenizer, text):
    assert tiny_tokenizer.decode(ids(tiny_tokenizer, text)) == text


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.sampled_from([IM_START, IM_END, "<tool_call>", "</tool_response>", "x", " ", "\n", "é", "{}"]), max_size=30
    )
)
def test_tokenizer_round_trips_text_with_markup(tiny_tokenizer, parts):
    text = "".join(parts)
    assert tiny_tokenizer.decode(ids(tiny_tokenizer, text)) == text


# ----------------------------------------------------------------------------- template


def test_template_renders_tools_calls_and_grouped_responses(tiny_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2 and 3*3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+2"}}},
                {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "3*3"}'}},
            ],
        },
        {"role": "tool", "content": "4"},
        {"role": "tool", "content": "9"},
        {"role": "assistant", "content": "\\boxed{4, 9}"},
    ]
    out = render(tiny_tokenizer, messages, tools=[CALC_SCHEMA, PY_SCHEMA])
    # tools are listed compactly: one JSON line per tool, argument names → JSON-schema types
    expected_system = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n"
        '{"name": "calculator", "arguments": {"expression": "string"}}\n'
        '{"name": "python", "arguments": {"code": "string"}}\n'
        "</tools>\nCall a tool as <tool_call>\n"
        '{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n'
    )
    for schema, line in zip([CALC_SCHEMA, PY_SCHEMA], expected_system.split("<tools>\n")[1].split("\n")):
        fn = schema.get("function", schema)
        assert json.loads(line) == {
            "name": fn["name"],
            "arguments": {k: v["type"] for k, v in fn["parameters"]["properties"].items()},
        }
    expected_rest = (
        "<|im_start|>user\nWhat is 2+2 and 3*3?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*3"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n9\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n\\boxed{4, 9}<|im_end|>\n"
    )
    assert out == expected_system + expected_rest
    # the tool-call JSON inside the assistant turn parses back to the call
    body = out.split("<tool_call>\n")[2].split("\n</tool_call>")[0]
    assert json.loads(body) == {"name": "calculator", "arguments": {"expression": "2+2"}}


def test_template_without_tools_or_system(tiny_tokenizer):
    out = render(tiny_tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = render(tiny_tokenizer, [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    assert out == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    # tools but no system message: the tools block is the system prompt
    out = render(tiny_tokenizer, [{"role": "user", "content": "hi"}], tools=[CALC_SCHEMA])
    assert out.startswith("<|im_start|>system\n# Tools\n<tools>\n") and out.endswith("<|im_start|>user\nhi<|im_end|>\n")


def test_template_assistant_content_with_call_and_reasoning(tiny_tokenizer):
    msg = {
        "role": "assistant",
        "reasoning_content": "need a tool",
        "content": "Let me compute.",
        "tool_calls": [{"name": "python", "arguments": {"code": "print(1)"}}],
    }
    out = render(tiny_tokenizer, [{"role": "user", "content": "q"}, msg])
    assert out.endswith(
        "<|im_start|>assistant\n<think>\nneed a tool\n</think>\n\nLet me compute.\n"
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call><|im_end|>\n'
    )


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "robot", "content": "x"}], "unknown message role"),
        ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "only allowed first"),
    ],
)
def test_template_rejects_bad_messages(tiny_tokenizer, messages, match):
    with pytest.raises(Exception, match=match):
        render(tiny_tokenizer, messages)


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)
_call = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["calculator", "python"]),
        "arguments": st.dictionaries(st.sampled_from(["code", "expression"]), _text, max_size=2),
    }
).map(lambda f: {"type": "function", "function": f})
_assistant = st.builds(
    lambda content, calls: {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})},
    _text,
    st.lists(_call, max_size=3),
)


@st.composite
def conversations(draw):
    """A conversation that ends with an assistant turn (the point where the env inserts messages)."""
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(_text)})
    msgs.append({"role": "user", "content": draw(_text)})
    msgs.append(draw(_assistant))
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            msgs += [{"role": "tool", "content": c} for c in draw(st.lists(_text, min_size=1, max_size=3))]
        else:
            msgs.append({"role": "user", "content": draw(_text)})
        msgs.append(draw(_assistant))
    return msgs


@settings(max_examples=150, deadline=None)
@given(conversations(), st.lists(_text, min_size=1, max_size=3), st.booleans(), st.booleans())
def test_template_is_prefix_preserving(tiny_tokenizer, msgs, tool_texts, as_user, with_tools):
    """Appending tool responses (or a user message) after an assistant turn only appends text/tokens,
    and the generation prompt is a prefix of the rendered assistant turn."""
    tok = tiny_tokenizer
    kw = {"tools": [CALC_SCHEMA, PY_SCHEMA]} if with_tools else {}
    base = render(tok, msgs, **kw)
    new = (
        [{"role": "user", "content": tool_texts[0]}]
        if as_user
        else [{"role": "tool", "content": t} for t in tool_texts]
    )
    full = render(tok, msgs + new, add_generation_prompt=True, **kw)
    assert full.startswith(base)
    base_ids, full_ids = ids(tok, base), ids(tok, full)
    assert full_ids[: len(base_ids)] == base_ids  # also prefix-preserving at the token level
    assert tok.decode(full_ids[len(base_ids) :]) == full[len(base) :]
    # the generation prompt, then the assistant's own text: the history is never rewritten
    gen = render(tok, msgs[:-1], add_generation_prompt=True, **kw)
    assert base.startswith(gen)
    assert base.endswith(IM_END + "\n")


# ----------------------------------------------------------------------------- model and folder


def test_model_is_deterministic_and_small(tiny_tokenizer):
    a = build_tiny_model(tiny_tokenizer, seed=3)
    b = build_tiny_model(tiny_tokenizer, seed=3)
    c = build_tiny_model(tiny_tokenizer, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    n = sum(p.numel() for p in a.parameters())
    assert 2e5 <= n <= 5e6, n
    assert a.config.tie_word_embeddings and a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()
    assert a.config.model_type == "qwen3" and a.config.vocab_size == len(tiny_tokenizer)
    small = build_tiny_model(
        tiny_tokenizer, hidden_size=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate_size=64
    )
    assert sum(p.numel() for p in small.parameters()) < n / 3


def test_saved_folder_reloads_with_auto_classes(tiny_model_dir, tiny_tokenizer, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fresh_tok = build_tiny_tokenizer()
    assert tiny_tokenizer.get_vocab() == fresh_tok.get_vocab()
    assert tiny_tokenizer.chat_template == fresh_tok.chat_template
    assert tiny_tokenizer.eos_token_id == fresh_tok.eos_token_id == tiny_model.config.eos_token_id
    fresh_model = build_tiny_model(fresh_tok)  # the fixture folder was built with the defaults
    msgs = [{"role": "user", "content": "Compute 17*23 with the calculator."}]
    x = torch.tensor(
        [ids(tiny_tokenizer, render(tiny_tokenizer, msgs, tools=[CALC_SCHEMA], add_generation_prompt=True))]
    )
    with torch.no_grad():
        assert torch.equal(tiny_model(x).logits, fresh_model(x).logits)
        again = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        assert torch.equal(again(x).logits, tiny_model(x).logits)
    assert AutoTokenizer.from_pretrained(tiny_model_dir).encode("2+2=4") == tiny_tokenizer.encode("2+2=4")
    # cached: the same call returns the same folder without rebuilding
    assert tiny_policy_dir() == tiny_model_dir


@pytest.mark.slow
def test_cache_dir_env_and_concurrent_builders(tmp_path, monkeypatch):
    """Two processes building the same folder at once both end with one valid folder."""
    script = textwrap.dedent(
        """
        import sys
        from otb_tir.defaults.tiny import tiny_policy_dir
        print(tiny_policy_dir(hidden_size=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate_size=64))
        """
    )
    env = {**__import__("os").environ, "OTB_TIR_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and outs[0].startswith(str(tmp_path))
    entries = [e.name for e in tmp_path.iterdir()]
    assert entries == [outs[0].rsplit("/", 1)[1]]  # no temporary folder left behind
    monkeypatch.setenv("OTB_TIR_CACHE", str(tmp_path))
    from pathlib import Path

    assert tiny_policy_dir(hidden_size=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate_size=64) == Path(
        outs[0]
    )
    other = tiny_policy_dir(
        tmp_path / "elsewhere", hidden_size=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate_size=64, seed=1
    )
    assert other.parent == tmp_path / "elsewhere" and other.name != Path(outs[0]).name


def test_template_compact_tool_lines_edge_cases(tiny_tokenizer):
    """A tool without parameters, a bare (unwrapped) schema, and a property without a ``type``."""
    tools = [
        {"type": "function", "function": {"name": "now", "description": "time"}},
        {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"key": {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "n": {"type": "integer"}},
            },
        },
    ]
    out = render(tiny_tokenizer, [{"role": "user", "content": "hi"}], tools=tools)
    lines = out.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(x) for x in lines] == [
        {"name": "now", "arguments": {}},
        {"name": "lookup", "arguments": {"key": "any", "n": "integer"}},
    ]
