"""Opt-in experiment ``prefault`` (``worker_options={"prefault": True}``; off by default): idle
spares copy in advance the worker pages that sympy / numpy snippets write.

Measured (docs/results.md, "Python sandbox latency and throughput"): it cuts a sympy snippet's page
faults by ~60 % but costs CPU per call and did not lower p50 under load, hence off by default.
``benchmarks/bench_sandbox.py --variants default,prefault`` compares it; the test is
``tests/tools/test_sandbox_perf.py``.

Part of the sandbox worker: ``worker.py`` loads this file by path, only when the config asks for
it, and mixes ``PrefaultMixin`` into its ``Worker``. It only reads the worker's memory layout and
pre-copies pages: the calibration runs trusted snippets (below) in throw-away forks before any user
code, and the pre-copying runs in a spare that is already armed (rlimits, uid, seccomp).
"""

from __future__ import annotations

import array
import ctypes
import os
import select
import signal
import time

_PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_POPULATE_WRITE = 23
_PM_PRESENT = 1 << 63
_PM_EXCLUSIVE = 1 << 56
PREFAULT_EWMA = 0.2
PREFAULT_THRESHOLD = 0.5
_CALIBRATION = {
    # typical sympy use, deliberately different from the benchmark's snippet
    "sympy": [
        "import sympy as sp\na, b = sp.symbols('a b')\nstr(sp.expand((a + b)**5))",
        "import sympy as sp\nx = sp.Symbol('x')\nstr(sp.solve(x**2 - 5*x + 6, x))",
        "import sympy as sp\nx = sp.symbols('x')\nstr(sp.integrate(x**2 * sp.sin(x), x))",
        "from sympy import Rational, sqrt, simplify\nstr(simplify(Rational(3, 4) + sqrt(12)))",
        "import sympy\nn = sympy.Symbol('n', integer=True)\n"
        "str((sympy.summation(n**2, (n, 1, 10)), sympy.factorint(2024)))",
    ],
    "numpy": [
        "import numpy as np\na = np.array([[2.0, 1.0], [1.0, 3.0]])\n"
        "str((np.linalg.inv(a), np.linalg.eigvals(a), a @ a))",
        "import numpy as np\nv = np.linspace(0, 1, 11)\nstr((v.sum(), v.mean(), np.cumsum(v)[-1]))",
        "import numpy as np\nm = np.arange(9.0).reshape(3, 3)\n"
        "str((np.linalg.det(m + np.eye(3)), m.T.max(), np.round(m / 7, 3)))",
    ],
}


