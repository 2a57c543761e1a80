"""benchmarks/bench_peers.py: the pieces that make TRL's GRPOTrainer do the same work as ours (checked
against the real chat template, tokenizer, tools and TRL), its report, and its --quick run as a user
runs it (a subprocess from another folder)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.optional import need

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_peers.py"

import bench_peers as bp  # noqa: E402 - benchmarks/ is on pytest's pythonpath (pyproject.toml)

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "585*93"}}\n</tool_call>'
ANSWER = "The answer is \\boxed{54405}."
PROMPT = [{"role": "user", "content": "Compute 585 times 93."}]


def _trl():
    return need("trl", reason="TRL is not installed: pip install -e '.[peers]'")


def _trl_suffix_ids(tokenizer, tool_messages):
    """The tokens TRL's tool loop inserts after a tool call (its own method, on a stand-in trainer)."""
    from trl import GRPOTrainer

    stub = SimpleNamespace(
        processing_class=tokenizer, chat_template=None, chat_template_kwargs={}, _is_vlm=False, _tokenizer=tokenizer
    )
    return GRPOTrainer._get_tool_suffix_ids(stub, tool_messages)


def test_trl_inserts_the_same_tool_tokens_as_our_episode(tiny_tokenizer):
    _trl()
    from agent_env.template import ChatTemplate

    tok = tiny_tokenizer
    ct = ChatTemplate(tok)
    turn = tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]
    stream = ct.prompt_ids(PROMPT) + turn
    assistant = {"role": "assistant", "content": CALL}
    ours, note = ct.delta(stream, PROMPT + [assistant], [{"role": "tool", "content": "54405"}])
    assert note is None
    trl_ids = _trl_suffix_ids(tok, [{"role": "tool", "name": "calculator", "content": "54405"}])
    assert tok.decode(trl_ids) == ours
    assert trl_ids == ct.encode(ours)


def test_solution_text_is_what_our_episode_scores(tiny_tokenizer):
    """TRL's completion ids (turn, tool tokens, turn) give the text our episode scores: each assistant
    turn without its stop token, joined by a newline, the tool message left out."""
    _trl()
    tok = tiny_tokenizer
    eos = [tok.eos_token_id]
    suffix = _trl_suffix_ids(tok, [{"role": "tool", "name": "calculator", "content": "54405"}])
    two_turns = tok.encode(CALL, add_special_tokens=False) + eos + suffix + tok.encode(ANSWER) + eos
    assert bp.solution_text(tok, two_turns) == CALL + "\n" + ANSWER
    # a tool result that itself looks like template markup does not end the block early
    odd = _trl_suffix_ids(tok, [{"role": "tool", "name": "python", "content": "<|im_start|>assistant"}])
    ids = tok.encode(CALL, add_special_tokens=False) + eos + odd + tok.encode(ANSWER) + eos
    assert bp.solution_text(tok, ids) == CALL + "\n" + ANSWER
    assert bp.solution_text(tok, tok.encode(ANSWER) + eos) == ANSWER
    truncated = tok.encode(CALL, add_special_tokens=False) + eos + suffix + tok.encode("The ans")  # budget ran out
    assert bp.solution_text(tok, truncated) == CALL + "\nThe ans"
    reward = bp.make_reward(tok)
    scores = reward(
        prompts=[PROMPT] * 3,
        completions=[None] * 3,
        completion_ids=[two_turns, two_turns, truncated],
        ground_truth=["54405", "1", "54405"],
        data_source=["otb_tir/arith"] * 3,
    )
    assert scores == [1.0, 0.0, 0.0]


def test_trl_parses_the_tiny_models_calls_with_qwen3_schema(tiny_model_dir):
    _trl()
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, parse_response, qwen3_schema

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)  # its own copy: the schema is set on it
    with pytest.raises(ValueError, match="Unrecognized chat template"):  # why the schema is set by hand
        add_response_schema(tok)
    tok.response_schema = qwen3_schema
    # the call as the template renders it (what the warm start was trained to write)
    text = tok.apply_chat_template(
        PROMPT
        + [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "python", "arguments": {"code": "print(2**10)"}}}],
            }
        ],
        tokenize=False,
    )
    turn = text[text.rfind("<|im_start|>assistant\n") + len("<|im_start|>assistant\n") :].rstrip("\n")
    parsed = parse_response(tok, tok.encode(turn, add_special_tokens=False))
    assert parsed["tool_calls"] == [
        {"type": "function", "function": {"name": "python", "arguments": {"code": "print(2**10)"}}}
    ]
    bad = parse_response(tok, tok.encode(CALL[:-14] + "<|im_end|>", add_special_tokens=False))
    assert "tool_calls" not in bad  # a malformed call is plain text for TRL (a note in the report)


