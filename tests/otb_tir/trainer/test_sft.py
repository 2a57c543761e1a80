"""SFT warm start: the loss mask from the real chat template, shared-prefix loss == plain loss,
a few steps reduce the loss, traces run the real tools."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_env.math_task.data import make_split
from otb_tir import ConfigError
from otb_tir.defaults.tiny import build_tiny_model, tiny_policy_dir
from otb_tir.defaults.traces import (
    TraceMixture,
    _perturb_number,
    final_answer_from_result,
    make_traces,
    plan_messages,
    plan_trace,
    reference_call,
    tool_schemas,
)
from otb_tir.trainer.sft import SFTConfig, collate, masked_lm_loss, sft_train, tokenize_conversation


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_policy_dir())


@pytest.fixture(scope="module")
def schemas():
    return tool_schemas()


def _tool_conversation(question="What is 12 times 34? Put the final answer in \\boxed{}."):
    return [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": "Let me compute.",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}
            ],
        },
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "The answer is \\boxed{408}."},
    ]


def _masked_spans(example):
    spans, cur = [], []
    for tok, m in zip(example.input_ids, example.loss_mask):
        if m:
            cur.append(tok)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return spans


def test_mask_covers_exactly_assistant_tokens(tokenizer, schemas):
    ex = tokenize_conversation(tokenizer, _tool_conversation(), tools=schemas)
    text = tokenizer.apply_chat_template(_tool_conversation(), tools=schemas, tokenize=False)
    assert tokenizer.decode(ex.input_ids) == text
    spans = [tokenizer.decode(s) for s in _masked_spans(ex)]
    # what the policy generates in each assistant turn, including its <|im_end|> and nothing else
    assert spans == [
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n'
        "</tool_call><|im_end|>",
        "The answer is \\boxed{408}.<|im_end|>",
    ]
    unmasked = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if not m])
    assert "<tool_response>\n408\n</tool_response>" in unmasked and "12 times 34" in unmasked
    assert "The answer" not in unmasked and '"expression"' not in unmasked.split("<|im_start|>user")[-1]


def test_mask_on_generated_traces(tokenizer, schemas):
    """Property over many traces of every type: masked text == the assistant turns as the
    template renders them after '<|im_start|>assistant\\n', each ending at <|im_end|>."""
    rng = random.Random(0)
    mixture = TraceMixture()
    for item in make_split("train", 30, seed=4):
        plan = plan_trace(item, rng, mixture)
        if plan.call is not None:
            plan.result = "123"  # rendering only; make_traces runs the real tools
        messages = plan_messages(plan)
        ex = tokenize_conversation(tokenizer, messages, tools=schemas)
        text = tokenizer.decode(ex.input_ids)
        expected = [part.split("<|im_end|>")[0] + "<|im_end|>" for part in text.split("<|im_start|>assistant\n")[1:]]
        assert [tokenizer.decode(s) for s in _masked_spans(ex)] == expected
        assert len(expected) == sum(m["role"] == "assistant" for m in messages)


def test_tokenize_errors(tokenizer):
    with pytest.raises(ConfigError, match="at least one assistant"):
        tokenize_conversation(tokenizer, [{"role": "user", "content": "hi"}])


def test_shared_prefix_loss_equals_plain_loss(tokenizer, schemas):
    model = build_tiny_model(
        tokenizer, hidden_size=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate_size=64, seed=1
    )
    convs = [_tool_conversation(f"What is {a} times 7? Put the final answer in \\boxed{{}}.") for a in (3, 41, 977)]
    convs.append(_tool_conversation()[:1] + [{"role": "assistant", "content": "\\boxed{1}"}])
    batch = collate([tokenize_conversation(tokenizer, c, tools=schemas) for c in convs], tokenizer.pad_token_id)

    def loss_and_grads(share):
        model.zero_grad()
        loss = masked_lm_loss(model, batch, share_prefix=share)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain, g_plain = loss_and_grads(False)
    shared, g_shared = loss_and_grads(True)
    # oracle: the model's own full-vocabulary logits and torch's ignore_index cross-entropy
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    ref = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(plain, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(shared, ref.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(g_plain, g_shared):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_few_steps_reduce_loss(tokenizer, schemas):
    model = build_tiny_model(
        tokenizer, hidden_size=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate_size=64, seed=0
    )
    rng = random.Random(1)
    examples = []
    for item in make_split("train", 16, seed=9):
        plan = plan_trace(item, rng, TraceMixture(tool=1, python=0, guess=0, wrong_tool=0, tool_share={}))
        plan.result = item["reward_model"]["ground_truth"]
        # no tools= (no system prompt): short sequences keep this test fast
        examples.append(tokenize_conversation(tokenizer, plan_messages(plan)))
    batch = collate(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        before = float(masked_lm_loss(model, batch))
    losses = sft_train(
        model,
        examples,
        tokenizer.pad_token_id,
        SFTConfig(steps=12, batch_size=8, lr=1e-2, warmup_steps=2, progress=False),
    )
    with torch.no_grad():
        after = float(masked_lm_loss(model, batch))
    assert len(losses) == 12 and all(x == x for x in losses)
    assert after < before - 1.0, (before, after)


def test_sft_config_errors():
    with pytest.raises(ConfigError, match="steps"):
        SFTConfig(steps=0).validate()
    with pytest.raises(ConfigError, match="lr"):
        SFTConfig(lr=0).validate()
    with pytest.raises(ConfigError, match="mixture"):
        TraceMixture(tool=-1).validate()


def test_perturb_number_changes_one_digit():
    rng = random.Random(0)
    for text in ["56088", "5/338", "-16", "(33620 - 5652)/64", "7"]:
        for _ in range(20):
            out = _perturb_number(text, rng)
            assert len(out) == len(text) and sum(a != b for a, b in zip(out, text)) == 1
            assert not any(
                out[i] == "0" and (i == 0 or not out[i - 1].isdigit()) and i + 1 < len(out) and out[i + 1].isdigit()
                for i in range(len(out))
            )


@pytest.mark.slow
@pytest.mark.parametrize("task", ["arith", "chain"])
def test_in_process_calculator_traces_equal_the_sandboxed_tools(task):
    """The warm start evaluates its calculator calls in this process (``in_process``, the default):
    the traces must be exactly those the sandboxed tools give, every trace type included (wrong
    calls' results, equations' roots, the chain task's second calls on the first's output)."""
    from otb_tir.defaults.warm_start import CHAIN_MIXTURE

    if task == "arith":
        mixture = TraceMixture(tool=1, python=1, guess=1, wrong_tool=1, tool_share={})
    else:
        mixture = replace(CHAIN_MIXTURE, wrong_tool=0.2)
    fast = make_traces(120, seed=3, mixture=mixture, task=task)
    real = make_traces(120, seed=3, mixture=mixture, task=task, in_process=False)
    assert fast == real
    assert sum(len(m) > 2 for m in real) > 40  # most of them call a tool


@pytest.mark.slow
def test_make_traces_use_real_tool_results():
    traces = make_traces(16, seed=0, mixture=TraceMixture(tool=1, python=1, guess=1, wrong_tool=1, tool_share={}))
    kinds = set()
    items = make_split("train", 16, seed=0)
    for item, messages in zip(items, traces):
        assert messages[0] == item["prompt"][0]
        if len(messages) == 2:
            kinds.add("guess")
            continue
        call = messages[1]["tool_calls"][0]["function"]
        result = messages[2]["content"]
        boxed = final_answer_from_result(result)
        assert messages[3]["content"] == f"The answer is \\boxed{{{boxed}}}."
        truth = item["reward_model"]["ground_truth"]
        if call["name"] == "python":
            kinds.add("python")
            assert call["arguments"]["code"] == f"print({item['extra_info']['expression']})"
            assert boxed == truth
        elif call["arguments"]["expression"] == reference_call(item)[1]:
            kinds.add("tool")
            assert boxed == truth
        else:
            kinds.add("wrong_tool")
            assert boxed != truth
    assert len(kinds) >= 3


@pytest.mark.slow
def test_warm_start_policy_short_run_is_cached_and_loadable(tmp_path, monkeypatch):
    from otb_tir.defaults import warm_start

    base = tiny_policy_dir()
    path = warm_start.warm_start_policy(
        tmp_path, steps=3, copy_steps=2, n_traces=12, batch_size=4, warmup_steps=1, base=base, progress=False
    )
    assert path.parent == tmp_path and (path / "otb_tir_warm_start.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert tok.chat_template and model.config.model_type == "qwen3"
    # weights changed from the base
    base_model = AutoModelForCausalLM.from_pretrained(base)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), base_model.parameters()))
    # a second call with the same settings reuses the folder without training
    monkeypatch.setattr(warm_start, "sft_train", lambda *a, **k: pytest.fail("retrained a cached policy"))
    assert (
        warm_start.warm_start_policy(
            tmp_path, steps=3, copy_steps=2, n_traces=12, batch_size=4, warmup_steps=1, base=base
        )
        == path
    )
    # bad settings fail before any work
    with pytest.raises(ConfigError):
        warm_start.warm_start_policy(tmp_path, steps=0, base=base)
