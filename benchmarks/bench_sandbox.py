"""Python sandbox latency, throughput and CPU per call vs a fresh interpreter per call, one run.

    .venv/bin/python benchmarks/bench_sandbox.py [--n 300] [--concurrency 8] [--workers 4]
        [--variants default,no_raw_fork,no_thp,workers=2,workers=3] [--rounds 5]

Prints, for the sandbox (``tools.sandbox.PythonTool``, cache off) and for the reference
``subprocess.run([python, -c, code])``: p50/p95 latency of sequential calls, calls/s with
``--concurrency`` calls in flight, and CPU milliseconds per call (trainer process + every sandbox
process: bubblewrap, the workers and their reaped snippet children), for a trivial snippet and a
numpy+sympy snippet; then the ratios and the targets of issue 3 (p50 <= 6 ms, >= 150 calls/s,
heavy p50 <= 10 ms, >= 3x the reference's throughput).

``--variants`` runs several sandbox configurations side by side (each its own pool, all started
before measuring) and interleaves them in ``--rounds`` rounds, so that load from other processes
on the machine falls on all of them alike: ``default``; ``no_raw_fork`` / ``no_thp`` (one worker
performance switch off) or ``prefault`` (the opt-in one on), see the README, "Python sandbox: the fast path";
``workers=K`` (pool size). The targets are
checked on the first variant. CPU per call is the robust figure on a busy machine; wall-clock
figures need a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tqdm import tqdm

from tools.sandbox import PythonTool
from tools.sandbox.host_worker import descendants

TRIVIAL = "print(sum(range(1000)))"
HEAVY = (
    "import numpy as np\nimport sympy as sp\nx = sp.Symbol('x')\n"
    "print(sp.factor(x**4 - 1), round(float(np.linalg.det(np.eye(4) * 2)), 6))"
)
EXPECTED = {TRIVIAL: "499500", HEAVY: "(x - 1)*(x + 1)*(x**2 + 1) 16.0"}
SNIPPETS = {"trivial": TRIVIAL, "numpy+sympy": HEAVY}
_TCK = os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _proc_cpu_s(pid: int) -> float:
    """utime + stime + cutime + cstime of one process (children it has reaped included)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0.0
    rest = stat[stat.rindex(b")") + 2 :].split()
    return sum(int(x) for x in rest[11:15]) / _TCK


def sandbox_cpu_s(tool: PythonTool) -> float:
    """CPU seconds used so far by the tool's sandbox processes. Snippet children count once
    reaped (by the worker, which reaps each before its next call). Only live processes are
    counted, so a respawned worker would reset its share: the benchmark checks none died."""
    total = 0.0
    for w in tool.pool.workers:
        if w.proc is not None:
            total += sum(_proc_cpu_s(p) for p in descendants(w.proc.pid))
    return total


def host_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class Acc:
    """Measurements of one (runner, snippet), accumulated over rounds."""

    lat: list[float] = field(default_factory=list)
    calls: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    cpu_calls: int = 0

    def row(self) -> dict[str, float]:
        return {
            "p50": statistics.median(self.lat),
            "p95": pct(self.lat, 0.95),
            "cps": self.calls / self.wall if self.wall else float("nan"),
            "cpu_ms": 1000 * self.cpu / self.cpu_calls if self.cpu_calls else float("nan"),
        }


def check(r, code: str, who: str) -> None:
    if not r.ok or r.text.strip() != EXPECTED[code]:
        raise SystemExit(f"{who} returned a wrong result: {r}")


