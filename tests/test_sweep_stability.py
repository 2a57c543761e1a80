"""benchmarks/sweep_stability.py: its collapse and surge statistics against brute force, and its
--quick smoke run as a user runs it (a subprocess from another folder), resumable."""

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
SCRIPT = ROOT / "benchmarks" / "sweep_stability.py"


import sweep_stability as stab  # noqa: E402 - benchmarks/ is on pytest's pythonpath (pyproject.toml)


def test_surges_against_a_brute_force_median():
    rng = random.Random(0)
    grad = [rng.uniform(0.5, 2.0) for _ in range(30)]
    grad[20] = 40.0  # one spike
    ratios = stab.surges(grad, window=10)
    assert len(ratios) == 20
    for i, r in enumerate(ratios):
        before = sorted(grad[i : i + 10])
        assert r == pytest.approx(grad[i + 10] / ((before[4] + before[5]) / 2))
    assert max(ratios) == ratios[10] > 15
    assert stab.surges([1.0] * 5) == []  # too short to have a window
    # steps without a gradient (every group tied) are not updates: left out, not a median of ~0
    tied = [x for i, x in enumerate(grad) for x in ((x, 0.0 if i % 2 else 1e-7) if i % 3 else (x,))]
    assert stab.surges(tied, window=10) == ratios
    assert stab.surges([2e-7] * 5 + [0.05] * 11) == [1.0]  # a window of residue is not a baseline


@pytest.mark.parametrize(
    "curve, tools, expected",
    [
        ([(0, 0.2), (10, 0.5), (20, 0.6), (30, 0.65)], [], None),  # learning
        ([(0, 0.2), (10, 0.6), (20, 0.3), (30, 0.35)], [], 20),  # fell 0.3 below its best, stayed
        ([(0, 0.2), (10, 0.6), (20, 0.3), (30, 0.55)], [], None),  # fell, then recovered
        ([(0, 0.5), (10, 0.0), (20, 0.0)], [], 10),
        ([(0, 0.1), (10, 0.1), (20, 0.1)], [(0, 0.8), (10, 0.8), (20, 0.2)], 20),  # stopped calling tools
    ],
)
def test_collapse_step(curve, tools, expected):
    assert stab.collapse_step(curve, tools, tools[0][1] if tools else 0.8) == expected


def test_arms_are_the_fair_comparison():
    arms = stab.arms(8.0)
    assert {a.name for a in arms.values() if a.lr_scale == 1} == {
        "tir_otb_n4",
        "grpo_n4",
        "grpo_nostd_n4",
        "rloo_n4",
        "tir_otb_n16",
    }
    assert "algorithm.norm_adv_by_std_in_grpo=false" in arms["grpo_nostd_n4"].overrides(1e-4)
    assert "algorithm.norm_adv_by_std_in_grpo=false" in arms["grpo_nostd_n4_stress"].overrides(1e-4)
    assert "actor.optim.lr=0.0008" in arms["rloo_n4_stress"].overrides(1e-4)
    assert all(a.n == 4 for a in arms.values() if a.lr_scale != 1)


def test_both_sweeps_take_the_common_options(tmp_path, capsys):
    """--quick, --report-only, --plot and --set come from one place (sweep_otb_claim.add_sweep_options):
    a report from a folder without finished runs says so, in both sweeps."""
    import sweep_otb_claim as claim

    for sweep in (claim, stab):
        out = tmp_path / sweep.__name__
        args = ["--out", str(out), "--quick", "--report-only", "--plot", str(tmp_path / "p.png"), "--set", "a=b"]
        assert sweep.main(args) == 1
        assert "no finished runs yet" in capsys.readouterr().err
        assert out.is_dir() and not (tmp_path / "p.png").exists()


@pytest.mark.slow
def test_quick_sweep_runs_an_arm_writes_its_report_and_resumes(tmp_path, tiny_model_dir):
    out = tmp_path / "stab"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--quick",
        "--out",
        str(out),
        "--arms",
        "grpo_nostd_n4",
        "tir_otb_n4_stress",
        "--seeds",
        "0",
        "--set",
        f"model.path={tiny_model_dir}",
    ]
    first = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert sorted(report) == ["grpo_nostd_n4", "tir_otb_n4_stress"]
    for name, arm in report.items():
        run = arm["runs"]["0"]
        assert run["steps"] == [1, 2] and len(run["grad_norm"]) == 2
        assert all(math.isfinite(g) and g >= 0 for g in run["grad_norm"])
        assert [s for s, _ in run["curve"]] == [0, 1, 2]
        cmdline = (out / "multistep" / name / "seed0" / "sweep.log").read_text().splitlines()[0]
        assert "data.task=multistep" in cmdline and "actor.ppo_epochs=1" in cmdline
        assert ("norm_adv_by_std_in_grpo=false" in cmdline) == (name == "grpo_nostd_n4")
        cfg = (out / "multistep" / name / "seed0" / "config.yaml").read_text()
        assert "max_assistant_turns: 6" in cfg  # the task's own turns
    assert "| GRPO without std n=4 |" in (out / "table.md").read_text()
    assert (out / "stability.png").stat().st_size > 10_000
    metrics = {p: p.read_bytes() for p in out.glob("multistep/*/seed0/metrics.jsonl")}
    second = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.count("done already, skipped") == 2
    assert {p: p.read_bytes() for p in metrics} == metrics
    assert statistics.fmean(report["grpo_nostd_n4"]["runs"]["0"]["grad_norm"]) >= 0
