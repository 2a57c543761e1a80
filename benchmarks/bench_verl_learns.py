"""Does the verl path learn as the local trainer does? README command 1 (the built-in default: same
warm start, task, batch, 15 steps and held-out evaluation) per trainer and seed, side by side.

    python benchmarks/bench_verl_learns.py --keep runs/learns            # local, sync, colocate_async × seeds 0 1 2
    python benchmarks/bench_verl_learns.py --keep runs/learns --trainers sync --seeds 3 4

Each run is ``recipes/train_tir_math.py trainer.seed=S`` (plus ``trainer=verl
verl.trainer_mode=MODE`` for the verl rows) as a subprocess: the local trainer with this python, verl
with the verl environment's (``.venv-verl``). Runs whose ``summary.json`` is already in ``--keep``
are read, not run again, so an interrupted benchmark resumes where it stopped. Prints per run the
held-out accuracy and tool-call rate before → after and the wall time of the command, then per
trainer the mean and [min, max] over its seeds, and the machine with its speed reference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from otb_tir.machine import describe, speed_reference

REPO = Path(__file__).resolve().parents[1]
TRAINERS = {"local": [], "sync": ["trainer=verl", "verl.trainer_mode=sync"]}
TRAINERS["colocate_async"] = ["trainer=verl", "verl.trainer_mode=colocate_async"]


def tools(figures: dict) -> str:
    """Tool use on the held-out pass: the local trainer's summary has the rate of episodes that
    called a tool, verl's the mean calls per episode (its validation metrics)."""
    if "tool_call_rate" in figures:
        return f"{figures['tool_call_rate']:.2f}"
    return f"{figures.get('tool_calls', float('nan')):.2f}/ep"


def run_one(python: str, out: Path, args: list[str], timeout: float) -> tuple[dict | None, float, str | None]:
    """``(summary, wall seconds, error)`` of one run; a finished run in ``out`` is read, not re-run."""
    done = out / "summary.json"
    wall_file = out / "bench_wall_s.txt"
    if done.exists() and wall_file.exists():
        return json.loads(done.read_text()), float(wall_file.read_text()), None
    t0 = time.time()
    cmd = [python, str(REPO / "recipes" / "train_tir_math.py"), f"trainer.output_dir={out}", *args]
    try:
        proc = subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, time.time() - t0, f"did not finish in {timeout:.0f} s"
    wall = time.time() - t0
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.splitlines() if line.strip()][-6:]
        return None, wall, f"rc={proc.returncode}: " + " / ".join(tail)[-800:]
    wall_file.write_text(f"{wall:.1f}")
    return json.loads(done.read_text()), wall, None


def phase_table(root: Path, results: dict[str, list]) -> None:
    """Where a step's time goes, per trainer, on these same runs: each phase's mean over the steps
    after the first (bench_verl_phases.figures), then over the trainer's seeds; and verl's step as a
    multiple of the local trainer's (the same batch: README command 1's)."""
    import statistics

    import bench_verl_phases as phases  # a sibling script (benchmarks/): the phase names and figures

    done = [t for t in results if results[t]]
    if not done:
        return
    figs = {t: [phases.figures(t, root / f"{t}-seed{seed}") for seed, *_ in results[t]] for t in done}

    def mean(t: str, label: str) -> float | None:
        vals = [f[label] for f in figs[t] if f.get(label) is not None]
        return statistics.fmean(vals) if vals else None

    print("\nseconds per step, mean over the steps after the first and over the seeds:\n")
    print("| phase | " + " | ".join(done) + " |")
    print("|---" * (len(done) + 1) + "|")
    for label, *_ in phases.PHASES:
        cells = [mean(t, label) for t in done]
        print(f"| {label} | " + " | ".join("–" if c is None else f"{c:.2f}" for c in cells) + " |")
    local = mean("local", "step") if "local" in done else None
    if local:
        for t in done:
            if t != "local" and mean(t, "step"):
                print(f"{t}: step {mean(t, 'step') / local:.1f}x the local trainer's")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma-separated, of {list(TRAINERS)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--verl-python", default=str(REPO / ".venv-verl" / "bin" / "python"))
    p.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    p.add_argument("--keep", type=Path, default=None, help="run folders (and resume) here")
    p.add_argument("overrides", nargs="*", help="recipe overrides applied to every run")
    a = p.parse_args(argv)
    trainers = [t for t in a.trainers.split(",") if t]
    unknown = [t for t in trainers if t not in TRAINERS]
    if unknown:
        p.error(f"--trainers: unknown {unknown}; choose from {list(TRAINERS)}")
    root = (a.keep or Path(tempfile.mkdtemp(prefix="otb_verl_learns_"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[tuple[int, dict, float]]] = {t: [] for t in trainers}
    failed = []
    print(
        "| trainer | seed | held-out accuracy | tool use (rate; verl: calls per episode) | wall time of the command |"
    )
    print("|---|---|---|---|---|")
    for seed in a.seeds:  # seed-major: an interrupted benchmark has every trainer's first seeds
        for t in trainers:
            python = sys.executable if t == "local" else a.verl_python
            args = [*TRAINERS[t], f"trainer.seed={seed}", *a.overrides]
            summary, wall, err = run_one(python, root / f"{t}-seed{seed}", args, a.timeout)
            if err:
                failed.append(f"{t} seed {seed}: {err}")
                print(f"| {t} | {seed} | failed: {err[:200]} | | {wall:.0f} s |", flush=True)
                continue
            b, f = summary["before"], summary["after"]
            results[t].append((seed, summary, wall))
            print(
                f"| {t} | {seed} | {b['accuracy']:.2f} → **{f['accuracy']:.2f}** "
                f"({100 * (f['accuracy'] - b['accuracy']):+.0f}) | {tools(b)} → {tools(f)} | {wall:.0f} s |",
                flush=True,
            )

    def stats(xs: list[float], fmt: str = ".2f") -> str:
        return f"{sum(xs) / len(xs):{fmt}} [{min(xs):{fmt}}, {max(xs):{fmt}}]"

    print("\nper trainer, mean [min, max] over its seeds:")
    for t in trainers:
        runs = results[t]
        if not runs:
            print(f"- {t}: no finished run")
            continue
        before = [s["before"]["accuracy"] for _, s, _ in runs]
        after = [s["after"]["accuracy"] for _, s, _ in runs]
        walls = [w for *_, w in runs]
        print(
            f"- {t} ({len(runs)} seed{'s' if len(runs) > 1 else ''}: {', '.join(str(s) for s, *_ in runs)}): "
            f"held-out {stats(before)} → {stats(after)}; wall time {stats(walls, '.0f')} s"
        )
    phase_table(root, results)
    ref = speed_reference()
    print(f"\nmachine: {describe()}; speed reference {ref['matmul_gflops']:.0f} GFLOP/s; runs in {root}")
    for line in failed:
        print(f"failed: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
