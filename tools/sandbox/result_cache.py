"""The python tool's result cache: a stateless snippet whose output is a function of its code
alone is answered from an LRU of earlier results, and identical snippets called while one of them
runs share that run (:class:`tools.sandbox.tool.PythonTool`'s ``cache`` / ``cache_size``)."""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import Awaitable, Callable

from tools.base import ErrorKind, ToolResult

Key = tuple[str, float, int]  # (code, time limit, max output chars)

# snippets whose output is not a function of the code alone are never served from the cache (nor share
# a concurrent run): randomness (random, numpy.random, sympy's randprime / randMatrix / randint: any name
# starting with "rand"), time and dates, ids and hashes (``id()``, ``hash()``: addresses and per-process
# string hashing), uninitialised memory (``np.empty``), sets (their order of strings follows the
# process's hash seed), the process, its environment, files, threads. A list can never be complete:
# a snippet that reads nondeterminism another way (say ``object.__repr__`` of an address) is cached;
# the cache is an LRU of ``cache_size`` entries, and ``cache=False`` turns it off.
_NONDETERMINISTIC = re.compile(
    r"\brand|random|shuffle|time|today|now\s*\(|uuid|urandom|secrets|getpid|gethostname|platform|"
    r"\bid\s*\(|\bhash\s*\(|\bempty(_like)?\s*\(|\b(frozen)?set\b|\{[^{}:\n]*,[^{}:\n]*\}|"
    r"input\s*\(|environ|listdir|scandir|glob|open\s*\(|thread|multiprocessing|concurrent"
)


def cacheable(code: str) -> bool:
    """Whether ``code`` may be answered from the cache (nothing in it reads nondeterminism we know of)."""
    return not _NONDETERMINISTIC.search(code)


class _Flight:
    """A cacheable snippet's run in progress and the calls waiting on it. A waiter that is
    cancelled leaves the run to the others; the last one to leave stops it (as the snippet of a
    cancelled call was always stopped), and the run is then *abandoned*: no call joins it."""

    def __init__(self, task: asyncio.Task[ToolResult]) -> None:
        self.task = task
        self.waiters = 0
        self.abandoned = False
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())  # never "unretrieved"

    async def wait(self) -> ToolResult | None:
        """The run's result; None if the run was stopped while this call was not (it is then the
        call's to run the snippet itself)."""
        self.waiters += 1
        try:
            return await asyncio.shield(self.task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and not me.cancelling():  # the run was stopped, not this call
                return None
            if self.waiters == 1 and not self.task.done():
                self.abandoned = True
                self.task.cancel()
            raise
        finally:
            self.waiters -= 1


class ResultCache:
    """An LRU of ``size`` results of cacheable snippets, and the runs of them in progress."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._results: collections.OrderedDict[Key, ToolResult] = collections.OrderedDict()
        self._inflight: dict[Key, _Flight] = {}

    def __len__(self) -> int:
        return len(self._results)

    def clear(self) -> None:
        """Forget the cached results (a run in progress still answers its waiters)."""
        self._results.clear()

    async def lookup(self, key: Key) -> ToolResult | None:
        """The cached result of ``key``, or that of the same snippet's run in progress (waited for);
        None when there is neither, or that run failed in the sandbox or was stopped under this call."""
        hit = self._results.get(key)
        if hit is not None:
            self._results.move_to_end(key)
            return hit
        flight = self._inflight.get(key)
        if flight is not None and not flight.abandoned:  # the same snippet runs now: share it
            shared = await flight.wait()
            # an infrastructure failure is not shared, nor a run stopped under this call
            if shared is not None and shared.error != ErrorKind.SANDBOX:
                return shared
        return None

    async def run(self, key: Key, run: Callable[[], Awaitable[ToolResult]]) -> ToolResult | None:
        """Run ``run()`` as the run of ``key`` that identical calls can join; its result, or None if
        it was stopped while this call was not."""
        flight = self._inflight[key] = _Flight(asyncio.ensure_future(self._run(key, run)))
        return await flight.wait()

    async def _run(self, key: Key, run: Callable[[], Awaitable[ToolResult]]) -> ToolResult:
        """One run of a cacheable snippet, shared by the identical calls made while it runs (a
        group's samples often call with the same code at once: 37 of 83 calculator calls in a
        bench_peers run, 2026-12-06); its result enters the cache unless it timed out or failed
        in the sandbox (both may be the load's doing, not the code's). A timeout is shared with
        the calls that waited on this run (the same code under the same limit, at the same time);
        a sandbox failure is not: each of those calls runs the snippet itself."""
        try:
            result = await run()
        finally:
            flight = self._inflight.get(key)
            if flight is not None and flight.task is asyncio.current_task():
                del self._inflight[key]
        if result.error not in (ErrorKind.TIMEOUT, ErrorKind.SANDBOX):
            self._results[key] = result
            if len(self._results) > self.size:
                self._results.popitem(last=False)
        return result
