#!/usr/bin/env python
"""Does TIR-OTB stay stable over long runs where the fair baselines do not? The OTB paper's
stability claim, at this machine's scale.

The paper trains for hundreds of steps, fully on-policy, and reports that the compared methods
collapse when their gradient norm surges while OTB's stays flat. Here: the built-in ``multistep``
task (three or four dependent calculator calls; ``data.task=multistep``), every run a subprocess of
the training recipe from the same warm start, fully on-policy (one PPO epoch, the mini-batch is the
batch), with the fair baselines beside TIR-OTB — GRPO *without* the std division and RLOO as well
as verl's GRPO, which divides by the group std where OTB does not:

    python benchmarks/sweep_stability.py                        # the long runs and the stress runs
    python benchmarks/sweep_stability.py --arms grpo_nostd_n4 --seeds 0   # one arm alone
    python benchmarks/sweep_stability.py --quick                # smoke: 2 steps, 4 held-out problems
    python benchmarks/sweep_stability.py --report-only          # tables and the plot from what ran

Arms: TIR-OTB, GRPO, GRPO without std and RLOO at n=4, and TIR-OTB at n=16 (the larger-group
reference), ``--steps`` (100) steps each; the stress arms are the four n=4 estimators at
``--stress-lr-scale`` × the recipe's learning rate, ``--stress-steps`` (60) steps each. ``--seeds``
(3) each.

**Resumable**, as ``sweep_otb_claim.py`` (whose run mechanism this uses): a finished run is not run
again, an interrupted one resumes from its last checkpoint (saved every ``--eval-every`` steps).

**Reported** per run, from its ``metrics.jsonl``: the gradient norm every step, the variance proxies,
the entropy, the tool-call rate and the training-batch accuracy every step, the held-out accuracy
(greedy) every ``--eval-every`` steps. Per arm, with 95 % CIs over seeds:

* *collapse*: a run collapsed at the first held-out evaluation from which its accuracy stays at
  least 0.2 below its best so far to the end of the run, or from which its tool-call rate stays
  below half the warm start's; reported as the count of collapsed seeds and the mean step;
* *gradient-norm surges*: each update's norm over the median of the 10 updates before it (steps
  without a learning signal, every group tied, left out); the largest
  ratio per run, and the number of steps above 3×;
* held-out accuracy at the end and its best, mean entropy and grad norm over the last 20 steps.

Sizing: ``--batch`` 4 prompts × n samples per step, 64 held-out problems every 10 steps. On the
2-core VM a multistep n=4 step takes ~3–4 s (n=16: ~3×), so the 15 long runs and 12 stress runs
of 100 steps fit in about 2.5 h when nothing else runs (the docstring of ``docs/results.md``'s
section gives the measured time).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import sweep_otb_claim as _claim  # a sibling script (benchmarks/): the run mechanism, arms, settings, CIs
from figures import figure  # a sibling module (benchmarks/)

Arm, Settings, run_one, mean_ci, T95 = _claim.Arm, _claim.Settings, _claim.run_one, _claim.mean_ci, _claim.T95
TIR_OTB, GRPO, RLOO = _claim.TIR_OTB, _claim.GRPO, _claim.RLOO

ROOT = Path(__file__).resolve().parents[1]
TASK = "multistep"
NO_STD = ("algorithm.norm_adv_by_std_in_grpo=false",)
STRESS_LR_SCALE = 5.0  # lr ×10 collapsed every estimator on arith and chain in 15 steps (docs/results.md)
SURGE = 3.0  # a step whose grad norm is more than SURGE × the median of the 10 before it
NO_SIGNAL = 1e-3  # a grad norm below this × the run's median: every group tied, float residue, not an update
COLLAPSE_DROP = 0.2


def arms(stress_scale: float = STRESS_LR_SCALE) -> dict[str, Arm]:
    base = [
        Arm("tir_otb_n4", TIR_OTB, 4, label="TIR-OTB n=4"),
        Arm("grpo_n4", GRPO, 4, label="GRPO n=4"),
        Arm("grpo_nostd_n4", GRPO, 4, label="GRPO without std n=4", extra=NO_STD),
        Arm("rloo_n4", RLOO, 4, label="RLOO n=4"),
    ]
    ref = [Arm("tir_otb_n16", TIR_OTB, 16, label="TIR-OTB n=16")]
    stress = [
        Arm(
            f"{a.name}_stress",
            a.estimator,
            a.n,
            lr_scale=stress_scale,
            label=f"{a.label}, lr ×{stress_scale:g}",
            extra=a.extra,
        )
        for a in base
    ]
    return {a.name: a for a in base + ref + stress}


def settings(steps: int, eval_every: int, eval_size: int, batch: int, extra: list[str]) -> Any:
    # fully on-policy: one PPO epoch over the whole batch (Settings makes the mini-batch the batch)
    return Settings(steps, eval_every, eval_size, batch, ["actor.ppo_epochs=1", *extra])


QUICK = dict(steps=2, eval_every=1, eval_size=4, batch=2)
QUICK_EXTRA = ["data.train_size=16", "rollout.response_length=96", "rollout.max_tokens_per_turn=32"]


# ----------------------------------------------------------------------------- reading runs


def _rows(d: Path) -> list[dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for line in (d / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["step"])] = row  # a resumed run rewrote its later rows: the last one wins
    return [rows[s] for s in sorted(rows)]


def surges(grad: list[float], window: int = 10) -> list[float]:
    """Each update's gradient norm over the median of the ``window`` updates before it (from the
    ``window``+1-th on). Steps without a learning signal (every group's rewards tied: a norm of 0,
    or float residue below ``NO_SIGNAL`` × the run's median norm) are left out: a window of them
    made the ratio a division by ~0 (a stress run's 5.6e5 "surge" was 0.12 over a median of 2e-7)."""
    finite = [x for x in grad if math.isfinite(x) and x > 0]
    if not finite:
        return []
    floor = NO_SIGNAL * statistics.median(finite)
    g = [x for x in finite if x > floor]
    return [g[i] / statistics.median(g[i - window : i]) for i in range(window, len(g))]


def collapse_step(curve: list[tuple[int, float]], tool_curve: list[tuple[int, float]], tool_start: float) -> int | None:
    """The first evaluation step from which the held-out accuracy stays ≥ COLLAPSE_DROP below its
    best so far to the end, or the tool-call rate stays below half the start's; None: no collapse."""
    for i, (step, _) in enumerate(curve):
        best = max(a for _, a in curve[: i + 1])
        if all(a <= best - COLLAPSE_DROP for _, a in curve[i:]):
            return step
    for i, (step, _) in enumerate(tool_curve):
        if tool_start > 0 and all(r < 0.5 * tool_start for _, r in tool_curve[i:]):
            return step
    return None


def read_run(d: Path) -> dict[str, Any] | None:
    if not (d / "summary.json").is_file():
        return None
    summary = json.loads((d / "summary.json").read_text())
    rows = _rows(d)
    before, after = summary.get("before", {}), summary.get("after", {})
    curve = [(0, before.get("accuracy", math.nan))]
    tool_curve = [(0, before.get("tool_call_rate", math.nan))]
    for r in rows:
        if "val/reward/accuracy" in r:
            curve.append((int(r["step"]), r["val/reward/accuracy"]))
            if "val/tools/call_rate" in r:
                tool_curve.append((int(r["step"]), r["val/tools/call_rate"]))
    last = int(rows[-1]["step"]) if rows else 0
    if after and (not curve or curve[-1][0] != last):
        curve.append((last, after["accuracy"]))
        tool_curve.append((last, after.get("tool_call_rate", math.nan)))
    series = lambda key: [float(r.get(key, math.nan)) for r in rows]  # noqa: E731
    grad = series("actor/grad_norm")
    ratios = surges(grad)
    tail = lambda xs: statistics.fmean([x for x in xs[-20:] if math.isfinite(x)] or [math.nan])  # noqa: E731
    collapsed_at = collapse_step(curve, tool_curve, before.get("tool_call_rate", math.nan))
    return {
        "steps": [int(r["step"]) for r in rows],
        "grad_norm": grad,
        "entropy": series("actor/entropy"),
        "train_accuracy": series("reward/accuracy"),
        "tool_call_rate": series("tools/call_rate"),
        "turns": series("episode/turns_mean"),
        "proxy_total_power": series("variance_proxy/proxy2_total_power"),
        "proxy_noise": series("variance_proxy/proxy3_pure_noise"),
        "curve": curve,
        "before": before.get("accuracy", math.nan),
        "after": after.get("accuracy", math.nan),
        "best": max(a for _, a in curve),
        "collapsed_at": collapsed_at,
        "surge_max": max((x for x in ratios if math.isfinite(x)), default=math.nan),
        "surge_steps": sum(x > SURGE for x in ratios if math.isfinite(x)),
        "grad_norm_tail": tail(grad),
        "entropy_tail": tail(series("actor/entropy")),
        "sampled_tokens": sum(r.get("rollout/sampled_tokens", 0.0) for r in rows),
        "wall_s": sum(json.loads((d / "wall.json").read_text())) if (d / "wall.json").is_file() else math.nan,
    }


def summarize(out: Path, chosen: dict[str, Arm], seeds: list[int]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name, arm in chosen.items():
        runs = {s: r for s in seeds if (r := read_run(_claim.run_dir(out, TASK, name, s))) is not None}
        if not runs:
            continue
        vals = list(runs.values())
        steps_at = [r["collapsed_at"] for r in vals if r["collapsed_at"] is not None]
        report[name] = {
            "label": arm.label,
            "n": arm.n,
            "lr_scale": arm.lr_scale,
            "seeds": sorted(runs),
            "before": mean_ci([r["before"] for r in vals]),
            "after": mean_ci([r["after"] for r in vals]),
            "best": mean_ci([r["best"] for r in vals]),
            "collapsed": len(steps_at),
            "collapse_step": mean_ci(steps_at),
            "surge_max": mean_ci([r["surge_max"] for r in vals]),
            "surge_steps": mean_ci([r["surge_steps"] for r in vals]),
            "grad_norm_tail": mean_ci([r["grad_norm_tail"] for r in vals]),
            "entropy_tail": mean_ci([r["entropy_tail"] for r in vals]),
            "sampled_tokens": mean_ci([r["sampled_tokens"] for r in vals]),
            "wall_s": mean_ci([r["wall_s"] for r in vals]),
            "runs": runs,
        }
    return report


def _f(m: float, h: float, n: int, digits: int = 2) -> str:
    if n == 0:
        return "–"
    return f"{m:.{digits}f}" if n == 1 else f"{m:.{digits}f} ± {h:.{digits}f}"


def tables(report: dict[str, Any]) -> str:
    lines = [
        f"Task `{TASK}`; mean ± 95 % CI over seeds (Student t). Collapse: held-out accuracy stays ≥ "
        f"{COLLAPSE_DROP} below its best so far to the end (or the tool-call rate below half the warm "
        f"start's). Surge: an update's grad norm over the median of the 10 updates before it (steps "
        f"whose groups all tied left out); updates above {SURGE:g}×.",
        "",
        "| arm | seeds | held-out before | after | best | collapsed (mean step) | max surge | steps > "
        f"{SURGE:g}× | grad norm, last 20 | entropy, last 20 | sampled tokens | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in report.values():
        k = len(a["seeds"])
        step = f" ({_f(*a['collapse_step'], digits=0)})" if a["collapsed"] else ""
        lines.append(
            "| "
            + " | ".join(
                [
                    a["label"],
                    str(k),
                    _f(*a["before"]),
                    _f(*a["after"]),
                    _f(*a["best"]),
                    f"{a['collapsed']}/{k}{step}",
                    _f(*a["surge_max"], digits=1),
                    _f(*a["surge_steps"], digits=1),
                    _f(*a["grad_norm_tail"], digits=3),
                    _f(*a["entropy_tail"], digits=3),
                    f"{a['sampled_tokens'][0] / 1e3:.0f}k",
                    _f(*a["wall_s"], digits=0),
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> Path:
    """Held-out accuracy (top) and gradient norm (bottom, 5-step rolling mean, log scale) against
    steps, mean over seeds with the seeds' range as a band; the long runs left, the stress runs right."""
    import numpy as np

    with figure(path, 2, 2, figsize=(13, 8.5)) as axes:
        for col, stress in enumerate((False, True)):
            for a in report.values():
                if (a["lr_scale"] != 1) != stress:
                    continue
                runs = list(a["runs"].values())
                # held-out accuracy: the evaluation steps every run has
                common = sorted(set.intersection(*(set(s for s, _ in r["curve"]) for r in runs)))
                ys = np.array([[dict(r["curve"])[s] for s in common] for r in runs])
                (line,) = axes[0][col].plot(common, ys.mean(0), marker=".", label=a["label"])
                # grad norm: a 5-step rolling mean of each run over the steps every run has
                n = min(len(r["grad_norm"]) for r in runs)
                w = max(1, min(5, n))  # a --quick run has fewer than 5 steps
                g = np.array([np.convolve(np.array(r["grad_norm"][:n]), np.ones(w) / w, mode="valid") for r in runs])
                xs = np.array(runs[0]["steps"][w - 1 : n])
                axes[1][col].plot(xs, g.mean(0), color=line.get_color(), label=a["label"])
                for row, arr, x in ((0, ys, common), (1, g, xs)):
                    if len(runs) > 1:  # the seeds' range (a t-interval over 3 seeds leaves [0, 1] and crosses 0)
                        axes[row][col].fill_between(x, arr.min(0), arr.max(0), color=line.get_color(), alpha=0.12)
            kind = "stress (high learning rate)" if stress else "long runs"
            axes[0][col].set_title(f"{kind}: held-out accuracy (greedy)")
            axes[1][col].set_title(f"{kind}: gradient norm (5-step rolling mean)")
            axes[1][col].set_yscale("log")
            for row in (0, 1):
                axes[row][col].set_xlabel("step")
                axes[row][col].grid(alpha=0.3)
                axes[row][col].legend(fontsize=7)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=str(ROOT / "runs" / "stability"), help="one run folder per arm/seed")
    ap.add_argument("--arms", nargs="+", default=None, help="default: every arm (long runs, reference, stress)")
    ap.add_argument("--no-stress", action="store_true", help="leave out the stress arms")
    ap.add_argument("--stress-lr-scale", type=float, default=STRESS_LR_SCALE)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--stress-steps", type=int, default=60, help="steps of the stress arms")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="prompts per step")
    _claim.add_sweep_options(ap, "stability.png")
    args = ap.parse_args(argv)

    every = arms(args.stress_lr_scale)
    names = args.arms or [n for n, a in every.items() if not (args.no_stress and a.lr_scale != 1)]
    unknown = [n for n in names if n not in every]
    if unknown:
        ap.error(f"unknown arms {unknown}; arms: {', '.join(every)}")
    chosen = {n: every[n] for n in names}
    if args.quick:
        long_settings = stress_settings = settings(**QUICK, extra=[*QUICK_EXTRA, *args.overrides])
    else:
        long_settings = settings(args.steps, args.eval_every, args.eval_size, args.batch, list(args.overrides))
        stress_settings = settings(args.stress_steps, args.eval_every, args.eval_size, args.batch, list(args.overrides))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    if not args.report_only:
        from tqdm.auto import tqdm

        # seed-major: an interrupted sweep has every arm at the same number of seeds
        jobs = [(arm, seed) for seed in args.seeds for arm in chosen.values()]
        t0 = time.perf_counter()
        for arm, seed in tqdm(jobs, desc="stability", unit="run", file=sys.stderr):
            run_one(out, TASK, arm, seed, stress_settings if arm.lr_scale != 1 else long_settings, log)
        log(f"stability: {len(jobs)} runs in {time.perf_counter() - t0:.0f} s")
    report = summarize(out, chosen, args.seeds)
    return _claim.write_report(out, report, tables, plot, Path(args.plot) if args.plot else out / "stability.png")


if __name__ == "__main__":
    sys.exit(main())
