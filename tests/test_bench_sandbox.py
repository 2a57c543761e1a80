"""benchmarks/bench_sandbox.py: the isolation floor's fork servers, run for real (they return the
snippet's output, survive a crashing snippet, spread concurrent calls over the pool), and the ratio
and target figures against brute force."""

from __future__ import annotations

import asyncio
import math
import os
import random
import statistics
import sys

import bench_sandbox as bench  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
import pytest

pytestmark = pytest.mark.timeout(120)

LIGHT = ("math",)  # a quick preload for the servers that do not need numpy/sympy

CRASHES = {
    "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)": ("crashed", "signal 9"),
    "import os\nos._exit(3)": ("crashed", "exit code 3"),
    "import ctypes\nctypes.string_at(0)": ("crashed", "signal 11"),
    "print('before')\n1 / 0": ("error", ""),
    "import sys\nsys.exit(2)": ("error", ""),
}


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] == b"Z"


def _run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("mode", list(bench.FLOOR_MODES))
def test_floor_server_returns_the_snippets_output_and_survives_crashes(mode):
    async def go():
        s = bench.FloorServer(preload=LIGHT, mode=mode)
        await s.start()
        try:
            assert s.info["op"] == "ready" and s.info["mode"] == mode and "math" in s.info["preloaded"]
            pid = s.proc.pid
            r = await s.call(bench.TRIVIAL)
            assert (r.status, r.output, r.ok) == ("ok", "499500\n", True)
            # stdout and stderr both captured; a final sys.exit(0) is a clean end
            r = await s.call("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(0)")
            assert (r.status, r.output) == ("ok", "out\nerr\n")
            # more than a pipe's buffer (64 KiB) comes back whole
            r = await s.call("print('x' * 300000)")
            assert r.ok and r.output == "x" * 300000 + "\n"
            for code, (status, note) in CRASHES.items():
                r = await s.call(code)
                assert (r.status, r.note) == (status, note), code
                if code.startswith("print('before')"):
                    assert r.output.startswith("before\n") and "ZeroDivisionError" in r.output
                # the server itself lives on, same process, and still answers correctly
                assert s.proc.returncode is None and s.proc.pid == pid
                r = await s.call(bench.TRIVIAL)
                assert (r.status, r.output) == ("ok", "499500\n")
            # each call is a fresh fork of the server: state does not carry over
            assert (await s.call("x = 41\nprint(x + 1)")).output == "42\n"
            r = await s.call("print(x)")
            assert r.status == "error" and "NameError" in r.output
            # the snippet runs in a child of the server, which reaps it: no zombie is left
            r = await s.call("import os\nprint(os.getppid())")
            assert int(r.output) == pid
            want = 0 if mode == "fork" else 1  # prefork: the next spare, forked after the reply
            for _ in range(200):
                kids = [p for p in bench.descendants(pid) if p != pid]
                if len(kids) == want and not any(_zombie(p) for p in kids):
                    break
                await asyncio.sleep(0.01)
            assert len(kids) == want and not any(_zombie(p) for p in kids)
        finally:
            await s.close()
        assert s.proc.returncode == 0

    _run(go())


def test_floor_server_with_the_sandbox_preload_runs_numpy_sympy():
    async def go():
        s = bench.FloorServer()  # the sandbox's default preload: math, numpy, sympy + warm-up
        await s.start()
        try:
            assert s.info["preloaded"] == list(bench.DEFAULT_PRELOAD)
            r = await s.call(bench.HEAVY)
            assert r.ok and r.output.strip() == bench.EXPECTED[bench.HEAVY]
        finally:
            await s.close()

    _run(go())


