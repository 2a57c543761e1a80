"""The ``mcpServers`` file: :func:`load_mcp_config` reads it into :class:`ServerSpec` records (one
per server), with a :class:`ToolError` naming the file, the server and the key for anything
malformed. The keys are listed in :mod:`tools.mcp`."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.base import ToolError

OPT_OUT_KEY = "unsandboxed"

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
