#!/usr/bin/env python
"""Does TIR-OTB learn more per sampled token? The OTB paper's claim, at this machine's scale.

Trains the built-in policy from the same warm start with each *arm* (an estimator and a group
size, plus a void-turn-masking arm and a high-learning-rate arm per estimator), for several seeds,
on the built-in ``arith`` task and on the ``chain`` task (``data.task=chain``: two dependent tool
calls per problem), every run a subprocess of the training recipe with its own run folder:

    python benchmarks/sweep_otb_claim.py                      # the full sweep (hours on 2 cores)
    python benchmarks/sweep_otb_claim.py --arms grpo_n4 --tasks chain --seeds 0   # one arm alone
    python benchmarks/sweep_otb_claim.py --quick              # smoke: 2 steps, 4 held-out problems
    python benchmarks/sweep_otb_claim.py --report-only        # tables and the plot from what ran

**Resumable.** A run whose ``summary.json`` exists is not run again; an interrupted run continues
from its last checkpoint (``trainer.resume=true``), so killing the sweep loses at most a few steps.

**Reported** (``<out>/results.json``, ``<out>/table.md``, ``<out>/accuracy_vs_tokens.png``; the
tables are also printed): per run, the held-out accuracy curve (greedy, every ``--eval-every``
steps), sampled and tool tokens, wall time, gradient norm (max and median), clip fraction and
entropy; per arm, mean ± 95 % CI across seeds (Student t) at **equal steps** (the last) and at
**equal sampled tokens** (each run's curve interpolated at the least any n=4 run spent), and the
tokens each arm needs to reach the GRPO n=16 arm's final accuracy. A run *collapsed* when its
held-out accuracy ends more than 0.2 below its own peak (the start included) or its tool-call
rate halves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from figures import figure  # a sibling module (benchmarks/)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "train_tir_math.py"

TIR_OTB, GRPO, RLOO = "tir_optimal_token_baseline", "grpo", "rloo"


@dataclass(frozen=True)
class Arm:
    name: str
    estimator: str
    n: int
    void_turns: bool = False  # SimpleTIR-style masking of trajectories with a void turn
    lr_scale: float = 1.0  # × the recipe's learning rate (the stability arms)
    seeds: tuple[int, ...] | None = None  # None: every seed of the sweep
    optional: bool = False  # only with --with-n8
    label: str = ""
    extra: tuple[str, ...] = ()  # more recipe overrides, e.g. GRPO without the std division

    def overrides(self, base_lr: float) -> list[str]:
        out = [f"algorithm.adv_estimator={self.estimator}", f"rollout.n={self.n}"]
        if self.void_turns:
            out.append("algorithm.filter.void_turns=true")
        if self.lr_scale != 1.0:
            out.append(f"actor.optim.lr={base_lr * self.lr_scale:g}")
        return out + list(self.extra)


ARMS: dict[str, Arm] = {
    a.name: a
    for a in [
        Arm("tir_otb_n4", TIR_OTB, 4, label="TIR-OTB n=4"),
        Arm("grpo_n4", GRPO, 4, label="GRPO n=4"),
        Arm("rloo_n4", RLOO, 4, label="RLOO n=4"),
        Arm("grpo_n16", GRPO, 16, label="GRPO n=16"),
        Arm("tir_otb_n4_void", TIR_OTB, 4, void_turns=True, label="TIR-OTB n=4 + void-turn mask"),
        Arm("tir_otb_n8", TIR_OTB, 8, optional=True, label="TIR-OTB n=8"),
        Arm("grpo_n8", GRPO, 8, optional=True, label="GRPO n=8"),
        # stability: a deliberately high learning rate, one seed per estimator
        Arm("tir_otb_n4_highlr", TIR_OTB, 4, lr_scale=10.0, seeds=(0,), label="TIR-OTB n=4, lr ×10"),
        Arm("grpo_n4_highlr", GRPO, 4, lr_scale=10.0, seeds=(0,), label="GRPO n=4, lr ×10"),
        Arm("rloo_n4_highlr", RLOO, 4, lr_scale=10.0, seeds=(0,), label="RLOO n=4, lr ×10"),
    ]
}
TASKS = ("arith", "chain")
BASE_LR = 2e-4  # the recipe's actor.optim.lr
#: two-sided 95 % Student t quantiles by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


@dataclass
class Settings:
    steps: int = 15
    eval_every: int = 5
    eval_size: int = 100
    train_batch_size: int = 8
    extra: list[str] = field(default_factory=list)  # more key=value overrides for every run

    def overrides(self) -> list[str]:
        return [
            f"trainer.total_steps={self.steps}",
            f"eval.every={self.eval_every}",
            f"eval.size={self.eval_size}",
            f"data.val_size={self.eval_size}",
            f"data.train_batch_size={self.train_batch_size}",
            f"actor.ppo_mini_batch_size={self.train_batch_size}",
            f"trainer.save_every={self.eval_every}",
            "trainer.keep_checkpoints=1",
            "trainer.resume=true",
            "trainer.loggers=[jsonl]",
            *self.extra,
        ]


QUICK = Settings(
    steps=2,
    eval_every=1,
    eval_size=4,
    train_batch_size=2,
    extra=["data.train_size=16", "rollout.response_length=64", "rollout.max_tokens_per_turn=32"],
)


def run_dir(out: Path, task: str, arm: str, seed: int) -> Path:
    return out / task / arm / f"seed{seed}"


def run_one(out: Path, task: str, arm: Arm, seed: int, settings: Settings, log) -> Path:
    """Train one (task, arm, seed) unless its summary exists; returns the run folder."""
    d = run_dir(out, task, arm.name, seed)
    if (d / "summary.json").is_file():
        log(f"  {task}/{arm.name}/seed{seed}: done already, skipped")
        return d
    d.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(RECIPE),
        f"data.task={task}",
        f"trainer.seed={seed}",
        f"trainer.output_dir={d}",
        *settings.overrides(),
        *arm.overrides(BASE_LR),
    ]
    resumed = (d / "checkpoints").is_dir()
    log(f"  {task}/{arm.name}/seed{seed}: {'resuming' if resumed else 'training'}")
    t0 = time.perf_counter()
    with open(d / "sweep.log", "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (d / "sweep.log").read_text().splitlines()[-15:]
        raise SystemExit(f"run {d} failed (exit {proc.returncode}); the end of {d / 'sweep.log'}:\n" + "\n".join(tail))
    walls = json.loads((d / "wall.json").read_text()) if (d / "wall.json").is_file() else []
    (d / "wall.json").write_text(json.dumps(walls + [wall]))
    return d


# ----------------------------------------------------------------------------- reading runs


def _mean_or_nan(values) -> float:
    vals = list(values)
    return statistics.fmean(vals) if vals else math.nan


def read_run(d: Path) -> dict[str, Any] | None:
    """One finished run's figures: the held-out curve against steps and cumulative sampled tokens."""
    if not (d / "summary.json").is_file():
        return None
    summary = json.loads((d / "summary.json").read_text())
    rows: dict[int, dict[str, float]] = {}
    for line in (d / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["step"])] = row  # a resumed run rewrote its later rows: the last one wins
    steps = sorted(rows)
    cum_sampled, cum_tool, tokens_at = 0.0, 0.0, {0: 0.0}
    for s in steps:
        cum_sampled += rows[s].get("rollout/sampled_tokens", math.nan)
        cum_tool += rows[s].get("rollout/tool_tokens", math.nan)
        tokens_at[s] = cum_sampled
    curve = [(0, 0.0, summary["before"]["accuracy"])] if "before" in summary else []
    for s in steps:
        if "val/reward/accuracy" in rows[s]:
            curve.append((s, tokens_at[s], rows[s]["val/reward/accuracy"]))
    if "after" in summary and steps:
        curve.append((steps[-1], tokens_at[steps[-1]], summary["after"]["accuracy"]))
    # the training batches' accuracy (sampled at the rollout temperature, every step, the same
    # prompts for every arm of a seed): finer-grained than the held-out curve, noisier
    train_curve = [(s, tokens_at[s], rows[s]["reward/accuracy"]) for s in steps if "reward/accuracy" in rows[s]]
    grad = [rows[s]["actor/grad_norm"] for s in steps if math.isfinite(rows[s].get("actor/grad_norm", math.nan))]
    walls = json.loads((d / "wall.json").read_text()) if (d / "wall.json").is_file() else []
    before, after = summary.get("before", {}), summary.get("after", {})
    peak = max((a for _, _, a in curve), default=math.nan)
    collapsed = bool(
        before
        and after
        and (after["accuracy"] < peak - 0.2 or after["tool_call_rate"] < 0.5 * before["tool_call_rate"])
    )
    mean = lambda key: _mean_or_nan(rows[s][key] for s in steps if key in rows[s])  # noqa: E731
    return {
        "curve": curve,
        "train_curve": train_curve,
        "train_accuracy_mean": _mean_or_nan(a for _, _, a in train_curve),
        "steps": len(steps),
        "sampled_tokens": cum_sampled,
        "tool_tokens": cum_tool,
        "wall_s": sum(walls),
        "grad_norm_max": max(grad) if grad else math.nan,
        "grad_norm_median": statistics.median(grad) if grad else math.nan,
        "clip_frac": mean("actor/clip_frac"),
        "entropy": mean("actor/entropy"),
        "before": before.get("accuracy", math.nan),
        "after": after.get("accuracy", math.nan),
        "tool_call_rate_before": before.get("tool_call_rate", math.nan),
        "tool_call_rate_after": after.get("tool_call_rate", math.nan),
        "peak": peak,
        "drop_from_peak": peak - after.get("accuracy", math.nan),
        "void_turn_rate": mean("episode/void_turn_rate"),
        "collapsed": collapsed,
    }


