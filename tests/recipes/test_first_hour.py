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
    "not verl columns": (["data.train_files=[data/plain.parquet]"], ["lacks the verl column(s)", "prepare_data.py"]),
    "prompt as a string": (
        ["data.train_files=[data/good.parquet]", "data.val_files=[data/prompt_as_string.parquet]"],
        ["data.val_files:", "'prompt' must be a non-empty list"],
    ),
    "no chat template": (["--model", "my_model"], ["has no chat template", "chat_template.jinja"]),
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