async def sandbox_round(tool: PythonTool, code: str, n_seq: int, n_conc: int, conc: int, acc: Acc) -> None:
    for _ in range(n_seq):
        t0 = time.perf_counter()
        r = await tool.call({"code": code})
        acc.lat.append((time.perf_counter() - t0) * 1000)
        check(r, code, "sandbox")
    await settle(tool)  # the last call's cleanup finishes before the CPU snapshot
    sem = asyncio.Semaphore(conc)

    async def one() -> None:
        async with sem:
            check(await tool.call({"code": code}), code, "sandbox")

    c0, h0, t0 = sandbox_cpu_s(tool), host_cpu_s(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n_conc)))
    acc.wall += time.perf_counter() - t0
    acc.calls += n_conc
    respawned = tool.pool.respawned
    await settle(tool)  # every worker's post-call cleanup (reap, next spare) counts too
    acc.cpu += (sandbox_cpu_s(tool) - c0) + (host_cpu_s() - h0)
    acc.cpu_calls += n_conc
    if tool.pool.respawned != respawned:
        raise SystemExit("a sandbox worker died during the benchmark")


async def settle(tool: PythonTool) -> None:
    """Wait until every worker is back in the pool's idle queue (its cleanup is done)."""
    pool = tool.pool
    for _ in range(2000):
        if pool._idle is not None and pool._idle.qsize() == len(pool.workers) and not pool._respawns:
            return
        await asyncio.sleep(0.002)


def run_ref(code: str) -> None:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if r.stdout.strip() != EXPECTED[code]:
        raise SystemExit(f"reference returned a wrong result: {r}")


def bench_reference(code: str, n: int, conc: int) -> dict[str, float]:
    lat = []
    for _ in tqdm(range(n), desc=f"subprocess seq {code[:18]!r}", leave=False):
        t0 = time.perf_counter()
        run_ref(code)
        lat.append((time.perf_counter() - t0) * 1000)
    total = max(n, 2 * conc)
    c0 = os.times()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as ex:
        list(ex.map(lambda _: run_ref(code), range(total)))
    wall = time.perf_counter() - t0
    c1 = os.times()
    cpu = sum(c1[:4]) - sum(c0[:4])  # this process + its reaped children
    return {"p50": statistics.median(lat), "p95": pct(lat, 0.95), "cps": total / wall, "cpu_ms": 1000 * cpu / total}


