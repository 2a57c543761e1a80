"""Tool-call parsers on well-formed and adversarial text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_env import EnvError
from agent_env.parsers import CodeBlockParser, HermesParser, get_parser


def call(name, args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def test_get_parser_by_name():
    assert isinstance(get_parser("hermes"), HermesParser)
    assert isinstance(get_parser("code_block"), CodeBlockParser)
    with pytest.raises(EnvError, match="unknown tool-call format 'xml'.*code_block.*hermes"):
        get_parser("xml")


def test_hermes_several_calls_in_order_with_text_between():
    text = (
        "Let me compute.\n"
        + call("calculator", {"expression": "2+2"})
        + " and also "
        + call("python", {"code": "print('}</tool_call>')"})
        + "\nDone."
    )
    calls = HermesParser().parse(text)
    assert [c.name for c in calls] == ["calculator", "python"]
    assert calls[0].arguments == {"expression": "2+2"}
    assert all(c.ok for c in calls)
    assert calls[0].raw.startswith("<tool_call>") and calls[0].raw.endswith("</tool_call>")


def test_hermes_no_call():
    assert HermesParser().parse("The answer is \\boxed{4}.") == []
    assert HermesParser().parse("") == []


def test_hermes_bad_json_is_malformed_not_raised():
    calls = HermesParser().parse('<tool_call>{"name": "calculator", "arguments": {"expression": "2+</tool_call>')
    assert len(calls) == 1 and calls[0].error == "malformed_call"
    assert "not valid JSON" in calls[0].error_message


def test_hermes_truncated_unterminated_call():
    text = call("calculator", {"expression": "1+1"}) + '\n<tool_call>\n{"name": "python", "argu'
    calls = HermesParser().parse(text)
    assert [c.ok for c in calls] == [True, False]
    assert "unterminated" in calls[1].error_message


def test_hermes_nested_tags():
    text = (
        "<tool_call> oops <tool_call>"
        + json.dumps({"name": "calculator", "arguments": {"expression": "3*3"}})
        + "</tool_call>"
    )
    calls = HermesParser().parse(text)
    assert [c.ok for c in calls] == [False, True]
    assert calls[0].error == "malformed_call" and "inside another" in calls[0].error_message
    assert calls[1].arguments == {"expression": "3*3"}


@pytest.mark.parametrize(
    "body,msg",
    [
        ('["calculator"]', "JSON object"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "", "arguments": {}}', 'no "name"'),
        ('{"name": "calculator", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "calculator", "arguments": "{bad"}', "string that is not valid JSON"),
        ('', "not valid JSON"),
    ],
)
def test_hermes_malformed_shapes(body, msg):
    calls = HermesParser().parse(f"<tool_call>{body}</tool_call>")
    assert len(calls) == 1 and not calls[0].ok and msg in calls[0].error_message


def test_hermes_arguments_as_json_string_and_missing():
    calls = HermesParser().parse(
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+2\\"}"}'
        '</tool_call><tool_call>{"name": "calculator"}</tool_call>'
    )
    assert [c.ok for c in calls] == [True, True]
    assert calls[0].arguments == {"expression": "1+2"} and calls[1].arguments == {}


def test_hermes_unicode():
    calls = HermesParser().parse(call("python", {"code": "print('héllo 世界 🚀')"}) + "🙂")
    assert calls[0].ok and calls[0].arguments["code"] == "print('héllo 世界 🚀')"


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(max_size=20),
            st.sampled_from(["calculator", "python", "x"]),
            st.dictionaries(st.text(max_size=5), st.text(max_size=10), max_size=3),
        ),
        max_size=4,
    ),
    st.text(max_size=30),
)
def test_hermes_property_roundtrip(parts, junk):
    """Well-formed calls separated by arbitrary text (without tags) are all found, in order,
    with exactly their arguments; arbitrary junk never makes the parser raise."""
    parts = [(p.replace("<tool_call>", "").replace("</tool_call>", ""), n, a) for p, n, a in parts]
    text = "".join(prefix + call(name, args) for prefix, name, args in parts)
    calls = HermesParser().parse(text)
    assert [(c.name, c.arguments) for c in calls] == [(n, a) for _, n, a in parts]
    HermesParser().parse(junk + text[: len(text) // 2])  # truncated: must not raise


def test_code_block_calls_python_tool():
    text = "First:\n```python\nx = 2\nprint(x * 21)\n```\nthen\n```py\nprint('ok')\n```\n```output\n42\n```"
    calls = CodeBlockParser().parse(text)
    assert [c.name for c in calls] == ["python", "python"]
    assert calls[0].arguments == {"code": "x = 2\nprint(x * 21)\n"}
    assert calls[1].arguments == {"code": "print('ok')\n"}


def test_code_block_unterminated_and_empty_are_malformed():
    calls = CodeBlockParser().parse("```python\n\n```\nand\n```python\nprint(1)")
    assert [c.ok for c in calls] == [False, False]
    assert "empty" in calls[0].error_message and "unterminated" in calls[1].error_message


def test_code_block_ignores_other_languages_and_formats_output():
    p = CodeBlockParser()
    assert p.parse("```bash\nls\n```\n```\nplain\n```") == []
    assert p.format_observation("42\n") == "```output\n42\n```"
