"""The tools plugin API: @tool schemas, Tool.invoke, the registry, entry points, verl-style YAML."""

from __future__ import annotations

import asyncio
import enum
import importlib.util
import json
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tools
from tests.support.optional import need
from tools import ErrorKind, Tool, ToolError, ToolResult, get_tool, list_tools, load_tools, register_tool, tool
from tools.decorator import function_schema
from tools.registry import unregister_tool
from tools.verl_tools import VerlToolAdapter


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def registered():
    """Names registered during a test are removed afterwards."""
    before = set(tools.registry.TOOLS.registered())
    yield
    for name in set(tools.registry.TOOLS.registered()) - before:
        unregister_tool(name)


# ---------------------------------------------------------------------------------- @tool schemas


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


def kitchen_sink(
    a: int,
    b: float,
    c: str,
    d: bool,
    e: list[int],
    h: typing.Literal["x", "y"] = "x",
    j: int | str = 1,
    k: dict[str, int] | None = None,
    color: Color = Color.RED,
    maybe: typing.Optional[float] = None,
) -> str:
    """Do a thing with many arguments.

    A longer explanation.

    Args:
        a: the a.
        b: the b, which takes
            two lines.
        c: the c.
        d: the d.
        e: the e.
        h: the h.
        j: the j.
        k: the k.
        color: the color.
        maybe: the maybe.
    """
    return "ok"


def test_schema_from_signature_matches_transformers_get_json_schema():
    """transformers' get_json_schema (what verl's @function_tool uses) is the oracle for the plain
    types; Optional is expressed as standard JSON schema (type [..., "null"]) rather than OpenAPI
    'nullable', so jsonschema can validate it."""
    from transformers.utils import get_json_schema

    description, ours = function_schema(kitchen_sink)
    theirs = get_json_schema(kitchen_sink)["function"]
    assert description == "Do a thing with many arguments.\n\nA longer explanation."
    assert theirs["description"].startswith("Do a thing with many arguments.")
    assert ours["required"] == theirs["parameters"]["required"] == ["a", "b", "c", "d", "e"]
    for name in ("a", "b", "c", "d", "e", "h", "j"):
        mine = {k: v for k, v in ours["properties"][name].items() if k != "default"}
        assert mine == theirs["parameters"]["properties"][name], name
    assert ours["properties"]["maybe"] == {"type": ["number", "null"], "description": "the maybe.", "default": None}
    assert ours["properties"]["color"] == {
        "enum": ["red", "blue"],
        "type": "string",
        "description": "the color.",
        "default": "red",
    }
    assert ours["properties"]["k"]["anyOf"][0] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert ours["additionalProperties"] is False
    jsonschema.Draft202012Validator.check_schema(ours)


def test_numpy_docstring_and_annotated_descriptions():
    def f(x: int, y: typing.Annotated[str, "the y, from Annotated"] = "a") -> int:
        """Compute f.

        Parameters
        ----------
        x : int
            the x value
        """
        return x

    description, schema = function_schema(f)
    assert description == "Compute f."
    assert schema["properties"]["x"] == {"type": "integer", "description": "the x value"}
    assert schema["properties"]["y"] == {"type": "string", "description": "the y, from Annotated", "default": "a"}
    assert schema["required"] == ["x"]


@pytest.mark.parametrize(
    "bad, needle",
    [
        ("def f(x): pass", "no type hint"),
        ("def f(*args: int): pass", "*args"),
        ("def f(**kw: int): pass", "*args"),
        ("def f(x: int, /): pass", "positional-only"),
        ("def f(x: complex): pass", "no JSON-schema equivalent"),
    ],
)
def test_schema_errors_are_tool_errors(bad, needle):
    namespace: dict = {}
    exec(bad, namespace)
    with pytest.raises(ToolError, match=needle.replace("*", r"\*")):
        function_schema(namespace["f"])


