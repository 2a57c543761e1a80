"""A researcher's first hour with their own data and model: each mistake, typed as a user types it
(the recipe and the eval as subprocesses, from a folder of their own), stops at start with one line,
``config error: ...`` and the fix, exit 2, and leaves no run folder behind.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _cmd(script: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "recipes" / script), *args],
        cwd=str(cwd),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("config error:")]
    assert len(lines) == 1, err[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture(scope="module")
def user(tmp_path_factory, tiny_model_dir):
    """A user's folder: bad data files of each kind, and a model folder whose tokenizer has no chat template."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from agent_env.math_task.data import make_split, write_parquet

    home = tmp_path_factory.mktemp("user")
    data = home / "data"
    good = make_split("test", 4, seed=0)
    write_parquet(good, data / "good.parquet")
    pq.write_table(pa.table({"question": ["1+1"], "answer": ["2"]}), data / "plain.parquet")
    as_string = [{**row, "prompt": json.dumps(row["prompt"])} for row in good]  # prompt stored as JSON text
    pq.write_table(pa.Table.from_pylist(as_string), data / "prompt_as_string.parquet")
    model = home / "my_model"
    shutil.copytree(tiny_model_dir, model)
    tc = model / "tokenizer_config.json"
    conf = json.loads(tc.read_text())
    conf.pop("chat_template", None)
    tc.write_text(json.dumps(conf))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    return home