def test_floor_pool_spreads_concurrent_calls_and_round_accumulates():
    async def go():
        pool = bench.FloorPool(2, preload=LIGHT, mode="prefork")
        await pool.start()
        try:
            servers = {s.proc.pid for s in pool.servers}
            assert len(servers) == 2
            code = "import os, time\ntime.sleep(0.05)\nprint(os.getppid())"
            replies = await asyncio.gather(*(pool.call(code) for _ in range(6)))
            assert {int(r.output) for r in replies} == servers  # both servers took calls
            acc = bench.Acc()
            await bench.floor_round(pool, bench.TRIVIAL, 5, 6, 3, acc)
            assert len(acc.lat) == 5 and all(x > 0 for x in acc.lat)
            # CPU is read from /proc in clock ticks (10 ms): six ~1 ms calls may round to 0
            assert acc.calls == acc.cpu_calls == 6 and acc.wall > 0 and acc.cpu >= 0
            assert pool.cpu_s() > 0  # the servers' preload alone takes many ticks
        finally:
            await pool.close()

    _run(go())


def _brute_rank(xs: list[float], k: int) -> float:
    """The element with exactly k smaller ones (xs has distinct values)."""
    (x,) = [x for x in xs if sum(y < x for y in xs) == k]
    return x


def test_floor_ratios_against_brute_force():
    rng = random.Random(0)
    for _ in range(20):
        accs = []
        for _ in range(2):
            n = 2 * rng.randint(5, 60) + 1  # odd: the median is one element
            acc = bench.Acc(lat=[rng.uniform(0.5, 40.0) for _ in range(n)])
            acc.calls, acc.wall = rng.randint(8, 500), rng.uniform(0.1, 5.0)
            acc.cpu_calls, acc.cpu = acc.calls, rng.uniform(0.01, 3.0)
            accs.append(acc)
        sb, fl = accs
        q = bench.floor_ratios(sb.row(), fl.row())
        for name, a in (("sandbox", sb), ("floor", fl)):
            n = len(a.lat)
            assert _brute_rank(a.lat, (n - 1) // 2) == statistics.median(a.lat) == a.row()["p50"], name
            assert _brute_rank(a.lat, round(0.95 * (n - 1))) == a.row()["p95"], name
        med = [_brute_rank(a.lat, (len(a.lat) - 1) // 2) for a in (sb, fl)]
        p95 = [_brute_rank(a.lat, round(0.95 * (len(a.lat) - 1))) for a in (sb, fl)]
        assert q["p50"] == pytest.approx(med[0] / med[1])
        assert q["p95"] == pytest.approx(p95[0] / p95[1])
        assert q["cps"] == pytest.approx((sb.calls / sb.wall) / (fl.calls / fl.wall))
        assert q["cpu_ms"] == pytest.approx((sb.cpu / sb.cpu_calls) / (fl.cpu / fl.cpu_calls))
    # an empty floor measurement gives nan, not an exception
    assert math.isnan(bench.floor_ratios({"p50": 1, "p95": 1, "cps": 1, "cpu_ms": 1}, dict.fromkeys(q, 0.0))["p50"])


def test_target_line():
    line = bench.target_line("trivial", 2.5, 1.0)
    assert "sequential p50 ≤ 3 ms: met (2.50 ms); floor p50 1.00 ms" in line and "instead" not in line
    line = bench.target_line("trivial", 4.0, 2.0)
    assert ": not met (4.00 ms); floor p50 2.00 ms" in line and "instead" not in line
    line = bench.target_line("trivial", 5.0, 4.0)  # the floor itself is above the target
    assert "not met (5.00 ms); floor p50 4.00 ms > 3 ms" in line
    assert "shown against the floor instead: sandbox p50 = 1.25x floor" in line
    assert "met (2.90 ms)" in bench.target_line("t", 2.9, 3.5) and "0.83x floor" in bench.target_line("t", 2.9, 3.5)


def test_unknown_floor_mode_is_refused():
    with pytest.raises(ValueError, match="unknown floor mode"):
        bench.FloorServer(mode="vfork")
    assert os.path.isfile(os.path.join(bench.SANDBOX_DIR, "worker_snippet.py"))
    assert sys.executable  # the floor servers run this interpreter
