"""benchmarks/gpu_check.py (run by scripts/gpu_check.sh): a clear failure without a GPU, and the
whole step (HF-engine rollout, FSDP2 actor on a one-rank gloo group, TIR-OTB, update, weight sync,
fused vs unfused Σπ² replays) on CPU with a tiny Qwen3 shape (--cpu-smoke); the shapes the GPU
checks and benchmarks build (otb_tir.defaults.shapes)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_benchmarks_shapes_build_the_models_their_names_say():
    """otb_tir.defaults.shapes.build_model, which bench_engine_decode.py and bench_pack_rows.py share (on
    the meta device: the shapes, no weights)."""
    from otb_tir.defaults.shapes import SHAPES, build_model

    sizes = {}
    for name in SHAPES:
        model = build_model(name, torch.device("meta"), torch.bfloat16)
        assert not model.training and model.dtype == torch.bfloat16 and model.device.type == "meta"
        embedding = model.get_input_embeddings().weight.numel()
        sizes[name] = round(sum(p.numel() for p in model.parameters()) - embedding, -5) / 1e6
    # besides the (tied) embedding; in all 6.6M, 80.7M, 596.0M, 29.9M, 151.0M (tests/test_bench_scale.py)
    assert sizes == {"small": 6.0, "medium": 79.1, "qwen3-0.6b": 440.5, "30m": 11.0, "150m": 113.3}
    gpu_check = _load()
    assert gpu_check.SMOKE["num_hidden_layers"] == 2 and gpu_check.QWEN3_0_6B is SHAPES["qwen3-0.6b"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_fails_clearly(capsys):
    assert _load().main([]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--cpu-smoke" in err
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr


@pytest.mark.slow
def test_cpu_smoke_runs_every_phase(tmp_path):
    out = tmp_path / "smoke.json"
    # a fresh process: the FSDP path starts (and ends) its own one-rank process group
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--cpu-smoke",
            "--prompts",
            "1",
            "--n",
            "2",
            "--response-length",
            "16",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(out.read_text())
    assert info["fsdp"] is True and info["trajectories"] == 2
    st = info["step"]
    for phase in ("rollout_s", "advantage_s", "update_s", "weight_sync_s"):
        assert st[f"timing/{phase}"] > 0, phase
    # 2 trajectories, one epoch, one mini-batch: the update's forward gives the old stats, no separate pass
    assert st["one_forward"] == 1.0 and st["timing/old_log_prob_s"] == 0.0
    assert 0 < st["sampled_tokens"] <= 2 * 16 and st["rollout_tokens_per_s"] > 0
    assert st["grad_norm"] > 0  # the token-hash reward gives non-zero advantages
    f, u = info["sum_pi_squared"]["fused"], info["sum_pi_squared"]["unfused"]
    assert "error" not in f and "error" not in u
    d = info["fused_vs_unfused"]  # the two Σπ² paths agree on the same batch and weights
    assert d["max_abs_diff_log_probs"] < 1e-4 and d["max_abs_diff_sum_pi_squared"] < 1e-5
    assert d["grad_norm_rel_diff"] < 1e-4 and f["grad_norm"] > 0
    assert "one training step" in r.stdout and "unfused" in r.stdout
