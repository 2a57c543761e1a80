"""Tools of MCP (Model Context Protocol) servers, as :class:`tools.Tool` objects.

``multi_turn.mcp_servers=PATH`` names a JSON or YAML file with the standard ``mcpServers`` map::

    {"mcpServers": {
        "notes": {"command": "python", "args": ["notes_server.py"], "env": {"LEVEL": "1"}},
        "search": {"url": "http://127.0.0.1:8000/mcp", "headers": {"Authorization": "Bearer ..."}}
    }}

A server is either **stdio** (``command``, ``args``, ``env``, ``cwd``) or **streamable HTTP**
(``url``, ``headers``); ``type``/``transport`` may say which (``stdio`` | ``http`` |
``streamable-http``). Our own keys: ``unsandboxed`` (stdio: run without isolation, see below),
``writable_paths`` (stdio: existing files/folders the sandboxed server may write), ``start_timeout``
(seconds for start + ``initialize`` + ``list_tools``, default 30), ``call_timeout`` (upper bound of
a call when the episode gives none, default 60), ``max_restarts`` (default 3), ``disabled``.

:func:`build_mcp_tools` starts (or connects to) every server at build time, in one background
thread of this process, and discovers its tools: each becomes an :class:`MCPTool` named as the
server names it, with the MCP input schema as ``parameters``. :func:`tools.build_tool_set` puts
them into the run's tool set (the one assembly), so training, eval and the verl agent loop see them
like any other tool.

Isolation: a stdio server runs under bubblewrap by default (read-only root, a private ``/tmp``,
no network, its own pid/ipc/uts namespaces; its folder readable, ``writable_paths`` writable).
``"unsandboxed": true`` runs it as a plain child process (with the user's files and network). If
bubblewrap does not work here, a stdio server without the opt-out is refused at start. An HTTP
server runs wherever its URL points; it is not isolated by us.

Processes: one client session per server per process. stdio servers die with the run: bubblewrap's
``--die-with-parent`` (and its pid namespace), or, unsandboxed, ``PR_SET_PDEATHSIG`` set by a tiny
launcher before it execs the server; both in a new session. :meth:`MCPTool.close` (the tool set's
``close``) stops them. A server that dies (or an HTTP session that breaks) answers the call that
finds it so with ``ErrorKind.SANDBOX`` (a per-trajectory server: ``ErrorKind.SESSION_LOST``, saying
its state is gone) and is restarted (``max_restarts`` times) for the next call. The episode's
``tool_timeout`` bounds the call itself, not a server's start or restart (``start_timeout``); a call
cut by it may still have taken effect on the server, and its answer says so.

Modules: :mod:`tools.mcp.config` (the ``mcpServers`` file), :mod:`tools.mcp.launch` (a stdio
server's process and its isolation), :mod:`tools.mcp.client` (the client session, its restarts
and per-trajectory sessions); :class:`MCPTool` and :func:`build_mcp_tools` are here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from tools.base import ErrorKind, Tool, ToolError, ToolResult, check_schema
from tools.mcp.client import MCPServerClient, ServerLost, describe_exc
from tools.mcp.config import ServerSpec, load_mcp_config
from tools.mcp.launch import isolation_level, require_bwrap, stdio_command

__all__ = [
    "MCP_INSTALL",
    "MCPServerClient",
    "MCPTool",
    "ServerSpec",
    "build_mcp_tools",
    "isolation_level",
    "load_mcp_config",
    "stdio_command",
]

logger = logging.getLogger(__name__)

MCP_INSTALL = "pip install -e '.[mcp]' in the otb-tir checkout (the `mcp` SDK, >=2.3,<3)"
MAX_OUTPUT_CHARS = 65536  # a flooding server: cut here before the episode cuts it to tokens


class MCPTool(Tool):
    """One tool of an MCP server: ``call`` sends ``tools/call`` over the server's session."""

    def __init__(self, client: MCPServerClient, record: Any) -> None:
        self.client = client
        self.name = str(record.name)
        self.description = str(record.description or getattr(record, "title", None) or record.name)
        params = dict(record.input_schema or {})
        params.setdefault("type", "object")
        params.setdefault("properties", {})
        check_schema(params, tool_name=self.name)
        self.parameters = params
        client.refs += 1
        self._closed = False

    @property
    def server(self) -> str:
        return self.client.spec.name

    @property
    def transport(self) -> str:
        return self.client.spec.transport

    @property
    def isolation(self) -> str:
        return isolation_level(self.client.spec)

    #: the call's ``timeout`` bounds the call itself; a per-trajectory server's start (bounded by
    #: ``start_timeout``) and a shared server's restart are waited for outside it
    bounds_itself = True

    @property
    def capacity_wait_s(self) -> float:  # type: ignore[override]
        return self.client.spec.start_timeout + 15.0

    async def call(self, args: dict[str, Any], *, session_id: str | None = None) -> ToolResult:
        return await self.call_bounded(args, session_id=session_id)

    async def call_bounded(
        self, args: dict[str, Any], *, session_id: str | None = None, timeout: float | None = None
    ) -> ToolResult:
        """``tools/call`` bounded by ``timeout`` (the episode's ``tool_timeout``; ``call_timeout`` when it
        gives none). A per-trajectory server starts first, outside that bound (its own bound is
        ``start_timeout``): a call the model made correctly does not read "timed out" because its
        server was still starting."""
        timeout = self.client.spec.call_timeout if timeout is None else float(timeout)
        client = self.client
        own = client.spec.session == "per_trajectory" and session_id is not None
        if own:
            try:
                client = await client.session_client(str(session_id))
            except ToolError as e:  # the trajectory's server could not start, or too many are open
                return ToolResult(text=f"Error: {e}", ok=False, error=ErrorKind.SANDBOX, metrics={"server_lost": 1.0})
        try:
            fut = client.call_future(self.name, args, timeout)
            result = await asyncio.wrap_future(fut)  # cancelling this (the episode's timeout) cancels the call
        except ServerLost as e:
            if own:  # the trajectory's state lived in that process: say it is gone, as the python tool does
                client.lost_told = client.lost
                return ToolResult(
                    text=f"Error: the MCP server {self.server!r} of tool '{self.name}' was lost: {e}. "
                    "Its state from this trajectory's earlier calls is gone; the next call starts a fresh server.",
                    ok=False,
                    error=ErrorKind.SESSION_LOST,
                    metrics={"server_lost": 1.0},
                )
            return ToolResult(
                text=f"Error: the MCP server {self.server!r} of tool '{self.name}' was lost: {e}",
                ok=False,
                error=ErrorKind.SANDBOX,
                metrics={"server_lost": 1.0},
            )
        except Exception as e:  # noqa: BLE001 - protocol errors (unknown tool, bad params) and read timeouts
            from mcp import MCPError

            if isinstance(e, MCPError) and "timed out" in e.error.message.lower():
                # the request was sent: the server may have acted on it (and may still be acting)
                return ToolResult(
                    text=f"Error: tool '{self.name}' timed out after {timeout:g} s. The request had reached "
                    "its server, so it may still have taken effect there.",
                    ok=False,
                    error=ErrorKind.TIMEOUT,
                )
            msg = e.error.message if isinstance(e, MCPError) else describe_exc(e)
            return ToolResult(text=f"Error: tool '{self.name}' failed: {msg}", ok=False, error=ErrorKind.RUNTIME)
        out = _to_result(self.name, result)
        if own and client.lost > client.lost_told:  # restarted after a loss another call of this trajectory met
            client.lost_told = client.lost
            out = dataclasses.replace(
                out,
                text=f"Note: the MCP server {self.server!r} was restarted after it was lost; its state from this "
                "trajectory's earlier calls is gone.\n" + out.text,
                metrics={**out.metrics, "server_lost": 1.0},
            )
        return out

    async def release(self, session_id: str) -> None:
        """The trajectory ended: close its own session (``"session": "per_trajectory"``; idempotent,
        and every tool of the server releases the same one)."""
        await self.client.release_session(session_id)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.client.refs -= 1
        if self.client.refs <= 0:
            await asyncio.to_thread(self.client.close)

    def __repr__(self) -> str:
        return f"MCPTool(name={self.name!r}, server={self.server!r})"


