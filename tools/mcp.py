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
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.base import ErrorKind, Tool, ToolError, ToolResult, check_schema

__all__ = ["MCP_INSTALL", "MCPServerClient", "MCPTool", "ServerSpec", "build_mcp_tools", "load_mcp_config"]

logger = logging.getLogger(__name__)

MCP_INSTALL = "pip install -e '.[mcp]' in the otb-tir checkout (the `mcp` SDK, >=2.3,<3)"
OPT_OUT_KEY = "unsandboxed"
MAX_OUTPUT_CHARS = 65536  # a flooding server: cut here before the episode cuts it to tokens
STDERR_TAIL = 2000

_STDIO_KEYS = {"command", "args", "env", "cwd", OPT_OUT_KEY, "writable_paths"}
_HTTP_KEYS = {"url", "headers"}
_COMMON_KEYS = {
    "type",
    "transport",
    "start_timeout",
    "call_timeout",
    "max_restarts",
    "disabled",
    "session",
    "max_sessions",
}
SESSION_MODES = ("shared", "per_trajectory")

# Sets PR_SET_PDEATHSIG (SIGKILL when the thread that started it ends: this process dying included)
# and execs the server; exits at once if that parent is already gone.
_LAUNCHER = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL)\n"
    "os.getppid()==int(sys.argv[1]) or os._exit(70)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


# ----------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ServerSpec:
    """One entry of the ``mcpServers`` map."""

    name: str
    transport: str  # "stdio" | "http"
    where: str  # "<file>: mcpServers.<name>", for messages
    command: str = ""
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    folder: str = ""  # the config file's folder: relative paths resolve here; readable in the sandbox
    unsandboxed: bool = False
    writable_paths: tuple[str, ...] = ()
    url: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    start_timeout: float = 30.0
    call_timeout: float = 60.0
    max_restarts: int = 3
    # "shared": one client session per server per process (default); "per_trajectory": a session of its own
    # for each trajectory (a server process of its own for stdio), closed when the trajectory ends
    session: str = "shared"
    max_sessions: int = 64  # per_trajectory: sessions open at once, at most