def test_tool_decorator_sync_async_and_return_values(registered):
    @tool
    def add(a: int, b: int = 0) -> int:
        """Add two integers.

        Args:
            a: first.
            b: second.
        """
        return a + b

    @tool(name="greet", description="Say hello.")
    async def hello(who: str) -> ToolResult:
        await asyncio.sleep(0)
        return ToolResult(text=f"hello {who}", metrics={"greetings": 1.0})

    @tool
    def as_json(n: int) -> dict:
        """Return a dict."""
        return {"n": n, "square": n * n}

    @tool
    def remember(x: int, session_id: str | None = None) -> str:
        """Echo the session."""
        return f"{session_id}:{x}"

    assert add(2, 3) == 5  # still a plain function
    assert add.schema()["function"]["name"] == "add"
    assert add.schema()["function"]["description"] == "Add two integers."
    assert run(add.invoke({"a": 2, "b": 3})).text == "5"
    assert get_tool("add") is add
    result = run(get_tool("greet").invoke({"who": "bob"}))
    assert (result.text, result.ok, result.metrics["greetings"]) == ("hello bob", True, 1.0)
    assert hello.description == "Say hello."
    assert json.loads(run(as_json.invoke({"n": 4})).text) == {"n": 4, "square": 16}
    assert "session_id" not in remember.parameters["properties"]
    assert run(remember.invoke({"x": 1}, session_id="s1")).text == "s1:1"
    assert {"add", "greet", "as_json", "remember", "python", "calculator"} <= set(list_tools())


def test_registering_twice(registered):
    @tool
    def dup_tool(x: int) -> int:
        """One."""
        return x

    def other(x: int) -> int:
        """Two."""
        return -x

    with pytest.raises(ToolError, match="already registered"):
        tool(name="dup_tool")(other)
    tool(name="dup_tool", replace=True)(other)
    assert run(get_tool("dup_tool").invoke({"x": 3})).text == "-3"


# ---------------------------------------------------------------------------------- Tool.invoke


class Echo(Tool):
    name = "echo"
    description = "Echo text, optionally repeated."
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
        "required": ["text"],
        "additionalProperties": False,
    }

    def __init__(self, prefix: str = "", delay: float = 0.0) -> None:
        self.prefix, self.delay = prefix, delay

    async def call(self, args, *, session_id=None):
        if self.delay:
            await asyncio.sleep(self.delay)
        if args["text"] == "boom":
            raise ValueError("the text exploded")
        if args["text"] == "io":
            raise BrokenPipeError("pipe closed")
        return ToolResult(text=self.prefix + args["text"] * args.get("times", 1))


@pytest.mark.parametrize(
    "args, needle",
    [
        ({}, "missing required argument 'text'"),
        ({"text": 3}, "argument 'text' must be string, got integer 3"),
        ({"text": "a", "times": "2"}, "argument 'times' must be integer"),
        ({"text": "a", "colour": 1}, "unexpected argument 'colour'"),
        (["a"], "must be a JSON object, got list"),
        ('{"text": ', "not valid JSON"),
    ],
)
def test_invoke_bad_arguments_become_error_results(args, needle):
    result = run(Echo().invoke(args))
    assert not result.ok and result.error == ErrorKind.BAD_ARGUMENTS
    assert needle in result.text
    assert "Expected arguments: text (string, required), times (integer)" in result.text
    assert result.metrics["latency_ms"] >= 0


def test_invoke_runtime_errors_timeouts_and_json_strings():
    echo = Echo(prefix="> ")
    ok = run(echo.invoke('{"text": "ab", "times": 2}'))
    assert (ok.ok, ok.text, ok.error) == (True, "> abab", None) and "latency_ms" in ok.metrics
    boom = run(echo.invoke({"text": "boom"}))
    assert (boom.ok, boom.error) == (False, ErrorKind.RUNTIME) and "ValueError: the text exploded" in boom.text
    io = run(echo.invoke({"text": "io"}))
    assert (io.ok, io.error) == (False, ErrorKind.SANDBOX)
    slow = run(Echo(delay=5).invoke({"text": "zz"}, timeout=0.05))
    assert (slow.ok, slow.error) == (False, ErrorKind.TIMEOUT) and "timed out after 0.05 s" in slow.text


