"""benchmarks/figures.py, the one figure helper of the benchmarks' plots, and each plot drawn through it
from a small hand-made report (the sweeps' own tests draw them after real runs, marked slow)."""

from __future__ import annotations

# benchmarks/ is on pytest's pythonpath (pyproject.toml): its scripts import as modules
import bench_grad_variance
import matplotlib.pyplot as plt
import pytest
import sweep_otb_claim
import sweep_stability
from figures import figure


def test_figure_saves_the_grid_into_a_new_folder_and_closes_it_even_when_drawing_fails(tmp_path):
    path = tmp_path / "new" / "folder" / "grid.png"
    with figure(path, 2, 3, figsize=(6, 4)) as axes:
        assert len(axes) == 2 and len(axes[0]) == 3  # axes[row][col], a 1 x 1 grid too
        axes[1][2].plot([0, 1], [1, 0])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plt.get_fignums() == []
    with pytest.raises(KeyError), figure(tmp_path / "failed.png", 1, 1, figsize=(2, 2)) as axes:
        assert len(axes) == 1 and len(axes[0]) == 1
        axes[0][0].plot({}["no such series"])
    assert not (tmp_path / "failed.png").exists() and plt.get_fignums() == []


def test_each_benchmarks_plot_draws_a_report(tmp_path):
    curve = [(0, 0.0, 0.2), (1, 500.0, 0.4), (2, 1000.0, 0.5)]  # (step, sampled tokens, accuracy)
    runs = {"0": {"curve": curve, "train_curve": curve[1:]}, "1": {"curve": curve, "train_curve": curve[1:]}}
    claim = {"arith": {"arms": {"tir_otb_n4": {"label": "TIR-OTB n=4", "runs": runs}}}}
    assert sweep_otb_claim.plot(claim, tmp_path / "a" / "claim.png").stat().st_size > 10_000

    run = {"curve": [(0, 0.2), (5, 0.4)], "grad_norm": [1.0, 2.0, 1.5, 1.2, 0.9, 1.1], "steps": [1, 2, 3, 4, 5, 6]}
    stab = {
        "grpo_n4": {"lr_scale": 1, "label": "GRPO n=4", "runs": {"0": run, "1": run}},
        "grpo_n4_stress": {"lr_scale": 8, "label": "GRPO n=4 stress", "runs": {"0": run}},
    }
    assert sweep_stability.plot(stab, tmp_path / "b" / "stability.png").stat().st_size > 10_000

    est = {"grpo": {"variance": 2.0, "snr": 0.5}, "rloo": {"variance": 1.5, "snr": 0.7}}
    cells = {"arith_warm": {n: {"estimators": est, "key": {"k": 4, "batch": 8}} for n in (2, 4, 8)}}
    bench_grad_variance.plot(cells, ["grpo", "rloo"], tmp_path / "c" / "grad_variance.png")
    assert (tmp_path / "c" / "grad_variance.png").stat().st_size > 10_000
    assert plt.get_fignums() == []
