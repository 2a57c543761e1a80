"""Python sandbox latency and throughput vs a fresh interpreter per call, measured in one run.

    .venv/bin/python benchmarks/bench_sandbox.py [--n 300] [--concurrency 8] [--workers 4]

Prints p50/p95 latency (sequential calls) and calls/s (``--concurrency`` calls in flight) for a
trivial snippet and a numpy+sympy snippet, for the sandbox (``tools.sandbox.PythonTool``, cache
off) and for the reference ``subprocess.run([python, -c, code])``, then the ratios and the targets
of issue 3 (p50 <= 6 ms, >= 150 calls/s, heavy p50 <= 10 ms, >= 3x the reference's throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from tools.sandbox import PythonTool  # noqa: E402

TRIVIAL = "print(sum(range(1000)))"
HEAVY = ("import numpy as np\nimport sympy as sp\nx = sp.Symbol('x')\n"
         "print(sp.factor(x**4 - 1), round(float(np.linalg.det(np.eye(4) * 2)), 6))")
EXPECTED = {TRIVIAL: "499500", HEAVY: "(x - 1)*(x + 1)*(x**2 + 1) 16.0"}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def bench_sandbox(tool: PythonTool, code: str, n: int, conc: int) -> dict[str, float]:
    lat = []
    for _ in tqdm(range(n), desc=f"sandbox seq {code[:18]!r}", leave=False):
        t0 = time.perf_counter()
        r = await tool.call({"code": code})
        lat.append((time.perf_counter() - t0) * 1000)
        if not r.ok or r.text.strip() != EXPECTED[code]:
            raise SystemExit(f"sandbox returned a wrong result: {r}")
    sem = asyncio.Semaphore(conc)

    async def one() -> None:
        async with sem:
            r = await tool.call({"code": code})
            if not r.ok or r.text.strip() != EXPECTED[code]:
                raise SystemExit(f"sandbox returned a wrong result: {r}")

    total = max(n, 4 * conc)
    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(total)))
    wall = time.perf_counter() - t0
    return {"p50": statistics.median(lat), "p95": pct(lat, 0.95), "cps": total / wall}


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
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as ex:
        list(ex.map(lambda _: run_ref(code), range(total)))
    wall = time.perf_counter() - t0
    return {"p50": statistics.median(lat), "p95": pct(lat, 0.95), "cps": total / wall}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="sequential calls per sandbox case")
    ap.add_argument("--ref-n", type=int, default=40, help="sequential calls, trivial reference")
    ap.add_argument("--ref-heavy-n", type=int, default=8, help="calls, numpy+sympy reference")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    tool = PythonTool(backend=args.backend, workers=args.workers, cache=False, timeout=30)
    t0 = time.perf_counter()
    await tool.start()
    start_s = time.perf_counter() - t0
    for _ in range(20):  # warm-up
        await tool.call({"code": TRIVIAL})
    rows = {}
    rows[("sandbox", "trivial")] = await bench_sandbox(tool, TRIVIAL, args.n, args.concurrency)
    rows[("sandbox", "numpy+sympy")] = await bench_sandbox(tool, HEAVY, args.n,
                                                           args.concurrency)
    await tool.close()
    rows[("subprocess", "trivial")] = bench_reference(TRIVIAL, args.ref_n, args.concurrency)
    rows[("subprocess", "numpy+sympy")] = bench_reference(HEAVY, args.ref_heavy_n,
                                                          args.concurrency)

    print(f"\nsandbox backend: {tool.backend.name} ({tool.isolation}); {args.workers} workers, "
          f"started in {start_s:.2f} s; concurrency {args.concurrency}")
    print(f"{'runner':<12}{'snippet':<14}{'p50 ms':>10}{'p95 ms':>10}{'calls/s':>10}")
    for (runner, snippet), r in rows.items():
        print(f"{runner:<12}{snippet:<14}{r['p50']:>10.2f}{r['p95']:>10.2f}{r['cps']:>10.1f}")
    s_t, s_h = rows[("sandbox", "trivial")], rows[("sandbox", "numpy+sympy")]
    r_t, r_h = rows[("subprocess", "trivial")], rows[("subprocess", "numpy+sympy")]
    thr_ratio = s_t["cps"] / r_t["cps"]
    print(f"\nthroughput ratio sandbox/subprocess: trivial {thr_ratio:.1f}x, "
          f"numpy+sympy {s_h['cps'] / r_h['cps']:.1f}x")
    print(f"latency ratio subprocess/sandbox (p50): trivial {r_t['p50'] / s_t['p50']:.1f}x, "
          f"numpy+sympy {r_h['p50'] / s_h['p50']:.1f}x")
    checks = [("trivial p50 <= 6 ms", s_t["p50"] <= 6.0),
              ("trivial >= 150 calls/s", s_t["cps"] >= 150.0),
              ("numpy+sympy p50 <= 10 ms", s_h["p50"] <= 10.0),
              (">= 3x subprocess throughput (trivial)", thr_ratio >= 3.0)]
    for name, ok in checks:
        print(f"  [{'PASS' if ok else 'MISS'}] {name}")


if __name__ == "__main__":
    asyncio.run(main())
