"""Opt-in instrumentation ``profile`` (``worker_options={"profile": True}``; off by default):
timestamps and page-fault counts of one call's critical path and of the worker's cleanup after it.

Added to the frames (nothing else changes):

- the reply: ``prof`` = {``recv_ns``, ``worker_flt0``, ``sent_ns`` (code written to the child),
  ``status_ns`` (its status frame read), ``reply_ns``, ``a_forked`` (the last fork), and the
  child's ``child_armed_flt`` (its minor faults when it started waiting for code),
  ``child_got_ns``, ``child_done_ns``, ``child_run_flt`` (faults while the snippet ran),
  ``stamps`` ([name, ns, faults] at fork, armed and, with ``prefault``, prefault done)};
- the idle frame: ``prof`` = {``after_ms`` and its parts ``reap_ms`` / ``wipe_ms`` / ``fork_ms`` /
  ``arm_ms``, ``worker_flt``, ``self_cpu_s``, ``children_cpu_s``, ``children_flt``}.

``*_ns`` are ``time.perf_counter_ns()`` (one clock for worker and child). Used by
``tests/tools/test_sandbox_perf.py`` (page faults of a prefaulted snippet).

Part of the sandbox worker: ``worker.py`` loads this file by path, only when the config asks for
it, and mixes ``ProfileMixin`` into its ``Worker`` (outermost). It only reads clocks and rusage.
"""

from __future__ import annotations

import resource
import time

_ns = time.perf_counter_ns


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class ProfileMixin:
    def __init__(self, cfg: dict) -> None:
        super().__init__(cfg)
        self.prof: dict = {}
        self._idle_prof: dict = {}
        self._stamps: list = []
        self._p_armed: tuple[int, int] | None = None  # set in the child only
        self._p_got = (0, 0)

    # ---- worker side
    def handle(self, req: dict) -> dict:
        self.prof = {"recv_ns": _ns(), "worker_flt0": _minflt()}
        resp = super().handle(req)
        self.prof["reply_ns"] = _ns()
        resp["prof"] = self.prof
        return resp

    def _collect(self, child, timeout: float, max_output: int):
        self.prof["sent_ns"] = _ns()
        return super()._collect(child, timeout, max_output)

    def _status_frame(self, st: dict) -> str:
        status = super()._status_frame(st)
        self.prof.update(st.get("prof", {}), status_ns=_ns())
        return status

    def _fork(self) -> int:
        self._stamps = [("fork", _ns(), 0)]  # the child inherits this list and adds to it
        pid = super()._fork()
        if pid:
            self.prof["a_forked"] = _ns()
        return pid

    def _wipe_scratch(self) -> None:
        self.prof["a_reaped"] = _ns()
        super()._wipe_scratch()
        self.prof["a_wiped"] = _ns()

    def after(self) -> None:
        a0 = _ns()
        super().after()
        a1 = _ns()
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        me = resource.getrusage(resource.RUSAGE_SELF)
        pr = self.prof
        reaped, wiped, forked = (pr.get(k, a1) for k in ("a_reaped", "a_wiped", "a_forked"))
        self._idle_prof = {
            "after_ms": (a1 - a0) / 1e6,
            "reap_ms": (reaped - a0) / 1e6,
            "wipe_ms": (wiped - reaped) / 1e6,
            "fork_ms": (forked - wiped) / 1e6,
            "arm_ms": (a1 - forked) / 1e6,
            "worker_flt": me.ru_minflt - pr.get("worker_flt0", 0),
            "self_cpu_s": me.ru_utime + me.ru_stime,
            "children_cpu_s": ru.ru_utime + ru.ru_stime,
            "children_flt": ru.ru_minflt,
        }

    def _idle_frame(self) -> dict:
        frame = super()._idle_frame()
        frame["prof"] = self._idle_prof
        return frame

    # ---- child side (after the child is armed)
    def _child_idle(self) -> None:
        self._stamps.append(("armed", _ns(), _minflt()))
        super()._child_idle()
        if getattr(self, "prefault_now", None):  # worker_prefault.PrefaultMixin copied pages
            self._stamps.append(("prefault", _ns(), _minflt()))

    def _next_request(self) -> dict | None:
        if self._p_armed is None:
            self._p_armed = (_ns(), _minflt())
        req = super()._next_request()
        self._p_got = (_ns(), _minflt())
        return req

    def _child_status(self, status: str) -> dict:
        frame = super()._child_status(status)
        t, f = _ns(), _minflt()
        frame["prof"] = {
            "child_armed_flt": self._p_armed[1],
            "child_got_ns": self._p_got[0],
            "child_done_ns": t,
            "child_run_flt": f - self._p_got[1],
            "stamps": self._stamps,
        }
        return frame