@pytest.mark.slow
def test_trl_tool_functions_are_our_tools_and_render_our_prompt(tiny_tokenizer):
    from agent_env.template import ChatTemplate
    from tools import build_tool_set

    tok = tiny_tokenizer
    tool_set = build_tool_set(None)
    stats: dict = {}
    fns = bp.make_trl_tools(tok, tool_set, 48, 60.0, stats)  # what is checked here is not the timeout (a loaded CI box)
    assert [f.__name__ for f in fns] == ["python", "calculator"]
    ours = ChatTemplate(tok, tool_schemas=[t.schema() for t in tool_set.values()]).render(PROMPT, True)
    assert tok.apply_chat_template(PROMPT, tools=fns, add_generation_prompt=True, tokenize=False) == ours

    async def calls():
        try:
            return await fns[1]("585*93"), await fns[0]("print('x' * 500)"), await fns[1]("1/")
        finally:
            await tool_set.close()  # in the loop that started the sandbox workers

    calc, long, err = asyncio.run(calls())
    assert calc == "54405"
    assert "...(truncated)..." in long and len(tok.encode(long, add_special_tokens=False)) <= 48
    assert err.startswith("Error") and stats["tool_calls"] == 3 and stats["tool_s"] > 0


def test_parse_verl_table_reads_bench_verl_phases_output():
    text = """## verl's trainer modes side by side on this CPU (bench_verl_phases.py) (2026-12-03)

```text
# 2026-12-03, 4 steps each (means over steps 2..4), overrides: trainer.total_steps=4
# launch to exit: local 39 s, legacy 330 s

| per step | local | legacy | sync |
|---|---|---|---|
| reward (batch) | – | 0.000 | – |
| step | 5.150 | 39.299 | 40.914 |
| samples/s | 12.427 | 1.629 | 1.564 |
| sampled tokens/s | 365 | 48.110 | 46.650 |
```
"""
    t = bp.parse_verl_table(text)
    assert t["legacy"]["step"] == 39.299 and t["sync"]["samples/s"] == 1.564 and t["local"]["sampled tokens/s"] == 365
    assert t["local"]["reward (batch)"] is None
    assert "overrides" in t["_meta"]["run"]
    with pytest.raises(ValueError):
        bp.parse_verl_table("no table here")


def test_verl_rows_come_from_the_recorded_run(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results.md").write_text(
        "## verl's trainer modes side by side on this CPU\n\n| per step | local | legacy | sync |\n|---|---|---|---|\n"
        "| step | 5.0 | 40.0 | 41.0 |\n| samples/s | 12.8 | 1.6 | 1.56 |\n| sampled tokens/s | 365 | 48 | 47 |\n"
    )
    rows, source = bp.verl_rows(tmp_path)
    assert [r["trainer"] for r in rows] == ["verl_legacy", "verl_sync"]
    assert rows[0]["samples_per_s"] == 1.6 and rows[1]["step_s"] == 41.0 and source.endswith("results.md")
    assert bp.verl_rows(tmp_path / "nothing") == ([], "")
    if (ROOT / "docs" / "results.md").is_file() and bp.VERL_SECTION in (ROOT / "docs" / "results.md").read_text():
        real, _ = bp.verl_rows(ROOT)
        assert {r["trainer"] for r in real} == {"verl_legacy", "verl_sync"}
        assert all(r["samples_per_s"] > 0 for r in real)


