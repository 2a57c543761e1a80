"""The sandboxed ``python`` tool: a pool of fork-server workers inside bubblewrap (or Docker, or a
plain-process fallback), each snippet in a hardened child (rlimits, seccomp, non-root uid)."""

from tools.sandbox.backends import (Backend, BwrapBackend, DockerBackend, FallbackBackend,
                                    bwrap_works, make_backend)
from tools.sandbox.tool import PythonTool, SandboxStats

__all__ = ["Backend", "BwrapBackend", "DockerBackend", "FallbackBackend", "PythonTool",
           "SandboxStats", "bwrap_works", "make_backend"]
