"""How a stdio server's process starts: inside bubblewrap (read-only root, a private ``/tmp``, its
own namespaces; its folders readable, ``writable_paths`` writable), or, ``unsandboxed``, through a
tiny launcher that sets ``PR_SET_PDEATHSIG`` before it execs the server."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from tools.base import ToolError
from tools.mcp.config import OPT_OUT_KEY, ServerSpec

# Sets PR_SET_PDEATHSIG (SIGKILL when the thread that started it ends: this process dying included)
# and execs the server; exits at once if that parent is already gone.
_LAUNCHER = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL)\n"
    "os.getppid()==int(sys.argv[1]) or os._exit(70)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


def require_bwrap() -> str:
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
    from tools.sandbox.bwrap import namespace_args, private_tmp_then_binds

    # as root no user namespace (as the python sandbox) and every capability dropped
    cmd = [require_bwrap(), *namespace_args(), "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    cmd += private_tmp_then_binds(_readable_dirs(spec))  # a server or venv under /tmp stays visible
    for w in spec.writable_paths:
        cmd += ["--bind", w, w]
    cmd += ["--chdir", spec.cwd or spec.folder, "--", spec.command, *spec.args]
    return cmd
