"""math-verify in a killable helper process: answer comparison that is bounded on every thread.

math-verify's own timeouts use ``signal.alarm``, which works only in the main thread; elsewhere
(verl's reward workers, thread pools, Ray actors) a slow input such as ``9^{9^{9^{9}}}`` holds the
GIL for as long as sympy takes and cannot be abandoned. Here the comparison runs in a child
process (this file run as a script) whose main thread applies math-verify's own timeouts,
and the caller waits at most ``timeout + KILL_GRACE_S`` seconds: past that the child is killed and
replaced, and the comparison counts as not equal. Each calling thread has its own child (no
thread waits behind another's slow input); a child exits when its parent does.

Starting a child takes ~0.6 s (it imports math-verify and sympy). :func:`prewarm` starts the calling
thread's child without waiting for it, so that the first comparison a run needs (often in a later
step, when a sample first writes an answer that is not a plain number) does not stall that thread:
the episode calls it when an episode starts (:meth:`agent_env.rewards.RewardScorer.prewarm`). Before
it did, the wait fell on whichever step met the first such answer, with the whole rollout of the
local trainer (its engine and episodes share the thread) stopped behind it: 0.5 s on one step of a
0.3 s-a-step run (bench_peers, 2026-12-06).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["KILL_GRACE_S", "prewarm", "verify_in_child", "VerifyTimeout"]

KILL_GRACE_S = 0.5
START_TIMEOUT_S = 120.0


class VerifyTimeout(Exception):
    """The comparison did not finish within its deadline (the child was killed)."""


class _Child:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.buf = b""
        self.ready = False  # the child said it has imported math-verify

    def _start(self) -> None:
        self._spawn()
        self._wait_ready()

    def _spawn(self) -> None:
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        # the file as a script (-I: no PYTHONPATH, no cwd): the child imports math-verify, nothing of ours
        self.proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        _CHILDREN.add(self)
        self.buf = b""
        self.ready = False

    def _wait_ready(self) -> None:
        line = self._readline(time.monotonic() + START_TIMEOUT_S)
        if line is None or json.loads(line).get("op") != "ready":
            self.kill()
            raise RuntimeError("the math-verify helper process did not start")
        self.ready = True

    def prewarm(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._spawn()

    def _readline(self, deadline: float) -> bytes | None:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None  # the child died
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def kill(self) -> None:
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.proc = None
        self.ready = False
        _CHILDREN.discard(self)

    def verify(self, pred: str, gold: str, timeout: float) -> dict[str, Any]:
        msg = json.dumps({"pred": pred, "gold": gold, "timeout": max(1, int(round(timeout)))}) + "\n"
        for attempt in range(2):  # a child found dead is replaced once; a fresh one dying too is an error
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            elif not self.ready:  # prewarmed: started, perhaps still importing
                self._wait_ready()
            assert self.proc is not None and self.proc.stdin is not None
            try:
                self.proc.stdin.write(msg.encode())
                self.proc.stdin.flush()
                break
            except (BrokenPipeError, OSError):
                self.kill()
                if attempt:
                    raise RuntimeError(
                        "the math-verify helper process died before reading its request, twice in a row "
                        "(a fresh one too): is something killing it (memory limit, OOM killer)?"
                    ) from None
        line = self._readline(time.monotonic() + timeout + KILL_GRACE_S)
        if line is None:
            self.kill()  # hung in sympy (or died): the next call starts a fresh child
            raise VerifyTimeout(f"answer comparison exceeded {timeout:g} s")
        return json.loads(line)


_CHILDREN: set[_Child] = set()
_LOCAL = threading.local()


@atexit.register
def _kill_children() -> None:
    for child in list(_CHILDREN):
        child.kill()


def _child() -> _Child:
    child = getattr(_LOCAL, "child", None)
    if child is None:
        child = _LOCAL.child = _Child()
    return child


def verify_in_child(pred: str, gold: str, timeout: float) -> dict[str, Any]:
    """``{"parsed": bool, "equal": bool}`` from math-verify run in this thread's helper process.
    Raises :class:`VerifyTimeout` after ``timeout + KILL_GRACE_S`` seconds."""
    return _child().verify(pred, gold, timeout)


def prewarm() -> None:
    """Start this thread's helper process if it has none, without waiting for it to be ready (the
    first :func:`verify_in_child` of this thread waits for what is left). Costs a process spawn
    (a few ms) once per thread; nothing after that."""
    _child().prewarm()


# ----------------------------------------------------------------------------- the child


def _serve(parent_pid: int) -> None:
    from math_verify import parse, verify

    def orphan_watch() -> None:  # the parent died (even by SIGKILL): do not linger in sympy
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(1.0)

    threading.Thread(target=orphan_watch, daemon=True).start()
    try:  # the first parse loads math-verify's grammars (~0.3 s): before "ready", not in a caller's wait
        verify(parse("\\boxed{1/2}", parsing_timeout=30), parse("\\boxed{0.5}", parsing_timeout=30), timeout_seconds=30)
    except Exception:  # noqa: BLE001 - only a warm-up
        pass
    out = sys.stdout.buffer
    out.write(b'{"op": "ready"}\n')
    out.flush()
    for line in sys.stdin.buffer:
        req = json.loads(line)
        t = req["timeout"]
        res = {"parsed": False, "equal": False}
        try:
            g = parse("\\boxed{" + req["gold"] + "}", parsing_timeout=t)
            p = parse("\\boxed{" + req["pred"] + "}", parsing_timeout=t)
            if g and p:
                res = {"parsed": True, "equal": bool(verify(g, p, timeout_seconds=t))}
        except Exception as e:  # noqa: BLE001 - math-verify raises on pathological input
            res["error"] = f"{type(e).__name__}"
        out.write((json.dumps(res) + "\n").encode())
        out.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
