"""The snippet's process: forked from the worker, hardened, then given one snippet (or, in a
stateful session, several).

The hardening, in order, in the child before any code arrives (``Spawner._child_main``): its own
process group, PDEATHSIG, default signal handlers, fds 0-4 only (the rest closed), cwd = scratch,
rlimits (core 0, file size, open files, address space = the preloaded interpreter + the budget),
then as root RLIMIT_NPROC and the drop to the sandbox uid (groups, gid, uid; the child exits if
it still is root), then the seccomp filter (no_new_privs). Per snippet, RLIMIT_CPU backs up the
worker's wall-clock timeout.

Part of the sandbox worker (``worker.py`` loads this file by path, next to itself, and the
backends mount it read-only beside it). It imports ``worker_seccomp`` and ``worker_snippet``, which
``worker.py`` loads first; otherwise standard library (numpy only if preloaded).
"""

from __future__ import annotations

import _signal
import ctypes
import io
import json
import os
import random as _random_mod
import resource
import select
import signal
import struct
import sys
import traceback

from worker_seccomp import CompiledFilter
from worker_snippet import run_snippet

_HDR = struct.Struct(">I")
ARM_TIMEOUT_S = 10.0
_SIGINT, _SIGTERM, _SIGCHLD, _SIGXFSZ = (
    int(signal.SIGINT),
    int(signal.SIGTERM),
    int(signal.SIGCHLD),
    int(signal.SIGXFSZ),
)
_LIBC_FORK = ctypes.PyDLL(None, use_errno=True).fork  # keeps the GIL: see Spawner._fork
_LIBC_FORK.restype = ctypes.c_int
_LIBC_FORK.argtypes = []
PR_SET_PDEATHSIG = 1
_PAGE = os.sysconf("SC_PAGE_SIZE")

# Exit code of a child that died without sending a status frame.
EXIT_SETUP_FAILED = 71


# --------------------------------------------------------------------------- framing
def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        try:
            b = os.read(fd, n)
        except InterruptedError:
            continue
        if not b:
            return None
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def read_frame(fd: int) -> dict | None:
    hdr = _read_exact(fd, _HDR.size)
    if hdr is None:
        return None
    (n,) = _HDR.unpack(hdr)
    body = _read_exact(fd, n)
    if body is None:
        return None
    return json.loads(body.decode("utf-8"))


def write_frame(fd: int, obj: dict) -> None:
    body = json.dumps(obj).encode("utf-8")
    data = _HDR.pack(len(body)) + body
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        view = view[n:]


# --------------------------------------------------------------------------- the child
class Child:
    __slots__ = ("pid", "req_w", "out_r", "st_r", "armed")

    def __init__(self, pid: int, req_w: int, out_r: int, st_r: int) -> None:
        self.pid, self.req_w, self.out_r, self.st_r = pid, req_w, out_r, st_r
        self.armed = False

    def close_fds(self) -> None:
        for fd in (self.req_w, self.out_r, self.st_r):
            try:
                os.close(fd)
            except OSError:
                pass