def accuracy_at_tokens(curve: list[tuple[int, float, float]], budget: float) -> float:
    """The held-out accuracy a run had reached after ``budget`` sampled tokens (linear between
    evaluation points; NaN past the run's end)."""
    pts = [(t, a) for _, t, a in curve]
    if not pts or budget > pts[-1][0] * (1 + 1e-9):
        return math.nan
    for (t0, a0), (t1, a1) in zip(pts, pts[1:]):
        if t0 <= budget <= t1:
            return a0 if t1 == t0 else a0 + (a1 - a0) * (budget - t0) / (t1 - t0)
    return pts[0][1]


def tokens_to_reach(curve: list[tuple[int, float, float]], target: float) -> float:
    """Sampled tokens until the held-out accuracy first reaches ``target`` (NaN: never)."""
    for _, t, a in curve:
        if a >= target - 1e-9:
            return t
    return math.nan


def mean_ci(values: list[float]) -> tuple[float, float, int]:
    """Mean, 95 % CI half-width (Student t; 0 for one value) and count, NaNs dropped."""
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return math.nan, math.nan, 0
    if len(vals) == 1:
        return vals[0], 0.0, 1
    half = T95.get(len(vals) - 1, 1.96) * statistics.stdev(vals) / math.sqrt(len(vals))
    return statistics.fmean(vals), half, len(vals)


