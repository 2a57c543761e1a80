"""Host side of the sandbox: a pool of interchangeable worker processes (asyncio).

:class:`WorkerPool` starts ``size`` workers (:class:`tools.sandbox.host_worker.WorkerProcess`)
once, shared by every caller (a caller that gives up does not cancel the start for the others),
hands out an idle one per call and takes it back. A worker that died while idle is replaced
before it is handed out; one that died during a call, or is due for recycling, is replaced in the
background. :meth:`WorkerPool.close` stops everything, and the pool can be started again (also
from a new event loop, whose workers replace the old loop's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from tools.sandbox.backends import Backend
from tools.sandbox.host_worker import WorkerDied, WorkerProcess

log = logging.getLogger(__name__)


class WorkerPool:
    """``size`` interchangeable stateless workers; a call takes an idle one.

    A worker that dies is respawned in the background; the call that was in flight gets an
    error from :meth:`WorkerProcess.run`, the next caller waits for the replacement.
    """

    def __init__(
        self, backend: Backend, cfg: dict[str, Any], size: int, *, recycle_after: int | None = None, debug: bool = False
    ) -> None:
        self.backend = backend
        self.cfg = cfg
        self.size = size
        self.recycle_after = recycle_after
        self.debug = debug
        self.workers: list[WorkerProcess] = []
        self._idle: asyncio.Queue[WorkerProcess] | None = None
        self._respawns: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.respawned = 0
        # the one start in flight, shared by every caller: a caller that gives up (its tool-call timeout,
        # a cancelled episode) must not cancel the start for the others, or under load each new caller
        # would begin a start that the next timeout cancels again, and the pool would never come up
        self._start_task: asyncio.Task | None = None
        self.closed = False  # close() was called: no call may start workers again until start()

    def _new_worker(self) -> WorkerProcess:
        return WorkerProcess(self.backend, self.cfg, recycle_after=self.recycle_after, debug=self.debug)

    async def start(self) -> None:
        self.closed = False
        loop = asyncio.get_running_loop()
        if self.loop is loop and self._idle is not None:
            return
        if self.loop is not None and self.loop is not loop:
            # used from a new event loop (e.g. a second asyncio.run): the old processes belong to
            # the old loop's transports, so replace them
            self.close_sync()
            self._start_task = None
        task = self._start_task
        if task is None or self.loop is not loop or task.done():  # none yet, or the last one failed
            self.loop = loop
            task = self._start_task = loop.create_task(self._start_workers())
        # shielded: cancelling this caller leaves the start running for the others
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and not (current is not None and current.cancelling()):
                raise WorkerDied("the sandbox was closed while it started") from None  # by close()
            raise

    async def _start_workers(self) -> None:
        if self._idle is not None:
            return
        t0 = time.perf_counter()
        workers = [self._new_worker() for _ in range(self.size)]
        try:
            results = await asyncio.gather(*(w.start() for w in workers), return_exceptions=True)
        except asyncio.CancelledError:  # close() during the start: stop what was launched
            for w in workers:
                await w.kill()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for w in workers:
                await w.kill()
            raise errors[0]
        if self.closed:  # closed while starting
            for w in workers:
                await w.close(grace=0.5)
            raise WorkerDied("the sandbox was closed")
        self.workers = workers
        idle: asyncio.Queue[WorkerProcess] = asyncio.Queue()
        for w in workers:
            idle.put_nowait(w)
        self._idle = idle
        log.info(
            "python sandbox: %d %s workers ready in %.2fs (%s)",
            self.size,
            self.backend.name,
            time.perf_counter() - t0,
            self.backend.level,
        )

    async def acquire(self) -> WorkerProcess:
        """An idle, running worker. One that died while idle (OOM killer, an operator's kill) is
        replaced before it is handed out; WorkerDied only if no replacement can start (or the
        pool was closed)."""
        if self.closed:
            raise WorkerDied("the sandbox was closed")
        await self.start()
        assert self._idle is not None
        w = await self._idle.get()
        if w.alive:
            return w
        log.warning("python sandbox: %s died while idle; replacing it", w.name)
        new = await self._respawn(w)
        if self.closed or self._idle is None:  # closed while the replacement started
            if new is not None:
                await new.close(grace=0.5)
            raise WorkerDied("the sandbox was closed")
        if new is None:
            self._idle.put_nowait(w)  # the next caller tries again
            raise WorkerDied(f"{w.name} died and no replacement could be started")
        return new

    def release(self, w: WorkerProcess) -> None:
        """Give a worker back; a dead (or due for recycling) one is replaced in the background."""
        if self.closed or self._idle is None:
            return  # close() stops every worker it holds; nothing is queued or respawned any more
        loop = asyncio.get_running_loop()
        if w.alive and not w.needs_recycle:
            if not w._pending_idle:
                self._idle.put_nowait(w)
                return
            task = loop.create_task(self._requeue_when_idle(w))
        else:
            task = loop.create_task(self._replace(w))
        self._respawns.add(task)
        task.add_done_callback(self._respawns.discard)

    async def _requeue_when_idle(self, w: WorkerProcess) -> None:
        try:
            await w.wait_idle()
        except WorkerDied:
            await self._replace(w)
            return
        assert self._idle is not None
        self._idle.put_nowait(w)

    async def _respawn(self, old: WorkerProcess) -> WorkerProcess | None:
        """Stop ``old`` and start its replacement (3 attempts); the new worker, not queued."""
        await old.close(grace=1.0)
        delay = 0.1
        for attempt in range(3):
            cand = self._new_worker()
            try:
                await cand.start()
            except WorkerDied as e:
                log.error("python sandbox: respawn failed (%s); attempt %d/3", e, attempt + 1)
                await asyncio.sleep(delay)
                delay *= 4
                continue
            self.respawned += 1
            self.workers = [cand if w is old else w for w in self.workers]
            return cand
        return None

    async def _replace(self, old: WorkerProcess) -> None:
        if self.closed:
            await old.close(grace=0.5)
            return
        new = await self._respawn(old)
        if self._idle is None:  # closed meanwhile
            if new is not None:
                await new.close(grace=0.5)
            return
        # no replacement: give the dead worker back; the next acquire tries again (never hangs)
        self._idle.put_nowait(new if new is not None else old)

    async def close(self) -> None:
        self.closed = True
        start, self._start_task = self._start_task, None
        if start is not None and not start.done() and start.get_loop() is asyncio.get_running_loop():
            start.cancel()
            try:
                await start
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        for t in list(self._respawns):
            t.cancel()
        for t in list(self._respawns):
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        await asyncio.gather(*(w.close() for w in self.workers), return_exceptions=True)
        self.workers = []
        self._idle = None
        self.loop = None

    def close_sync(self) -> None:
        self._start_task = None
        for w in self.workers:
            w.kill_sync()
        self.workers = []
        self._idle = None
