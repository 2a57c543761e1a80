"""The client side: :class:`MCPServerClient`, one client session to one MCP server (stdio or
streamable HTTP) driven by an event loop in a thread of its own; its start, its restarts after a
loss, its per-trajectory sessions and its close."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import tempfile
import threading
import weakref
from typing import Any

from tools.base import ToolError
from tools.mcp.config import ServerSpec
from tools.mcp.launch import stdio_command

logger = logging.getLogger("tools.mcp")

STDERR_TAIL = 2000


class ServerLost(Exception):
    """The server's process or connection is gone."""


class MCPServerClient:
    """One client session to one MCP server, driven by an event loop in a thread of its own (so
    the episodes' loops, whichever they are, share it; and an unsandboxed server's PDEATHSIG is
    tied to a thread that lives as long as the client)."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.tools: list[Any] = []  # mcp Tool records of the last discovery
        self.starts = 0
        self.restarts = 0
        self.lost = 0
        self.lost_told = 0  # per_trajectory: losses the trajectory's model was told about
        self.refs = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp-{spec.name}", daemon=True)
        self._thread.start()
        self._session: Any = None
        self._stop: asyncio.Event | None = None
        self._runner: asyncio.Future[Any] | None = None
        self._restarting: asyncio.Future[Any] | None = None
        self._closed = False
        self._errlog = tempfile.TemporaryFile("w+", prefix=f"mcp-{spec.name}-", suffix=".stderr")
        self._sessions: dict[str, MCPServerClient] = {}  # per_trajectory: session id → its own client
        self._opening: dict[str, asyncio.Future[Any]] = {}
        self.sessions_opened = 0
        _LIVE.add(self)

    async def session_client(self, session_id: str) -> MCPServerClient:
        """The client of trajectory ``session_id`` (``"session": "per_trajectory"``), started on first use
        outside the caller's event loop (a stdio server takes a while to start); concurrent first calls
        of one trajectory share the start, and a caller cancelled meanwhile loses nothing."""
        if session_id in self._sessions:
            return self._sessions[session_id]
        pending = self._opening.get(session_id)
        if pending is None:
            if len(self._sessions) + len(self._opening) >= self.spec.max_sessions:
                raise ToolError(
                    f"MCP server {self.spec.name!r}: {self.spec.max_sessions} per-trajectory sessions are open "
                    "(max_sessions); this call is refused"
                )

            def open_one() -> MCPServerClient:
                child = MCPServerClient(self.spec)
                child.start()  # ToolError naming the server and its stderr when it cannot start
                return child

            pending = asyncio.ensure_future(asyncio.to_thread(open_one))
            self._opening[session_id] = pending

            def opened(f: asyncio.Future[Any]) -> None:
                self._opening.pop(session_id, None)
                if not f.cancelled() and f.exception() is None:
                    self._sessions[session_id] = f.result()
                    self.sessions_opened += 1

            pending.add_done_callback(opened)
        return await asyncio.shield(pending)

    async def release_session(self, session_id: str) -> None:
        pending = self._opening.get(session_id)
        if pending is not None:  # released while its server was starting: close it once started
            with contextlib.suppress(Exception):
                await asyncio.shield(pending)
        child = self._sessions.pop(session_id, None)
        if child is not None:
            await asyncio.to_thread(child.close)

    # --- life cycle (called from any thread) ---

    def start(self) -> list[Any]:
        """Start/connect, ``initialize`` and ``list_tools`` within ``start_timeout``; the tools."""
        fut = asyncio.run_coroutine_threadsafe(self._connect(), self._loop)
        try:
            return fut.result(self.spec.start_timeout + 5.0)
        except ToolError:
            self.close()
            raise
        except BaseException as e:  # noqa: BLE001 - say which server and why, then clean up
            fut.cancel()
            message = self._start_failure(e)  # before close(), which drops the stderr file
            self.close()
            raise ToolError(message) from None

    def stderr_tail(self, n: int = STDERR_TAIL) -> str:
        try:
            fd = self._errlog.fileno()
            size = os.fstat(fd).st_size
            return os.pread(fd, n, max(0, size - n)).decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""

    def _start_failure(self, e: BaseException) -> str:
        s = self.spec
        what = f"`{' '.join([s.command, *s.args])}`" if s.transport == "stdio" else s.url
        why = (
            f"did not answer initialize/list_tools within {s.start_timeout:g} s"
            if isinstance(e, (TimeoutError, concurrent.futures.TimeoutError))
            else f"failed: {describe_exc(e)}"
        )
        tail = self.stderr_tail()
        tail = f"; its stderr ends with:\n{tail}" if tail else "; it wrote nothing to stderr"
        return f"MCP server {s.name!r} ({s.where}, {s.transport}: {what}) {why}{tail if s.transport == 'stdio' else ''}"

    def close(self) -> None:
        """Stop the session (and the server process), and every per-trajectory one; idempotent."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        for child in list(self._sessions.values()):
            child.close()
        self._sessions.clear()
        if self._loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(self._disconnect(), self._loop)
            with contextlib.suppress(Exception):
                fut.result(15.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
        with contextlib.suppress(Exception):
            self._errlog.close()

    # --- inside the client's loop ---

    async def _connect(self) -> list[Any]:
        ready: asyncio.Future[Any] = self._loop.create_future()
        self._stop = asyncio.Event()
        self._runner = asyncio.ensure_future(self._run(ready, self._stop))
        try:
            tools = await asyncio.wait_for(asyncio.shield(ready), self.spec.start_timeout)
        except BaseException:
            await self._disconnect()
            raise
        self.starts += 1
        self.tools = tools
        return tools

    async def _run(self, ready: asyncio.Future[Any], stop: asyncio.Event) -> None:
        from mcp import ClientSession

        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport())
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                tools: list[Any] = []
                cursor = None
                while True:
                    from mcp import types

                    params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
                    listed = await session.list_tools(params=params)
                    tools += listed.tools
                    cursor = listed.next_cursor
                    if not cursor:
                        break
                self._session = session
                if not ready.done():
                    ready.set_result(tools)
                await stop.wait()
        except BaseException as e:  # noqa: BLE001 - reported through `ready` or the next call
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self._session = None

    def _transport(self) -> Any:
        s = self.spec
        if s.transport == "http":
            from mcp.client.streamable_http import streamable_http_client
            from mcp.shared._httpx_utils import create_mcp_http_client

            return _http(streamable_http_client, create_mcp_http_client, s)
        from mcp import StdioServerParameters, stdio_client

        argv = stdio_command(s)
        params = StdioServerParameters(command=argv[0], args=argv[1:], env=s.env or None, cwd=s.cwd or s.folder)
        return stdio_client(params, errlog=self._errlog)

    async def _disconnect(self) -> None:
        runner, self._runner = self._runner, None
        if self._stop is not None:
            self._stop.set()
        if runner is not None:
            try:
                await asyncio.wait_for(runner, 12.0)  # the SDK's own shutdown is bounded (~2 s + kill)
            except BaseException:  # noqa: BLE001 - stuck or failed: cancel it, the process group dies
                runner.cancel()
                with contextlib.suppress(BaseException):
                    await runner
        self._session = None

    async def _restart(self) -> None:
        await self._disconnect()
        if self.restarts >= self.spec.max_restarts or self._closed:
            return
        self.restarts += 1
        logger.warning(
            "MCP server %r was lost; restarting it (%d/%d)", self.spec.name, self.restarts, self.spec.max_restarts
        )
        try:
            await self._connect()
        except BaseException as e:  # noqa: BLE001 - the next call answers an error
            logger.warning("restarting MCP server %r failed: %s", self.spec.name, describe_exc(e))

    async def _call(self, name: str, args: dict[str, Any], timeout: float) -> Any:
        if self._restarting is not None and not self._restarting.done():
            await asyncio.shield(self._restarting)
        session = self._session
        if session is None:
            if self.restarts >= self.spec.max_restarts:
                raise ServerLost(f"it was lost and restarted {self.restarts} time(s) already (max_restarts)")
            self._restarting = asyncio.ensure_future(self._restart())
            await asyncio.shield(self._restarting)
            session = self._session
            if session is None:
                raise ServerLost("it could not be restarted" + _tail_note(self.stderr_tail(300)))
        try:
            return await session.call_tool(name, args, read_timeout_seconds=timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if _is_lost(e) and self._session is session:
                self.lost += 1
                self._session = None
                self._restarting = asyncio.ensure_future(self._restart())  # ready for the next call
                raise ServerLost(describe_exc(e) + _tail_note(self.stderr_tail(300))) from None
            raise

    def call_future(self, name: str, args: dict[str, Any], timeout: float) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise ServerLost("its client was closed")
        return asyncio.run_coroutine_threadsafe(self._call(name, args, timeout), self._loop)


@contextlib.asynccontextmanager
async def _http(client_cm: Any, make_http: Any, spec: ServerSpec) -> Any:
    import httpx2

    timeout = httpx2.Timeout(spec.start_timeout, read=max(spec.call_timeout, 30.0))
    async with make_http(headers=spec.headers or None, timeout=timeout) as http:
        async with client_cm(spec.url, http_client=http) as streams:
            yield streams


def describe_exc(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(describe_exc(x) for x in e.exceptions)
    text = str(e) or repr(e)
    return f"{type(e).__name__}: {text}"


def _tail_note(tail: str) -> str:
    return f" (server stderr: {tail[-300:]})" if tail else ""


def _is_lost(e: BaseException) -> bool:
    """An error that means the transport is gone (process died, connection broken)."""
    if isinstance(e, BaseExceptionGroup):
        return any(_is_lost(x) for x in e.exceptions)
    import anyio

    try:
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED
    except ImportError:  # pragma: no cover
        return False
    if isinstance(e, MCPError):
        return e.code == CONNECTION_CLOSED
    if isinstance(e, (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError, EOFError)):
        return True
    return type(e).__module__.startswith("httpx") and "Timeout" not in type(e).__name__


_LIVE: weakref.WeakSet[MCPServerClient] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # a run that never closed its tool set: stop the servers at exit
    for client in list(_LIVE):
        with contextlib.suppress(Exception):
            client.close()
