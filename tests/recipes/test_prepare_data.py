"""otb-tir-prepare-data (recipes/prepare_data.py) on small GSM8K / MATH fixture files written here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent_env.math_task.data import load_parquet, make_split
from otb_tir import ConfigError

ROOT = Path(__file__).resolve().parents[2]
from otb_tir import prepare_data  # noqa: E402  (recipes/prepare_data.py is its thin wrapper)

GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A shop sells 1,200 pens a day. How many in 2 days?", "answer": "1200*2=2400\n#### 2,400"},
]
MATH = [
    {
        "problem": "Simplify $\\frac{2}{4}$.",
        "solution": "It is $\\boxed{\\frac{1}{2}}$.",
        "level": "Level 1",
        "type": "Prealgebra",
    },
    {
        "problem": "Find $x$ if $x^2=9$, $x>0$.",
        "solution": "First \\boxed{-3} is out; so $x=\\boxed{3}$.",
        "level": "Level 2",
        "type": "Algebra",
    },
    {"problem": "No boxed answer here.", "solution": "The answer is 5."},
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_and_math_to_parquet(tmp_path):
    gsm = _write_jsonl(tmp_path / "gsm8k_test.jsonl", GSM8K)
    math_dir = tmp_path / "MATH" / "test" / "algebra"
    math_dir.mkdir(parents=True)
    for i, rec in enumerate(MATH):  # the original MATH layout: one json file per problem
        (math_dir / f"{i}.json").write_text(json.dumps(rec))
    out = tmp_path / "out"
    written = prepare_data.main(
        ["--gsm8k", str(gsm), "--math", str(tmp_path / "MATH"), "--split", "test", "--out", str(out)]
    )
    assert [p.name for p in written] == ["gsm8k_test.parquet", "math_test.parquet"]

    gsm_rows = load_parquet(out / "gsm8k_test.parquet")
    assert [r["reward_model"]["ground_truth"] for r in gsm_rows] == ["7", "2400"]
    assert gsm_rows[0]["data_source"] == "openai/gsm8k" and gsm_rows[0]["agent_name"] == "tool_agent"
    assert gsm_rows[1]["prompt"] == [
        {
            "role": "user",
            "content": "A shop sells 1,200 pens a day. How many in 2 days? Put the final answer in \\boxed{}.",
        }
    ]
    assert gsm_rows[1]["extra_info"]["split"] == "test" and gsm_rows[1]["extra_info"]["index"] == 1
    assert gsm_rows[1]["extra_info"]["answer"].endswith("#### 2,400")

    math_rows = load_parquet(out / "math_test.parquet")  # the record without \boxed is skipped
    assert [r["reward_model"]["ground_truth"] for r in math_rows] == ["\\frac{1}{2}", "3"]
    assert math_rows[1]["extra_info"]["level"] == "Level 2"


def test_math_jsonl_and_limit(tmp_path):
    path = _write_jsonl(tmp_path / "math.jsonl", MATH)
    rows = prepare_data.convert_math(path, "train", limit=1)
    assert len(rows) == 1 and rows[0]["reward_model"]["ground_truth"] == "\\frac{1}{2}"


def test_last_boxed_nested_and_unbalanced():
    assert prepare_data.last_boxed("a \\boxed{\\frac{a}{b^{2}}} b") == "\\frac{a}{b^{2}}"
    assert prepare_data.last_boxed("\\boxed{1} then \\fbox{2}") == "2"
    assert prepare_data.last_boxed("\\boxed{1") is None
    assert prepare_data.last_boxed("nothing") is None


@pytest.mark.slow
def test_builtin_cli(tmp_path):
    out = tmp_path / "data"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes" / "prepare_data.py"),
            "--builtin",
            "40",
            "--builtin-test",
            "10",
            "--seed",
            "3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert load_parquet(out / "arith_train.parquet") == make_split("train", 40, seed=3)
    assert load_parquet(out / "arith_test.parquet") == make_split("test", 10, seed=3)


@pytest.mark.parametrize(
    "rows, match",
    [
        ([{"question": "q", "answer": "no final line"}], "has no '#### <number>'"),
        ([{"question": "q"}], "expected a string field 'answer'"),
    ],
)
def test_bad_gsm8k_records(tmp_path, rows, match):
    path = _write_jsonl(tmp_path / "g.jsonl", rows)
    with pytest.raises(ConfigError, match=match):
        prepare_data.convert_gsm8k(path, "train")


def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        prepare_data.main(["--gsm8k", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)])
    assert exc.value.code == 2 and "input not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{broken\n')
    with pytest.raises(SystemExit):
        prepare_data.main(["--gsm8k", str(bad), "--out", str(tmp_path)])
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare_data.main(["--out", str(tmp_path)])
    assert "nothing to do" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.parquet"))  # nothing half-written
