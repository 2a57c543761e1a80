"""README command 1 as a newcomer meets it: a first run on an empty cache, then more seeds.

    python benchmarks/first_run.py                 # seed 0 on an empty cache, seeds 1 and 2 reusing it
    python benchmarks/first_run.py --seeds 0 --quick   # a smoke run: 2 steps, tiny warm start
    python benchmarks/first_run.py --float-paths native,avx2,generic   # as other CPUs would compute it

Runs ``recipes/train_tir_math.py`` as a subprocess, from a scratch folder, with ``OTB_TIR_CACHE``
pointing at a new empty folder: the first seed puts the warm start in the cache (a copy of the
shipped one, or its build with ``model.warm_start_shipped=false``: the whole cost a newcomer pays
once), the others reuse it. Prints per seed the wall time of the whole command and the held-out
accuracy / tool-call rate before and after training from its ``summary.json``; then the mean and
range over seeds, where the warm start came from (its build times if built), and the machine with
its speed reference (:func:`otb_tir.machine.speed_reference`), so that a reader can scale the
times. Trailing ``key=value`` arguments go to the recipe.

``--float-paths`` runs the seeds again under torch's other vector kernels
(:data:`otb_tir.machine.FLOAT_PATHS`: ``avx2`` as on a CPU without AVX-512, ``generic`` with every
kernel on another float order), so that the spread of the figures over the float orders other
machines of this kind compute in is measured here, not assumed. The first seed of the first path
is the empty-cache run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from otb_tir.machine import FLOAT_PATHS, cpu_kernels, describe, speed_reference

ROOT = Path(__file__).resolve().parents[1]
QUICK = [
    "trainer.total_steps=2",
    "data.train_batch_size=2",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=2",
    "eval.size=4",
    "model.warm_start_steps=60",  # the least above the warm start's 50 warmup steps
    "model.warm_start_copy_steps=0",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="2 RL steps and a tiny warm start (smoke test)")
    ap.add_argument("--keep", default=None, help="folder for the runs and the cache (default: a temporary one)")
    ap.add_argument(
        "--float-paths",
        default="native",
        help=f"comma-separated, from {', '.join(FLOAT_PATHS)}: run every seed under each (default: native)",
    )
    args, overrides = ap.parse_known_args()
    paths = [p for p in args.float_paths.split(",") if p]
    unknown = [p for p in paths if p not in FLOAT_PATHS]
    if unknown or not paths:
        ap.error(f"--float-paths: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(FLOAT_PATHS)}")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)} (recipe overrides are key=value)")
    work = Path(args.keep or tempfile.mkdtemp(prefix="otb_first_run_"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    if cache.exists() and any(cache.iterdir()):
        print(f"error: {cache} is not empty: a first run needs an empty cache", file=sys.stderr)
        return 2
    env = {**os.environ, "OTB_TIR_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    rows = []  # (float path, seed, first run?, wall time, summary)
    for path in paths:
        for seed in args.seeds:
            first = not rows
            run = work / (f"seed{seed}" if path == "native" else f"{path}-seed{seed}")
            cmd = [sys.executable, str(ROOT / "recipes" / "train_tir_math.py"), f"trainer.seed={seed}"]
            cmd += [f"trainer.output_dir={run}", *(QUICK if args.quick else []), *overrides]
            kernels = " ".join(f"{k}={v}" for k, v in FLOAT_PATHS[path].items())
            print(
                ("first run, empty cache: " if first else "cache warm: ")
                + (kernels + " " if kernels else "")
                + " ".join(cmd[1:]),
                flush=True,
            )
            t0 = time.perf_counter()
            proc = subprocess.run(
                cmd,
                cwd=work,
                env={**env, **FLOAT_PATHS[path]},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                print(proc.stderr[-4000:], file=sys.stderr)
                print(f"error: seed {seed} ({path}) exited with {proc.returncode}", file=sys.stderr)
                return proc.returncode
            summary = json.loads((run / "summary.json").read_text())
            rows.append((path, seed, first, wall, summary))
    warm = sorted(cache.glob("warm-*/otb_tir_warm_start.json"))
    record = json.loads(warm[0].read_text()) if warm else {}

    print(f"\n{len(rows)} runs in {work} (cache {cache})\n")
    several = len(paths) > 1
    print(
        ("| float path " if several else "")
        + "| seed | cache | held-out accuracy | tool-call rate | wall time of the command |"
    )
    print(("|---" if several else "") + "|---|---|---|---|---|")
    for path, seed, first, wall, s in rows:
        b, a = s["before"], s["after"]
        print(
            (f"| {path} " if several else "")
            + f"| {seed} | {'empty (puts the warm start in the cache)' if first else 'warm'} | "
            f"{b['accuracy']:.2f} → **{a['accuracy']:.2f}** ({100 * (a['accuracy'] - b['accuracy']):+.0f}) | "
            f"{b['tool_call_rate']:.2f} → {a['tool_call_rate']:.2f} | {wall:.0f} s ({wall / 60:.1f} min) |"
        )
    stats = lambda xs: f"{sum(xs) / len(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"  # noqa: E731

    def summarize(label: str, picked: list) -> None:
        before = [s["before"]["accuracy"] for *_, s in picked]
        after = [s["after"]["accuracy"] for *_, s in picked]
        gains = [100 * (a - b) for a, b in zip(after, before)]
        print(
            f"{label}over {len(picked)} seed{'s' if len(picked) > 1 else ''}, mean [min, max]: "
            f"held-out accuracy {stats(before)} → {stats(after)}, "
            f"gain {sum(gains) / len(gains):+.1f} points [{min(gains):+.0f}, {max(gains):+.0f}]"
        )

    print()
    for path in paths:
        summarize(f"{path}: " if several else "", [r for r in rows if r[0] == path])
    if several:
        summarize(f"all {len(paths)} float paths: ", rows)
    walls = [w for _, _, first, w, _ in rows if not first]
    print(
        f"wall time: first run {rows[0][3]:.0f} s"
        + (f", cache warm {sum(walls) / len(walls):.0f} s [{min(walls):.0f}, {max(walls):.0f}]" if walls else "")
    )
    source = record.get("source", "built here")
    if source == "shipped":
        shipped = record.get("shipped", {})
        print(f"warm start: the shipped one (built {shipped.get('date')} on {shipped.get('built_on')}), copied")
    elif record:
        print(
            f"warm start built here (first run): traces {record.get('trace_seconds', float('nan')):.1f} s, "
            f"SFT {record.get('train_seconds', float('nan')):.1f} s "
            f"({len(record.get('losses', []))} steps, final loss {sum(record['losses'][-10:]) / 10:.3f})"
        )
    ref = speed_reference()
    print(
        f"machine: {describe()}, {cpu_kernels()} natively; speed reference {ref['matmul_gflops']:.0f} GFLOP/s "
        f"(otb_tir.machine.speed_reference, {ref['threads']:.0f} threads): scale the times by the ratio to yours"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
