"""benchmarks/gpu_check.py (run by scripts/gpu_check.sh): a clear failure without a GPU; --cpu-smoke on
CPU with a tiny Qwen3 shape: the local leg's whole step (HF-engine rollout, FSDP2 actor on a one-rank
gloo group, TIR-OTB, update, weight sync, fused vs unfused Σπ² replays), the verl legs composed for a GPU
(V1 sync; separate_async with the nccl checkpoint engine and a rollout pool of its own; nothing of the
CPU profile) and the sglang leg's command, one table row each; a leg that cannot run is a skipped row,
a hung one is killed at its timeout; the shapes the GPU checks and benchmarks build
(otb_tir.defaults.shapes)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gpu_check_commands as commands  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
import gpu_check_legs as legs
import pytest
import torch
from omegaconf import OmegaConf

from tests.support.optional import need

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


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """``gpu_check.py --cpu-smoke`` (every leg), in a fresh process as scripts/gpu_check.sh runs it: the FSDP
    path starts (and ends) its own one-rank process group. ~25 s on 2 idle cores."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    out, work = tmp / "smoke.json", tmp / "work"
    argv = ["--cpu-smoke", "--prompts", "1", "--n", "2", "--response-length", "16", "--work", str(work)]
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *argv, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout, work


def _args(**kw):
    import argparse

    return argparse.Namespace(**{"prompts": 1, "n": 2, "cpu_smoke": True, **kw})


@pytest.mark.slow
def test_cpu_smoke_runs_every_phase(smoke):
    full, stdout, _ = smoke
    info = full["local"]  # the local leg's own figures
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
    assert "one training step" in stdout and "unfused" in stdout


@pytest.mark.slow
def test_cpu_smoke_prints_one_row_per_leg(smoke):
    need("verl")  # the verl legs are composed with verl's own config classes
    full, stdout, _ = smoke
    status = {row["leg"]: row["status"] for row in full["legs"]}
    assert status == {
        "local": "ok (cpu)",
        "verl_sync": "wired (dry run)",
        "verl_separate_async": "wired (dry run)",
        "sglang": "wired (dry run)",
    }
    assert full["failed"] == []
    header = stdout[stdout.index("| leg") :].splitlines()[0]
    for column in ("status", "wall s", "step s", "tokens/s", "peak GPU GiB", "weight sync s"):
        assert column in header
    local = next(r for r in full["legs"] if r["leg"] == "local")
    assert local["step_s"] > 0 and local["tokens_per_s"] > 0 and local["weight_sync_s"] > 0
    for leg in legs.LEGS:
        assert f"| {leg} (" in stdout and os.path.isfile(next(r["log"] for r in full["legs"] if r["leg"] == leg))


@pytest.mark.slow
def test_the_verl_legs_are_v1_sync_and_separate_async_with_nccl_for_a_gpu(smoke):
    """What the two verl legs composed for a GPU (trainer.device=cuda verl.dry_run=true, read back from
    their run folders): the V1 trainer's sync mode, colocated on one GPU; separate_async with verl's nccl
    checkpoint engine and a rollout pool of its own; the saved random model; nothing of the CPU profile."""
    need("verl")
    from otb_tir.verl.cpu import ENV_FLAG, MODULE

    _, _, work = smoke
    model = (work / "model_smoke").resolve()
    sync = OmegaConf.load(work / "verl_sync" / "verl_config.yaml")
    sep = OmegaConf.load(work / "verl_separate_async" / "verl_config.yaml")
    assert sync.trainer.use_v1 is True and sync.trainer.v1.trainer_mode == "otb_sync"
    assert sync.actor_rollout_ref.hybrid_engine is True and sync.algorithm.rollout_correction.rollout_is is None
    assert sep.trainer.use_v1 is True and sep.trainer.v1.trainer_mode == "otb_separate_async"
    ro = sep.actor_rollout_ref.rollout
    assert ro.checkpoint_engine.backend == "nccl" and ro.nnodes == 1 and ro.n_gpus_per_node == 1
    for v, name in ((sync, "verl_sync"), (sep, "verl_separate_async")):
        run = json.loads((work / name / "verl_run.json").read_text())
        assert v.trainer.device == "cuda" and run["device"] == "gpu" and v.trainer.n_gpus_per_node == 1
        assert v.actor_rollout_ref.rollout.name == "vllm" and v.actor_rollout_ref.model.path == str(model)
        assert v.actor_rollout_ref.rollout.enforce_eager is True
        assert v.actor_rollout_ref.rollout.gpu_memory_utilization == commands.VLLM_GPU_MEMORY
        env = v.ray_kwargs.ray_init.runtime_env.env_vars
        assert ENV_FLAG not in env and ENV_FLAG not in run["env"] and MODULE not in env.VERL_USE_EXTERNAL_MODULES
        assert "gloo" not in json.dumps(OmegaConf.to_container(v)) and "num_gpus" not in v.ray_kwargs.ray_init
        assert commands.check_verl_wiring(name[len("verl_") :], v, run, model, _args()) == []
    # the check the script applies finds each break of that wiring
    run = json.loads((work / "verl_sync" / "verl_run.json").read_text())
    broken = [
        (sync, "sync", "trainer.v1.trainer_mode", "otb_colocate_async", "otb_sync"),
        (sync, "sync", "actor_rollout_ref.rollout.name", "sglang", "vLLM"),
        (sync, "sync", "trainer.device", "cpu", "cuda"),
        (sep, "separate_async", "actor_rollout_ref.rollout.checkpoint_engine.backend", "gloo", "nccl"),
        (sep, "separate_async", "actor_rollout_ref.rollout.n_gpus_per_node", 0, "pool of its own"),
        (sync, "sync", "actor_rollout_ref.rollout.free_cache_engine", False, "CPU profile"),
    ]
    for v, mode, key, value, named in broken:
        bad = OmegaConf.create(OmegaConf.to_container(v))
        OmegaConf.update(bad, key, value)
        problems = commands.check_verl_wiring(mode, bad, run, model, _args())
        assert any(named in p for p in problems), (key, problems)
    leaked = {**run, "env": {**run["env"], ENV_FLAG: "1"}}
    assert any("CPU profile" in p for p in commands.check_verl_wiring("sync", sync, leaked, model, _args()))