def _expected_valid(args) -> bool:
    """Brute-force oracle for Echo's schema."""
    if not isinstance(args, dict) or set(args) - {"text", "times"} or "text" not in args:
        return False
    if not isinstance(args["text"], str):
        return False
    times = args.get("times", 1)
    return (isinstance(times, int) and not isinstance(times, bool)) or (isinstance(times, float) and times.is_integer())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, width=32) | st.text(max_size=3),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=6,
)
arg_dicts = st.dictionaries(st.sampled_from(["text", "times", "other"]), json_values, max_size=3)


@settings(max_examples=150, deadline=None)
@given(args=arg_dicts | json_values)
def test_invoke_never_raises_and_validates_like_the_oracle(args):
    class Counted(Echo):
        async def call(self, args, *, session_id=None):
            return ToolResult(text="called")

    result = asyncio.run(Counted().invoke(args))
    assert isinstance(result, ToolResult)
    if _expected_valid(args):
        assert result.ok and result.text == "called", result
    else:
        assert not result.ok and result.error == ErrorKind.BAD_ARGUMENTS, (args, result)


# ---------------------------------------------------------------------------------- registry


def test_unknown_name_and_config_keys_name_the_choices(registered):
    with pytest.raises(ToolError, match=r"unknown tool 'nope'; available tools: .*calculator.*python"):
        get_tool("nope")
    register_tool(Echo)
    assert isinstance(get_tool("echo", prefix="$"), Echo)
    with pytest.raises(ToolError, match=r"unknown config key\(s\) \['colour'\]; valid keys: prefix, delay"):
        get_tool("echo", colour="red")
    with pytest.raises(ToolError, match=r"unknown config key\(s\) \['bogus'\]; valid keys: timeout"):
        get_tool("calculator", bogus=1)
    with pytest.raises(ToolError, match="timeout must be a positive number"):
        get_tool("calculator", timeout=-1)