def _fmt(m: float, h: float, n: int, digits: int = 2) -> str:
    if n == 0:
        return "–"
    return f"{m:.{digits}f}" if n == 1 else f"{m:.{digits}f} ± {h:.{digits}f}"


def _fmt_tokens(m: float, h: float, n: int) -> str:
    if n == 0:
        return "never"
    return f"{m / 1e3:.0f}k" if n == 1 else f"{m / 1e3:.0f}k ± {h / 1e3:.0f}k"


def summarize(out: Path, tasks, arms, seeds) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for task in tasks:
        runs = {}
        for arm in arms:
            for seed in arm.seeds or seeds:
                r = read_run(run_dir(out, task, arm.name, seed))
                if r is not None:
                    runs.setdefault(arm.name, {})[seed] = r
        if not runs:
            continue
        # the equal-token budget: the least any n=4 run (at the default learning rate) spent, so every
        # n=4 run covers it
        n4 = [
            r["sampled_tokens"]
            for a, rs in runs.items()
            for r in rs.values()
            if ARMS[a].n == 4 and ARMS[a].lr_scale == 1
        ]
        budget = min(n4) if n4 else min(r["sampled_tokens"] for rs in runs.values() for r in rs.values())
        target_runs = runs.get("grpo_n16") or {}
        target = mean_ci([r["after"] for r in target_runs.values()])[0] if target_runs else math.nan
        arm_rows = {}
        for name, rs in runs.items():
            vals = list(rs.values())
            arm_rows[name] = {
                "label": ARMS[name].label,
                "seeds": sorted(rs),
                "before": mean_ci([r["before"] for r in vals]),
                "after": mean_ci([r["after"] for r in vals]),
                "at_budget": mean_ci([accuracy_at_tokens(r["curve"], budget) for r in vals]),
                "train_accuracy_mean": mean_ci([r["train_accuracy_mean"] for r in vals]),
                # NaN for a run whose first step already spends more than the budget (n=16 in --quick)
                "train_at_budget": mean_ci(
                    [_mean_or_nan(a for _, t, a in r["train_curve"] if t <= budget * (1 + 1e-9)) for r in vals]
                ),
                "tokens_to_target": mean_ci([tokens_to_reach(r["curve"], target) for r in vals])
                if math.isfinite(target)
                else (math.nan, math.nan, 0),
                "reached_target": sum(math.isfinite(tokens_to_reach(r["curve"], target)) for r in vals)
                if math.isfinite(target)
                else 0,
                "sampled_tokens": mean_ci([r["sampled_tokens"] for r in vals]),
                "tool_tokens": mean_ci([r["tool_tokens"] for r in vals]),
                "wall_s": mean_ci([r["wall_s"] for r in vals]),
                "grad_norm_max": max(r["grad_norm_max"] for r in vals),
                "grad_norm_max_over_median": max(
                    r["grad_norm_max"] / r["grad_norm_median"] for r in vals if r["grad_norm_median"] > 0
                )
                if any(r["grad_norm_median"] > 0 for r in vals)
                else math.nan,
                "clip_frac": mean_ci([r["clip_frac"] for r in vals]),
                "entropy": mean_ci([r["entropy"] for r in vals]),
                "peak": mean_ci([r["peak"] for r in vals]),
                "drop_from_peak": max(r["drop_from_peak"] for r in vals),
                "void_turn_rate": mean_ci([r["void_turn_rate"] for r in vals]),
                "collapsed": sum(r["collapsed"] for r in vals),
                "runs": rs,
            }
        report[task] = {"budget_tokens": budget, "target_accuracy": target, "arms": arm_rows}
    return report


