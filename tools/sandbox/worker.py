"""The sandbox worker: a long-lived fork server that runs Python snippets in hardened children.

It runs *inside* the sandbox (bubblewrap, a Docker container, or a plain process in the
unisolated mode) where the otb-tir packages are not visible, so it is standalone: standard library
(plus optional numpy / sympy / pyseccomp) and its sibling modules, loaded by path (``_sibling``)
and mounted read-only beside it by the backends (``backends.WORKER_FILES``):

    worker.py           this file: the request loop, output capture (caps, wall-clock timeout),
                        killing and reaping what a snippet leaves, scratch
    worker_child.py     the snippet's process: fork, hardening (rlimits, uid drop, seccomp), framing
    worker_seccomp.py   the seccomp filter
    worker_snippet.py   running a snippet (REPL-style, trimmed tracebacks); preload, warm-up and
                        the tool's prelude (trusted code run once, before the first spare)
    worker_prefault.py  opt-in experiments, loaded only when the config asks for them
    worker_profile.py   (worker_options "prefault" / "profile"; see the hooks below)

(Over 450 lines on purpose: the request loop, output capture and cleanup share one fork server's
state; what separates from them is already in the sibling modules, and a new one must be mounted.)

The host talks to it over stdin/stdout with length-prefixed JSON frames (4-byte big-endian
length, then UTF-8 JSON):

    host -> worker  {"op": "run", "id": n, "code": str, "timeout": s, "max_output": chars}
    worker -> host  {"op": "ready", ...} once, then one {"id": n, "status": ..., "output": ...}
                    per request, followed by {"op": "idle"} once the next child is ready.

``status`` is one of ok, syntax, runtime, memory, timeout, output_cut, sandbox.

Per snippet the worker uses a *pre-forked spare child* that has already: moved to its own process
group, set PDEATHSIG, applied rlimits (address space, file size, open files, processes, core),
dropped to a non-root uid (when the worker runs as root), and loaded a seccomp filter. The spare
then blocks until the code arrives, so fork and hardening are off the critical path. After the
snippet, the whole process group is killed, any process left with the sandbox uid is killed,
orphans are reaped (the worker is a child subreaper) and the scratch directory is wiped.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import select
import shutil
import signal
import stat
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))


def _sibling(name: str):
    """Load ``<name>.py`` from this file's directory and register it in sys.modules (so a sibling
    loaded later can import it by name). The worker runs with ``python -I``, so that directory is
    not on sys.path, and it stays off it: a snippet's imports resolve as they would without it."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_sibling("worker_seccomp")
_snippet = _sibling("worker_snippet")
_child = _sibling("worker_child")  # imports the two above
Child, read_frame, write_frame = _child.Child, _child.read_frame, _child.write_frame
_HDR = _child._HDR
PR_SET_CHILD_SUBREAPER = 36


