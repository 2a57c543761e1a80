"""The ``python`` tool: runs model-written Python in a pool of hardened sandbox workers."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
import weakref
from dataclasses import dataclass
from typing import Any

from tools.base import ErrorKind, Tool, ToolError, ToolResult
from tools.sandbox.backends import Backend, DockerBackend, make_backend
from tools.sandbox.host_worker import RunReply, WorkerDied, WorkerProcess
from tools.sandbox.pool import WorkerPool
from tools.sandbox.result_cache import ResultCache, cacheable

log = logging.getLogger(__name__)

# performance switches of the sandbox worker (benchmarks/bench_sandbox.py compares them): raw_fork
# and thp in tools/sandbox/worker_child.py; the opt-in prefault and profile are the separate
# modules worker_prefault.py and worker_profile.py, which the worker loads only when asked
WORKER_OPTIONS = {
    "raw_fork": "fork with libc's fork(), skipping CPython's at-fork hooks",
    "thp": "back the worker's heap with transparent huge pages (cheaper fork/exit)",
    "prefault": "off by default: idle spares pre-copy the pages sympy/numpy "
    "snippets write when recent snippets used them (learned at worker "
    "start; trades CPU for latency)",
    "profile": "per-call timings and page-fault counts in the worker's replies",
}

_STATUS_TO_ERROR = {
    "ok": None,
    "syntax": ErrorKind.SYNTAX,
    "runtime": ErrorKind.RUNTIME,
    "memory": ErrorKind.MEMORY,
    "timeout": ErrorKind.TIMEOUT,
    "output_cut": ErrorKind.OUTPUT_CUT,
    "sandbox": ErrorKind.SANDBOX,
}


@dataclass
class SandboxStats:
    calls: int = 0
    cache_hits: int = 0
    cache_lookups: int = 0
    respawns: int = 0
    retried: int = 0  # stateless snippets re-run on a fresh worker after an outside worker death
    sessions_lost: int = 0

    @property
    def cache_hit_rate(self) -> float:
        return self.cache_hits / self.cache_lookups if self.cache_lookups else 0.0


class PythonTool(Tool):
    """Run Python code in a sandbox and return what it prints.

    Config (keywords): ``timeout`` (s per snippet, wall clock, from the moment a worker runs it: an
    episode's ``tool_timeout`` lowers it, waiting for a free worker does not count), ``queue_timeout``
    (s a call may wait for a free worker, default 300: then a ``sandbox_error``), ``workers`` (pool size),
    ``backend`` ("auto" = bubblewrap, the system's or the bundled one, else a ToolError saying
    why | "bwrap" | "docker" | "unisolated": no isolation, an explicit opt-in; or a Backend instance),
    ``stateful`` (keep globals across the calls of one ``session_id``), ``memory_mb`` (address
    space budget of a snippet on top of the preloaded interpreter), ``max_output_chars``,
    ``cache`` / ``cache_size`` (identical stateless snippets), ``fsize_mb`` (largest file a snippet
    may write), ``nofile``, ``nproc`` (processes per worker uid), ``tmp_size_mb`` (scratch tmpfs),
    ``max_code_chars``, ``max_sessions``, ``preload`` (modules imported once per worker),
    ``prelude`` (the host's own trusted code run once in each worker after ``preload``, before any
    snippet: what it defines, e.g. modules in ``sys.modules``, every snippet's child starts with;
    if it raises, the tool's start fails with its error),
    ``seccomp``, ``recycle_after`` (restart a worker after N snippets; docker default 500),
    ``image`` (docker image), ``debug`` (worker stderr to the trainer's stderr),
    ``worker_options`` (performance switches of the fork server; none changes what a snippet may
    do: ``raw_fork`` and ``thp`` default on, ``prefault`` off; ``profile`` adds per-call timings
    to the worker's replies; see docs/tools.md, "Python sandbox: the fast path").

    Output: stdout and stderr interleaved as a terminal shows them; a traceback keeps only the
    snippet's own frames; when the last statement is a bare expression its ``repr`` is printed
    (REPL style) unless it is None.
    """

    name = "python"
    bounds_itself = True  # the worker kills a snippet at its limit; waiting for a worker is not its time
    description = (
        "Execute Python 3 code in a sandbox and return its printed output (stdout and "
        "stderr). The value of a final bare expression is printed too. math, numpy "
        "and sympy are available. No network, no persistent files."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python code to run."}},
        "required": ["code"],
    }

    def __init__(
        self,
        *,
        timeout: float = 5.0,
        queue_timeout: float = 300.0,
        workers: int = 4,
        backend: str | Backend = "auto",
        stateful: bool = False,
        memory_mb: int = 1024,
        max_output_chars: int = 8192,
        cache: bool = True,
        cache_size: int = 1024,
        fsize_mb: int = 16,
        nofile: int = 64,
        nproc: int = 32,
        tmp_size_mb: int = 64,
        max_code_chars: int = 100_000,
        max_sessions: int = 64,
        preload: tuple[str, ...] | list[str] = ("math", "numpy", "sympy"),
        prelude: str | None = None,
        seccomp: bool = True,
        recycle_after: int | None = None,
        image: str | None = None,
        debug: bool = False,
        worker_options: dict[str, bool] | None = None,
    ) -> None:
        def positive(name: str, v: Any, kind: type = int) -> None:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            if not ok or (kind is int and not float(v).is_integer()) or not math.isfinite(v):
                raise ToolError(f"PythonTool: {name} must be a positive {kind.__name__}, got {v!r}")

        positive("timeout", timeout, float)
        positive("queue_timeout", queue_timeout, float)
        for n, v in (
            ("workers", workers),
            ("memory_mb", memory_mb),
            ("max_output_chars", max_output_chars),
            ("cache_size", cache_size),
            ("fsize_mb", fsize_mb),
            ("nofile", nofile),
            ("nproc", nproc),
            ("tmp_size_mb", tmp_size_mb),
            ("max_code_chars", max_code_chars),
            ("max_sessions", max_sessions),
        ):
            positive(n, v)
        if recycle_after is not None:
            positive("recycle_after", recycle_after)
        if nofile < 16:
            raise ToolError("PythonTool: nofile must be at least 16 (Python needs a few fds)")
        self.timeout = float(timeout)
        self.capacity_wait_s = float(queue_timeout)
        self.stateful = bool(stateful)
        self.max_output_chars = int(max_output_chars)
        self.max_code_chars = int(max_code_chars)
        self.max_sessions = int(max_sessions)
        self.use_cache = bool(cache)
        self.cache_size = int(cache_size)
        kwargs: dict[str, Any] = {}
        if backend == "docker" and image is not None:
            kwargs["image"] = image
        if backend in ("auto", "bwrap"):
            kwargs["tmp_size_mb"] = int(tmp_size_mb)
        self.backend: Backend = make_backend(backend, **kwargs)
        if isinstance(self.backend, DockerBackend) and recycle_after is None:
            recycle_after = 500
        self.recycle_after = recycle_after
        self.worker_cfg: dict[str, Any] = {
            "memory_mb": int(memory_mb),
            "fsize_mb": int(fsize_mb),
            "nofile": int(nofile),
            "nproc": int(nproc),
            "preload": list(preload),
            "seccomp": bool(seccomp),
        }
        if prelude is not None:
            if not isinstance(prelude, str):
                raise ToolError(f"PythonTool: prelude must be Python source (a str), got {type(prelude).__name__}")
            self.worker_cfg["prelude"] = prelude
        for k, v in (worker_options or {}).items():
            if k not in WORKER_OPTIONS or not isinstance(v, bool):
                raise ToolError(
                    f"PythonTool: worker_options takes booleans for {sorted(WORKER_OPTIONS)}, got {k}={v!r}"
                )
            self.worker_cfg[k] = v
        self.debug = debug
        self.pool = WorkerPool(
            self.backend, dict(self.worker_cfg, stateful=False), int(workers), recycle_after=recycle_after, debug=debug
        )
        self._sessions: dict[str, WorkerProcess] = {}
        self._session_locks: dict[str, asyncio.Lock] = {}
        self._cache = ResultCache(self.cache_size)
        self.stats = SandboxStats()
        self.errors_by_kind: collections.Counter[str] = collections.Counter()
        self._finalizer = weakref.finalize(self, _kill_everything, self.pool, self._sessions)

    # ------------------------------------------------------------------ lifecycle
    @property
    def isolation(self) -> str:
        """A sentence naming the isolation level in use."""
        return self.backend.level

    async def start(self) -> None:
        """Start the worker pool now (otherwise the first call does it)."""
        await self.pool.start()

    async def release(self, session_id: str) -> None:
        w = self._sessions.pop(session_id, None)
        self._session_locks.pop(session_id, None)
        if w is not None:
            if w.loop is asyncio.get_running_loop():
                await w.close(grace=1.0)
            else:  # started under another event loop
                w.kill_sync()

    async def close(self) -> None:
        if self.pool.loop is not None and self.pool.loop is not asyncio.get_running_loop():
            # started under another (maybe closed) event loop: its transports can't be awaited
            _kill_everything(self.pool, self._sessions)
            self._session_locks.clear()
            return
        for sid in list(self._sessions):
            await self.release(sid)
        await self.pool.close()

    def clear_cache(self) -> None:
        """Forget cached results (call it between training steps)."""
        self._cache.clear()

    def cache_stats(self) -> dict[str, float]:
        return {
            "hits": self.stats.cache_hits,
            "lookups": self.stats.cache_lookups,
            "hit_rate": self.stats.cache_hit_rate,
            "size": len(self._cache),
        }

    # ------------------------------------------------------------------ calls
    def _bad_args(self, args: Any) -> str | None:
        if not isinstance(args, dict):
            return f"arguments must be an object like {{\"code\": \"print(1)\"}}, got {type(args).__name__}"
        extra = sorted(set(args) - {"code"})
        if "code" not in args:
            return "missing required argument 'code' (the Python source to run)"
        if extra:
            return f"unexpected argument(s) {extra}: the python tool takes only 'code'"
        if not isinstance(args["code"], str):
            return f"argument 'code' must be a string, got {type(args['code']).__name__}"
        if len(args["code"]) > self.max_code_chars:
            return f"argument 'code' is {len(args['code'])} characters long; the limit is {self.max_code_chars}"
        return None

    async def call(self, args: dict[str, Any], *, session_id: str | None = None) -> ToolResult:
        return await self.call_bounded(args, session_id=session_id)

    async def call_bounded(
        self, args: dict[str, Any], *, session_id: str | None = None, timeout: float | None = None
    ) -> ToolResult:
        """The snippet runs for at most ``min(self.timeout, timeout)`` once a worker has it."""
        limit = self.timeout if timeout is None else min(self.timeout, float(timeout))
        t0 = time.perf_counter()
        self.stats.calls += 1
        problem = self._bad_args(args)
        if problem is not None:
            return self._count(
                ToolResult(
                    text=f"Error: {problem}",
                    ok=False,
                    error=ErrorKind.BAD_ARGUMENTS,
                    metrics={"latency_ms": 0.0, "cache_hit": 0.0},
                )
            )
        code: str = args["code"]
        if self.stateful and session_id is not None:
            result = await self._call_session(session_id, code, limit)
        else:
            key = (code, limit, self.max_output_chars)
            if self.use_cache and cacheable(code):
                self.stats.cache_lookups += 1
                hit = await self._cache.lookup(key)
                if hit is not None:
                    self.stats.cache_hits += 1
                    metrics = dict(hit.metrics, cache_hit=1.0, latency_ms=(time.perf_counter() - t0) * 1000.0)
                    return self._count(ToolResult(hit.text, hit.ok, hit.error, metrics))
                ran = await self._cache.run(key, lambda: self._call_pool(code, limit))
                if ran is None:  # this call's own run was stopped from outside (the pool closing)
                    ran = _sandbox_error("the run was stopped")
                result = dataclasses.replace(ran, metrics=dict(ran.metrics))  # the cached one stays as it was
            else:
                result = await self._call_pool(code, limit)
        result.metrics["latency_ms"] = (time.perf_counter() - t0) * 1000.0
        result.metrics.setdefault("cache_hit", 0.0)
        return self._count(result)

    def _count(self, r: ToolResult) -> ToolResult:
        if r.error is not None:
            self.errors_by_kind[r.error] += 1
        return r

    async def _call_pool(self, code: str, limit: float) -> ToolResult:
        """Run on an idle worker. If that worker dies during the call from an outside cause (the
        snippet's own crash, timeout or limit is answered by the worker and never lands here),
        the snippet is run once more on a fresh worker, so the model never reads an
        infrastructure failure it did not cause."""
        for attempt in (1, 2):
            try:
                w = await self.pool.acquire()
            except WorkerDied as e:
                return _sandbox_error(str(e))
            try:
                reply = await w.run(code, limit, self.max_output_chars)
            except WorkerDied as e:
                self.stats.respawns += 1
                if attempt == 1 and not e.hung and not self.pool.closed:
                    log.warning("python sandbox: %s; running the snippet again on a fresh worker", e)
                    self.stats.retried += 1
                    continue
                return _sandbox_error(str(e))
            finally:
                self.pool.release(w)
            result = self._to_result(reply, limit)
            if attempt == 2:
                result.metrics["infra_retries"] = 1.0
            return result
        raise AssertionError("unreachable")

    async def _call_session(self, session_id: str, code: str, limit: float) -> ToolResult:
        lock = self._session_locks.setdefault(session_id, asyncio.Lock())
        async with lock:
            w = self._sessions.get(session_id)
            restarted = False
            if w is not None and w.loop is not asyncio.get_running_loop():
                w.kill_sync()  # started under another event loop: unusable here
                del self._sessions[session_id]
                w, restarted = None, True
            if w is not None and not w.alive and not w.needs_recycle:
                # killed from outside while idle (OOM killer, operator): its state is gone
                await w.close(grace=0.5)
                del self._sessions[session_id]
                return self._session_lost(f"{w.name} was killed while idle")
            if w is None or not w.alive or w.needs_recycle:
                if w is not None:
                    restarted = True
                    await w.close(grace=0.5)
                elif not restarted and len(self._sessions) >= self.max_sessions:
                    return _sandbox_error(f"too many open python sessions ({self.max_sessions}); release finished ones")
                w = WorkerProcess(
                    self.backend,
                    dict(self.worker_cfg, stateful=True),
                    recycle_after=self.recycle_after,
                    debug=self.debug,
                )
                self._sessions[session_id] = w
                try:
                    await w.start()
                except WorkerDied as e:
                    self._sessions.pop(session_id, None)
                    return _sandbox_error(str(e))
            try:
                reply = await w.run(code, limit, self.max_output_chars)
            except WorkerDied as e:
                self.stats.respawns += 1
                self._sessions.pop(session_id, None)
                if e.hung:
                    return _sandbox_error(str(e) + "; the session's Python state was lost")
                return self._session_lost(str(e))
            if restarted:
                reply.state_reset = True
            return self._to_result(reply, limit)

    def _session_lost(self, why: str) -> ToolResult:
        self.stats.sessions_lost += 1
        log.warning("python sandbox: session lost (%s)", why)
        return ToolResult(
            text="Error: the Python session was lost: its sandbox process was stopped from outside "
            "(not by your code). Variables from earlier calls are gone; the next call starts a "
            "fresh session.",
            ok=False,
            error=ErrorKind.SESSION_LOST,
            metrics={"cache_hit": 0.0},
        )

    def _to_result(self, reply: RunReply, limit: float) -> ToolResult:
        text = reply.output
        error = _STATUS_TO_ERROR.get(reply.status, ErrorKind.SANDBOX)
        ok = reply.status == "ok"
        if reply.status == "output_cut" or reply.cut:
            text = text[: self.max_output_chars]
            if not text.endswith("\n"):
                text += "\n"
            text += f"[output truncated: the snippet printed more than {self.max_output_chars} characters]"
            if reply.status in ("ok", "output_cut"):
                ok, error = True, ErrorKind.OUTPUT_CUT
        if reply.status == "timeout":
            text += _sep(text) + (f"TimeoutError: the snippet ran longer than {limit:g} s and was killed")
        if reply.note and reply.status != "timeout":
            text += _sep(text) + f"[{reply.note}]"
        elif reply.note:
            text += f" ({reply.note})"
        if reply.state_reset and self.stateful:
            text += _sep(text) + ("[the Python session was restarted: variables from earlier calls are gone]")
        return ToolResult(text=text, ok=ok, error=error, metrics={"exec_ms": reply.exec_ms})


def _sep(text: str) -> str:
    return "" if not text or text.endswith("\n") else "\n"


def _sandbox_error(why: str) -> ToolResult:
    return ToolResult(
        text=f"SandboxError: the code could not be run to completion ({why}). Retrying may work.",
        ok=False,
        error=ErrorKind.SANDBOX,
        metrics={"cache_hit": 0.0},
    )


def _kill_everything(pool: WorkerPool, sessions: dict[str, WorkerProcess]) -> None:
    """Finalizer: a PythonTool dropped without close() still leaves no process behind."""
    pool.close_sync()
    for w in list(sessions.values()):
        w.kill_sync()
    sessions.clear()