def tables(report: dict[str, Any]) -> str:
    lines = []
    for task, t in report.items():
        lines += [
            f"### Task `{task}`",
            "",
            f"Held-out accuracy (greedy) mean ± 95 % CI over seeds. Equal tokens: each run's curve at "
            f"{t['budget_tokens'] / 1e3:.0f}k sampled tokens (the least any n=4 run spent). Target: GRPO "
            f"n=16's final accuracy ({t['target_accuracy']:.2f}).",
            "",
            "Train accuracy: the training batches' accuracy (sampled), mean over all steps, and over the "
            "steps within the equal-token budget.",
            "",
            "| arm | seeds | before | after (equal steps) | at equal tokens | tokens to target (reached) "
            "| train acc: all steps | train acc: equal tokens "
            "| sampled tokens | tool tokens | wall s | grad-norm max (max/median) | clip frac | entropy "
            "| void-turn rate | peak (largest drop to the end) | collapsed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for a in t["arms"].values():
            k = len(a["seeds"])
            cells = [
                a["label"],
                str(k),
                _fmt(*a["before"]),
                _fmt(*a["after"]),
                _fmt(*a["at_budget"]),
                f"{_fmt_tokens(*a['tokens_to_target'])} ({a['reached_target']}/{k})"
                if math.isfinite(t["target_accuracy"])
                else "– (no GRPO n=16 arm)",
                _fmt(*a["train_accuracy_mean"]),
                _fmt(*a["train_at_budget"]),
                _fmt_tokens(*a["sampled_tokens"]),
                _fmt_tokens(*a["tool_tokens"]),
                _fmt(*a["wall_s"], digits=0),
                f"{a['grad_norm_max']:.2f} ({a['grad_norm_max_over_median']:.1f}×)",
                _fmt(*a["clip_frac"], digits=3),
                _fmt(*a["entropy"]),
                _fmt(*a["void_turn_rate"], digits=3),
                f"{_fmt(*a['peak'])} ({a['drop_from_peak']:.2f})",
                f"{a['collapsed']}/{k}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> Path:
    """Accuracy vs sampled tokens, one line per arm (mean over seeds, 95 % CI band): held-out (top)
    and training batches (bottom), one column per task."""
    import numpy as np

    tasks = list(report)
    panels = [(0, "curve", "held-out accuracy (greedy)"), (1, "train_curve", "training-batch accuracy (sampled)")]
    with figure(path, 2, len(tasks), figsize=(6.5 * len(tasks), 8.5)) as axes:
        for (row, key, ylabel), (col, task) in ((p, t) for p in panels for t in enumerate(tasks)):
            ax = axes[row][col]
            for name, a in report[task]["arms"].items():
                curves = [r[key] for r in a["runs"].values()]
                if key == "train_curve":  # from the first step's tokens on
                    curves = [[(0, 0.0, c[0][2])] + c for c in curves if c]
                if not curves:
                    continue
                end = min(c[-1][1] for c in curves)
                if end <= 0:
                    continue
                grid = np.linspace(0, end, 40)
                ys = np.array([[accuracy_at_tokens(c, g) for g in grid] for c in curves])
                mean = ys.mean(0)
                style = "--" if ARMS[name].lr_scale != 1 else "-"
                (line,) = ax.plot(grid / 1e3, mean, style, label=a["label"])
                if len(curves) > 1:
                    half = T95.get(len(curves) - 1, 1.96) * ys.std(0, ddof=1) / np.sqrt(len(curves))
                    ax.fill_between(grid / 1e3, mean - half, mean + half, color=line.get_color(), alpha=0.15)
            ax.set_title(f"task: {task}")
            ax.set_xlabel("sampled tokens (thousands)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out", default=str(ROOT / "runs" / "otb_claim"), help="sweep folder (one run folder per task/arm/seed)"
    )
    ap.add_argument("--arms", nargs="+", default=None, choices=sorted(ARMS), help="default: every arm but the n=8 ones")
    ap.add_argument("--with-n8", action="store_true", help="add the n=8 arms (TIR-OTB, GRPO)")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=Settings.steps)
    ap.add_argument("--eval-every", type=int, default=Settings.eval_every)
    ap.add_argument("--eval-size", type=int, default=Settings.eval_size)
    add_sweep_options(ap, "accuracy_vs_tokens.png")
    args = ap.parse_args(argv)

    settings = QUICK if args.quick else Settings(args.steps, args.eval_every, args.eval_size)
    settings = Settings(
        settings.steps,
        settings.eval_every,
        settings.eval_size,
        settings.train_batch_size,
        [*settings.extra, *args.overrides],
    )
    names = args.arms or [a.name for a in ARMS.values() if not a.optional or args.with_n8]
    arms = [ARMS[n] for n in names]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    if not args.report_only:
        # seed-major within a task: an interrupted sweep has every arm at the same number of seeds
        jobs = [
            (task, arm, seed)
            for task in args.tasks
            for seed in args.seeds
            for arm in arms
            if seed in (arm.seeds or args.seeds)
        ]
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        for task, arm, seed in tqdm(jobs, desc="sweep", unit="run", file=sys.stderr):
            run_one(out, task, arm, seed, settings, log)
        log(f"sweep: {len(jobs)} runs in {time.perf_counter() - t0:.0f} s")
    report = summarize(out, args.tasks, arms, args.seeds)
    return write_report(out, report, tables, plot, Path(args.plot) if args.plot else out / "accuracy_vs_tokens.png")


def add_sweep_options(ap: argparse.ArgumentParser, png: str) -> None:
    """The options every sweep has (this script's and sweep_stability's): ``--quick``, ``--report-only``,
    ``--plot`` (default ``<out>/<png>``) and ``--set KEY=VALUE`` (``args.overrides``)."""
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 steps, batch 2, 4 held-out problems")
    ap.add_argument("--report-only", action="store_true", help="train nothing; tables and plot from the runs present")
    ap.add_argument("--plot", default=None, help=f"where to write the plot (default <out>/{png})")
    ap.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override for every run"
    )


def write_report(out: Path, report: dict, tables_fn, plot_fn, png: Path) -> int:
    """A sweep's ending (this script's and sweep_stability's): ``table.md``, ``results.json`` and the
    plot from the finished runs' ``report``, the table printed; 1 when no run has finished yet."""
    if not report:
        print("no finished runs yet", file=sys.stderr)
        return 1
    text = tables_fn(report)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    png = plot_fn(report, png)
    print(text)
    print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
