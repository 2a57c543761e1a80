"""Warm start: per-kind trace mixture statistics, reference calls checked by the real calculator
and sympy, the per-kind diagnostic, the check's report read from AgentEnv episodes, the cache key,
and bad settings."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import sympy

from agent_env.engines.base import GenerationOutput
from agent_env.math_task.data import KINDS, make_split
from otb_tir import ConfigError
from otb_tir.defaults import check, warm_start
from otb_tir.defaults.check import _breakdown
from otb_tir.defaults.traces import (
    DEFAULT_TOOL_SHARE,
    TraceMixture,
    final_answer_from_result,
    make_traces,
    plan_trace,
    reference_call,
)
from otb_tir.defaults.warm_start import WarmStartSettings


def _sympy_value(expr: str) -> Fraction:
    """Independent oracle: the (largest real) value of a reference call, by sympy directly."""
    x = sympy.Symbol("x")
    if "=" in expr:
        lhs, rhs = expr.split("=")
        roots = sympy.solve(sympy.sympify(lhs) - sympy.sympify(rhs), x)
        value = max(roots)
    else:
        value = sympy.sympify(expr.replace("%", " % "))
    value = sympy.nsimplify(value)
    return Fraction(int(value.p), int(value.q))


def test_per_kind_tool_shares_match_the_mixture():
    """Binomial check: over 4,000 planned traces the tool share of every kind is within 4.5
    standard deviations of its setting, and tool traces split between calculator and python as
    the weights say (python only where print() gives the exact answer)."""
    mixture = TraceMixture()
    rng = random.Random(3)
    counts: dict[str, list[int]] = {}
    modes: dict[str, int] = {}
    for item in make_split("train", 4000, seed=11):
        plan = plan_trace(item, rng, mixture)
        kind = item["extra_info"]["kind"]
        c = counts.setdefault(kind, [0, 0])
        c[0] += 1
        c[1] += plan.call is not None
        modes[plan.mode] = modes.get(plan.mode, 0) + 1
        if plan.mode == "python":
            assert kind in ("mul", "add", "pow", "mod")
    assert set(counts) == set(KINDS)
    for kind, (n, tools) in counts.items():
        p = mixture.tool_share[kind]
        assert abs(tools / n - p) <= 4.5 * math.sqrt(p * (1 - p) / n) + 1e-9, (kind, tools / n, p)
    assert "wrong_tool" not in modes  # default: no corrupted calls
    # the defaults really differ by kind: some tool-leaning, some guess-leaning
    assert max(DEFAULT_TOOL_SHARE.values()) >= 0.8 and min(DEFAULT_TOOL_SHARE.values()) <= 0.4


def test_mode_weights():
    m = TraceMixture(tool=3, python=1, guess=4, wrong_tool=0, tool_share={"mul": 0.5})
    w = m.mode_weights("mul")
    no = {"stop_early": 0.0}  # a chain-task mode: arith kinds have one step
    assert w == pytest.approx({"tool": 0.375, "python": 0.125, "guess": 0.5, "wrong_tool": 0.0, **no})
    # kinds not in tool_share use the weights as they are; python only for print()-exact kinds
    add = {"tool": 3 / 8, "python": 1 / 8, "guess": 0.5, "wrong_tool": 0, **no}
    assert m.mode_weights("add") == pytest.approx(add)
    assert m.mode_weights("frac") == pytest.approx(
        {"tool": 3 / 7, "python": 0.0, "guess": 4 / 7, "wrong_tool": 0, **no}
    )
    assert sum(TraceMixture().mode_weights("quadratic").values()) == pytest.approx(1.0)


def test_reference_calls_give_the_answer():
    """Every kind's reference call, run by the real calculator, leads to the ground truth; the
    reference value also equals the truth by sympy directly; equations are copied verbatim
    from the question."""
    items = [it for kind in KINDS for it in make_split("train", 3, seed=5, kinds=[kind])]
    for it in items:
        name, expr = reference_call(it)
        assert name == "calculator"
        truth = it["reward_model"]["ground_truth"]
        assert _sympy_value(expr) == Fraction(truth)
        if it["extra_info"]["kind"] in ("linear", "quadratic"):
            assert expr in it["extra_info"]["question"] and " = " in expr
            assert expr != it["extra_info"]["expression"]
        else:
            assert expr == it["extra_info"]["expression"]
    mixture = TraceMixture(tool=1, python=0, guess=0, tool_share={})
    traces = make_traces(len(items), seed=0, mixture=mixture)  # make_split("train", n, seed=0) items
    for messages, item in zip(traces, make_split("train", len(items), seed=0)):
        assert messages[1]["tool_calls"][0]["function"]["arguments"]["expression"] == reference_call(item)[1]
        assert messages[3]["content"] == f"The answer is \\boxed{{{item['reward_model']['ground_truth']}}}."


def test_final_answer_from_result():
    assert final_answer_from_result("x = -12, x = 5") == "5"
    assert final_answer_from_result("x = 437") == "437"
    assert final_answer_from_result("279936\n") == "279936"
    assert final_answer_from_result("41/28") == "41/28"


def test_breakdown_counts():
    items = [
        {
            "extra_info": {"kind": "mul", "expression": "12*34", "question": "What is 12 times 34?"},
            "reward_model": {"ground_truth": "408"},
        }
        for _ in range(4)
    ]
    correct = [True, False, False, True]
    first_call = [True, True, True, False]
    first_correct = [False, False, False, True]
    first_args = [
        {"name": "calculator", "expression": "12 * 34"},
        {"name": "calculator", "expression": "12*35"},
        {"name": "python", "code": "print(12*34)"},
        None,
    ]
    first_result = ["408", "420", "408\n", None]
    row = _breakdown(items, correct, first_call, first_correct, first_args, first_result)["mul"]
    assert row["n"] == 4 and row["accuracy"] == 0.5 and row["tool_call_rate"] == 0.75
    assert row["call_exact"] == pytest.approx(2 / 3)  # "12 * 34" and print(12*34); not 12*35
    assert row["copy_out"] == 0.5  # 2 calls returned the answer, 1 of them boxed it
    assert row["guess_rate"] == 0.25 and row["guess_accuracy"] == 1.0
    table = check.format_breakdown({"mul": row}).splitlines()
    assert table[0].split()[:3] == ["kind", "n", "accuracy"] and table[1].split()[:3] == ["mul", "4", "0.50"]


@pytest.mark.parametrize(
    "bad",
    [
        dict(steps=0),
        dict(copy_steps=-1),
        dict(batch_size=-1),
        dict(n_traces=0),
        dict(hidden_size=100),
        dict(layers=0),
        dict(lr=0.0),
        dict(warmup_steps=10, steps=10),
        dict(mixture=TraceMixture(tool=-1)),
        dict(mixture=TraceMixture(tool_share={"cubic": 0.5})),
        dict(mixture=TraceMixture(tool_share={"mul": 1.5})),
        dict(mixture=TraceMixture(guess_right=2.0)),
        dict(mixture=TraceMixture(tool=0, python=0, wrong_tool=0, guess=1, tool_share={"mul": 0.5})),
    ],
)
def test_bad_settings_raise_config_error(bad, tmp_path, monkeypatch):
    from otb_tir.defaults.tiny import tiny_policy_dir

    monkeypatch.setattr(warm_start, "make_traces", lambda *a, **k: pytest.fail("worked on bad settings"))
    with pytest.raises(ConfigError):
        warm_start.warm_start_policy(tmp_path, base=tiny_policy_dir(), progress=False, **bad)
    assert not list(tmp_path.iterdir())


def test_base_without_config_raises(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        warm_start.warm_start_policy(tmp_path, base=tmp_path, progress=False)


@pytest.mark.slow
def test_cache_key_same_settings_same_folder(tmp_path, monkeypatch):
    """Same settings → the cached folder is reused (no training); a different setting → a new folder."""
    from otb_tir.defaults.tiny import tiny_policy_dir

    base = tiny_policy_dir()
    kw = dict(steps=2, copy_steps=1, n_traces=6, batch_size=3, warmup_steps=1, base=base, progress=False)
    first = warm_start.warm_start_policy(tmp_path, **kw)
    assert (first / "otb_tir_warm_start.json").is_file()
    monkeypatch.setattr(warm_start, "sft_train", lambda *a, **k: pytest.fail("retrained a cached policy"))
    assert warm_start.warm_start_policy(tmp_path, **kw) == first
    monkeypatch.undo()
    other = warm_start.warm_start_policy(tmp_path, **{**kw, "mixture": TraceMixture(tool_share={"mul": 0.5})})
    assert other != first and other.parent == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])
    # the multistep traces' stop hazard is in the multistep key, and only there
    from otb_tir.defaults import traces

    ms = dict(kw, task="multistep", copy_steps=0)
    multistep = warm_start.warm_start_policy(tmp_path, **ms)
    monkeypatch.setattr(traces, "STOP_HAZARD", traces.STOP_HAZARD / 2)
    assert warm_start.warm_start_policy(tmp_path, **ms) != multistep
    monkeypatch.setattr(warm_start, "sft_train", lambda *a, **k: pytest.fail("retrained a cached policy"))
    assert warm_start.warm_start_policy(tmp_path, **kw) == first  # arith: same key


def test_default_settings_are_valid():
    WarmStartSettings().validate()
    TraceMixture().validate()


@pytest.mark.slow
def test_copy_phase_trains_on_tool_call_traces_only(tmp_path, monkeypatch):
    """Phase 1 (``copy_steps``) sees exactly the traces with a tool call, phase 2 all of them;
    the recorded loss curve covers both phases."""
    from otb_tir.defaults.tiny import tiny_policy_dir

    base = tiny_policy_dir()
    seen = []
    real = warm_start.sft_train

    def spy(model, examples, pad_id, cfg):
        seen.append((list(examples), cfg))
        return real(model, examples, pad_id, cfg)

    monkeypatch.setattr(warm_start, "sft_train", spy)
    path = warm_start.warm_start_policy(
        tmp_path, steps=2, copy_steps=3, n_traces=16, batch_size=4, warmup_steps=1, base=base, progress=False
    )
    (phase1, cfg1), (phase2, cfg2) = seen
    assert (cfg1.steps, cfg2.steps) == (3, 2)
    from transformers import AutoTokenizer

    call_id = AutoTokenizer.from_pretrained(base).convert_tokens_to_ids("<tool_call>")
    traces = warm_start.make_traces(16, seed=0)
    with_call = sum(any(m.get("tool_calls") for m in msgs) for msgs in traces)
    assert 0 < len(phase1) == with_call < len(phase2) == 16

    def calls(e):  # the policy writes a <tool_call> (the system prompt's mention has no loss)
        return any(i == call_id and m for i, m in zip(e.input_ids, e.loss_mask))

    assert all(calls(e) for e in phase1)
    assert sum(calls(e) for e in phase2) == with_call
    record = __import__("json").loads((path / "otb_tir_warm_start.json").read_text())
    assert len(record["losses"]) == 5


def test_copy_phase_needs_tool_traces(tmp_path, monkeypatch):
    from otb_tir.defaults.tiny import tiny_policy_dir

    monkeypatch.setattr(warm_start, "make_traces", lambda *a, **k: pytest.fail("worked on bad settings"))
    with pytest.raises(ConfigError, match="copy_steps"):
        warm_start.warm_start_policy(
            tmp_path,
            steps=1,
            copy_steps=2,
            n_traces=4,
            batch_size=2,
            warmup_steps=0,
            base=tiny_policy_dir(),
            progress=False,
            mixture=TraceMixture(tool_share={k: 0.0 for k in DEFAULT_TOOL_SHARE}),
        )


# ----------------------------------------------------------------------------- the check


class _ScriptedCheckPolicy:
    """An Engine that plays one strategy per problem (index mod 6), read from the prompt text:
    0 the reference calculator call, then the tool's result boxed; 1 a wrong calculator call, its
    result boxed; 2 a right guess; 3 a wrong guess; 4 a call with a bad argument name, then a wrong
    answer; 5 the reference call, then a wrong number boxed."""

    def __init__(self, tokenizer, items):
        self.tok, self.items = tokenizer, items
        self.stop = tokenizer.eos_token_id

    async def generate(self, prompt_ids, params):
        text = self.tok.decode(prompt_ids)
        i = max(
            (j for j, it in enumerate(self.items) if it["extra_info"]["question"] in text),
            key=lambda j: len(self.items[j]["extra_info"]["question"]),
        )
        item, plan = self.items[i], i % 6
        truth = item["reward_model"]["ground_truth"]
        turn = text.count("<|im_start|>assistant")

        def call(args):
            return '<tool_call>\n{"name": "calculator", "arguments": %s}\n</tool_call>' % __import__("json").dumps(args)

        if turn == 1:
            out = {
                0: call({"expression": reference_call(item)[1]}),
                1: call({"expression": "12345+1"}),
                2: f"The answer is \\boxed{{{truth}}}.",
                3: "The answer is \\boxed{99999999}.",
                4: call({"expr": "1+1"}),
                5: call({"expression": reference_call(item)[1]}),
            }[plan]
        else:
            result = text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
            out = {
                0: f"The answer is \\boxed{{{final_answer_from_result(result)}}}.",
                1: f"The answer is \\boxed{{{final_answer_from_result(result)}}}.",
                4: "The answer is \\boxed{2}.",
                5: "The answer is \\boxed{77777777}.",
            }[plan]
        ids = self.tok.encode(out, add_special_tokens=False) + [self.stop]
        return GenerationOutput(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")

    async def update_weights(self, named_tensors):
        pass

    async def close(self):
        pass


@pytest.mark.slow
def test_check_report_is_what_the_agent_env_episodes_give(tiny_model_dir, tiny_tokenizer, monkeypatch, tmp_path):
    """evaluate_tool_use runs its episodes with AgentEnv (the evaluation's rollout, real tools):
    every figure of the report equals the one computed directly from those trajectories, and the
    scripted strategies give the figures they must."""
    from agent_env import AgentEnv
    from agent_env.tool_metrics import MALFORMED_KINDS, tool_metrics
    from otb_tir.evaluation import run as run_mod

    items = make_split("test", 12, seed=0)
    monkeypatch.setattr(run_mod, "build_engine", lambda cfg, path, tok: _ScriptedCheckPolicy(tok, items))
    trajs = []
    real_run = AgentEnv.run

    async def spy(self, *a, **k):
        traj = await real_run(self, *a, **k)
        trajs.append(traj)
        return traj

    monkeypatch.setattr(AgentEnv, "run", spy)
    report = check.evaluate_tool_use(tiny_model_dir, items, temperature=0.0, report_dir=tmp_path)
    assert len(trajs) == len(items)  # one AgentEnv episode per problem, nothing else
    assert (tmp_path / "warm_start_check.json").is_file()  # the evaluation's own report
    trajs.sort(key=lambda t: int(t.uid[1:]))
    n = len(items)
    correct = [bool(t.reward_details["correct"]) for t in trajs]
    first_call = [bool(t.turns[0].tool_calls) for t in trajs]
    first_correct = [ok and not c for ok, c in zip(correct, first_call)]
    first_args = [
        {"name": t.turns[0].tool_calls[0].name, **t.turns[0].tool_calls[0].arguments} if c else None
        for t, c in zip(trajs, first_call)
    ]
    first_result = [
        t.turns[0].tool_calls[0].text if c and t.turns[0].tool_calls[0].executed else None
        for t, c in zip(trajs, first_call)
    ]
    calls = [c for t in trajs for tr in t.turns for c in tr.tool_calls]
    assert report.n == n and report.temperature == 0.0
    assert report.accuracy == sum(correct) / n
    assert report.tool_call_rate == sum(first_call) / n
    assert report.accuracy_without_tools == sum(first_correct) / n
    assert report.well_formed_rate == sum(c.error not in MALFORMED_KINDS for c in calls) / len(calls)
    assert report.tool_success_rate == tool_metrics(trajs)["tools/executed_success_rate"]
    kinds = sorted({it["extra_info"]["kind"] for it in items})
    assert report.by_kind == {
        k: sum(ok for ok, it in zip(correct, items) if it["extra_info"]["kind"] == k)
        / sum(it["extra_info"]["kind"] == k for it in items)
        for k in kinds
    }
    expected = _breakdown(items, correct, first_call, first_correct, first_args, first_result)
    assert report.breakdown.keys() == expected.keys()
    for kind, row in expected.items():
        assert report.breakdown[kind] == pytest.approx(row, nan_ok=True)
    # the scripted strategies: plans 0 and 2 are right (4 of 12), plans 0, 1, 4, 5 call a tool (8),
    # plan 2 guesses right (2); the two calls with a bad argument name are malformed and fail
    assert correct == [i % 6 in (0, 2) for i in range(n)]
    assert (report.accuracy, report.tool_call_rate, report.accuracy_without_tools) == (4 / 12, 8 / 12, 2 / 12)
    assert report.well_formed_rate == 6 / 8 and report.tool_success_rate == 6 / 8
    assert sum(
        row["n"] * row["tool_call_rate"] * row["call_exact"]
        for row in report.breakdown.values()
        if row["tool_call_rate"]
    ) == pytest.approx(4)  # plans 0 and 5 make the reference call
    assert sum(row["n"] * row["guess_rate"] for row in report.breakdown.values()) == pytest.approx(4)


@pytest.mark.slow
def test_warm_start_publishes_through_the_cache(tmp_path, monkeypatch):
    """warm_start_policy publishes with agent_env.cache.publish: two concurrent callers train once;
    a build that fails mid-training publishes nothing (no folder, temporary or lock file left)."""
    import threading

    from otb_tir.defaults.tiny import tiny_policy_dir

    base = tiny_policy_dir()
    kw = dict(steps=2, copy_steps=1, n_traces=6, batch_size=3, warmup_steps=1, base=base, progress=False)
    real = warm_start.sft_train
    phases = []

    def counted(*a, **k):
        phases.append(threading.get_ident())
        return real(*a, **k)

    monkeypatch.setattr(warm_start, "sft_train", counted)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(warm_start.warm_start_policy(tmp_path, **kw))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == 2 and results[0] == results[1] and len(phases) == 2  # one build: its two phases
    assert sorted(p.name for p in tmp_path.iterdir()) == [results[0].name]

    def crash(*a, **k):
        raise RuntimeError("killed mid-training")

    monkeypatch.setattr(warm_start, "sft_train", crash)
    with pytest.raises(RuntimeError, match="mid-training"):
        warm_start.warm_start_policy(tmp_path, **{**kw, "steps": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == [results[0].name]


# --- the chain task's warm start -----------------------------------------------------------------


def test_chain_traces_chain_the_real_calculator_and_box_the_right_value():
    """Full-chain traces call the real calculator once per step, the second call on the first
    call's output, and box the ground truth; stop-early traces box the intermediate (wrong)."""
    from agent_env.math_task.data import CHAIN_KINDS

    n = 24
    items = make_split("train", n, seed=0, task="chain")
    for mode, mixture in [
        ("tool", TraceMixture(tool=1, python=0, guess=0, stop_early=0, tool_share={})),
        ("stop_early", TraceMixture(tool=0, python=0, guess=0, stop_early=1, tool_share={})),
    ]:
        traces = make_traces(n, seed=0, mixture=mixture, task="chain")
        for messages, item in zip(traces, items):
            steps, truth = item["extra_info"]["steps"], item["reward_model"]["ground_truth"]
            calls = [m["tool_calls"][0]["function"] for m in messages if m.get("tool_calls")]
            results = [m["content"] for m in messages if m["role"] == "tool"]
            assert calls[0] == {"name": "calculator", "arguments": {"expression": steps[0]}}
            first = _sympy_value(steps[0])
            assert Fraction(results[0]) == first  # the real calculator's output, checked by sympy
            if mode == "tool":
                assert len(calls) == 2
                assert calls[1]["arguments"]["expression"] == steps[1].format(r=results[0])
                assert Fraction(results[1]) == Fraction(truth)
                assert messages[-1]["content"] == f"The answer is \\boxed{{{truth}}}."
            else:
                assert len(calls) == 1 and messages[-1]["content"] == f"The answer is \\boxed{{{results[0]}}}."
                assert results[0] != truth
    m = TraceMixture(tool=0.35, python=0.5, guess=0.2, stop_early=0.45, guess_right=0, tool_share={})
    for kind in CHAIN_KINDS:
        w = m.mode_weights(kind)
        assert w["python"] == 0 and w["stop_early"] == pytest.approx(0.45)  # print(expr) would be one call
    assert TraceMixture(stop_early=1).mode_weights("mul")["stop_early"] == 0  # arith kinds have one step


def test_multistep_traces_stop_after_each_call_with_the_hazard():
    """A multistep trace stops after each call with probability STOP_HAZARD (counted over draws;
    the chain task does not draw, so its traces are as before); the generated traces chain the real
    calculator, each call on the previous output, box the last result, and are right exactly when
    they make every call."""
    from otb_tir.defaults import traces
    from otb_tir.defaults.warm_start import MULTISTEP_MIXTURE

    rng = random.Random(3)
    state = rng.getstate()
    assert traces._calls_made(1, rng) == 1 and rng.getstate() == state
    h, draws = traces.STOP_HAZARD, 20000
    counts = {j: sum(traces._calls_made(4, rng) == j for _ in range(draws)) for j in (1, 2, 3, 4)}
    expected = {1: h, 2: (1 - h) * h, 3: (1 - h) ** 2 * h, 4: (1 - h) ** 3}
    for j, p in expected.items():  # within 4 standard errors
        assert abs(counts[j] / draws - p) < 4 * math.sqrt(p * (1 - p) / draws), (j, counts[j] / draws, p)

    n = 40
    items = make_split("train", n, seed=0, task="multistep")
    made = []
    for messages, item in zip(make_traces(n, seed=0, mixture=MULTISTEP_MIXTURE, task="multistep"), items):
        steps, truth = item["extra_info"]["steps"], item["reward_model"]["ground_truth"]
        calls = [m["tool_calls"][0]["function"]["arguments"]["expression"] for m in messages if m.get("tool_calls")]
        results = [m["content"] for m in messages if m["role"] == "tool"]
        boxed = messages[-1]["content"]
        if not calls:  # a guess: always wrong
            assert truth not in boxed
            continue
        made.append(len(calls))
        assert calls[0] == steps[0] and len(calls) <= len(steps)
        for i in range(1, len(calls)):
            assert calls[i] == steps[i].format(r=results[i - 1])
        assert boxed == f"The answer is \\boxed{{{results[-1]}}}."
        assert (Fraction(results[-1]) == Fraction(truth)) == (len(calls) == len(steps))
    assert set(made) >= {1, 2}  # stops at different steps: episodes of different lengths


@pytest.mark.slow
def test_chain_warm_start_continues_from_the_arith_warm_start(tmp_path, monkeypatch):
    """``data.task=chain``'s policy: the arith warm start (the base), then SFT on chain traces only,
    cached under its own key."""
    from otb_tir.defaults.tiny import tiny_policy_dir

    tiny_policy_dir(tmp_path)
    seen = []
    real = warm_start.sft_train

    def spy(model, examples, pad_id, cfg):
        seen.append(len(examples))
        return real(model, examples, pad_id, cfg)

    monkeypatch.setattr(warm_start, "sft_train", spy)
    monkeypatch.setattr(warm_start, "CHAIN_TRACES", 12)
    kw = dict(steps=2, copy_steps=1, n_traces=12, chain_steps=2, progress=False)
    chain = warm_start.task_warm_start("chain", tmp_path, **kw)
    arith = warm_start.task_warm_start("arith", tmp_path, **kw)
    assert chain != arith and chain.parent == arith.parent == tmp_path
    import json

    record = json.loads((chain / "otb_tir_warm_start.json").read_text())
    assert record["key"]["settings"]["task"] == "chain"
    assert record["key"]["base"] == arith.name  # a cached artifact, by its name (its key's digest)
    assert seen[-1] == 12  # the chain phase trained on the chain traces
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(chain)
    monkeypatch.setattr(warm_start, "MULTISTEP_TRACES", 10)
    monkeypatch.setattr(warm_start, "MULTISTEP_STEPS", 2)
    multistep = warm_start.task_warm_start("multistep", tmp_path, **kw)
    record = json.loads((multistep / "otb_tir_warm_start.json").read_text())
    assert record["key"]["settings"]["task"] == "multistep"
    assert record["key"]["base"] == chain.name  # multistep continues from chain
    assert seen[-1] == 10