def _anon_regions() -> list[tuple[int, int]]:
    """(start, end) of the private writable anonymous mappings (heap included)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if parts[1][:2] != "rw" or (len(parts) > 5 and parts[5] != "[heap]"):
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    except OSError:
        pass
    return out


def _populate_write_works(libc: ctypes.CDLL) -> bool:
    """Whether madvise(MADV_POPULATE_WRITE) (Linux >= 5.14) is available."""
    import mmap

    m = mmap.mmap(-1, _PAGE)
    try:
        buf = (ctypes.c_char * _PAGE).from_buffer(m)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        ok = madvise(ctypes.addressof(buf), _PAGE, MADV_POPULATE_WRITE) == 0
        del buf
        return ok
    finally:
        m.close()


class PrefaultMixin:
    """Learns, at worker start, the pages each preloaded library's snippets write (``_calibrate``);
    tracks how often recent snippets used each library; an armed spare forked while most recent
    snippets used it pre-copies those pages until its code arrives."""

    def __init__(self, cfg: dict) -> None:
        super().__init__(cfg)
        # per library, the page ranges its snippets write, and how often recent snippets used it
        self.hot_ranges: dict[str, list[tuple[int, int]]] = {}
        self.family_rate: dict[str, float] = {}
        self.prefault_now: list[tuple[int, int]] = []
        self._madvise = self.libc.madvise
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._madvise.restype = ctypes.c_int
        self._req_poll = select.poll()  # used only in children, where fd 3 is the request pipe
        self._req_poll.register(3, select.POLLIN | select.POLLHUP)

    def _prepare(self) -> dict:
        info = super()._prepare()
        if not self.stateful:
            for fam, snippets in _CALIBRATION.items():
                if fam in self.cfg.get("_preloaded", []):
                    ranges = self._calibrate(snippets)
                    if ranges:
                        self.hot_ranges[fam] = ranges
                        self.family_rate[fam] = 0.0
        info["hot_pages"] = {f: sum(n for _, n in r) // _PAGE for f, r in self.hot_ranges.items()}
        return info

    def handle(self, req: dict) -> dict:
        for fam, rate in self.family_rate.items():
            used = 1.0 if fam in req["code"] else 0.0
            self.family_rate[fam] = rate + PREFAULT_EWMA * (used - rate)
        return super().handle(req)

    def _ensure_spare(self):
        # the next spare pre-copies the pages sympy (numpy) code writes when most recent snippets
        # used sympy (numpy)
        self.prefault_now = [
            r for fam, rate in self.family_rate.items() if rate >= PREFAULT_THRESHOLD for r in self.hot_ranges[fam]
        ]
        return super()._ensure_spare()

    def _child_idle(self) -> None:
        super()._child_idle()
        if self.prefault_now:
            # Use the idle time before the code arrives to copy the pages sympy/numpy code writes
            # (see _calibrate). Interrupted as soon as the request is readable: when the pool is
            # saturated the spare is used at once and spends (almost) no CPU on this.
            madvise, poll, ranges = self._madvise, self._req_poll.poll, self.prefault_now
            for i in range(len(ranges)):
                if not i & 15 and poll(0):
                    break
                madvise(ranges[i][0], ranges[i][1], MADV_POPULATE_WRITE)

    def _calibrate(self, snippets: list[str]) -> list[tuple[int, int]]:
        """Learn which pages of the worker a sympy snippet writes, once, before any user code.

        Each calibration snippet (trusted code from this module, not the benchmark's) runs in its
        own fork; the fork reads /proc/self/pagemap and reports the pages it holds privately
        (copied on write, or newly filled) within the worker's writable anonymous memory. Pages
        reported by all but one snippet form the hot set. When most recent snippets used sympy,
        each spare copies these pages in advance with madvise(MADV_POPULATE_WRITE), off the
        critical path, so a sympy snippet takes few page faults while it runs. Page faults are
        expensive here (several microseconds each on a virtual machine with PTI), and a snippet
        calling sympy writes about a thousand pages. Returns merged (address, length) ranges."""
        if not _populate_write_works(self.libc):
            return []
        regions = _anon_regions()
        counts: dict[int, int] = {}
        for code in snippets:
            for page in self._touched_pages(code, regions):
                counts[page] = counts.get(page, 0) + 1
        need = max(1, len(snippets) - 1)
        ranges: list[list[int]] = []
        for page in sorted(p for p, c in counts.items() if c >= need):
            if ranges and page - (ranges[-1][0] + ranges[-1][1]) <= 2 * _PAGE:
                ranges[-1][1] = page + _PAGE - ranges[-1][0]
            else:
                ranges.append([page, _PAGE])
        return [(a, n) for a, n in ranges]

    def _touched_pages(self, code: str, regions: list[tuple[int, int]]) -> list[int]:
        r, w = os.pipe()
        pid = self._fork()
        if pid == 0:
            try:
                os.close(r)
                exec(compile(code, "<calibration>", "exec"), {"__name__": "__main__"})  # noqa: S102
                pages = array.array("Q")
                fd = os.open("/proc/self/pagemap", os.O_RDONLY)
                for lo, hi in regions:
                    entries = array.array("Q", os.pread(fd, (hi - lo) // _PAGE * 8, lo // _PAGE * 8))
                    for i, e in enumerate(entries):
                        if e & _PM_PRESENT and e & _PM_EXCLUSIVE:
                            pages.append(lo + i * _PAGE)
                data = pages.tobytes()
                view = memoryview(data)
                while view:
                    view = view[os.write(w, view) :]
            finally:
                os._exit(0)
        os.close(w)
        chunks = []
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            b = os.read(r, 1 << 20)
            if not b:
                break
            chunks.append(b)
        os.close(r)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        os.waitpid(pid, 0)
        out = array.array("Q")
        data = b"".join(chunks)
        out.frombytes(data[: len(data) - len(data) % 8])
        return list(out)
