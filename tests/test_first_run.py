"""benchmarks/first_run.py as a user runs it: a subprocess from another folder, an empty cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_first_run_builds_the_warm_start_once_and_reports_each_seed(tmp_path):
    work = tmp_path / "runs"
    proc = subprocess.run(
        [
            *(sys.executable, ROOT / "benchmarks" / "first_run.py", "--seeds", "0", "--quick", "--keep", work),
            *("--float-paths", "native,avx2"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # one warm start was built, in the benchmark's own (initially empty) cache, and recorded
    (record,) = (work / "cache").glob("warm-*/otb_tir_warm_start.json")
    assert len(json.loads(record.read_text())["losses"]) == 60
    kernels = {}
    for path, run in (("native", "seed0"), ("avx2", "avx2-seed0")):
        summary = json.loads((work / run / "summary.json").read_text())
        acc = f"{summary['before']['accuracy']:.2f} → **{summary['after']['accuracy']:.2f}**"
        assert f"| {path} | 0 | " in out and acc in out
        kernels[path] = summary["cpu_kernels"]
    # the second path's run computed on torch's AVX2 kernels: what a CPU without AVX-512 runs
    assert kernels["avx2"] == "torch CPU kernels AVX2", kernels
    assert kernels["native"].startswith("torch CPU kernels ")
    assert "| native | 0 | empty (puts the warm start in the cache)" in out and "| avx2 | 0 | warm |" in out
    assert "native: over 1 seed, mean [min, max]: held-out accuracy" in out
    assert "all 2 float paths: over 2 seeds," in out
    assert "warm start built here (first run): traces" in out  # --quick: a small one, never the shipped
    assert "speed reference" in out and "GFLOP/s" in out

    # a non-empty cache is refused: the figure would not be a first run's
    again = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "first_run.py", "--quick", "--keep", work],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 2 and "not empty" in again.stderr