class Spawner:
    """Forks the snippets' hardened processes. The limits come from the worker config: ``uid``
    (None: no uid drop), ``memory_mb``, ``fsize_mb``, ``nofile``, ``nproc``, ``seccomp``, plus the
    ``raw_fork`` switch; ``scratch`` is the child's working directory."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.uid: int | None = cfg.get("uid")
        self.scratch: str = cfg.get("scratch", "/tmp/scratch")
        self.stateful: bool = bool(cfg.get("stateful", False))
        self.libc = ctypes.CDLL(None, use_errno=True)
        self._prctl = self.libc.prctl
        self._prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        self._prctl.restype = ctypes.c_int
        mb = 1024 * 1024
        self.rlimits: list[tuple[int, int]] = [(resource.RLIMIT_CORE, 0)]
        if cfg.get("fsize_mb"):
            self.rlimits.append((resource.RLIMIT_FSIZE, int(cfg["fsize_mb"] * mb)))
        if cfg.get("nofile"):
            self.rlimits.append((resource.RLIMIT_NOFILE, int(cfg["nofile"])))
        self.memory_bytes = int(cfg["memory_mb"] * mb) if cfg.get("memory_mb") else 0
        self.nproc = int(cfg["nproc"]) if cfg.get("nproc") else 0
        self.raw_fork = bool(cfg.get("raw_fork", True)) and _single_threaded()
        self.child_stdio = (
            io.TextIOWrapper(
                io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
            ),
            io.TextIOWrapper(
                io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
            ),
            io.TextIOWrapper(io.FileIO(0, "r", closefd=False)),
        )
        self.filter: CompiledFilter | None = None
        self.filter_error = ""
        if cfg.get("seccomp", True):
            try:
                self.filter = CompiledFilter(self.libc)
            except Exception as e:  # noqa: BLE001 - reported in the ready frame
                self.filter_error = f"{type(e).__name__}: {e}"
        self.pid = os.getpid()

    def _fork(self) -> int:
        """fork(2). With ``raw_fork`` (the default, used only while the worker is single-threaded)
        libc's fork is called directly: CPython's at-fork hooks (thread state re-initialisation,
        the random module's reseed, threading/logging bookkeeping) are skipped. They protect
        state shared with *other threads*, and the worker has none; skipping them spares every
        child ~200 copy-on-write page faults (~1.5 ms of CPU). The child reseeds its random
        generators itself."""
        if self.raw_fork:
            pid = _LIBC_FORK()
            if pid < 0:
                raise OSError(ctypes.get_errno(), "fork failed")
            return pid
        return os.fork()

    def _fork_child(self, wait_armed: bool = True) -> Child:
        req_r, req_w = os.pipe()
        out_r, out_w = os.pipe()
        st_r, st_w = os.pipe()
        pid = self._fork()
        if pid == 0:  # child
            code = EXIT_SETUP_FAILED
            try:
                self._child_main(req_r, out_w, st_w)
                code = 0
            except BaseException:  # noqa: BLE001
                try:
                    traceback.print_exc()
                except Exception:  # noqa: BLE001
                    pass
            os._exit(code)
        os.close(req_r)
        os.close(out_w)
        os.close(st_w)
        child = Child(pid, req_w, out_r, st_r)
        if wait_armed:
            # the child's hardening (uid, rlimits, seccomp) happens now, off the critical path:
            # wait for its one-byte "armed" note so that the next request finds it blocked in read
            try:
                r, _, _ = select.select([st_r], [], [], ARM_TIMEOUT_S)
                if r:
                    os.read(st_r, 1)  # b"A", or EOF if setup failed (the call then reports it)
                    child.armed = True
            except InterruptedError:
                pass
        return child

    def _child_main(self, req_r: int, out_w: int, st_w: int) -> None:
        # Everything here runs in the pre-forked spare before any code arrives. It is written with
        # few Python objects on purpose: each page the child writes is a copy-on-write fault.
        os.setpgid(0, 0)
        prctl = self._prctl
        prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
        if os.getppid() != self.pid:  # the worker died before PDEATHSIG was armed
            os._exit(EXIT_SETUP_FAILED)
        for sig in (_SIGINT, _SIGTERM, _SIGCHLD):
            _signal.signal(sig, _signal.SIG_DFL)
        _signal.signal(_SIGXFSZ, _signal.SIG_IGN)  # a too-big write raises EFBIG instead
        # fds: 0 = /dev/null, 1 = 2 = output pipe, 3 = requests, 4 = status; close the rest
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        os.dup2(req_r, 3)
        os.dup2(st_w, 4)
        os.closerange(5, 65536)
        os.chdir(self.scratch)
        setrlimit = resource.setrlimit
        for res, lim in self.rlimits:
            setrlimit(res, (lim, lim))
        if self.memory_bytes:
            # address space: what the preloaded interpreter already maps, plus the budget
            lim = _vm_size_bytes() + self.memory_bytes
            setrlimit(resource.RLIMIT_AS, (lim, lim))
        if self.uid is not None:
            if self.nproc:
                setrlimit(resource.RLIMIT_NPROC, (self.nproc, self.nproc))
            os.setgroups([])
            os.setresgid(self.uid, self.uid, self.uid)
            os.setresuid(self.uid, self.uid, self.uid)
            if os.getuid() == 0 or os.geteuid() == 0:
                os._exit(EXIT_SETUP_FAILED)
        if self.filter is not None:
            self.filter.load()  # also sets no_new_privs
        # text streams made once in the worker (never used there): fds 0/1/2 are the child's
        sys.stdout, sys.stderr, sys.stdin = self.child_stdio
        # a fresh random state per child (forked children would otherwise all share the worker's)
        _random_mod.seed()
        np_random = sys.modules.get("numpy.random")
        if np_random is not None:
            # the legacy global generator from 624 fresh words (full MT19937 entropy; resets the
            # cached gaussian); half the pages np.random.seed()'s SeedSequence path touches
            np = sys.modules["numpy"]
            np_random.set_state(("MT19937", np.frombuffer(os.urandom(2496), np.uint32), 624))
        os.write(4, b"A")  # armed
        self._child_idle()
        g: dict = {"__name__": "__main__", "__builtins__": __builtins__}
        while True:
            req = self._next_request()
            if req is None:
                os._exit(0)
            # CPU-time backstop (the wall-clock timeout is enforced by the worker); only the soft
            # limit moves so that a stateful session can raise it again for its next snippet
            t = max(1, int(float(req.get("timeout", 10)) + 1.0))
            _, hard = resource.getrlimit(resource.RLIMIT_CPU)
            soft = int(sum(os.times()[:2])) + t
            if hard != resource.RLIM_INFINITY:
                soft = min(soft, hard)
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
            status = run_snippet(req["code"], g)
            write_frame(4, self._child_status(status))
            if not self.stateful:
                os._exit(0)
            g.pop("__warningregistry__", None)

    # ---- child-side extension points (no-ops here; worker.py's Worker says which opt-in modules
    # override them). They run in an armed child: after its rlimits, uid drop and seccomp.
    def _child_idle(self) -> None:
        """In an armed child, before it blocks for its code."""

    def _next_request(self) -> dict | None:
        """In the child: the next request, None when the worker closed the pipe."""
        return read_frame(3)

    def _child_status(self, status: str) -> dict:
        """In the child: the status frame written to the worker after a snippet."""
        return {"status": status}


def _vm_size_bytes() -> int:
    """VmSize from /proc/self/statm (first field, in pages), read with two syscalls."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        try:
            data = os.read(fd, 256)
        finally:
            os.close(fd)
        return int(data.split(None, 1)[0]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _single_threaded() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


_HUGE = 2 * 1024 * 1024
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def collapse_heap(libc: ctypes.CDLL, min_resident: float = 0.5) -> int:
    """Back the worker's populated anonymous memory with transparent huge pages (2 MiB).

    fork() then copies one page-table entry per 2 MiB instead of 512, and a child's exit tears
    down as few: about 1 ms of CPU less per snippet for a worker holding numpy+sympy. A child's
    first write into such a region still copies only a 4 KiB page (the kernel splits its own
    mapping of the huge page). Only 2 MiB ranges that are at least ``min_resident`` populated are
    collapsed, so the worker grows by a few MiB at most. Returns the bytes collapsed (0 where the
    kernel lacks MADV_COLLAPSE, Linux < 6.1)."""
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    mincore = libc.mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    mincore.restype = ctypes.c_int
    npages = _HUGE // _PAGE
    vec = ctypes.create_string_buffer(npages)
    done = 0
    try:
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
    except OSError:
        return 0
    for line in maps:
        parts = line.split()
        if len(parts) < 5 or parts[1][:2] != "rw" or (len(parts) > 5 and parts[5] != "[heap]"):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        a, b = (lo + _HUGE - 1) & ~(_HUGE - 1), hi & ~(_HUGE - 1)
        for x in range(a, b, _HUGE):
            if mincore(x, _HUGE, vec) != 0:
                continue
            if sum(c & 1 for c in vec.raw) < min_resident * npages:
                continue
            if madvise(x, _HUGE, MADV_HUGEPAGE) == 0 and madvise(x, _HUGE, MADV_COLLAPSE) == 0:
                done += _HUGE
    return done
