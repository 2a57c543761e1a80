"""recipes/eval_tool_use.py end to end, as a user runs it (subprocess): the tiny policy, the HF
engine, the real python/calculator sandbox; the JSON parses and holds every figure, the Markdown
and PNGs exist and open, --compare prints and plots, bad input fails at start with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "eval_tool_use.py"


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, str(RECIPE), *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env
    )


@pytest.mark.slow
def test_recipe_end_to_end_and_compare(tmp_path, tiny_model_dir):
    common = [
        f"--model={tiny_model_dir}",
        "data.size=3",
        "rollout.n=2",
        "eval.pass_k=[1,2]",
        "rollout.response_length=48",
        "rollout.max_tokens_per_turn=24",
        f"output.dir={tmp_path}",
    ]
    a = run(*common, "output.name=a", "rollout.temperature=1.0")
    assert a.returncode == 0, a.stderr[-3000:]
    assert "| accuracy/pass@2" in a.stdout and "tools disabled" in a.stdout
    assert "rollout" in a.stderr  # the tqdm progress bar
    report = json.loads((tmp_path / "a.json").read_text())
    for section in ("with_tools", "without_tools"):
        fig = report[section]["overall"]
        for key in [
            "accuracy/mean@n",
            "accuracy/pass@1",
            "accuracy/pass@2",
            "tools/call_rate",
            "tools/calls_per_episode",
            "tools/success_rate",
            "errors/syntax_error",
            "errors/runtime_error",
            "errors/timeout",
            "errors/memory",
            "errors/output_cut",
            "errors/malformed_call",
            "errors/unknown_tool",
            "turns/mean",
            "episode/void_turn_rate",
            "response/tool_token_share",
            "response/length_mean",
        ]:
            assert key in fig, (section, key)
        assert any(k.startswith("turns/hist/") for k in fig) and any(k.startswith("finish/") for k in fig)
        assert set(report[section]["by_source"]) == {"otb_tir/arith"}
        assert 0.0 <= fig["accuracy/mean@n"] <= 1.0 and fig["episodes"] == 6 and fig["problems"] == 3
    recs = report["records"]["with_tools"]
    assert len(recs) == 6
    assert {"prompt", "turns", "answer", "correct", "finish_reason"} <= set(recs[0])
    assert report["meta"]["n"] == 2 and report["meta"]["tools"] == ["calculator", "python"]
    md = (tmp_path / "a.md").read_text()
    assert md.startswith("# Tool-use evaluation") and "a_accuracy.png" in md
    import matplotlib.image as mpimg

    for name in ("accuracy", "turns", "errors"):
        img = mpimg.imread(tmp_path / f"a_{name}.png")
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100

    b = run(*common, "output.name=b", "rollout.temperature=0", "eval.without_tools=false")
    assert b.returncode == 0, b.stderr[-3000:]
    assert json.loads((tmp_path / "b.json").read_text()).get("without_tools") is None
    out = tmp_path / "cmp.png"
    c = run("--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(out))
    assert c.returncode == 0, c.stderr[-3000:]
    assert "| accuracy/mean@n" in c.stdout and "B - A" in c.stdout and "tools disabled accuracy/mean@n" in c.stdout
    assert mpimg.imread(out).ndim == 3


@pytest.mark.slow
def test_recipe_bad_input_fails_at_start(tmp_path, tiny_model_dir):
    r = run(f"--model={tiny_model_dir}", "rollout.n=2", "eval.pass_k=[1,4]", timeout=300)
    assert r.returncode == 2 and "every k must be in 1..rollout.n (2)" in r.stderr
    # a missing model folder, data file, unknown tool, no chat template:
    # tests/otb_tir/evaluation/test_evaluation.py (in process)
    r = run("--compare", str(tmp_path / "x.json"), str(tmp_path / "y.json"), timeout=300)
    assert r.returncode == 2 and "report not found" in r.stderr
