"""The README's "Adding a tool" section does what it says: run its code block verbatim, then use
the tool it defines. The block is read from README.md, so documentation and test cannot drift apart."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from tools import ErrorKind, get_tool, list_tools, load_tools
from tools.registry import unregister_tool

ROOT = Path(__file__).resolve().parents[2]
HEADING = re.compile(r"^#+\s*Adding a tool\s*$", re.MULTILINE)


def adding_a_tool_section() -> tuple[Path, str]:
    for path in (ROOT / "README.md",):
        if path.exists():
            text = path.read_text()
            match = HEADING.search(text)
            if match:
                rest = text[match.end():]
                level = len(text[match.start():match.end()].split()[0])
                following = re.search(rf"^#{{1,{level}}}\s", rest, re.MULTILINE)
                return path, rest[: following.start()] if following else rest
    pytest.fail("no 'Adding a tool' section in README.md")


def test_section_is_short_and_has_one_python_block():
    path, section = adding_a_tool_section()
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1, path
    lines = [line for line in section.strip().splitlines() if line.strip() and not line.startswith("```")]
    assert len(lines) <= 15, f"{path}: the section has {len(lines)} lines of code+text"


def test_readme_snippet_runs_and_makes_a_working_tool(tmp_path):
    path, section = adding_a_tool_section()
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert "word_count" not in list_tools()
    namespace: dict = {"__name__": "readme_snippet"}
    exec(compile(code, str(path), "exec"), namespace)  # the documented code, verbatim
    try:
        assert "word_count" in list_tools()
        tool = get_tool("word_count")
        function = tool.schema()["function"]
        assert function["description"] == "Count the words in a text."
        assert function["parameters"]["required"] == ["text"]
        assert function["parameters"]["properties"]["text"] == {"type": "string", "description": "The text to count."}
        assert function["parameters"]["properties"]["unique"] == {
            "type": "boolean", "description": "Count each distinct word once.", "default": False}

        async def calls():
            return (await tool.invoke({"text": "to be or not to be"}),
                    await tool.invoke({"text": "to be or not to be", "unique": True}),
                    await tool.invoke({"txt": "oops"}))

        plain, unique, bad = asyncio.run(calls())
        assert (plain.ok, plain.text) == (True, "6")
        assert (unique.ok, unique.text) == (True, "4")
        assert bad.error == ErrorKind.BAD_ARGUMENTS and "missing required argument 'text'" in bad.text

        # "YAML tool configs can name it"
        config = tmp_path / "tools.yaml"
        config.write_text("tools:\n  - name: word_count\n")
        (from_yaml,) = load_tools(config)
        assert asyncio.run(from_yaml.invoke({"text": "a b c"})).text == "3"
    finally:
        unregister_tool("word_count")
