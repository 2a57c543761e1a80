"""tools.build_tool_set: the one assembly of a run's tools (names, per-tool config, verl-style
YAML, entry points), its rules, its record of where each tool came from, and its errors."""

from __future__ import annotations

import asyncio
import shutil
import textwrap
from pathlib import Path

import pytest

from tools import DEFAULT_TOOLS, ToolError, build_tool_set

PLUGIN = Path(__file__).resolve().parents[1] / "data" / "plugins" / "lookup_plugin.py"


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """The user's plugin module in a folder outside the project, on sys.path (as PYTHONPATH would)."""
    d = tmp_path / "user_code"
    d.mkdir()
    shutil.copy(PLUGIN, d / "lookup_plugin.py")
    monkeypatch.syspath_prepend(str(d))
    return d


def _yaml(tmp_path: Path, body: str) -> str:
    p = tmp_path / "my_tools.yaml"
    p.write_text(textwrap.dedent(body))
    return str(p)


def _close(ts) -> None:
    asyncio.run(ts.close())


def test_default_set_is_python_and_calculator():
    ts = build_tool_set()
    try:
        assert sorted(ts) == sorted(DEFAULT_TOOLS)
        rec = {r["name"]: r for r in ts.describe()}
        assert rec["python"]["cls"] == "tools.sandbox.tool.PythonTool" and rec["python"]["source"].startswith(
            "built-in"
        )
        assert rec["python"]["isolation"]  # the sandbox names its isolation level
        assert rec["calculator"]["cls"].endswith("CalculatorTool")
    finally:
        _close(ts)


def test_yaml_alone_gives_exactly_its_tools_and_records_where_they_came_from(tmp_path, plugin_dir):
    log = tmp_path / "calls.jsonl"
    path = _yaml(
        tmp_path,
        f"""
        tools:
          - class_name: lookup_plugin.Lookup
            config: {{log_path: {log}, prefix: hello}}
    """,
    )
    ts = build_tool_set(None, None, path)
    try:
        assert list(ts) == ["lookup"]
        (rec,) = ts.describe()
        assert rec["cls"] == "lookup_plugin.Lookup" and path in rec["source"] and "tools[0]" in rec["source"]
        assert rec["config"] == {"log_path": str(log), "prefix": "hello"} and rec["isolation"] is None
        res = asyncio.run(ts["lookup"].invoke({"query": "x"}, session_id="s1"))
        assert res.ok and res.text == "hello 1"
        assert '"session_id": "s1"' in log.read_text()
    finally:
        _close(ts)


def test_names_and_yaml_are_added_and_a_name_defined_twice_is_an_error(tmp_path, plugin_dir):
    path = _yaml(
        tmp_path,
        f"""
        tools:
          - class_name: lookup_plugin.Lookup
            config: {{log_path: {tmp_path / 'log'}}}
    """,
    )
    ts = build_tool_set(["calculator"], {"calculator": {"timeout": 2.0}}, path)
    try:
        assert sorted(ts) == ["calculator", "lookup"]
        assert {r["name"]: r["config"] for r in ts.describe()}["calculator"] == {"timeout": 2.0}
    finally:
        _close(ts)
    clash = _yaml(
        tmp_path,
        """
        tools:
          - class_name: tools.calculator.CalculatorTool
    """,
    )
    with pytest.raises(ToolError, match="'calculator' is also in multi_turn.tools"):
        build_tool_set(["calculator"], None, clash)


@pytest.mark.parametrize(
    "names, conf, match",
    [
        ([], None, "yields no tools"),
        (["pyhton"], None, "unknown tool 'pyhton'; available tools: .*python"),
        (["calculator"], {"calculator": {"bogus": 1}}, "tool 'calculator' got unknown config key\\(s\\) \\['bogus'\\]"),
        (["calculator"], {"python": {"timeout": 1}}, "settings for \\['python'\\], which are not in multi_turn.tools"),
        (["calculator", "calculator"], None, "more than once"),
        ("calculator", None, "must be a list of tool names"),
    ],
)
def test_bad_sets_name_the_tool_and_the_reason(names, conf, match):
    with pytest.raises(ToolError, match=match):
        build_tool_set(names, conf)