def test_figures_skip_the_first_step_and_the_verdict_needs_speed_and_accuracy():
    run = {
        "steps": [
            {"step_s": 10.0, "policy_tokens": 100.0},
            {"step_s": 2.0, "policy_tokens": 300.0},
            {"step_s": 4.0, "policy_tokens": 300.0},
        ],
        "peak_rss_mb": 500.0,
    }
    f = bp.per_run_figures(run, samples_per_step=16)
    assert f["step_s"] == 3.0 and f["samples_per_s"] == pytest.approx(16 / 3) and f["sampled_tokens_per_s"] == 100.0
    fast = [{**run, "accuracy": 0.5}, {**run, "accuracy": 0.7}]
    slow = [{**run, "steps": [{"step_s": 9.0, "policy_tokens": 1.0}] * 2, "accuracy": 0.6}]
    rows = [bp.summarize("ours", fast, 16, 0.3), bp.summarize("trl", slow, 16, 0.3)]
    assert rows[0]["after_mean"] == pytest.approx(0.6) and (rows[0]["after_min"], rows[0]["after_max"]) == (0.5, 0.7)
    line, ratio = bp.verdict(rows)
    assert ratio == pytest.approx(3.0) and line.startswith("verdict: MET")
    assert "(seed by seed: 3.00×)" in line  # the runs carry no seed here: one key in common
    rows[1]["after_mean"] = 0.65
    assert bp.verdict(rows)[0].startswith("verdict: NOT MET")
    failed = bp.summarize("trl", [{"error": "rc=1", "seed": 0}], 16, 0.3)
    assert math.isnan(failed["samples_per_s"]) and failed["failed"] == [{"seed": 0, "error": "rc=1"}]
    assert "runs failed" in bp.verdict([rows[0], failed])[0]
    assert "trl not among --trainers" in bp.verdict([rows[0]])[0]  # an A/B of our own rows: no verdict
    # an opt-in row of ours gets its own ratio beside the verdict, which rates the default only
    off = bp.summarize(
        "ours_off1", [{**run, "steps": [{"step_s": 1.5, "policy_tokens": 1.0}] * 2, "accuracy": 0.5}], 16, 0.3
    )
    (also,) = bp.opt_in_ratios([rows[0], off, rows[1]])
    assert also.startswith(bp.LABELS["ours_off1"]) and "6.00× TRL's samples/s" in also and "(worse)" in also
    assert bp.opt_in_ratios([rows[0], off]) == []  # no TRL row
    table = bp.render_table(rows, [], bp.QUICK)
    assert "0.30 → 0.60 [0.50, 0.70]" in table and "tool tokens in loss" in table


def test_generation_figures_per_trainer():
    ours = {
        "steps": [{"step_s": 1.0}] * 4,
        "engine": {"decode_steps": 200.0, "prefills": 24.0, "prefill_s": 0.8, "sample_s": 0.4, "engine_s": 2.0},
    }
    g = bp.generation_figures(ours)
    assert g["gen/decode_steps"] == 50.0 and g["gen/prefills"] == 6.0 and g["gen/ms_per_decode_step"] == 10.0
    trl = {
        "steps": [
            {"step_s": 1.0, "generate_s": 0.3, "decode_steps": 40.0, "generate_calls": 2.0},
            {"step_s": 1.0, "generate_s": 0.5, "decode_steps": 60.0, "generate_calls": 3.0},
        ]
    }
    g = bp.generation_figures(trl)
    assert g["gen/decode_steps"] == 50.0 and g["gen/prefills"] == 2.5 and g["gen/ms_per_decode_step"] == 8.0
    rows = [bp.summarize("ours", [ours], 16, 0.1), bp.summarize("trl", [trl], 16, 0.1)]
    profile = bp.render_profile(rows)
    assert "| decode forwards per step (all steps) | 50.0 | 50.0 |" in profile
    assert bp.generation_figures({"steps": []}) == {}


@pytest.mark.slow
def test_quick_run_from_another_folder(tmp_path):
    _trl()
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    rows = {r["trainer"]: r for r in res["trainers"]}
    assert set(rows) == {"ours", "trl"}
    for r in rows.values():
        assert not r["failed"], r["failed"]
        assert math.isfinite(r["samples_per_s"]) and r["samples_per_s"] > 0
        assert math.isfinite(r["sampled_tokens_per_s"]) and r["sampled_tokens_per_s"] > 0
        assert r["peak_rss_mb"] > 50
        assert 0.0 <= r["before"] <= 1.0 and len(r["after"]) == 1 and all(0.0 <= a <= 1.0 for a in r["after"])
        assert r["tool_tokens_in_loss"].startswith("no")
    assert rows["trl"]["same_prompts_as_ours"] is True
    assert math.isfinite(res["ratio_samples_per_s"]) and res["verdict"].startswith("verdict:")
    assert (out / "trl" / "seed0" / "final" / "model.safetensors").is_file()
    assert (out / "ours" / "seed0" / "final" / "model.safetensors").is_file()
    assert "| TRL 1.16 GRPOTrainer |" in proc.stdout and "ours/TRL samples/s" in proc.stdout


def test_bench_verl_phases_reads_each_processs_peak_resident_set():
    """PeakRSS samples a process and its descendants: a child that holds 300 MB for 2 s is seen at
    >= 0.25 GiB under its own name, the parent apart."""
    import bench_verl_phases as bvp

    child = "import time; b = bytearray(300 << 20); time.sleep(2.5)"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", code])
    rss = bvp.PeakRSS(proc.pid, every_s=0.2)
    proc.wait(timeout=60)
    peaks = rss.stop()
    assert peaks and peaks[0][1] >= 0.25, peaks
    assert "python" in peaks[0][0] or "-c" in peaks[0][0], peaks
