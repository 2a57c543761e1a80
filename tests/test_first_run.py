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
        [sys.executable, ROOT / "benchmarks" / "first_run.py", "--seeds", "0", "1", "--quick", "--keep", work],
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
    for seed in (0, 1):
        summary = json.loads((work / f"seed{seed}" / "summary.json").read_text())
        acc = f"{summary['before']['accuracy']:.2f} → **{summary['after']['accuracy']:.2f}**"
        assert f"| {seed} | " in out and acc in out
    assert "empty (puts the warm start in the cache)" in out and "| 1 | warm |" in out
    assert "over 2 seeds, mean [min, max]: held-out accuracy" in out
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
