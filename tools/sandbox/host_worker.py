"""Host side of one sandbox worker: the long-lived process, launched and talked to over asyncio.

:class:`WorkerProcess` starts a worker with its backend's command (a minimal environment, stdin
and stdout as pipes), waits for its ``ready`` frame, sends one snippet at a time as a
length-prefixed JSON frame and reads the reply, with the snippet's timeout plus a host-side grace
(:data:`HOST_GRACE_S`) after which a silent worker counts as hung. A worker that dies, hangs or
answers out of turn is killed (its sandbox's inner processes first, so that their parents reap
them) and :class:`WorkerDied` is raised; :mod:`tools.sandbox.pool` decides what replaces it. The
/proc helpers (:func:`descendants`) find a worker's processes for that kill and for tests.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import select
import shutil
import signal
import struct
import time
from dataclasses import dataclass
from typing import Any

from tools.sandbox.backends import Backend, UnisolatedBackend

log = logging.getLogger(__name__)

_HDR = struct.Struct(">I")
# host-side grace beyond the snippet timeout before the worker itself is declared hung
HOST_GRACE_S = 5.0
START_TIMEOUT_S = 60.0


class WorkerDied(Exception):
    """The worker process died or stopped answering (the pool respawns it). ``hung``: it stopped
    answering (no reply within the snippet timeout + grace) rather than exiting."""

    def __init__(self, msg: str, *, hung: bool = False) -> None:
        super().__init__(msg)
        self.hung = hung


def _pid_state(pid: int) -> bytes:
    """The process's state letter from /proc (b"R", b"S", b"T" stopped, b"Z" zombie …); b"X" if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return b"X"
    return stat[stat.rindex(b")") + 2 :][:1]


def _pid_running(pid: int) -> bool:
    """The process exists and is not a zombie (its exit may not have been reaped by asyncio yet)."""
    return _pid_state(pid) not in (b"Z", b"X")


@dataclass
class RunReply:
    status: str
    output: str
    cut: bool
    note: str
    exec_ms: float
    state_reset: bool


