"""benchmarks/bench_grad_variance.py: its statistics against brute force, and its --quick smoke run
as a user runs it (a subprocess from another folder), resumable."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_grad_variance.py"


import bench_grad_variance as bench  # noqa: E402 - benchmarks/ is on pytest's pythonpath (pyproject.toml)


def test_variance_snr_and_bootstrap_against_brute_force():
    rng = np.random.default_rng(0)
    k, p = 7, 50
    g = rng.normal(size=(k, p)) + 0.3  # K gradients with a nonzero mean
    st = bench.variance_stats(g.sum(0), float((g**2).sum()), k)
    mean = g.mean(0)
    var = sum(float(((x - mean) ** 2).sum()) for x in g) / (k - 1)  # trace of the sample covariance
    assert st["variance"] == pytest.approx(var)
    assert st["norm2_of_mean"] == pytest.approx(float(mean @ mean))
    assert st["signal"] == pytest.approx(float(mean @ mean) - var / k)
    assert st["snr"] == pytest.approx(st["signal"] / var)
    gram = g @ g.T
    v, snr = bench.gram_stats(gram)
    assert v == pytest.approx(var) and snr == pytest.approx(st["snr"])
    # a resample's statistics from counts equal those of the explicitly resampled gradients
    idx = np.array([0, 0, 3, 4, 4, 4, 6])
    counts = np.bincount(idx, minlength=k)[None].astype(float)
    gb = g[idx]
    vb = bench.variance_stats(gb.sum(0), float((gb**2).sum()), k)
    got_v, got_snr = bench.gram_stats(gram, counts)
    assert got_v[0] == pytest.approx(vb["variance"]) and got_snr[0] == pytest.approx(vb["snr"])
    # a scaled copy: the variance ratio is the scale squared in every resample, the SNR ratio 1
    r = bench.ratio_ci(4.0 * gram, gram, boot=200)
    assert r["ratio"] == pytest.approx(4.0) and r["lo"] == pytest.approx(4.0) and r["hi"] == pytest.approx(4.0)
    assert r["snr_ratio"] == pytest.approx(1.0) and r["snr_lo"] == pytest.approx(1.0)
    assert math.isnan(bench.ratio_ci(gram[:3, :3], gram[:3, :3], boot=200)["lo"])  # too few batches for a CI


def test_reward_energy_correlation_counts_only_groups_where_both_vary():
    rewards = np.array([1, 0, 0, 1, 1, 1, 0, 1, 0, 1], dtype=float)
    energy = np.array([1, 2, 3, 4, 5, 6, 7, 7, 8, 9], dtype=float)
    group = np.array([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])
    # group 0: both vary; 1: flat reward; 2: flat W; 3: both vary (two points: corr 1)
    got = bench.group_reward_energy(rewards, energy, group)
    assert got["groups"] == 4 and got["reward_varies_frac"] == 0.75 and got["both_vary_frac"] == 0.5
    want0 = np.corrcoef([1, 0, 0], [1, 2, 3])[0, 1]
    assert got["corr_reward_w"] == pytest.approx((want0 + 1.0) / 2)


def test_policy_gradient_vector_is_the_gradient_whose_norm_the_paired_bench_measures(tiny_model_factory):
    """bench_estimators.policy_gradient (shared with bench_estimators): its norm is policy_gradient_norm's,
    it is linear in the advantages, and the weights do not move."""
    import bench_estimators  # benchmarks/ is on pytest's pythonpath
    import torch

    from otb_tir.trainer.actor import ActorSettings, compute_old_stats

    torch.manual_seed(0)
    model = tiny_model_factory()
    b, p, r = 4, 5, 8
    input_ids = torch.randint(3, model.config.vocab_size, (b, p + r))
    attention_mask = torch.ones(b, p + r, dtype=torch.long)
    position_ids = attention_mask.cumsum(-1) - 1
    mask = torch.ones(b, r)
    mask[1, 3:5] = 0.0  # a tool span
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": input_ids[:, p:],
        "response_mask": mask,
    }
    settings = ActorSettings(ppo_micro_batch_size=3)
    tensors["old_log_probs"] = compute_old_stats(model, tensors, settings).log_probs
    adv = torch.randn(b, r) * mask
    before = [q.detach().clone() for q in model.parameters()]
    g = bench_estimators.policy_gradient(model, tensors, adv, mask, settings)
    assert g.shape == (sum(q.numel() for q in model.parameters()),) and bool(torch.isfinite(g).all())
    norm = bench_estimators.policy_gradient_norm(model, tensors, adv, mask, settings)
    assert float(g.double().norm()) == pytest.approx(norm, rel=1e-4)  # the float32 norm of clip_grad_norm_
    g3 = bench_estimators.policy_gradient(model, tensors, 3 * adv, mask, settings)
    assert float((g3 - 3 * g).norm()) <= 1e-5 * float((3 * g).norm())
    assert all(torch.equal(x, q) for x, q in zip(before, model.parameters()))
    assert all(q.grad is None for q in model.parameters())


def _reward_file(folder: Path) -> Path:
    """A reward that varies within groups even for the untrained tiny policy (so gradients are not 0)."""
    f = folder / "parity_reward.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) % 2)\n"
    )
    return f


def test_quick_run_writes_finite_results_and_resumes(tmp_path, tiny_model_dir):
    out = tmp_path / "gv"
    cmd = [
        sys.executable,
        str(BENCH),
        "--quick",
        "--out",
        str(out),
        "--set",
        f"model.path={tiny_model_dir}",
        f"reward.custom_reward_function.path={_reward_file(tmp_path)}",
    ]
    first = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for name in ("results.json", "table.md", "grad_variance.png", "cells/arith_warm_n2.json"):
        assert (out / name).is_file(), name
    assert not list((out / "cells").glob(".tmp_*"))  # the gradient scratch files are gone
    res = json.loads((out / "results.json").read_text())
    cell = res["cells"]["arith_warm"]["2"]
    assert cell["key"]["k"] == 2 and cell["key"]["batch"] == 2 and len(cell["estimators"]) == 5
    for name, s in cell["estimators"].items():
        for key in ("mean_sq_norm", "norm2_of_mean", "variance", "signal", "variance_from_gram"):
            assert math.isfinite(s[key]), (name, key)
        assert s["variance"] >= 0 and s["mean_sq_norm"] >= 0
        assert s["variance"] == pytest.approx(s["variance_from_gram"], rel=1e-6, abs=1e-12)
    ctx = cell["context"]
    assert 0 <= ctx["reward_varies_frac"] <= 1 and 0 <= ctx["both_vary_frac"] <= ctx["reward_varies_frac"]
    if ctx["reward_varies_frac"] > 0:  # a group with a signal: a nonzero gradient
        assert max(s["mean_sq_norm"] for s in cell["estimators"].values()) > 0
        # RLOO's advantage is n/(n−1) × GRPO-without-std's on the same rollouts: (n/(n−1))² the variance
        est = cell["estimators"]
        assert est["rloo"]["mean_sq_norm"] == pytest.approx(4 * est["grpo_no_std"]["mean_sq_norm"], rel=1e-3)
    row = "| arith_warm | 2 | TIR-OTB |"
    assert row in first.stdout and row in (out / "table.md").read_text()
    second = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "done already, skipped" in second.stderr
    assert json.loads((out / "results.json").read_text())["cells"]["arith_warm"]["2"]["wall_s"] == cell["wall_s"]