def test_register_by_import_path_and_alias(registered, tmp_path, monkeypatch):
    (tmp_path / "h3_lazy_mod.py").write_text(
        textwrap.dedent("""
        from tools import Tool, ToolResult
        class Shout(Tool):
            name = "shout"
            parameters = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
            async def call(self, args, *, session_id=None):
                return ToolResult(text=args["s"].upper())
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    register_tool("h3_lazy_mod:Shout", name="loud")
    assert "h3_lazy_mod" not in sys.modules  # imported on first use only
    loud = get_tool("loud")
    assert loud.name == "loud" and run(loud.invoke({"s": "hi"})).text == "HI"
    register_tool("h3_missing_mod:Nothing", name="broken")
    with pytest.raises(ToolError, match="cannot import module 'h3_missing_mod'"):
        get_tool("broken")
    with pytest.raises(ToolError, match="cannot register"):
        register_tool(42, name="x")


def test_builtin_python_is_lazy():
    """`python` is registered by import path: listing it imports nothing; building it either
    works (the sandbox package is installed) or says clearly what is missing."""
    assert "python" in list_tools()
    if importlib.util.find_spec("tools.sandbox") is None:
        with pytest.raises(ToolError, match="tools.sandbox"):
            get_tool("python")
        return
    python = get_tool("python", timeout=5, stateful=False)  # builds the tool; workers start on first call
    assert python.name == "python" and python.schema()["function"]["parameters"]["required"] == ["code"]
    with pytest.raises(ToolError, match=r"unknown config key\(s\) \['bogus'\]; valid keys: timeout"):
        get_tool("python", bogus=1)


def test_import_tools_is_light():
    code = (
        "import sys, tools; heavy = [m for m in ('verl', 'sympy', 'jsonschema', 'omegaconf', 'torch', "
        "'transformers', 'tools.sandbox', 'tools.calculator', 'agent_env', 'otb_tir') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_entry_point_plugin(registered, tmp_path, monkeypatch):
    """A third-party package registers through the `otb_tir.tools` entry-point group: a real
    dist-info on a sys.path entry, discovered by importlib.metadata."""
    (tmp_path / "h3_plugin_pkg.py").write_text(
        textwrap.dedent("""
        from tools import Tool, ToolResult
        class Reverse(Tool):
            name = "reverse"
            description = "Reverse a string."
            parameters = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
            def __init__(self, upper: bool = False):
                self.upper = upper
            async def call(self, args, *, session_id=None):
                out = args["s"][::-1]
                return ToolResult(text=out.upper() if self.upper else out)
    """)
    )
    dist = tmp_path / "h3_plugin_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: h3-plugin-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[otb_tir.tools]\nreverse = h3_plugin_pkg:Reverse\nbroken_plugin = h3_plugin_pkg:DoesNotExist\n"
    )
    assert "reverse" not in list_tools()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert {"reverse", "broken_plugin"} <= set(list_tools())
    rev = get_tool("reverse", upper=True)
    assert run(rev.invoke({"s": "abc"})).text == "CBA"
    with pytest.raises(ToolError, match="valid keys: upper"):
        get_tool("reverse", lower=True)
    with pytest.raises(ToolError, match="broken_plugin.*h3_plugin_pkg:DoesNotExist.*failed to load"):
        get_tool("broken_plugin")


# ---------------------------------------------------------------------------------- YAML (verl shape)

VERL_SHAPED = textwrap.dedent('''
    import uuid
    class Text:
        def __init__(self, text):
            self.text = text
    class CounterTool:
        """Shaped like verl's BaseTool: per-instance state, (response, reward, metrics) results."""
        created, released = [], []
        def __init__(self, config, tool_schema):
            self.config = config
            self.tool_schema = tool_schema
            self.name = tool_schema.function.name
            self.state = {}
        async def create(self, instance_id=None, **kwargs):
            instance_id = instance_id or str(uuid.uuid4())
            self.state[instance_id] = self.config["start"]
            CounterTool.created.append(instance_id)
            return instance_id, Text("")
        async def execute(self, instance_id, parameters, **kwargs):
            self.state[instance_id] += parameters["step"]
            return Text(f"count={self.state[instance_id]}"), 0.5, {"calls": 1, "note": "x"}
        async def release(self, instance_id, **kwargs):
            CounterTool.released.append(instance_id)
            del self.state[instance_id]
''')


def _write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_load_tools_ours_verl_shaped_and_registered(registered, tmp_path, monkeypatch):
    (tmp_path / "h3_verl_shaped.py").write_text(VERL_SHAPED)
    monkeypatch.syspath_prepend(str(tmp_path))
    register_tool(Echo)

    @tool
    def shout_words(text: str) -> str:
        """Shout."""
        return text.upper()

    path = _write_yaml(
        tmp_path,
        """
        tools:
          - class_name: h3_verl_shaped.CounterTool
            config: {type: native, start: 10}
            tool_schema:
              type: function
              function:
                name: counter
                description: Add a step to a counter.
                parameters:
                  type: object
                  properties: {step: {type: integer, description: how much}}
                  required: [step]
          - class_name: tests.tools.test_registry.Echo
            config: {type: native, prefix: "~"}
            tool_schema:
              type: function
              function: {name: echo2, description: Echo again.}
          - name: shout_words
            tool_schema: {type: function, function: {name: yell, description: Yell it.}}
          - name: calculator
            config: {timeout: 3}
    """,
    )
    counter, echo, yell, calc = load_tools(path)
    assert isinstance(counter, VerlToolAdapter)
    assert counter.schema()["function"] == {
        "name": "counter",
        "description": "Add a step to a counter.",
        "parameters": {
            "type": "object",
            "properties": {"step": {"type": "integer", "description": "how much"}},
            "required": ["step"],
        },
    }
    mod = sys.modules["h3_verl_shaped"]
    one = run(counter.invoke({"step": 2}))
    assert (one.text, one.metrics["tool_reward"], one.metrics["calls"]) == ("count=12", 0.5, 1.0)
    assert "note" not in one.metrics
    assert mod.CounterTool.created == mod.CounterTool.released  # stateless call: created and released

    async def session():
        a = await counter.invoke({"step": 1}, session_id="s")
        b = await counter.invoke({"step": 1}, session_id="s")
        await counter.release("s")
        return a.text, b.text

    assert run(session()) == ("count=11", "count=12")
    assert mod.CounterTool.released[-1] == "s"
    bad = run(counter.invoke({"step": "two"}))
    assert bad.error == ErrorKind.BAD_ARGUMENTS and "argument 'step' must be integer" in bad.text

    assert isinstance(echo, Echo) and (echo.name, echo.description, echo.prefix) == ("echo2", "Echo again.", "~")
    assert run(echo.invoke({"text": "a"})).text == "~a"
    assert yell.name == "yell" and shout_words.name == "shout_words"  # the registered one is untouched
    assert run(yell.invoke({"text": "hey"})).text == "HEY"
    assert calc.name == "calculator" and calc.timeout == 3.0


@pytest.mark.parametrize(
    "body, needle",
    [
        ("nothing: here", "top-level 'tools:' list"),
        ("tools:\n  - class_name: no_such_mod_h3.X", "cannot import module 'no_such_mod_h3'"),
        ("tools:\n  - name: calculator\n    config: {colour: red}", r"unknown config key\(s\) \['colour'\]"),
        ("tools:\n  - name: calculator\n    extra: 1", r"unknown key\(s\) \['extra'\]"),
        ("tools:\n  - name: calculator\n  - name: calculator", "appear more than once"),
        ("tools:\n  - name: calculator\n    class_name: x.Y", "exactly one of class_name"),
        (
            "tools:\n  - name: calculator\n    tool_schema: {type: function, function: {description: d}}",
            "name is missing",
        ),
        (
            "tools:\n  - name: calculator\n"
            "    tool_schema: {type: function, function: {name: c, parameters: {type: wrong}}}",
            "parameters must be a JSON schema",
        ),
    ],
)
def test_load_tools_errors(tmp_path, body, needle):
    with pytest.raises(ToolError, match=needle):
        load_tools(_write_yaml(tmp_path, body))


def test_load_tools_missing_file(tmp_path):
    with pytest.raises(ToolError, match="not found"):
        load_tools(tmp_path / "absent.yaml")


def test_verl_base_tool_through_yaml_matches_verl_loader(tmp_path):
    """verl's own BaseTool, loaded from the same YAML by our loader and by verl's."""
    need("verl.tools.base_tool")
    from verl.tools.tool_registry import initialize_tools_from_config

    path = _write_yaml(
        tmp_path,
        """
        tools:
          - class_name: verl.tools.base_tool.BaseTool
            config: {type: native}
            tool_schema:
              type: function
              function:
                name: noop
                description: Update the state.
                parameters: {type: object, properties: {x: {type: string, description: anything}}, required: [x]}
    """,
    )
    (ours,) = load_tools(path)
    (theirs,) = initialize_tools_from_config(str(path))
    assert isinstance(ours, VerlToolAdapter)
    assert ours.name == theirs.name == "noop"
    assert ours.schema() == theirs.get_openai_tool_schema().model_dump(exclude_unset=True, exclude_none=True)
    expected_response, expected_reward, _ = run(theirs.execute("id", {"x": "1"}))
    result = run(ours.invoke({"x": "1"}))
    assert result.ok and result.text == expected_response.text == "Updated the tool state."
    assert result.metrics["tool_reward"] == expected_reward
    assert run(ours.invoke({})).error == ErrorKind.BAD_ARGUMENTS