def load_mcp_config(path: str | os.PathLike[str]) -> list[ServerSpec]:
    """The servers of an ``mcpServers`` JSON/YAML file. Raises :class:`ToolError` naming the
    file, the server and the key for anything malformed."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ToolError(f"multi_turn.mcp_servers: file not found: {path}")
    text = p.read_text()
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - JSON or YAML syntax: say where
        raise ToolError(f"multi_turn.mcp_servers: {p} is not valid JSON/YAML: {e}") from None
    servers = data.get("mcpServers") if isinstance(data, Mapping) else None
    if not isinstance(servers, Mapping) or not servers:
        raise ToolError(
            f"multi_turn.mcp_servers: {p} must hold a non-empty 'mcpServers' map "
            '({"mcpServers": {"name": {"command": ..., "args": [...]}}} or {"name": {"url": ...}})'
        )
    folder = str(p.resolve().parent)
    specs = []
    for name, entry in servers.items():
        spec = _spec(str(name), entry, f"{p}: mcpServers.{name}", folder)
        if spec is not None:
            specs.append(spec)
    if not specs:
        raise ToolError(f"multi_turn.mcp_servers: every server of {p} is disabled")
    return specs


def _spec(name: str, entry: Any, where: str, folder: str) -> ServerSpec | None:
    if not isinstance(entry, Mapping):
        raise ToolError(f"{where}: must be a mapping with 'command' (stdio) or 'url' (HTTP), got {entry!r}")
    entry = dict(entry)
    if entry.get("disabled"):
        return None
    kind = str(entry.get("type") or entry.get("transport") or ("http" if "url" in entry else "stdio")).lower()
    kind = {"streamable-http": "http", "streamable_http": "http", "streamablehttp": "http"}.get(kind, kind)
    if kind not in ("stdio", "http"):
        raise ToolError(f"{where}: transport {kind!r} is not supported: use stdio (command) or streamable HTTP (url)")
    allowed = _COMMON_KEYS | (_STDIO_KEYS if kind == "stdio" else _HTTP_KEYS)
    stray = sorted(set(entry) - allowed)
    if stray:
        raise ToolError(f"{where}: unknown key(s) {stray} for a {kind} server; allowed: {sorted(allowed)}")

    def number(key: str, default: float, lo: float) -> float:
        value = entry.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < lo:
            raise ToolError(f"{where}: {key} must be a number >= {lo}, got {value!r}")
        return float(value)

    def str_map(key: str) -> dict[str, str]:
        value = entry.get(key) or {}
        if not isinstance(value, Mapping):
            raise ToolError(f"{where}: {key} must be a mapping of strings, got {value!r}")
        return {str(k): str(v) for k, v in value.items()}

    session = str(entry.get("session", "shared"))
    if session not in SESSION_MODES:
        raise ToolError(f"{where}: session must be one of {list(SESSION_MODES)}, got {session!r}")
    common = dict(
        name=name,
        where=where,
        folder=folder,
        start_timeout=number("start_timeout", 30.0, 0.1),
        call_timeout=number("call_timeout", 60.0, 0.1),
        max_restarts=int(number("max_restarts", 3, 0)),
        session=session,
        max_sessions=int(number("max_sessions", 64, 1)),
    )
    if kind == "http":
        url = entry.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ToolError(f"{where}: url must be an http(s) URL, got {url!r}")
        return ServerSpec(transport="http", url=url, headers=str_map("headers"), **common)
    command = entry.get("command")
    if not isinstance(command, str) or not command:
        raise ToolError(f"{where}: a stdio server needs 'command' (a program), got {command!r}")
    args = entry.get("args") or []
    if not isinstance(args, list):
        raise ToolError(f"{where}: args must be a list of strings, got {args!r}")
    unsandboxed = entry.get(OPT_OUT_KEY, False)
    if not isinstance(unsandboxed, bool):
        raise ToolError(f"{where}: {OPT_OUT_KEY} must be true or false, got {unsandboxed!r}")
    cwd = entry.get("cwd")
    cwd = str((Path(folder) / Path(str(cwd)).expanduser()).resolve()) if cwd else None
    writable = entry.get("writable_paths") or []
    if not isinstance(writable, list):
        raise ToolError(f"{where}: writable_paths must be a list of paths, got {writable!r}")
    base = Path(cwd or folder)
    writable = tuple(str((base / Path(str(w)).expanduser()).resolve()) for w in writable)
    for w in writable:
        if not os.path.exists(w):
            raise ToolError(f"{where}: writable_paths: {w} does not exist (create it first)")
    return ServerSpec(
        transport="stdio",
        command=command,
        args=tuple(str(a) for a in args),
        env=str_map("env"),
        cwd=cwd,
        unsandboxed=unsandboxed,
        writable_paths=writable,
        **common,
    )


# ----------------------------------------------------------------------------------- isolation


def _bwrap() -> str:
    from tools.sandbox.backends import NO_ISOLATION_HELP, find_bwrap

    exe, problems = find_bwrap()
    if exe is None:
        raise ToolError(
            "stdio MCP servers run under bubblewrap by default, and it does not work here ("
            + "; ".join(problems)
            + f"). {NO_ISOLATION_HELP.split(' To run')[0]} Or set \"{OPT_OUT_KEY}\": true on the server "
            "(it then runs with your files and the network)"
        )
    return exe


def isolation_level(spec: ServerSpec) -> str:
    if spec.transport == "http":
        return "remote (streamable HTTP): runs where its URL points, not isolated by otb-tir"
    if spec.unsandboxed:
        return f"unsandboxed ({OPT_OUT_KEY}=true): a plain child process with the user's files and network"
    return "bubblewrap: read-only root, private /tmp, no network, pid/ipc/uts namespaces"


def _readable_dirs(spec: ServerSpec) -> list[str]:
    """The server's own folder(s): the config's folder, ``cwd`` and the folders of path arguments."""
    base = Path(spec.cwd or spec.folder)
    dirs = [spec.folder] + ([spec.cwd] if spec.cwd else [])
    for a in (spec.command, *spec.args):
        if a.startswith("-"):
            continue
        p = (base / a) if not os.path.isabs(a) else Path(a)
        if os.sep in a and p.exists():
            dirs.append(str(p.resolve().parent if p.is_file() else p.resolve()))
    dirs += _interpreter_dirs(spec)
    out: list[str] = []
    for d in sorted(set(dirs), key=len):
        if not any(d == q or d.startswith(q.rstrip("/") + "/") for q in out):
            out.append(d)
    return out


def _interpreter_dirs(spec: ServerSpec) -> list[str]:
    """What the command's interpreter needs, unresolved and resolved: a venv's own root (its
    ``pyvenv.cfg``, ``lib/`` and ``bin/``, which resolving ``bin/python`` to the base interpreter
    would lose), the base install it names, and the install behind the real executable. A bare
    command (``python``) is looked up on the server's PATH, as the server's own start does."""
    cmd = spec.command
    if os.sep not in cmd:
        found = shutil.which(cmd, path=spec.env.get("PATH", os.environ.get("PATH")))
        if found is None:
            return []
        cmd = found
    exe = Path(cmd) if os.path.isabs(cmd) else Path(spec.cwd or spec.folder) / cmd
    if not exe.exists():
        return []
    out = [str(exe.resolve().parent.parent)]  # the real executable's install (its bin/ and lib/)
    for root in (exe.parent.parent, exe.resolve().parent.parent):
        cfg = root / "pyvenv.cfg"
        if cfg.is_file():
            out.append(str(root.absolute()))
            for line in cfg.read_text(errors="replace").splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "home" and value.strip():
                    out.append(str(Path(value.strip()).resolve().parent))
            out += _pth_dirs_under_tmp(root)
    for entry in spec.env.get("PYTHONPATH", "").split(os.pathsep):  # the server's own path entries
        if entry.startswith("/tmp/") and Path(entry).is_dir():
            out.append(str(Path(entry).resolve()))
    return [d for d in out if d not in ("/", "/tmp") and not d.startswith("/usr")]


def _pth_dirs_under_tmp(venv: Path) -> list[str]:
    """The folders a venv's ``.pth`` files put on ``sys.path`` that lie under /tmp (an editable
    install of a checkout under /tmp, a venv stacked on another): the private /tmp would hide them.
    Only paths the interpreter itself adds at start; ``import`` lines are not run."""
    out = []
    for pth in venv.glob("lib/python3*/site-packages/*.pth"):
        for line in pth.read_text(errors="replace").splitlines():
            line = line.strip()
            if not line or line.startswith(("#", "import ", "import\t")):
                continue
            d = (pth.parent / line).resolve()
            if str(d).startswith("/tmp/") and d.is_dir():
                out.append(str(d))
    return out


def stdio_command(spec: ServerSpec, parent_pid: int | None = None) -> list[str]:
    """The argv that starts the server: bubblewrap around it, or the PDEATHSIG launcher."""
    if spec.unsandboxed:
        return [sys.executable, "-I", "-c", _LAUNCHER, str(parent_pid or os.getpid()), spec.command, *spec.args]
    cmd = [_bwrap()]
    if os.geteuid() == 0:  # no user namespace as root (as the python sandbox): drop every capability
        cmd += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        cmd += ["--cap-drop", "ALL"]
    else:
        cmd += ["--unshare-all"]
    cmd += ["--die-with-parent", "--new-session", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    from tools.sandbox.backends import private_tmp_then_binds

    cmd += private_tmp_then_binds(_readable_dirs(spec))  # a server or venv under /tmp stays visible
    for w in spec.writable_paths:
        cmd += ["--bind", w, w]
    cmd += ["--chdir", spec.cwd or spec.folder, "--", spec.command, *spec.args]
    return cmd


# ----------------------------------------------------------------------------------- client


class _Lost(Exception):
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
            else f"failed: {_describe_exc(e)}"
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
            logger.warning("restarting MCP server %r failed: %s", self.spec.name, _describe_exc(e))

    async def _call(self, name: str, args: dict[str, Any], timeout: float) -> Any:
        if self._restarting is not None and not self._restarting.done():
            await asyncio.shield(self._restarting)
        session = self._session
        if session is None:
            if self.restarts >= self.spec.max_restarts:
                raise _Lost(f"it was lost and restarted {self.restarts} time(s) already (max_restarts)")
            self._restarting = asyncio.ensure_future(self._restart())
            await asyncio.shield(self._restarting)
            session = self._session
            if session is None:
                raise _Lost("it could not be restarted" + _tail_note(self.stderr_tail(300)))
        try:
            return await session.call_tool(name, args, read_timeout_seconds=timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if _is_lost(e) and self._session is session:
                self.lost += 1
                self._session = None
                self._restarting = asyncio.ensure_future(self._restart())  # ready for the next call
                raise _Lost(_describe_exc(e) + _tail_note(self.stderr_tail(300))) from None
            raise

    def call_future(self, name: str, args: dict[str, Any], timeout: float) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise _Lost("its client was closed")
        return asyncio.run_coroutine_threadsafe(self._call(name, args, timeout), self._loop)


@contextlib.asynccontextmanager
async def _http(client_cm: Any, make_http: Any, spec: ServerSpec) -> Any:
    import httpx2

    timeout = httpx2.Timeout(spec.start_timeout, read=max(spec.call_timeout, 30.0))
    async with make_http(headers=spec.headers or None, timeout=timeout) as http:
        async with client_cm(spec.url, http_client=http) as streams:
            yield streams


def _describe_exc(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_describe_exc(x) for x in e.exceptions)
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


# ----------------------------------------------------------------------------------- tools


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
        except _Lost as e:
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
            msg = e.error.message if isinstance(e, MCPError) else _describe_exc(e)
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
            _bwrap()
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