class WorkerProcess:
    """One long-lived sandbox worker, talked to over its stdin/stdout."""

    _ids = itertools.count()

    def __init__(
        self, backend: Backend, cfg: dict[str, Any], *, recycle_after: int | None = None, debug: bool = False
    ) -> None:
        self.backend = backend
        self.base_cfg = cfg
        self.recycle_after = recycle_after
        self.debug = debug
        self.proc: asyncio.subprocess.Process | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.cfg: dict[str, Any] = {}
        self.info: dict[str, Any] = {}
        self.calls = 0
        self._pending_idle = False
        self._req_ids = itertools.count()
        self.name = f"sandbox-worker-{next(self._ids)}"
        # a pidfd of the worker, polled by ``alive``: readable once the process has exited (also
        # while it is a zombie), one poll(2) instead of opening and reading /proc/PID/stat; it
        # also cannot be fooled by a reused pid. None where pidfds are unavailable (Linux < 5.3).
        self._pidfd: int | None = None
        self._pidfd_poll: select.poll | None = None

    @property
    def alive(self) -> bool:
        """Running, as far as this process can tell: a worker SIGKILLed from outside counts as
        dead at once, before asyncio reaps it. Checked up to three times per call (acquire, run,
        release), so it is kept to one system call."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return False
        if self._pidfd_poll is not None:
            return not self._pidfd_poll.poll(0)
        return _pid_running(proc.pid)

    def _open_pidfd(self) -> None:
        self._close_pidfd()
        assert self.proc is not None
        try:
            fd = os.pidfd_open(self.proc.pid)
        except (OSError, AttributeError):
            return
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        self._pidfd, self._pidfd_poll = fd, poller

    def _close_pidfd(self) -> None:
        fd, self._pidfd, self._pidfd_poll = self._pidfd, None, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.cfg = self.backend.worker_config(self.base_cfg)
        cmd = self.backend.command(self.cfg)
        launch = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=None if self.debug else asyncio.subprocess.DEVNULL,
                env=_minimal_env(),
                close_fds=True,
            )
        )
        try:
            # shielded: a cancel that lands while asyncio connects the pipes would make asyncio
            # SIGKILL the top process (bwrap) in the middle of its setup, orphaning a child that has
            # not yet asked to die with it; that child keeps the stdout pipe open and asyncio waits for
            # its exit forever. The launch finishes (a few loop turns) and kill() stops the tree.
            self.proc = await asyncio.shield(launch)
        except asyncio.CancelledError:
            try:
                self.proc = await launch
            except OSError:
                raise asyncio.CancelledError() from None
            await self.kill()
            raise
        except OSError as e:
            raise WorkerDied(f"{self.name} could not be launched ({cmd[0]}: {e})") from e
        self._open_pidfd()
        try:
            ready = await asyncio.wait_for(self._read_frame(), START_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            await self.kill()
            raise WorkerDied(f"{self.name} did not start ({type(e).__name__}); command: {' '.join(cmd[:3])} …") from e
        except asyncio.CancelledError:
            await self.kill()
            raise
        if ready.get("op") != "ready":
            await self.kill()
            raise WorkerDied(f"{self.name} sent {ready!r} instead of ready")
        if ready.get("prelude_error"):
            await self.kill()
            raise WorkerDied(f"{self.name}: the tool's prelude failed in the sandbox: {ready['prelude_error']}")
        self.info = ready
        self.calls = 0
        self._pending_idle = False
        log.debug("%s ready: %s", self.name, ready)

    async def _read_frame(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        hdr = await self.proc.stdout.readexactly(_HDR.size)
        (n,) = _HDR.unpack(hdr)
        body = await self.proc.stdout.readexactly(n)
        return json.loads(body.decode("utf-8"))

    async def run(self, code: str, timeout: float, max_output: int) -> RunReply:
        """Send one snippet; raises WorkerDied if the worker dies or hangs (it is then killed)."""
        if not self.alive:
            raise WorkerDied(f"{self.name} is not running")
        await self.wait_idle(timeout + HOST_GRACE_S)
        assert self.proc is not None and self.proc.stdin is not None
        rid = next(self._req_ids)
        body = json.dumps({"op": "run", "id": rid, "code": code, "timeout": timeout, "max_output": max_output}).encode(
            "utf-8"
        )
        try:
            self.proc.stdin.write(_HDR.pack(len(body)) + body)
            await self.proc.stdin.drain()
            # asyncio.timeout, not wait_for: no extra Task per call (host CPU is on the hot path)
            async with asyncio.timeout(timeout + HOST_GRACE_S):
                reply = await self._read_frame()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, BrokenPipeError) as e:
            hung = isinstance(e, asyncio.TimeoutError) and self.alive
            await self.kill()
            raise WorkerDied(
                f"{self.name} {'hung' if hung else 'died'} during a call ({type(e).__name__})", hung=hung
            ) from e
        except asyncio.CancelledError:
            # the caller gave up mid-call: the worker's state is unknown, so replace it
            await self.kill()
            raise
        if reply.get("id") != rid:
            await self.kill()
            raise WorkerDied(f"{self.name} answered request {reply.get('id')} instead of {rid}")
        self.calls += 1
        self._pending_idle = True
        return RunReply(
            reply["status"],
            reply.get("output", ""),
            bool(reply.get("cut")),
            reply.get("note", ""),
            float(reply.get("exec_ms", 0.0)),
            bool(reply.get("state_reset")),
        )

    async def wait_idle(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait for the worker's post-call cleanup (scratch wiped, next spare forked)."""
        if not self._pending_idle:
            return
        try:
            async with asyncio.timeout(timeout):
                frame = await self._read_frame()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            await self.kill()
            raise WorkerDied(f"{self.name} died after a call ({type(e).__name__})") from e
        except asyncio.CancelledError:
            await self.kill()
            raise
        if frame.get("op") != "idle":
            await self.kill()
            raise WorkerDied(f"{self.name} sent {frame!r} instead of idle")
        self._pending_idle = False

    @property
    def needs_recycle(self) -> bool:
        return self.recycle_after is not None and self.calls >= self.recycle_after

    async def close(self, grace: float = 2.0) -> None:
        """Close stdin (the worker cleans up and exits), then kill after ``grace`` seconds."""
        if self.proc is None:
            return
        if self.proc.returncode is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except Exception:  # noqa: BLE001
                pass
            try:
                await asyncio.wait_for(self.proc.wait(), grace)
            except asyncio.TimeoutError:
                pass
        await self.kill()

    async def kill(self) -> None:
        """Hard stop. The sandbox's own processes are killed first (bwrap's pid-namespace init,
        or the fallback worker's children) so that their parents reap them: killing the top
        process first would leave zombies for the host's init to collect. The top process is
        stopped meanwhile (see :func:`_kill_children`)."""
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            if _kill_children(proc.pid, self._pidfd):
                try:
                    await asyncio.wait_for(proc.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
        if proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(proc.wait(), 10.0)
            except asyncio.TimeoutError:
                log.error("%s (pid %s) did not exit after SIGKILL", self.name, proc.pid)
        self._close_pidfd()
        self._cleanup_scratch()

    def kill_sync(self) -> None:
        """Kill from outside the event loop (e.g. the loop is already closed)."""
        if self.proc is not None and self.proc.returncode is None:
            if _kill_children(self.proc.pid, self._pidfd):  # inner first (see kill()); else it killed the top
                try:
                    os.kill(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._close_pidfd()
        self._cleanup_scratch()

    def _cleanup_scratch(self) -> None:
        if isinstance(self.backend, UnisolatedBackend):
            scratch = self.cfg.get("scratch")
            if scratch and os.path.isdir(scratch):
                shutil.rmtree(scratch, ignore_errors=True)


def _parents() -> dict[int, list[int]]:
    """pid → its direct children, for every process this one can see (one pass over /proc)."""
    kids: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return kids
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        kids.setdefault(int(stat[stat.rindex(b")") + 2 :].split()[1]), []).append(int(name))
    return kids


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    return _parents().get(pid, [])


def _kill_children(pid: int, pidfd: int | None = None) -> bool:
    """SIGKILL the direct children of ``pid`` (bwrap's pid-namespace init, or the fallback
    worker's forks); True if there were any, and ``pid`` goes on to reap them. ``pid`` is
    stopped while they are listed and killed, so that it cannot start one in between: bwrap
    killed just before its child asked the kernel to die with its parent would leave that child
    running, orphaned, holding the worker's pipes. Where it had none, ``pid`` is killed while
    still stopped (so it never starts one) and False is returned. ``pidfd`` (the worker's, if
    open) signals that very process even if it was reaped and its pid reused meanwhile."""

    def signal_top(sig: int) -> None:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(pid, sig)

    try:
        signal_top(signal.SIGSTOP)
    except OSError:
        return False
    # the signal takes effect when the process next leaves the kernel: a clone(2) under way when
    # it was sent still completes (only a fatal signal cancels one), so list the children only
    # once the process is seen stopped (microseconds; bounded at 0.5 s)
    deadline = time.monotonic() + 0.5
    while _pid_state(pid) not in (b"T", b"t", b"Z", b"X") and time.monotonic() < deadline:
        time.sleep(0.0002)
    kids = _children(pid)
    for kid in kids:
        try:
            os.kill(kid, signal.SIGKILL)
        except OSError:
            pass
    try:
        signal_top(signal.SIGCONT if kids else signal.SIGKILL)
    except OSError:
        pass
    return bool(kids)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc), parents before children."""
    kids, out, todo = _parents(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _minimal_env() -> dict[str, str]:
    """The environment a worker starts with (bwrap clears it anyway; the fallback needs this)."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return env
