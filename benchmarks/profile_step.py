#!/usr/bin/env python
"""Where a training step's time goes: the default recipe for a few steps, phase by phase.

    python benchmarks/profile_step.py                    # 4 steps of the built-in CPU default
    python benchmarks/profile_step.py --steps 6 -- rollout.n=4 data.task=chain   # any overrides

Runs ``recipes/train_tir_math.py`` as a subprocess (held-out evaluation off, checkpoints as the
recipe saves them) and reads what the run wrote: the ``timing/*`` phases of every row of
``metrics.jsonl`` and the loop totals in ``summary.json`` (``timing``). Prints, per phase, the
mean seconds per step and the share of the training loop, the seconds no timer saw, and tokens
per second for the rollout (sampled tokens) and the update (prompt + response tokens through
forward and backward), with the share of padding in the columns the actor's forwards ran. The first step is
reported apart: it pays one-time costs (sandbox workers, allocator warm-up).

The phases are disjoint and cover the loop (``otb_tir.trainer.timing.STEP_PHASES``): the rollout
split into generating / waiting on tools / reward scoring / other host work / collate, then the
old log-prob pass (log-prob, entropy and Σπ² in one pass), reference model, advantage, update,
weight sync, metrics, the rest of the step, evaluation, writing the row (JSONL, TensorBoard,
``curves.png``) and the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from otb_tir.trainer.timing import AFTER_ROW_PHASES, STEP_PHASES, phase_name

ROOT = Path(__file__).resolve().parents[1]

# a row holds the previous step's log and checkpoint seconds as timing/prev_log_s, timing/prev_checkpoint_s
PREV = {"timing/prev_" + phase_name(k) + "_s": phase_name(k) for k in AFTER_ROW_PHASES}
PER_ROW = list(STEP_PHASES) + list(PREV)


def run_recipe(out: Path, steps: int, overrides: list[str]) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "train_tir_math.py"),
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={out}",
        "eval.before=false",
        "eval.after=false",
        *overrides,
    ]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=out.parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def report(out: Path) -> str:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())["timing"]
    lines = []
    steady = rows[1:] or rows

    def mean(key: str, rs=steady) -> float:
        vals = [float(r[key]) for r in rs if key in r]
        return statistics.fmean(vals) if vals else 0.0

    step = mean("timing/step_s")
    lines.append(
        f"{len(rows)} steps; training loop {summary['fit_s']:.1f} s; step 1 {rows[0]['timing/step_s']:.1f} s, "
        f"later steps {step:.2f} s on average"
    )
    lines.append("")
    lines.append("| phase | step 1 s | later steps, mean s | share of a later step | share of the loop |")
    lines.append("|---|---|---|---|---|")
    # log and checkpoint of step k land in row k+1 (prev_*); the loop totals hold all of them
    shares = summary["shares"]
    named = {k: phase_name(k) for k in STEP_PHASES} | PREV
    later = {k: mean(k, rows[1:]) if len(rows) > 1 else float("nan") for k in PER_ROW}
    step_with_after = sum(v for v in later.values() if v == v)
    order = sorted(PER_ROW, key=lambda k: -summary["phases_s"].get(named[k], 0.0))
    for k in order:
        name = named[k]
        first = float(rows[0].get(k, 0.0)) if not k.startswith("timing/prev_") else float("nan")
        share_step = later[k] / step_with_after if step_with_after > 0 else float("nan")
        share_loop = 100 * shares.get(name, 0.0)
        lines.append(f"| {name} | {first:.2f} | {later[k]:.3f} | {100 * share_step:.1f} % | {share_loop:.1f} % |")
    lines.append(f"| (no timer) | | | | {100 * summary['unattributed_s'] / summary['fit_s']:.2f} % |")
    lines.append("")
    rollout = mean("timing/rollout_s")
    lines.append(
        f"rollout: {mean('rollout/sampled_tokens'):.0f} sampled tokens per step in {rollout:.2f} s = "
        f"{mean('perf/rollout_sampled_tokens_per_s'):.0f} tokens/s "
        f"(generating {100 * mean('timing/gen_s') / rollout:.0f} % of the rollout, "
        f"waiting on tools {100 * mean('timing/tool_wait_s') / rollout:.0f} %)"
    )
    lines.append(
        f"update: {mean('perf/update_tokens_per_s'):.0f} tokens/s through forward + backward; "
        f"padding is {100 * mean('perf/pad_frac'):.0f} % of the columns its forwards ran (rows packed, "
        "actor.pack_rows; padded rows trimmed to the micro-batch's longest with actor.pack_rows=false)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="run folder (default: a temporary one)")
    ap.add_argument("--report-only", action="store_true", help="report on an existing --out run")
    ap.add_argument("overrides", nargs="*", help="recipe overrides key=value (after --)")
    args = ap.parse_args(argv)
    if args.report_only:
        if args.out is None:
            ap.error("--report-only needs --out")
        print(report(args.out))
        return 0
    with tempfile.TemporaryDirectory(prefix="otb_profile_") as tmp:
        out = args.out or Path(tmp) / "run"
        run_recipe(out.resolve(), args.steps, args.overrides)
        print(report(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
