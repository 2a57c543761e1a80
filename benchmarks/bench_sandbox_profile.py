"""Where one sandbox call's time goes, phase by phase, from the worker's ``profile`` option.

    .venv/bin/python benchmarks/bench_sandbox_profile.py [--n 40] [--prefault] [--backend auto] [--set thp=false]

Starts one sandbox worker (the ``python`` tool's default limits) with
``worker_options={"profile": True}`` (``tools/sandbox/worker_profile.py``; ``--prefault`` adds the
opt-in ``prefault`` experiment), talks to it over its framed stdin/stdout protocol as the pool
does, runs a trivial and then a numpy+sympy snippet ``--n`` times each, sequentially, with a short
pause between calls so that each finds an idle, armed spare, and prints per snippet the median
of every phase of the critical path (host send -> reply) and of the cleanup after it (reap, wipe,
fork and arm of the next spare), plus the page faults of the snippet's own run. Host and worker
timestamps share one clock (``time.perf_counter_ns``; the sandbox has no time namespace).

``benchmarks/bench_sandbox.py`` measures latency, throughput and CPU per call; this script says
which part of a call to work on.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import struct
import subprocess
import time

from tools.sandbox import PythonTool
from tools.sandbox.backends import UnisolatedBackend, make_backend
from tools.sandbox.host_worker import _minimal_env

_HDR = struct.Struct(">I")
SNIPPETS = {
    "trivial": ("print(sum(range(1000)))", "499500\n"),
    "numpy+sympy": (
        "import numpy as np\nimport sympy as sp\nx = sp.Symbol('x')\n"
        "print(sp.factor(x**4 - 1), round(float(np.linalg.det(np.eye(4) * 2)), 6))",
        "(x - 1)*(x + 1)*(x**2 + 1) 16.0\n",
    ),
}


def _read(proc: subprocess.Popen) -> dict:
    (n,) = _HDR.unpack(proc.stdout.read(_HDR.size))
    return json.loads(proc.stdout.read(n))


def _write(proc: subprocess.Popen, obj: dict) -> None:
    body = json.dumps(obj).encode()
    proc.stdin.write(_HDR.pack(len(body)) + body)
    proc.stdin.flush()


def phases(sent: int, got: int, reply: dict, idle: dict) -> dict[str, float]:
    """Milliseconds per phase of one call (``sent`` / ``got``: host clock at send / receive)."""
    p, a = reply["prof"], idle["prof"]
    stamps = {name: ns for name, ns, _ in p["stamps"]}
    ms = 1e-6
    out = {
        "host -> worker": (p["recv_ns"] - sent) * ms,
        "worker: take spare": (p["sent_ns"] - p["recv_ns"]) * ms,
        "worker -> child (code)": (p["child_got_ns"] - p["sent_ns"]) * ms,
        "snippet run": (p["child_done_ns"] - p["child_got_ns"]) * ms,
        "child -> worker (status)": (p["status_ns"] - p["child_done_ns"]) * ms,
        "kill + reply": (p["reply_ns"] - p["status_ns"]) * ms,
        "worker -> host": (got - p["reply_ns"]) * ms,
        "= call, host view": (got - sent) * ms,
        "after: reap": a["reap_ms"],
        "after: wipe scratch": a["wipe_ms"],
        "after: fork": a["fork_ms"],
        "after: arm": a["arm_ms"],
        "spare: fork -> armed": (stamps["armed"] - stamps["fork"]) * ms if "armed" in stamps else float("nan"),
        "snippet run: page faults": float(p["child_run_flt"]),
        "spare prefaulted (share)": float("prefault" in stamps),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=40, help="calls per snippet")
    ap.add_argument("--pause", type=float, default=0.05, help="seconds between calls")
    ap.add_argument("--prefault", action="store_true", help="also the opt-in prefault experiment")
    ap.add_argument("--backend", default="auto")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="diagnostics only: override one worker config key (e.g. thp=false, seccomp=false) to see what it costs",
    )
    args = ap.parse_args()

    opts = {"profile": True, **({"prefault": True} if args.prefault else {})}
    tool = PythonTool(backend=args.backend, workers=1, cache=False, worker_options=opts)
    backend = make_backend(args.backend) if isinstance(args.backend, str) else args.backend
    cfg = backend.worker_config(dict(tool.worker_cfg, stateful=False))
    for kv in args.set:
        key, _, value = kv.partition("=")
        cfg[key] = json.loads(value)
    proc = subprocess.Popen(backend.command(cfg), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_minimal_env())
    rows: dict[str, list[dict[str, float]]] = {s: [] for s in SNIPPETS}
    try:
        ready = _read(proc)
        assert ready["op"] == "ready", ready
        print(
            f"backend {backend.name}; worker ready: seccomp {ready['seccomp']}, "
            f"thp {ready['thp_mb']} MiB, raw_fork {ready['raw_fork']}"
            + (f", hot pages {ready.get('hot_pages')}" if args.prefault else "")
            + (f"; overrides {args.set}" if args.set else "")
        )
        i = 0
        for name, (code, expected) in SNIPPETS.items():  # one snippet after the other (prefault
            for _ in range(args.n):  # follows what recent snippets used)
                i += 1
                sent = time.perf_counter_ns()
                _write(proc, {"op": "run", "id": i, "code": code, "timeout": 30, "max_output": 4096})
                reply = _read(proc)
                got = time.perf_counter_ns()
                idle = _read(proc)
                if reply["status"] != "ok" or reply["output"] != expected or idle["op"] != "idle":
                    raise SystemExit(f"unexpected reply to {name}: {reply} / {idle}")
                rows[name].append(phases(sent, got, reply, idle))
                time.sleep(args.pause)
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if isinstance(backend, UnisolatedBackend):
            shutil.rmtree(cfg["scratch"], ignore_errors=True)

    names = list(SNIPPETS)
    print(f"\nmedian of {args.n} sequential calls (ms unless stated)")
    print(f"{'phase':<28}" + "".join(f"{n:>14}" for n in names))
    for key in rows[names[0]][0]:
        vals = [
            statistics.median(r[key] for r in rows[n])
            if key != "spare prefaulted (share)"
            else statistics.fmean(r[key] for r in rows[n])
            for n in names
        ]
        print(f"{key:<28}" + "".join(f"{v:>14.2f}" for v in vals))


if __name__ == "__main__":
    main()
