"""otb_tir.evaluation: pass@k against the closed form and brute force, error kinds on real sandbox
results, every figure on hand-built trajectories, and evaluate() on real episodes (real chat
template, real python/calculator tools) driven by a scripted engine."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_env import ToolCallRecord, Trajectory, TurnRecord
from agent_env.engines.base import GenerationOutput
from otb_tir import ConfigError
from otb_tir.evaluation import classify_call, figures, load_eval_config, pass_at_k
from otb_tir.evaluation.config import DEFAULT_CONFIG

# ----------------------------------------------------------------------------- pass@k


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 200).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_equals_closed_form(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_equals_brute_force_over_subsets(nck):
    """pass@k = P(a uniformly drawn k-subset of the n samples holds a correct one)."""
    n, c, k = nck
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(samples[i] for i in s) for s in subsets)
    assert pass_at_k(n, c, k) == pytest.approx(hits / len(subsets), abs=1e-12)


def test_pass_at_k_edges_and_stability():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    # big n: the binomials overflow a float (C(5000, 2500) ~ 1e1503) but the product form is exact
    assert pass_at_k(5000, 7, 2500) == pytest.approx(float(exact_pass_at_k(5000, 7, 2500)), abs=1e-12)
    assert pass_at_k(5000, 1, 1) == pytest.approx(1 / 5000, rel=1e-12)
    for bad in [(4, 1, 5), (4, 1, 0), (0, 0, 1), (4, 5, 1), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)
    with pytest.raises(TypeError):
        pass_at_k(4.0, 1, 1)


# ----------------------------------------------------------------------------- error kinds


def _record(res, name="python", args=None) -> ToolCallRecord:
    return ToolCallRecord(
        name=name, arguments=args or {}, raw="", text=res.text, ok=res.ok, error=res.error, executed=True
    )


@pytest.mark.slow
def test_error_kinds_on_real_sandbox_results():
    from tools.calculator import CalculatorTool
    from tools.sandbox import PythonTool

    cases = {
        "x = (1 +": "syntax_error",
        "def f(:\n    pass": "syntax_error",
        "print(1/0)": "runtime_error",
        "import json\njson.loads('{')": "runtime_error",
        "while True:\n    pass": "timeout",
        "x = bytearray(4 * 1024**3)\nprint(len(x))": "memory",
        "print('y' * 100000)": "output_cut",
        # a SyntaxError raised at run time (code compiled from a string) is the model's syntax error too
        "eval('1 +')": "syntax_error",
        "print(6 * 7)": None,
    }

    async def go():
        py = PythonTool(timeout=1.0, workers=1, memory_mb=256, max_output_chars=300, cache=False)
        calc = CalculatorTool()
        try:
            out = {code: classify_call(_record(await py.invoke({"code": code}, timeout=10.0))) for code in cases}
            out["calc 2+*3"] = classify_call(_record(await calc.invoke({"expression": "2+*3"}), "calculator"))
            out["calc 2**10"] = classify_call(_record(await calc.invoke({"expression": "2**10"}), "calculator"))
            out["calc missing arg"] = classify_call(_record(await calc.invoke({"expr": "1"}), "calculator"))
        finally:
            await py.close()
            await calc.close()
        return out

    got = asyncio.run(go())
    expected = dict(cases) | {"calc 2+*3": "syntax_error", "calc 2**10": None, "calc missing arg": "bad_arguments"}
    assert got == expected


def test_error_kinds_from_episode_records():
    # what the episode writes for calls that never reach a tool
    assert (
        classify_call(ToolCallRecord("python", {}, "", text="Error: ...", error="malformed_call")) == "malformed_call"
    )
    assert (
        classify_call(ToolCallRecord("foo", {}, "", text="Error: unknown tool 'foo'", error="unknown_tool"))
        == "unknown_tool"
    )
    # the last allowed turn still called a tool: parsed, not run
    assert classify_call(ToolCallRecord("python", {"code": "1"}, "", executed=False)) == "not_executed"
    # a tool that reports failure without a kind: read the traceback
    assert (
        classify_call(ToolCallRecord("x", {}, "", text="Traceback...\nIndentationError: bad", ok=False, executed=True))
        == "syntax_error"
    )
    assert classify_call(ToolCallRecord("x", {}, "", text="boom", ok=False, executed=True)) == "other"
    assert classify_call(ToolCallRecord("x", {}, "", text="fine", ok=True, executed=True)) is None


# ----------------------------------------------------------------------------- figures on hand-built records


def _call(name="python", ok=True, error=None, executed=True) -> ToolCallRecord:
    return ToolCallRecord(name=name, arguments={}, raw="", text="", ok=ok, error=error, executed=executed)


def _traj(uid, correct, turns_calls, mask, finish="answer", void=(), sample=0) -> Trajectory:
    turns = [
        TurnRecord(
            index=i,
            start=0,
            end=0,
            obs_start=0,
            obs_end=0,
            text="",
            engine_finish_reason="stop",
            tool_calls=list(calls),
            void=i in void,
        )
        for i, calls in enumerate(turns_calls)
    ]
    calls = [c for tr in turns for c in tr.tool_calls]
    return Trajectory(
        uid=uid,
        prompt_ids=[1, 2],
        response_ids=list(range(len(mask))),
        response_mask=list(mask),
        rollout_logprobs=[0.0] * len(mask),
        turns=turns,
        messages=[],
        reward=float(correct),
        reward_details={"correct": correct},
        finish_reason=finish,
        num_turns=len(turns),
        void_turns=len(void),
        malformed_calls=sum(c.error in ("malformed_call", "unknown_tool", "bad_arguments") for c in calls),
        num_tool_calls=len(calls),
        tool_errors=sum(c.executed and not c.ok for c in calls),
        template_mismatch=None,
        timings={},
        sample_index=sample,
    )


def test_figures_on_hand_built_trajectories():
    trajs = [
        # problem a: 2 of 3 correct
        _traj("a", True, [[_call()], []], [1, 1, 0, 0, 1]),  # 5 tokens, 2 inserted
        _traj("a", True, [[_call(ok=False, error="syntax_error"), _call("calculator")], []], [1, 0, 0, 0, 1, 1]),
        _traj("a", False, [[]], [1, 1, 1], finish="void_turn", void=(0,)),
        # problem b: 0 of 3 correct
        _traj(
            "b",
            False,
            [
                [_call(ok=False, error="timeout")],
                [_call(ok=False, error="malformed_call", executed=False)],
                [_call(executed=False, ok=False)],
            ],
            [1, 0, 1, 0, 1],
            finish="max_turns",
        ),
        _traj("b", False, [[_call(error="output_cut")], []], [1, 0, 1, 1]),
        _traj("b", False, [[]], [1, 1], finish="length"),
    ]
    f = figures(trajs, pass_k=[1, 2, 3])
    assert f["problems"] == 2 and f["episodes"] == 6
    assert f["accuracy/mean@n"] == pytest.approx(2 / 6)
    assert f["accuracy/pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert f["accuracy/pass@2"] == pytest.approx((1 - 0 / 3 + 0) / 2)  # C(1,2)=0: any pair has a correct one
    assert f["accuracy/pass@3"] == pytest.approx(0.5)
    assert f["accuracy/any_correct"] == pytest.approx(0.5)
    # calls: 1 + 2 + 3 + 1 = 7 over 6 episodes; 4 episodes call
    assert f["tools/calls"] == 7 and f["tools/calls_per_episode"] == pytest.approx(7 / 6)
    assert f["tools/call_rate"] == pytest.approx(4 / 6)
    ok = 3  # python ok, calculator ok, output_cut (ok, cut)
    # one call was written on the last allowed turn and never run: neither ok nor failed
    assert (f["tools/ok"], f["tools/failed"], f["tools/not_executed"]) == (ok, 3, 1)
    assert f["tools/success_rate"] == pytest.approx(ok / (7 - 1))
    assert f["tools/executed_success_rate"] == pytest.approx(ok / 5)
    assert f["tools/by_name/python"] == 6 and f["tools/by_name/calculator"] == 1
    assert (
        f["errors/syntax_error"],
        f["errors/timeout"],
        f["errors/malformed_call"],
        f["errors/output_cut"],
        f["errors/runtime_error"],
        f["errors/unknown_tool"],
    ) == (1, 1, 1, 1, 0, 0)
    assert "errors/not_executed" not in f
    assert f["errors/total"] == 3 and f["errors/timeout_per_call"] == pytest.approx(1 / 7)
    assert f["turns/mean"] == pytest.approx((2 + 2 + 1 + 3 + 2 + 1) / 6)
    assert (f["turns/hist/1"], f["turns/hist/2"], f["turns/hist/3"]) == pytest.approx((2 / 6, 3 / 6, 1 / 6))
    assert f["episode/void_turn_rate"] == pytest.approx(1 / 6)
    assert f["episode/void_turns_per_turn"] == pytest.approx(1 / 11)
    # tool-token share: mask-0 tokens / all response tokens
    total = 5 + 6 + 3 + 5 + 4 + 2
    inserted = 2 + 3 + 0 + 2 + 1 + 0
    assert f["response/tool_token_share"] == pytest.approx(inserted / total)
    assert f["response/length_mean"] == pytest.approx(total / 6) and f["response/length_max"] == 6
    assert f["response/length_p50"] == pytest.approx(4.5)
    assert (f["finish/answer"], f["finish/void_turn"], f["finish/max_turns"], f["finish/length"]) == pytest.approx(
        (3 / 6, 1 / 6, 1 / 6, 1 / 6)
    )
    with pytest.raises(ValueError, match="k <= samples"):
        figures(trajs, pass_k=[4])


def test_no_calls_gives_nan_rates_not_zero():
    f = figures([_traj("a", True, [[]], [1, 1])], pass_k=[1])
    assert math.isnan(f["tools/success_rate"]) and f["tools/call_rate"] == 0.0 and f["errors/total"] == 0


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["rollout.n=2", "eval.pass_k=[1,4]"], "every k must be in 1..rollout.n (2)"),
        (["rollout.nn=2"], "did you mean 'rollout.n'"),
        (["rollout.name=trt"], "'rollout.name' must be one of hf, vllm, sglang"),
        (["multi_turn.format=code_block"], "eval.without_tools=false"),
        (["verl.foo=1"], "no 'verl' section"),
        (["data.size=-1"], "'data.size' must be >= 0"),
        (["eval.pass_k=[]"], "at least one k"),
    ],
)
def test_bad_config_fails_with_a_clear_error(overrides, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        load_eval_config(DEFAULT_CONFIG, overrides)
    assert fragment in str(e.value)


def test_config_defaults_and_training_names():
    cfg = load_eval_config(DEFAULT_CONFIG, ["rollout.n=8", "eval.pass_k=[1,8]"])
    assert cfg.rollout.n == 8 and list(cfg.eval.pass_k) == [1, 8] and cfg.rollout.name == "hf"
    from otb_tir.builders import episode_config

    ep = episode_config(cfg)  # the training episode settings, from the same section names
    assert ep.response_length == cfg.rollout.response_length and ep.max_assistant_turns == 3


def test_bad_inputs_fail_at_start(tmp_path, tiny_model_dir):
    from otb_tir.evaluation import prepare

    base = [f"model.path={tiny_model_dir}", "data.size=2"]
    with pytest.raises(ConfigError, match="data.files: file not found: .*nope.parquet"):
        prepare(load_eval_config(DEFAULT_CONFIG, base + [f"data.files=[{tmp_path}/nope.parquet]"]))
    with pytest.raises(ConfigError, match="unknown tool 'pyhton'; available tools: .*python"):
        prepare(load_eval_config(DEFAULT_CONFIG, base + ["multi_turn.tools=[pyhton]"]))
    with pytest.raises(ConfigError, match="not a local Hugging Face model folder"):
        prepare(load_eval_config(DEFAULT_CONFIG, [f"model.path={tmp_path}/missing", "data.size=2"]))
    # a tokenizer without a chat template
    import shutil

    from transformers import AutoTokenizer

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    tok = AutoTokenizer.from_pretrained(bare)
    tok.chat_template = None
    for f in bare.glob("chat_template.*"):
        f.unlink()
    tok.save_pretrained(bare)
    cfg_file = bare / "tokenizer_config.json"
    data = json.loads(cfg_file.read_text())
    data.pop("chat_template", None)
    cfg_file.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="no chat template"):
        prepare(load_eval_config(DEFAULT_CONFIG, [f"model.path={bare}", "data.size=2"]))


# ----------------------------------------------------------------------------- evaluate() on real episodes


class ScriptedPolicy:
    """An Engine that writes chosen turns (encoded with the real tokenizer + the stop token): with
    tool schemas in the prompt, a python call (turn 1, sample 0 divides by zero, sample 1 prints the
    answer), then the answer read from the tool output; without tools, a calculator call (which the
    tools-disabled episode must answer with unknown_tool), then a wrong answer."""

    def __init__(self, tokenizer, answers: dict[str, str]):
        self.tok, self.answers = tokenizer, answers
        self.stop = tokenizer.eos_token_id

    async def generate(self, prompt_ids, params):
        text = self.tok.decode(prompt_ids)
        truth = next(a for q, a in self.answers.items() if q in text)
        with_tools = "<tools>" in text
        turn = text.count("<|im_start|>assistant")
        seed = params.seed // 1000  # the rollout's per-episode seed: even/odd sample of a problem
        if with_tools:
            if turn == 1:
                code = "print(1/0)" if seed % 2 == 0 else f"print({truth})"
                out = '<tool_call>\n{"name": "python", "arguments": {"code": "%s"}}\n</tool_call>' % code
            else:
                out = f"The answer is \\boxed{{{truth}}}." if "ZeroDivisionError" not in text else "\\boxed{0}"
        else:
            out = (
                '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
                if turn == 1
                else "\\boxed{-1}"
            )
        ids = self.tok.encode(out, add_special_tokens=False) + [self.stop]
        return GenerationOutput(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")

    async def update_weights(self, named_tensors):
        pass

    async def close(self):
        pass


@pytest.mark.slow
def test_evaluate_on_real_episodes_and_tools(tmp_path, tiny_model_dir, tiny_tokenizer, monkeypatch):
    from agent_env.math_task.data import make_split
    from otb_tir.evaluation import evaluate, summary_text
    from otb_tir.evaluation import run as run_mod

    items = make_split("test", 3, seed=0)
    answers = {it["extra_info"]["question"]: it["reward_model"]["ground_truth"] for it in items}
    monkeypatch.setattr(run_mod, "build_engine", lambda cfg, path, tok: ScriptedPolicy(tok, answers))
    cfg = load_eval_config(
        DEFAULT_CONFIG,
        [
            f"model.path={tiny_model_dir}",
            "data.size=3",
            "rollout.n=2",
            "eval.pass_k=[1,2]",
            f"output.dir={tmp_path}",
            "output.progress=false",
        ],
    )
    report = evaluate(cfg)
    w, o = report["with_tools"]["overall"], report["without_tools"]["overall"]
    # with tools: samples 0 (even seeds) hit ZeroDivisionError and answer 0; samples 1 answer right
    assert w["accuracy/mean@n"] == pytest.approx(0.5) and w["accuracy/pass@2"] == pytest.approx(1.0)
    assert w["accuracy/pass@1"] == pytest.approx(0.5)
    assert w["tools/call_rate"] == 1.0 and w["tools/calls"] == 6 and w["errors/runtime_error"] == 3
    assert w["tools/success_rate"] == pytest.approx(0.5) and w["turns/hist/2"] == 1.0
    assert 0 < w["response/tool_token_share"] < 1
    # tools disabled: the calculator call is answered with unknown_tool and counted; answers wrong
    assert o["accuracy/mean@n"] == 0.0 and o["errors/unknown_tool"] == 6 and o["tools/call_rate"] == 1.0
    assert report["tool_gain"]["overall"]["accuracy/mean@n"] == pytest.approx(0.5)
    recs = report["records"]["with_tools"]
    assert len(recs) == 6 and {r["correct"] for r in recs} == {True, False}
    r0 = next(r for r in recs if not r["correct"])
    call = r0["turns"][0]["tool_calls"][0]
    assert call["name"] == "python" and call["error_kind"] == "runtime_error" and "ZeroDivisionError" in call["result"]
    assert r0["answer"] == "0" and r0["finish_reason"] == "answer" and any(q in r0["prompt"] for q in answers)
    dis = report["records"]["without_tools"][0]["turns"][0]["tool_calls"][0]
    assert dis["error"] == "unknown_tool" and "unknown tool 'calculator'" in dis["result"]
    # the files
    data = json.loads((tmp_path / "eval.json").read_text())
    assert data["with_tools"]["overall"]["accuracy/mean@n"] == pytest.approx(0.5)
    assert "| runtime_error" in (tmp_path / "eval.md").read_text()
    assert "| accuracy/pass@2" in summary_text(report)


@pytest.mark.parametrize("engine, module", [("vllm", "vllm"), ("sglang", "sglang")])
def test_uninstalled_engine_is_a_config_error_naming_the_install(engine, module, tiny_model_dir):
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    import torch

    from otb_tir.evaluation.run import build_engine

    cfg = load_eval_config(DEFAULT_CONFIG, [f"rollout.name={engine}", f"model.path={tiny_model_dir}"])
    # sglang on a CPU is installed by the project's script (it publishes no CPU build)
    install = "scripts/install_sglang_env.sh" if engine == "sglang" and not torch.cuda.is_available() else "pip install"
    with pytest.raises(ConfigError, match=install):
        build_engine(cfg, tiny_model_dir, None)


def test_data_task_selects_the_built_in_held_out_split_as_training_does():
    """`data.task=chain` evaluates on the chain task's held-out split: the same problems training's
    `data.task=chain` holds out (its val set); an unknown task stops at load with the choices."""
    from agent_env.math_task.data import make_split
    from otb_tir.evaluation.run import _load_items
    from otb_tir.trainer.config import load_config
    from otb_tir.trainer.parts import load_items

    items, desc = _load_items(load_eval_config(DEFAULT_CONFIG, ["data.task=chain", "data.size=20"]))
    assert "chain" in desc and {i["data_source"] for i in items} == {"otb_tir/chain"}
    assert items == make_split("test", 20, seed=0, task="chain")
    _, val = load_items(load_config(None, ["data.task=chain", "data.val_size=20", "eval.size=20", "data.train_size=8"]))
    assert val == items
    arith, _ = _load_items(load_eval_config(DEFAULT_CONFIG, ["data.size=20"]))
    assert {i["data_source"] for i in arith} == {"otb_tir/arith"}
    with pytest.raises(ConfigError, match="chain"):
        load_eval_config(DEFAULT_CONFIG, ["data.task=chains"])
    with pytest.raises(ConfigError, match="chain"):
        load_config(None, ["data.task=chains"])