class Worker(_child.Spawner):
    """The fork server: one request at a time, each in a fresh hardened child (or, stateful, in
    the session's child), then cleanup off the critical path."""

    def __init__(self, cfg: dict) -> None:
        super().__init__(cfg)
        self.spare: Child | None = None
        self.session: Child | None = None
        self._to_reap: list[int] = []
        self.host_gone = False
        self.proto_in = os.dup(0)
        self.proto_out = os.dup(1)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.close(devnull)
        self.libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self._make_scratch()
        os.environ["HOME"] = os.environ["TMPDIR"] = self.scratch

    # ---- scratch
    def _make_scratch(self) -> None:
        os.makedirs(self.scratch, exist_ok=True)
        if self.uid is not None:
            os.chown(self.scratch, self.uid, self.uid)
        os.chmod(self.scratch, 0o700)

    def _wipe_scratch(self) -> None:
        try:
            for entry in os.scandir(self.scratch):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    try:
                        os.unlink(entry.path)
                    except OSError:
                        pass
        except FileNotFoundError:
            pass
        # one lstat instead of mkdir + chown + chmod when the snippet left the directory as it was
        try:
            st = os.lstat(self.scratch)
            if (
                stat.S_ISDIR(st.st_mode)
                and stat.S_IMODE(st.st_mode) == 0o700
                and (self.uid is None or st.st_uid == st.st_gid == self.uid)
            ):
                return
        except OSError:
            pass
        self._make_scratch()

    def _ensure_spare(self) -> Child:
        if self.spare is not None:
            try:
                pid, _ = os.waitpid(self.spare.pid, os.WNOHANG)
            except ChildProcessError:
                pid = self.spare.pid
            if pid == 0:
                return self.spare
            self.spare.close_fds()
            self.spare = None
        self.spare = self._fork_child()
        return self.spare

    # ---- cleanup
    def _kill_group(self, child: Child) -> None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _kill_uid_leftovers(self, keep: set[int]) -> None:
        """SIGKILL every process still running with the sandbox uid (escapes from the process
        group), found by scanning /proc."""
        if self.uid is None or not self.cfg.get("sweep_uid", True):
            return
        left = [p for p in _pids_with_uid(self.uid) if p not in keep]
        if not left:
            return
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass

    def _reap(self, keep: set[int]) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.spare is not None and pid == self.spare.pid:
                self.spare.close_fds()
                self.spare = None
            if self.session is not None and pid == self.session.pid:
                self.session.close_fds()
                self.session = None

    # ---- one request
    def _collect(self, child: Child, timeout: float, max_output: int) -> tuple[str, bytes, bool]:
        """Read output until the status frame arrives (or the child dies, or time runs out).
        Returns (status, output bytes, cut)."""
        cap = max(64, int(max_output)) * 4 + 16
        buf = bytearray()
        cut = False
        status: str | None = None
        deadline = time.monotonic() + timeout
        st_buf = bytearray()
        fds = [child.out_r, child.st_r, self.proto_in]
        while status is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                status = "timeout"
                break
            try:
                ready, _, _ = select.select(fds, [], [], remaining)
            except InterruptedError:
                continue
            if self.proto_in in ready:
                # the host never sends a request while one is running: this is EOF, the host is
                # closing the pool (or gone). Stop the snippet and shut down cleanly.
                self.host_gone = True
                status = "sandbox"
                break
            if child.out_r in ready:
                data = os.read(child.out_r, 65536)
                if not data:
                    fds.remove(child.out_r)
                else:
                    buf += data
                    if len(buf) > cap:
                        cut = True
                        status = "output_cut"
                        break
            if child.st_r in ready:
                data = os.read(child.st_r, 4096)
                if not data:
                    status = "died"
                else:
                    st_buf += data
                    if not child.armed and st_buf[:1] == b"A":  # armed note not consumed yet
                        del st_buf[:1]
                        child.armed = True
                    if len(st_buf) >= _HDR.size:
                        (n,) = _HDR.unpack(st_buf[: _HDR.size])
                        if len(st_buf) >= _HDR.size + n:
                            try:
                                st = json.loads(bytes(st_buf[_HDR.size : _HDR.size + n]))
                                status = self._status_frame(st)
                            except Exception:  # noqa: BLE001 - the snippet wrote garbage on fd 4
                                status = "runtime"
            if fds == [self.proto_in]:
                break
        # the child has printed everything it will print before its status: drain what is there
        if status not in ("timeout", "output_cut"):
            while len(buf) <= cap:
                r, _, _ = select.select([child.out_r], [], [], 0)
                if not r:
                    break
                data = os.read(child.out_r, 65536)
                if not data:
                    break
                buf += data
            if len(buf) > cap:
                cut = True
        return status or "died", bytes(buf), cut

    def handle(self, req: dict) -> dict:
        t0 = time.monotonic()
        timeout = float(req.get("timeout", 10.0))
        max_output = int(req.get("max_output", 8192))
        if self.stateful:
            if self.session is None:
                self.session = self._fork_child()
            child = self.session
        else:
            child = self._ensure_spare()
            self.spare = None
        state_reset = False
        try:
            write_frame(child.req_w, {"code": req["code"], "timeout": timeout})
        except OSError:  # the child died before it got the code: one retry with a fresh one
            self._kill_group(child)
            child.close_fds()
            child = self._fork_child()
            if self.stateful:
                self.session = child
                state_reset = True
            write_frame(child.req_w, {"code": req["code"], "timeout": timeout})
        status, out, cut = self._collect(child, timeout, max_output)
        exit_note = ""
        finished = (not self.stateful) or status in ("timeout", "output_cut", "died")
        if finished:
            # SIGKILL to the whole group before replying: nothing the snippet started runs on
            self._kill_group(child)
            if status == "died":  # need its exit status to say why
                try:
                    _, wstatus = os.waitpid(child.pid, 0)
                except ChildProcessError:
                    wstatus = 0
                status, exit_note = _classify_death(wstatus)
            else:
                self._to_reap.append(child.pid)
            child.close_fds()
            if self.stateful:
                self.session = None
                state_reset = True
            self._kill_uid_leftovers(keep={child.pid})
        elapsed = (time.monotonic() - t0) * 1000.0
        text = out.decode("utf-8", errors="backslashreplace")
        if len(text) > max_output:
            text = text[:max_output]
            cut = True
        return {
            "id": req.get("id"),
            "status": status,
            "output": text,
            "cut": cut,
            "note": exit_note,
            "exec_ms": elapsed,
            "state_reset": state_reset,
        }

    def after(self) -> None:
        """Off the critical path: wipe scratch, reap, pre-fork the next spare."""
        if not self.stateful and self.spare is None and self.session is None:
            # every child left is SIGKILLed already: reap them all (zombies would still count
            # against the uid's process limit) before the next spare is forked
            deadline = time.monotonic() + 2.0
            for pid in self._to_reap:  # sleep until the snippet's process is gone (no polling)
                _wait_exit(pid, deadline)
            while time.monotonic() < deadline:  # then its leftovers, if any
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    time.sleep(0.0005)
            self._to_reap.clear()
        # children killed after their snippet are reaped without waiting for the kernel to tear
        # down their memory; those not gone yet are reaped on a later pass
        still = []
        for pid in self._to_reap:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if done == 0:
                still.append(pid)
        self._to_reap = still
        if not self.stateful:
            self._wipe_scratch()
            self._reap(keep=set())
            self._ensure_spare()
        else:
            self._reap(keep=set())

    def shutdown(self) -> None:
        for c in (self.spare, self.session):
            if c is not None:
                self._kill_group(c)
        for pid in self._to_reap:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self._kill_uid_leftovers(keep=set())
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # reap everything: no zombie outlives the worker
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.005)

    # ---- extension points: no-ops here (the child-side ones are on worker_child.Spawner). The
    # opt-in experiments worker_prefault.py and worker_profile.py (worker_options "prefault" /
    # "profile") override them and wrap a few methods (handle, after, _fork, _collect,
    # _ensure_spare, _wipe_scratch); main() mixes them in only when the config asks for them.
    def _prepare(self) -> dict:
        """Before the first spare is forked (objects frozen): extra fields of the ready frame."""
        return {}

    def _status_frame(self, st: dict) -> str:
        """In the worker: the status of a child's status frame."""
        return st["status"]

    def _idle_frame(self) -> dict:
        """The frame that tells the host this worker has a fresh spare again."""
        return {"op": "idle"}

    # ---- the request loop
    def serve(self) -> None:
        preloaded = self.cfg.get("_preloaded", [])
        # objects that exist now are never collected: children don't touch (copy) their pages
        gc.collect()
        gc.freeze()
        self.thp_bytes = _child.collapse_heap(self.libc) if self.cfg.get("thp", True) else 0
        extra = self._prepare()
        if not self.stateful:
            self._ensure_spare()
        write_frame(
            self.proto_out,
            {
                "op": "ready",
                "pid": os.getpid(),
                "uid": self.uid,
                "seccomp": self.filter is not None,
                "seccomp_error": self.filter_error,
                "preloaded": preloaded,
                "prelude_error": self.cfg.get("_prelude_error"),
                "thp_mb": self.thp_bytes >> 20,
                "raw_fork": self.raw_fork,
                **extra,
            },
        )
        while True:
            req = read_frame(self.proto_in)
            if req is None:
                break
            if req.get("op") == "run":
                try:
                    resp = self.handle(req)
                except Exception as e:  # noqa: BLE001 - never leave the host waiting
                    resp = {
                        "id": req.get("id"),
                        "status": "sandbox",
                        "output": "",
                        "cut": False,
                        "note": f"worker error: {type(e).__name__}: {e}",
                        "exec_ms": 0.0,
                        "state_reset": True,
                    }
                if self.host_gone:
                    break
                write_frame(self.proto_out, resp)
                self.after()
                # tells the host this worker has a fresh spare again (the pool routes new calls
                # to workers that are ready, so the fork stays off the critical path)
                write_frame(self.proto_out, self._idle_frame())
            elif req.get("op") == "ping":
                write_frame(self.proto_out, {"id": req.get("id"), "op": "pong"})
        self.shutdown()