def _to_result(name: str, result: Any) -> ToolResult:
    texts: list[str] = []
    other: list[str] = []
    for block in result.content or []:
        kind = getattr(block, "type", type(block).__name__)
        if kind == "text":
            texts.append(block.text)
        elif kind == "resource" and isinstance(getattr(block.resource, "text", None), str):
            texts.append(block.resource.text)
        else:
            other.append(str(kind))
    if not texts and not other and result.structured_content is not None:
        texts.append(json.dumps(result.structured_content, ensure_ascii=False, default=str))
    text = "\n".join(texts)
    if result.is_error:
        return ToolResult(text=f"Error: {text or 'the tool reported an error'}", ok=False, error=ErrorKind.RUNTIME)
    if other and not texts:
        return ToolResult(
            text=f"Error: tool '{name}' returned only non-text content ({', '.join(sorted(set(other)))}), "
            "which cannot be shown as text",
            ok=False,
            error=ErrorKind.RUNTIME,
            metrics={"non_text_content": float(len(other))},
        )
    if other:
        text += f"\n[{len(other)} non-text item(s) omitted: {', '.join(sorted(set(other)))}]"
    if len(text) > MAX_OUTPUT_CHARS:
        return ToolResult(text=text[:MAX_OUTPUT_CHARS], ok=True, error=ErrorKind.OUTPUT_CUT)
    return ToolResult(text=text)


def build_mcp_tools(path: str | os.PathLike[str]) -> list[tuple[MCPTool, str]]:
    """Start every server of the ``mcpServers`` file ``path`` and discover its tools:
    ``[(tool, source)]`` with source ``"MCP server <name> (<transport>) in <file>"``. A server that
    cannot start, or answer ``initialize``/``list_tools`` in time, raises :class:`ToolError` naming
    it and the tail of its stderr (the servers already started are stopped)."""
    try:
        import mcp  # noqa: F401
    except ImportError as e:
        raise ToolError(f"multi_turn.mcp_servers needs the MCP SDK: {MCP_INSTALL} ({e})") from None
    specs = load_mcp_config(path)
    for s in specs:  # isolation first: refuse before anything starts
        if s.transport == "stdio" and not s.unsandboxed:
            require_bwrap()
    clients: list[MCPServerClient] = []
    out: list[tuple[MCPTool, str]] = []
    try:
        for s in specs:
            client = MCPServerClient(s)
            clients.append(client)
            records = client.start()
            source = f"MCP server {s.name!r} ({s.transport}) in {Path(path).expanduser()}"
            for rec in records:
                try:
                    out.append((MCPTool(client, rec), source))
                except ToolError as e:
                    raise ToolError(f"{s.where}: {e}") from None
            if not records:
                logger.warning("MCP server %r lists no tools", s.name)
    except BaseException:
        for c in clients:
            c.close()
        raise
    return out