@pytest.mark.parametrize(
    "body, match",
    [
        ("tools:\n  - class_name: no_such_module.Tool\n", "tools\\[0\\].*cannot import module 'no_such_module'"),
        ("tools:\n  - class_name: lookup_plugin.Nope\n", "'lookup_plugin' has no attribute 'Nope'"),
        (
            "tools:\n  - class_name: lookup_plugin.Lookup\n    config: {bogus: 1}\n",
            "unknown config key\\(s\\) \\['bogus'\\].*valid keys: log_path, prefix",
        ),
        ("tools:\n  - class_name: lookup_plugin.SessionLookup\n    config: {log_path: x}\n", "needs a tool_schema"),
        (
            "tools:\n  - class_name: lookup_plugin.SessionLookup\n    config: {}\n    tool_schema: {type: function, "
            "function: {name: lookup, parameters: {type: object, properties: {}}}}\n",
            "SessionLookup\\(config=..., tool_schema=...\\) failed: KeyError",
        ),
        (
            "tools:\n  - class_name: lookup_plugin.Lookup\n    config: {log_path: x}\n"
            "    tool_schema: {type: function, "
            "function: {name: lookup, parameters: {type: array}}}\n",
            "lookup",
        ),
        ("tool: []\n", "top-level 'tools:' list"),
    ],
)
def test_a_tools_yaml_that_does_not_load_says_which_entry_and_why(tmp_path, plugin_dir, body, match):
    path = _yaml(tmp_path, body)
    with pytest.raises(ToolError, match=match):
        build_tool_set(None, None, path)


def test_a_failing_constructor_is_reported_with_its_tool_name(tmp_path, plugin_dir):
    (plugin_dir / "broken_plugin.py").write_text(
        textwrap.dedent("""
        from tools import Tool

        class Broken(Tool):
            name = "broken"

            def __init__(self):
                raise RuntimeError("no licence key")

            async def call(self, args, *, session_id=None):
                return "unreachable"
    """)
    )
    path = _yaml(tmp_path, "tools:\n  - class_name: broken_plugin.Broken\n")
    with pytest.raises(ToolError, match="broken_plugin.Broken\\) failed to load: RuntimeError: no licence key"):
        build_tool_set(None, None, path)
    from tools import register_tool, unregister_tool

    register_tool("broken_plugin:Broken", name="broken")
    try:
        with pytest.raises(ToolError, match="tool 'broken' failed to load: RuntimeError: no licence key"):
            build_tool_set(["broken"])
    finally:
        unregister_tool("broken")


def test_agent_env_without_tools_uses_the_same_assembly(tmp_path, plugin_dir, tiny_tokenizer):
    from agent_env import AgentEnv, EnvError, EpisodeConfig

    path = _yaml(
        tmp_path, f"tools:\n  - class_name: lookup_plugin.Lookup\n    config: {{log_path: {tmp_path / 'l'}}}\n"
    )
    env = AgentEnv(tiny_tokenizer, config=EpisodeConfig(tool_config_path=path))
    try:
        assert list(env.tools) == ["lookup"] and env.tools.describe()[0]["cls"] == "lookup_plugin.Lookup"
    finally:
        asyncio.run(env.close())
    with pytest.raises(EnvError, match="yields no tools"):
        AgentEnv(tiny_tokenizer, config=EpisodeConfig(tools=[]))


def test_a_yaml_with_no_tools_and_no_names_says_so(tmp_path):
    path = _yaml(tmp_path, "tools: []\n")
    with pytest.raises(ToolError, match="yields no tools: multi_turn.tools is empty and the tools YAML .* lists none"):
        build_tool_set([], None, path)


def test_a_tool_set_starts_its_sandboxes_before_the_first_call():
    """ToolSet.start() starts every tool that has a start-up (the sandbox pools), once: the first call
    then pays no start-up inside its timeout; a tool without start() is left alone."""
    import asyncio

    from tools import build_tool_set

    class NoStartUp:  # a tool with nothing to start (not registered: the registry is process-wide)
        name = "no_start_up"

    ts = build_tool_set(["python", "calculator"])
    ts[NoStartUp.name] = NoStartUp()

    async def scenario():
        await ts.start()
        pools = [ts["python"].pool, ts["calculator"].sandbox.pool]
        assert all(p._idle is not None and p.workers for p in pools)
        workers = [list(p.workers) for p in pools]
        await ts.start()  # idempotent: the same workers
        assert [list(p.workers) for p in pools] == workers
        r = await ts["calculator"].call({"expression": "6*7"})
        return r

    loop = asyncio.new_event_loop()
    try:
        r = loop.run_until_complete(scenario())
        assert r.ok and "42" in r.text
    finally:
        loop.run_until_complete(ts.close())
        loop.close()
