"""The one assembly of a run's tool set from configuration.

Every path that runs episodes (the local trainer, the ``torchrun`` trainer, the evaluation and
the verl agent loop) builds its tools with :func:`build_tool_set`, so a tool a user plugs in
reaches all of them the same way:

* ``names``: tool names for :func:`tools.get_tool`: built-ins (``python``, ``calculator``),
  tools registered with ``@tool`` / ``register_tool``, and tools that installed packages
  register under the ``otb_tir.tools`` entry-point group;
* ``tool_config``: keyword configuration per name (``{"python": {"timeout": 5}}``);
* ``config_path``: a verl-style tools YAML (see :func:`tools.load_tools`);
* ``mcp_servers``: an ``mcpServers`` JSON/YAML file (see :mod:`tools.mcp`): its servers are
  started at build and each tool they list becomes an :class:`tools.mcp.MCPTool`.

The rules: with neither names nor a YAML nor MCP servers the set is the built-in default
(``python`` and ``calculator``). A YAML alone gives exactly the YAML's tools. Names *and* a YAML
give both (a name defined twice is an error, never a silent replacement). MCP servers without
names give every tool the servers list (added to the YAML's tools, like them); with names, the
names select: an MCP tool is in the set when ``names`` lists it (so ``names=[lookup, calculator]``
takes ``lookup`` from a server and ``calculator`` built in), and a server none of whose tools is
selected is stopped. A name given by two sources (a built-in/registered tool, a YAML tool, two MCP
servers) is an error naming both. A set with no tools, a name that does not load, a bad config key,
a bad schema or an MCP server that does not start raises :class:`ToolError` naming the tool (or
server) and the reason, before any episode runs.

The returned :class:`ToolSet` is a ``name → Tool`` mapping that also records where each tool
came from (:meth:`ToolSet.describe`: name, class, source, config, isolation level), which the
trainer writes into ``summary.json`` and the evaluation into its report.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tools.base import Tool, ToolError, close_quietly

__all__ = ["DEFAULT_TOOLS", "ToolOrigin", "ToolSet", "build_tool_set"]

logger = logging.getLogger(__name__)

DEFAULT_TOOLS: tuple[str, ...] = ("python", "calculator")


@dataclass
class ToolOrigin:
    """Where one tool of a set came from."""

    name: str
    cls: str  # module.QualName of the object that does the work (the wrapped class for verl tools)
    source: str  # "built-in", "registered", "entry point ...", "<yaml>: tools[i]"
    config: dict[str, Any] = field(default_factory=dict)
    isolation: str | None = None  # the sandbox's isolation level, for tools that have one
    server: str | None = None  # MCP tools: the server's name in the mcpServers file
    transport: str | None = None  # MCP tools: stdio | http


_MCP_ONLY = ("server", "transport")  # describe() records them for MCP tools only


class ToolSet(dict):
    """``name → Tool`` plus :attr:`origins` (``name → ToolOrigin``)."""

    def __init__(self, tools: Sequence[Tool] = (), origins: Sequence[ToolOrigin] = ()) -> None:
        super().__init__((t.name, t) for t in tools)
        self.origins: dict[str, ToolOrigin] = {o.name: o for o in origins}

    def describe(self) -> list[dict[str, Any]]:
        """JSON-ready records of the tools in use, sorted by name."""
        out = []
        for name in sorted(self):
            origin = self.origins.get(name) or ToolOrigin(name, _class_name(self[name]), "given")
            rec = asdict(origin)
            rec["isolation"] = _isolation(self[name])
            for key in _MCP_ONLY:
                if rec[key] is None:
                    del rec[key]
            out.append(rec)
        return out

    async def start(self) -> None:
        """Start the tools that have a start-up (sandbox worker pools) now, together, instead of in
        their first call, where the start-up would count against that call's timeout. Idempotent; a
        start that fails is logged and left to the first call (which then answers an error)."""
        names = [name for name, tool in self.items() if callable(getattr(tool, "start", None))]
        results = await asyncio.gather(*(self[name].start() for name in names), return_exceptions=True)
        for name, result in zip(names, results):
            if isinstance(result, Exception):
                logger.warning("starting tool %r failed: %s", name, result)

    async def close(self) -> None:
        for tool in self.values():
            try:
                await tool.close()
            except Exception:  # noqa: BLE001 - closing must go on for the others
                logger.warning("closing tool %r failed", tool, exc_info=True)


def _class_name(tool: Any) -> str:
    obj = getattr(tool, "inner", None) or tool  # VerlToolAdapter: the wrapped verl-style tool
    cls = obj if isinstance(obj, type) else type(obj)
    fn = getattr(tool, "fn", None)  # @tool functions: the function is the implementation
    if fn is not None and callable(fn):
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _isolation(tool: Any) -> str | None:
    try:
        level = getattr(tool, "isolation", None)
    except Exception:  # noqa: BLE001 - a property that fails says nothing about the set
        return None
    return level if isinstance(level, str) else None


def plain(x: Any) -> Any:
    """Nested mappings / sequences (OmegaConf containers, verl's config) as plain dicts and lists:
    the one copy of this helper."""
    if isinstance(x, Mapping):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
        return [plain(v) for v in x]
    return x


def build_tool_set(
    names: Sequence[str] | None = None,
    tool_config: Mapping[str, Mapping[str, Any]] | None = None,
    config_path: str | None = None,
    mcp_servers: str | None = None,
) -> ToolSet:
    """Build the tools a run uses (see the module docstring for the rules).

    ``names=None`` means "not given" (the default set, unless ``config_path`` or ``mcp_servers``
    is set); ``names=[]`` with no YAML and no MCP servers is an error (no tools). Raises
    :class:`ToolError`.
    """
    from tools.registry import TOOLS, get_tool, load_tool_entries, tool_source

    tool_config = plain(dict(tool_config or {}))
    select_mcp = names is not None
    if names is None:
        names = [] if (config_path or mcp_servers) else list(DEFAULT_TOOLS)
    if isinstance(names, str):
        raise ToolError(f"multi_turn.tools must be a list of tool names, got the string {names!r}")
    names = [str(n) for n in names]
    if not all(names):
        raise ToolError(f"tool names must be non-empty strings, got {names!r}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ToolError(f"multi_turn.tools names {repeated} more than once")
    mcp: dict[str, tuple[Tool, str]] = {}
    if mcp_servers:
        mcp = _discover_mcp(mcp_servers)
    mcp_named = [n for n in names if n in mcp] if select_mcp else []
    configured_mcp = sorted(set(tool_config) & set(mcp_named))
    if configured_mcp:
        close_quietly(_mcp_tools(mcp))
        raise ToolError(
            f"multi_turn.tool_config has settings for {configured_mcp}, tools of MCP servers, which take none; "
            f"set the server's options in the mcpServers file {mcp_servers}"
        )
    clash = [n for n in mcp_named if n in TOOLS]
    if clash:
        close_quietly(_mcp_tools(mcp))
        n = clash[0]
        raise ToolError(
            f"tool name {n!r} in multi_turn.tools is both {tool_source(n)} and a tool of {mcp[n][1]}; "
            "a tool is defined once: rename one of them"
        )
    stray = sorted(set(tool_config) - set(names))
    if stray:
        close_quietly(_mcp_tools(mcp))
        raise ToolError(
            f"multi_turn.tool_config has settings for {stray}, which are not in multi_turn.tools="
            f"{names}; add them to multi_turn.tools (tools of a tools YAML take their config there)"
        )
    for name, conf in tool_config.items():
        if not isinstance(conf, Mapping):
            raise ToolError(f"multi_turn.tool_config.{name} must be a mapping of keyword settings, got {conf!r}")

    built: list[Tool] = []
    origins: list[ToolOrigin] = []
    unused = [t for n, (t, _) in mcp.items() if select_mcp and n not in names]
    try:
        close_quietly(unused)  # the tools (and servers) multi_turn.tools does not select
        for name in names:
            if name in mcp:
                made, where = mcp.pop(name)
                built.append(made)
                origins.append(_mcp_origin(made, where))
                continue
            conf = dict(tool_config.get(name, {}))
            try:
                made = get_tool(name, **conf)
            except ToolError as e:
                msg = str(e)
                raise ToolError(msg if repr(name) in msg else f"tool {name!r}: {msg}") from e
            except Exception as e:  # noqa: BLE001 - a plugin's constructor: say which tool
                raise ToolError(f"tool {name!r} failed to load: {type(e).__name__}: {e}") from e
            built.append(made)
            origins.append(ToolOrigin(made.name, _class_name(made), tool_source(name), conf))
        if config_path:
            entries = load_tool_entries(config_path)
            built += [made for made, _, _ in entries]  # before any check: a failure closes them all
            origins += [ToolOrigin(made.name, _class_name(made), where, conf) for made, where, conf in entries]
            for made, where, _ in entries:
                if made.name in names:
                    raise ToolError(
                        f"{where}: a tool named {made.name!r} is also in multi_turn.tools={names}; "
                        "a tool is defined once: drop it from multi_turn.tools (or rename it in "
                        "the YAML's tool_schema)"
                    )
                if made.name in mcp or made.name in mcp_named:
                    where_mcp = mcp[made.name][1] if made.name in mcp else "an MCP server"
                    raise ToolError(
                        f"{where}: a tool named {made.name!r} is also a tool of {where_mcp}; "
                        "a tool is defined once: rename one of them"
                    )
        if not select_mcp:  # no names: every tool of the servers, after the YAML's
            for made, where in mcp.values():
                built.append(made)
                origins.append(_mcp_origin(made, where))
            mcp = {}
    except BaseException:
        close_quietly(built + [t for t, _ in mcp.values() if t not in unused])
        raise
    if not built:
        yaml = f"the tools YAML {config_path} lists none" if config_path else "no multi_turn.tool_config_path is set"
        if mcp_servers:
            yaml += f" and multi_turn.tools selects none of the MCP servers' tools ({mcp_servers})"
        raise ToolError(
            f"the configuration yields no tools: multi_turn.tools is empty and {yaml}; list tool names "
            "(e.g. multi_turn.tools=[python,calculator]) or give a verl-style tools YAML"
        )
    return ToolSet(built, origins)


def _discover_mcp(path: str) -> dict[str, tuple[Tool, str]]:
    """``name → (MCPTool, source)`` of every tool the servers of the mcpServers file list; two
    servers listing the same name is an error naming both."""
    from tools.mcp import build_mcp_tools

    found = build_mcp_tools(path)
    out: dict[str, tuple[Tool, str]] = {}
    for made, where in found:
        if made.name in out:
            close_quietly([t for t, _ in found])
            raise ToolError(
                f"tool name {made.name!r} is listed by two MCP servers: {out[made.name][1]} and {where}; "
                "a tool is defined once: drop it from one server (or disable one)"
            )
        out[made.name] = (made, where)
    return out


def _mcp_tools(mcp: Mapping[str, tuple[Tool, str]]) -> list[Tool]:
    return [t for t, _ in mcp.values()]


def _mcp_origin(made: Any, where: str) -> ToolOrigin:
    return ToolOrigin(
        made.name, _class_name(made), where, {}, server=getattr(made, "server", None), transport=made.transport
    )