CASES = {
    "missing file": (["data.train_files=[data/nope.parquet]"], ["data.train_files: file not found", "nope.parquet"]),
    "no brackets": (["data.train_files=data/good.parquet"], ["write it as data.train_files=[a, b]"]),
    "not verl columns": (
        ["data.train_files=[data/plain.parquet]"],
        ["lacks the verl column(s)", "prepare_data.py"],
    ),
    "prompt as a string": (
        ["data.train_files=[data/good.parquet]", "data.val_files=[data/prompt_as_string.parquet]"],
        ["data.val_files:", "'prompt' must be a non-empty list"],
    ),
    "no chat template": (["--model", "my_model"], ["has no chat template", "chat_template.jinja"]),
    # the HF engine reports full-softmax log-probs: truncated sampling would bias the IS ratio (issue 59)
    "nucleus sampling": (["rollout.top_p=0.9"], ["rollout.top_p=0.9 with the local trainer", "rollout.top_p=1"]),
    "top-k sampling": (["rollout.top_k=20"], ["rollout.top_k=20 with the local trainer", "rollout.top_k=-1"]),
    # the before/after figures would silently be the built-in task's: refused, the two fixes named
    "train files without val files": (
        ["data.train_files=[data/good.parquet]"],
        ["data.val_files is not", "data.val_files=[test.parquet]", "eval.before=false eval.after=false"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_stops_at_start_with_one_line(user, case):
    args, needles = CASES[case]
    proc = _cmd("train_tir_math.py", user, *args, "trainer.output_dir=run_" + case.replace(" ", "_"))
    _assert_one_line_error(proc, *needles)
    assert not list(user.glob("run_*")), "a refused run left a folder behind"


def test_trainer_verl_checks_the_same_inputs_before_verl_is_needed(user):
    """The same check runs before the verl launcher (no verl environment needed to be told)."""
    proc = _cmd(
        "train_tir_math.py", user, "trainer=verl", "data.train_files=[data/nope.parquet]", "trainer.output_dir=run_v"
    )
    _assert_one_line_error(proc, "data.train_files: file not found")
    assert not (user / "run_v").exists()


def test_the_eval_gives_the_same_one_line_for_the_same_mistakes(user):
    proc = _cmd("eval_tool_use.py", user, "data.files=[data/plain.parquet]", "output.dir=ev")
    _assert_one_line_error(proc, "data.files:", "lacks the verl column(s)")
    proc = _cmd("eval_tool_use.py", user, "--model", "my_model", "output.dir=ev")
    _assert_one_line_error(proc, "has no chat template", "chat_template.jinja")
    assert not (user / "ev").exists()


CONSTANT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A reward that never tells samples apart (a checker that always says 'wrong')."""
    return 0.0
'''


def test_a_run_that_cannot_learn_says_so_at_each_step_and_at_the_end(user):
    """Every group's rewards equal at every step: zero advantages, no update moves anything. Each
    step says so (warning and ``train/zero_advantage_frac`` = 1), the end says the run learned
    nothing, and ``summary.json`` counts the steps."""
    from tests.support.user_runs import TRAIN

    (user / "constant.py").write_text(CONSTANT_REWARD)
    out = user / "runs" / "constant"
    proc = _cmd(
        "train_tir_math.py",
        user,
        *TRAIN,
        "trainer.total_steps=2",
        "eval.after=false",
        "reward.custom_reward_function.path=constant.py",
        f"trainer.output_dir={out}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "train/zero_advantage_frac" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["train/zero_advantage_frac"] == 1.0 and r["reward/mean"] == 0.0 for r in steps)
    assert proc.stderr.count("every group's samples got the same reward") == 2
    assert "it learned nothing" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_without_signal"] == 2
    # which decode step generated the rollouts (the built-in policy: the fused step, never compiled)
    assert summary["engine"] == "hf"  # the configured rollout engine's name, as before
    assert summary["generation"] == {
        "engine_class": "HFEngine",
        "decode_step": "fused",
        "compile_s": None,
        "compile_error": None,
    }


def test_one_sample_per_prompt_with_a_group_baseline_is_refused(user):
    proc = _cmd("train_tir_math.py", user, "rollout.n=1", "trainer.output_dir=run_n1")
    _assert_one_line_error(proc, "rollout.n=1", "tir_optimal_token_baseline", "rollout.n >= 2")
    assert not (user / "run_n1").exists()


def test_the_eval_says_which_pass_at_k_it_drops(user):
    """``rollout.n=1`` leaves only pass@1 of the default [1, 2, 4]: the eval says so instead of
    dropping them without a word."""
    proc = _cmd(
        "eval_tool_use.py",
        user,
        "rollout.n=1",
        "data.size=2",
        "eval.without_tools=false",
        "rollout.response_length=64",
        "rollout.max_tokens_per_turn=32",
        "output.dir=ev_n1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pass@2, pass@4 not reported: pass@k needs rollout.n >= k (rollout.n=1)" in proc.stderr
    report = json.loads((user / "ev_n1" / "eval.json").read_text())
    assert not any("pass@2" in k or "pass@4" in k for k in json.dumps(report["with_tools"]).split('"'))


def test_the_eval_reproduces_trainings_held_out_figure_the_documented_way(user):
    """docs/training.md: training's held-out pass is greedy with one sample; ``otb-tir-eval`` with
    ``rollout.n=1 rollout.temperature=0`` on the same problems gives the same accuracy and tool-call
    rate (here on the warm-started policy before training, 12 problems)."""
    proc = _cmd(
        "train_tir_math.py", user, "trainer.total_steps=0", "eval.size=12", "eval.after=false", "trainer.output_dir=t0"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((user / "t0" / "summary.json").read_text())
    proc = _cmd(
        "eval_tool_use.py",
        user,
        "--model",
        summary["model"],
        "rollout.n=1",
        "rollout.temperature=0",
        "data.size=12",
        "eval.without_tools=false",
        "output.dir=ev_same",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((user / "ev_same" / "eval.json").read_text())
    assert summary["held_out"]["problems"] == 12 and summary["held_out"]["decoding"] == "greedy"
    overall = report["with_tools"]["overall"]
    assert overall["problems"] == 12
    assert overall["accuracy/mean@n"] == pytest.approx(summary["before"]["accuracy"])
    assert overall["tools/call_rate"] == pytest.approx(summary["before"]["tool_call_rate"])


@pytest.mark.parametrize(
    "name,how", [("tools", "cwd"), ("agent_env", "PYTHONPATH")], ids=["tools-in-the-folder", "agent_env-on-pythonpath"]
)
def test_a_users_package_shadowing_ours_is_named_at_start(tmp_path, name, how):
    """``tools`` and ``agent_env`` are common names: a user's own package of that name earlier on
    ``sys.path`` stops the command at start, naming both paths, instead of a confusing ImportError."""
    import os

    mine = tmp_path / "mycode"
    (mine / name).mkdir(parents=True)
    (mine / name / "__init__.py").write_text("# the user's own package\n")
    env = dict(os.environ)
    if how == "PYTHONPATH":
        env["PYTHONPATH"] = f"{mine}{os.pathsep}{env.get('PYTHONPATH', '')}"
        cwd, module = tmp_path, "otb_tir.eval"
    else:
        cwd, module = mine, "otb_tir.train"  # python -m puts the current folder first on sys.path
    proc = subprocess.run(
        [sys.executable, "-m", module, "--print-config"],
        cwd=str(cwd),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    _assert_one_line_error(proc, f"'{name}' resolves to {mine / name}", f"not otb-tir's {REPO / name}")


def test_prepare_data_console_script_writes_train_and_test_in_one_call(tmp_path):
    """``otb-tir-prepare-data --test-frac``: one input, both files a run needs, disjoint, from the
    user's own folder; training accepts them as they are."""
    from agent_env.math_task.data import load_parquet

    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"} for i in range(8)]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bin_ = Path(sys.executable).parent
    proc = subprocess.run(
        [str(bin_ / "otb-tir-prepare-data"), "--gsm8k", "gsm8k.jsonl", "--test-frac", "0.25", "--out", "data"],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    train, test = (load_parquet(tmp_path / "data" / f"gsm8k_{s}.parquet") for s in ("train", "test"))
    assert len(train) == 6 and len(test) == 2
    questions = [r["extra_info"]["question"] for r in train + test]
    assert sorted(questions) == sorted(r["question"] for r in rows)  # every record once, in one split
    assert {r["extra_info"]["split"] for r in test} == {"test"} and [r["extra_info"]["index"] for r in test] == [0, 1]
    proc = _cmd(
        "train_tir_math.py",
        tmp_path,
        "data.train_files=[data/gsm8k_train.parquet]",
        "data.val_files=[data/gsm8k_test.parquet]",
        "trainer.total_steps=0",
        "eval.before=false",
        "eval.after=false",
        "trainer.output_dir=run",
    )
    # 6 prompts cannot fill the default batch of 8: said at start, before the model loads
    _assert_one_line_error(proc, "data.train_batch_size (8) exceeds the number of training prompts (6")
    assert "Loading weights" not in proc.stderr and not (tmp_path / "run").exists()
    proc = _cmd(
        "train_tir_math.py",
        tmp_path,
        "data.train_files=[data/gsm8k_train.parquet]",
        "data.val_files=[data/gsm8k_test.parquet]",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "trainer.total_steps=0",
        "eval.before=false",
        "eval.after=false",
        "trainer.output_dir=run",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    bad = subprocess.run(
        [str(bin_ / "otb-tir-prepare-data"), "--gsm8k", "gsm8k.jsonl", "--test-frac", "1.5"],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--test-frac must be between 0 and 1" in bad.stderr


def test_the_readme_says_how_to_get_torchs_cpu_build_with_the_pinned_version():
    """A machine whose index serves PyTorch's CUDA build would pull several GB for README command 1:
    the README names the CPU wheel index, with the torch version the install scripts pin."""
    import re

    readme = (REPO / "README.md").read_text()
    pins = set(re.findall(r'torch==([0-9.]+)"', (REPO / "scripts" / "install_test_env.sh").read_text()))
    assert len(pins) == 1, pins
    (pin,) = pins
    assert f"pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu" in readme


def test_verl_dry_run_without_verl_says_it_needs_verl_and_the_command_that_installs_it(tmp_path):
    """``trainer=verl verl.dry_run=true`` in an environment without verl (the vLLM one,
    ``.venv-vllm``): one line saying the dry run needs verl too, and an install command that works
    in the checkout."""
    from tests.support.optional import unavailable

    python = REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        unavailable("no .venv-vllm here (scripts/install_test_env.sh makes it)")
    proc = subprocess.run(
        [str(python), str(REPO / "recipes" / "train_tir_math.py"), "trainer=verl", "verl.dry_run=true"]
        + ["trainer.device=cuda", "trainer.output_dir=dry"],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    _assert_one_line_error(proc, "verl.dry_run too", "pip install -e '.[verl]' in the otb-tir checkout")
    assert not (tmp_path / "dry").exists()