def _wait_exit(pid: int, deadline: float) -> None:
    """Block until process ``pid`` has exited (is a zombie or gone), at most until ``deadline``."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return
    try:
        select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    except (OSError, InterruptedError):
        pass
    finally:
        os.close(fd)


def _classify_death(wstatus: int) -> tuple[str, str]:
    if os.WIFSIGNALED(wstatus):
        sig = os.WTERMSIG(wstatus)
        if sig == signal.SIGXCPU:
            return "timeout", "the snippet used up its CPU time limit"
        return "runtime", f"the snippet's process died with signal {signal.Signals(sig).name}"
    code = os.WEXITSTATUS(wstatus) if os.WIFEXITED(wstatus) else -1
    if code == _child.EXIT_SETUP_FAILED:
        return "sandbox", "the sandboxed process could not be set up"
    return "runtime", f"the snippet's process exited with code {code}"


def _pids_with_uid(uid: int) -> list[int]:
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{name}")
        except OSError:
            continue
        if st.st_uid == uid:
            out.append(int(name))
    return out


def main() -> None:
    cfg = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        os.environ.setdefault(k, "1")
    cfg["_preloaded"] = _snippet.preload(cfg.get("preload", ["math", "numpy", "sympy"]), warmup=cfg.get("warmup", True))
    cfg["_prelude_error"] = _snippet.prelude(cfg.get("prelude"))
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    cls = Worker
    # opt-in experiments (off by default; benchmarks/bench_sandbox.py compares them)
    if cfg.get("prefault", False):
        cls = type("Worker", (_sibling("worker_prefault").PrefaultMixin, cls), {})
    if cfg.get("profile", False):
        cls = type("Worker", (_sibling("worker_profile").ProfileMixin, cls), {})
    cls(cfg).serve()


if __name__ == "__main__":
    main()