@pytest.mark.slow
def test_the_sglang_leg_is_the_local_trainer_serving_with_sglang_on_cuda(smoke):
    full, _, work = smoke
    argv = next(r["argv"] for r in full["legs"] if r["leg"] == "sglang")
    assert argv[1:3] == ["-m", "otb_tir.train"] and "rollout.name=sglang" in argv
    assert not [a for a in argv if a.startswith(("trainer=", "verl."))]  # the local trainer
    cfg = OmegaConf.load(work / "sglang_config.yaml")  # what --print-config composed from that command
    model = (work / "model_smoke").resolve()
    assert cfg.trainer.name == "local" and cfg.rollout.name == "sglang" and cfg.trainer.device == "cuda"
    assert cfg.rollout.engine_kwargs == {"disable_cuda_graph": True, "mem_fraction_static": commands.SGLANG_GPU_MEMORY}
    assert commands.check_sglang_wiring(cfg, model, _args()) == []
    for key, value, named in (
        ("rollout.engine_kwargs.disable_cuda_graph", False, "CUDA graphs off"),
        ("rollout.name", "hf", "rollout.name=sglang"),
        ("trainer.device", "cpu", "trainer.device=cuda"),
    ):
        bad = OmegaConf.create(OmegaConf.to_container(cfg))
        OmegaConf.update(bad, key, value)
        assert named in commands.check_sglang_wiring(bad, model, _args()), key


def test_a_leg_that_cannot_run_here_is_skipped_naming_why():
    sep, local = legs.LEGS["verl_separate_async"], legs.LEGS["local"]
    assert "needs 2 GPUs (1 visible)" in legs.skip_reason(sep, smoke=False, gpus=1)
    absent = dataclasses.replace(sep, needs=("json", "otb_no_such_package"), smoke_needs=("otb_no_such_package",))
    assert legs.skip_reason(absent, smoke=False, gpus=2) == "otb_no_such_package not installed"
    assert legs.skip_reason(absent, smoke=True, gpus=0) == "otb_no_such_package not installed"
    assert legs.skip_reason(dataclasses.replace(absent, needs=("json",)), smoke=False, gpus=2) is None
    assert legs.skip_reason(local, smoke=False, gpus=1) is None
    assert legs.skip_reason(local, smoke=False, gpus=0) == "needs 1 GPU (0 visible)"
    # the GPU legs need the serving engines and verl; --cpu-smoke's compositions need no engine
    assert "vllm" in legs.LEGS["verl_sync"].needs and "sglang" in legs.LEGS["sglang"].needs
    assert "vllm" not in legs.LEGS["verl_sync"].smoke_needs and not legs.LEGS["sglang"].smoke_needs


@pytest.mark.slow  # its 3 s timeout
def test_a_hung_leg_is_killed_with_its_processes_at_its_timeout(tmp_path):
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    res = legs.run_leg([sys.executable, "-c", code], 3, tmp_path / "leg.log", stdout=tmp_path / "out.txt")
    assert res["timed_out"] is True and res["rc"] != 0
    child = int((tmp_path / "out.txt").read_text().split()[0])  # the leg's own child process: gone too

    def alive(pid: int) -> bool:  # a zombie (killed, not yet reaped) is not
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (FileNotFoundError, ProcessLookupError):
            return False

    for _ in range(50):
        if not alive(child):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the leg's child {child} outlived the timeout")


@pytest.mark.slow
def test_a_failing_leg_is_a_failed_row_and_exit_1(tmp_path):
    out = tmp_path / "out.json"
    argv = ["--cpu-smoke", "--legs", "sglang", "--prompts", "0", "--work", str(tmp_path / "w"), "--out", str(out)]
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *argv], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 1, r.stdout + r.stderr
    (row,) = json.loads(out.read_text())["legs"]
    assert row["status"].startswith("failed: exit 2") and "data.train_batch_size" in r.stdout  # the log's end


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_the_gpu_run_on_a_machine_without_what_a_leg_needs_skips_it_and_saves_no_model(tmp_path, capsys):
    """run_legs as on a GPU (no --cpu-smoke) where there is none: every leg a skipped row naming why, no
    leg started, no model written, nothing failed."""
    args = _args(cpu_smoke=False, no_fsdp=False, response_length=None, micro_batch_size=2, leg_timeout=None)
    info = legs.run_legs(args, list(legs.LEGS), tmp_path, 570, {})
    status = {row["leg"]: row["status"] for row in info["legs"]}
    assert status["local"] == "skipped: needs 1 GPU (0 visible)"
    assert status["verl_separate_async"].startswith("skipped: needs 2 GPUs (0 visible)")
    assert all(s.startswith("skipped: ") for s in status.values()) and info["failed"] == []
    assert list(tmp_path.iterdir()) == [] and "leg " not in capsys.readouterr().out
    assert info["table"].count("| skipped: ") == 4
