"""The sandboxed ``python`` tool: a pool of fork-server workers inside bubblewrap (system or
bundled; or Docker; or, as an explicit opt-in, a plain process with no isolation), each snippet in
a hardened child (rlimits, seccomp, non-root uid)."""

from tools.sandbox.backends import (
    Backend,
    BwrapBackend,
    DockerBackend,
    UnisolatedBackend,
    bwrap_works,
    find_bwrap,
    make_backend,
)
from tools.sandbox.tool import PythonTool, SandboxStats

__all__ = [
    "Backend",
    "BwrapBackend",
    "DockerBackend",
    "UnisolatedBackend",
    "PythonTool",
    "SandboxStats",
    "bwrap_works",
    "find_bwrap",
    "make_backend",
]