def make_tool(variant: str, backend: str, workers: int) -> PythonTool:
    opts: dict[str, bool] = {}
    if variant == "default":
        pass
    elif variant.startswith("no_"):
        opts[variant[3:]] = False
    elif variant == "prefault":
        opts["prefault"] = True
    elif variant.startswith("workers="):
        workers = int(variant.split("=", 1)[1])
    elif variant.startswith("backend="):  # e.g. backend=docker beside the default bubblewrap
        backend = variant.split("=", 1)[1]
    else:
        raise SystemExit(
            f"unknown variant {variant!r}: default, no_raw_fork, no_thp, prefault, workers=K, backend=NAME"
        )
    return PythonTool(backend=backend, workers=workers, cache=False, timeout=30, worker_options=opts)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="sequential calls per sandbox case")
    ap.add_argument("--conc-n", type=int, default=None, help="concurrent calls per sandbox case (default: --n)")
    ap.add_argument("--ref-n", type=int, default=40, help="sequential calls, trivial reference")
    ap.add_argument("--ref-heavy-n", type=int, default=8, help="calls, numpy+sympy reference")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--backend", default="auto")
    ap.add_argument(
        "--variants",
        default="default",
        help="comma-separated: default, no_raw_fork, no_thp, prefault, workers=K, "
        "backend=docker (the docker backend beside the default)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaving rounds")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    conc_n = args.conc_n or args.n

    tools = {v: make_tool(v, args.backend, args.workers) for v in variants}
    start_s = {}
    for v, tool in tools.items():
        t0 = time.perf_counter()
        await tool.start()
        start_s[v] = time.perf_counter() - t0
        for _ in range(20):  # warm-up
            await tool.call({"code": TRIVIAL})
    accs = {(v, s): Acc() for v in variants for s in SNIPPETS}
    rounds = max(1, args.rounds)
    steps = [(r, s, v) for r in range(rounds) for s in SNIPPETS for v in variants]
    for r, s, v in tqdm(steps, desc="sandbox rounds", leave=False):
        n_seq = args.n // rounds + (1 if r < args.n % rounds else 0)
        n_conc = max(args.concurrency, conc_n // rounds)
        await sandbox_round(tools[v], SNIPPETS[s], n_seq, n_conc, args.concurrency, accs[(v, s)])
    info = {v: (t.backend.name, t.isolation, len(t.pool.workers)) for v, t in tools.items()}
    for tool in tools.values():
        await tool.close()
    ref = {
        "trivial": bench_reference(TRIVIAL, args.ref_n, args.concurrency),
        "numpy+sympy": bench_reference(HEAVY, args.ref_heavy_n, args.concurrency),
    }

    v0 = variants[0]
    name, level, _ = info[v0]
    print(
        f"\nsandbox backend: {name} ({level}); concurrency {args.concurrency}; "
        f"{rounds} interleaved rounds; cpu = CPU ms per call (trainer + sandbox processes)"
    )
    print(f"{'runner':<26}{'snippet':<14}{'p50 ms':>9}{'p95 ms':>9}{'calls/s':>9}{'cpu ms':>9}")
    for v in variants:
        label = f"sandbox[{v}, {info[v][2]}w]"
        for s in SNIPPETS:
            row = accs[(v, s)].row()
            print(f"{label:<26}{s:<14}{row['p50']:>9.2f}{row['p95']:>9.2f}{row['cps']:>9.1f}{row['cpu_ms']:>9.2f}")
        print(f"{'':<26}(started in {start_s[v]:.2f} s)")
    for s, row in ref.items():
        print(f"{'subprocess':<26}{s:<14}{row['p50']:>9.2f}{row['p95']:>9.2f}{row['cps']:>9.1f}{row['cpu_ms']:>9.2f}")
    s_t, s_h = accs[(v0, "trivial")].row(), accs[(v0, "numpy+sympy")].row()
    r_t, r_h = ref["trivial"], ref["numpy+sympy"]
    thr_ratio = s_t["cps"] / r_t["cps"]
    print(
        f"\n[{v0}] throughput ratio sandbox/subprocess: trivial {thr_ratio:.1f}x, "
        f"numpy+sympy {s_h['cps'] / r_h['cps']:.1f}x"
    )
    print(
        f"[{v0}] latency ratio subprocess/sandbox (p50): trivial {r_t['p50'] / s_t['p50']:.1f}x, "
        f"numpy+sympy {r_h['p50'] / s_h['p50']:.1f}x"
    )
    print(
        f"[{v0}] CPU per call subprocess/sandbox: trivial {r_t['cpu_ms'] / s_t['cpu_ms']:.1f}x, "
        f"numpy+sympy {r_h['cpu_ms'] / s_h['cpu_ms']:.1f}x"
    )
    for v in variants[1:]:
        a, b = accs[(v0, "trivial")].row(), accs[(v, "trivial")].row()
        ah, bh = accs[(v0, "numpy+sympy")].row(), accs[(v, "numpy+sympy")].row()
        print(
            f"[{v} vs {v0}] trivial: p50 {b['p50'] / a['p50']:.2f}x, calls/s "
            f"{b['cps'] / a['cps']:.2f}x, cpu/call {b['cpu_ms'] / a['cpu_ms']:.2f}x; "
            f"numpy+sympy: p50 {bh['p50'] / ah['p50']:.2f}x, cpu/call "
            f"{bh['cpu_ms'] / ah['cpu_ms']:.2f}x"
        )
    checks = [
        ("trivial p50 <= 6 ms", s_t["p50"] <= 6.0),
        ("trivial >= 150 calls/s", s_t["cps"] >= 150.0),
        ("numpy+sympy p50 <= 10 ms", s_h["p50"] <= 10.0),
        (">= 3x subprocess throughput (trivial)", thr_ratio >= 3.0),
    ]
    for cname, ok in checks:
        print(f"  [{'PASS' if ok else 'MISS'}] {cname}")


if __name__ == "__main__":
    asyncio.run(main())
