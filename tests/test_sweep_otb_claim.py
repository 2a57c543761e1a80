"""benchmarks/sweep_otb_claim.py: its statistics against brute force, and its --quick smoke run as a
user runs it (a subprocess from another folder), resumable."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "benchmarks" / "sweep_otb_claim.py"


import sweep_otb_claim as sweep  # noqa: E402 - benchmarks/ is on pytest's pythonpath (pyproject.toml)


def test_accuracy_at_tokens_interpolates_between_evaluations_and_stops_at_the_run_end():
    curve = [(0, 0.0, 0.2), (5, 1000.0, 0.4), (10, 3000.0, 0.8)]
    assert sweep.accuracy_at_tokens(curve, 0) == 0.2
    assert sweep.accuracy_at_tokens(curve, 500) == pytest.approx(0.3)
    assert sweep.accuracy_at_tokens(curve, 2000) == pytest.approx(0.6)
    assert sweep.accuracy_at_tokens(curve, 3000) == 0.8
    assert math.isnan(sweep.accuracy_at_tokens(curve, 3001))  # never extrapolated
    assert sweep.tokens_to_reach(curve, 0.4) == 1000.0 and sweep.tokens_to_reach(curve, 0.5) == 3000.0
    assert math.isnan(sweep.tokens_to_reach(curve, 0.9))


def _t_quantile_975(df: int) -> float:
    """Brute force: the 97.5 % quantile of Student's t, closed form for df=1 (Cauchy), else by
    integrating the density on a fine grid (the tail past 400 is below 1e-5 of the mass for df >= 2)."""
    if df == 1:
        return math.tan(math.pi * 0.475)
    step, grid_end = 0.002, 400.0
    dens = [(1 + (i * step) ** 2 / df) ** (-(df + 1) / 2) for i in range(int(grid_end / step) + 1)]
    half = sum((a + b) / 2 * step for a, b in zip(dens, dens[1:]))
    area = 0.0
    for i, (a, b) in enumerate(zip(dens, dens[1:])):
        area += (a + b) / 2 * step
        if area >= 0.95 * half:
            return (i + 1) * step
    raise AssertionError("unreachable")


def test_mean_ci_against_the_t_formula_by_brute_force():
    rng = random.Random(0)
    for n in (2, 3, 5):
        vals = [rng.random() for _ in range(n)]
        m, half, k = sweep.mean_ci(vals + [math.nan])  # NaNs (a run that never got there) are dropped
        assert k == n and m == pytest.approx(statistics.fmean(vals))
        assert half == pytest.approx(_t_quantile_975(n - 1) * statistics.stdev(vals) / math.sqrt(n), rel=2e-3)
    assert sweep.mean_ci([0.5]) == (0.5, 0.0, 1) and sweep.mean_ci([])[2] == 0


@pytest.mark.slow
def test_quick_sweep_runs_each_arm_writes_its_report_and_resumes(tmp_path, tiny_model_dir):
    """Three arms (TIR-OTB, its void-turn-masking arm, GRPO n=16) on the chain task, one seed, from
    another folder: each run has its held-out curve and token counts; a rerun trains nothing."""
    out = tmp_path / "sweep"
    cmd = [
        sys.executable,
        str(SWEEP),
        "--quick",
        "--out",
        str(out),
        "--arms",
        "tir_otb_n4",
        "tir_otb_n4_void",
        "grpo_n16",
        "--tasks",
        "chain",
        "--seeds",
        "0",
        "--set",
        f"model.path={tiny_model_dir}",
    ]
    first = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    arms = report["chain"]["arms"]
    assert sorted(arms) == ["grpo_n16", "tir_otb_n4", "tir_otb_n4_void"]
    for name, arm in arms.items():
        run = arm["runs"]["0"]
        assert [p[0] for p in run["curve"]] == [0, 1, 2]  # before, eval.every=1, after
        assert run["sampled_tokens"] > 0 and run["tool_tokens"] >= 0 and run["steps"] == 2
        assert [p[0] for p in run["train_curve"]] == [1, 2]  # the training batches' accuracy, every step
        assert run["train_curve"][-1][1] == run["sampled_tokens"]
        cfg = (out / "chain" / name / "seed0" / "sweep.log").read_text().splitlines()[0]
        assert "data.task=chain" in cfg and "eval.every=1" in cfg
        assert ("algorithm.filter.void_turns=true" in cfg) == (name == "tir_otb_n4_void")
        assert f"rollout.n={sweep.ARMS[name].n}" in cfg
    # n=16 samples four times the tokens of n=4 per step, roughly
    assert arms["grpo_n16"]["runs"]["0"]["sampled_tokens"] > 2 * arms["tir_otb_n4"]["runs"]["0"]["sampled_tokens"]
    assert "| GRPO n=16 |" in (out / "table.md").read_text() and "| GRPO n=16 |" in first.stdout
    assert (out / "accuracy_vs_tokens.png").stat().st_size > 10_000
    metrics = {p: p.read_bytes() for p in out.glob("chain/*/seed0/metrics.jsonl")}
    second = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.count("done already, skipped") == 3
    assert {p: p.read_bytes() for p in metrics} == metrics
