"""HFEngine's written-out decode step (agent_env.engines.hf_decode) against the model's own forward.

The oracle is the model's forward (``decode_step="model"``): the same requests, under the same seed,
through an engine that decodes with it and one that decodes with the fused step, eager or compiled,
must give the same tokens and log-probs to 1e-5 — with rows joining and leaving the running batch,
next turns prefilled on kept keys/values, greedy and sampled rows, and the trainer changing the
shared weights in place between two rollouts.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from agent_env.engines import EngineError, HFEngine, SamplingParams
from agent_env.engines.hf_decode import FusedDecoder, unsupported
from tests.support.small_models import small_decoder


def _rollouts(engine: HFEngine, model, prompts: list[list[int]]) -> list:
    """Two rounds of two turns each; between the rounds the shared weights change in place."""

    async def two_turns():
        first = await asyncio.gather(
            *(
                engine.generate(p, SamplingParams(max_tokens=6 + 5 * i, temperature=0.0 if i % 3 == 0 else 1.0))
                for i, p in enumerate(prompts)
            )
        )
        nxt = [p + o.token_ids + [11, 12, 13] for p, o in zip(prompts, first)]  # a tool's answer, then on
        second = await asyncio.gather(
            *(engine.generate(p, SamplingParams(max_tokens=24, temperature=1.0)) for p in nxt)
        )
        return first + second

    outs = asyncio.run(two_turns())
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # an optimizer step on the shared weights, the same on every model
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return outs + asyncio.run(two_turns())


@pytest.mark.parametrize("step", ["fused", "compiled"])
def test_the_fused_decode_step_equals_the_models_forward(tiny_model_factory, step):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (5, 17, 30, 9, 12, 40)]
    results = {}
    for name in ("model", step):
        model = tiny_model_factory()
        eng = HFEngine(model, share_weights=True, decode_step=name, seed=3, stop_at_eos=False, max_batch_size=4)
        results[name] = _rollouts(eng, model, prompts)
        assert eng.decode_step == name
        assert eng.stats["prefix_hits"] > 0  # next turns went on kept keys/values
        if step == "compiled" and name == step:
            assert eng.compile_s is not None and eng.compile_s > 0 and eng.compile_error is None
        asyncio.run(eng.close())
    ref, got = results["model"], results[step]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    gap = max(abs(a - b) for x, y in zip(ref, got) for a, b in zip(x.logprobs, y.logprobs))
    assert gap <= 1e-5, gap
    assert sum(len(o.token_ids) for o in ref) > 200


def test_auto_uses_the_fused_step_for_the_builtin_policy_and_the_model_elsewhere(tiny_model_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    assert HFEngine(tiny_model_factory(), share_weights=True).decode_step == "fused"
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)).eval()
    assert "gpt2" in unsupported(gpt2)
    eng = HFEngine(gpt2, share_weights=True)
    assert eng.decode_step == "model"
    out = asyncio.run(eng.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0)))
    assert len(out.token_ids) == 4
    with pytest.raises(EngineError, match="model_type 'gpt2'"):
        HFEngine(gpt2, share_weights=True, decode_step="fused")
    with pytest.raises(EngineError, match="decode_step must be one of"):
        HFEngine(gpt2, share_weights=True, decode_step="fast")


def test_the_probe_catches_a_model_the_step_does_not_reproduce(tiny_model_factory, caplog):
    """A layer that passes the structural checks but computes something else (its MLP's activation
    swapped): asked for, the fused step is refused naming the gap; under auto the engine decodes with
    the model's forward and says why."""
    model = tiny_model_factory()
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert unsupported(model) is None
    with pytest.raises(EngineError, match="does not reproduce this model's forward"):
        FusedDecoder(model)
    with pytest.raises(EngineError, match="does not reproduce"):
        HFEngine(model, share_weights=True, decode_step="fused")
    with caplog.at_level("WARNING", logger="agent_env.engines.hf"):
        eng = HFEngine(model, share_weights=True)
    assert eng.decode_step == "model" and "does not reproduce" in caplog.text


def test_a_compile_that_fails_runs_the_eager_step_and_says_so(tiny_model_factory, monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level("WARNING", logger="agent_env.engines.hf_decode"):
        eng = HFEngine(tiny_model_factory(), share_weights=True, decode_step="compiled", seed=0)
        out = asyncio.run(eng.generate([5, 6, 7], SamplingParams(max_tokens=5, temperature=1.0)))
    assert len(out.token_ids) == 5
    assert eng.decode_step == "fused" and "no C++ compiler here" in (eng.compile_error or "")
    assert "no C++ compiler here" in caplog.text


def _tiny(kind: str):
    """A random model of each family the fused step claims (seeded; nothing downloaded)."""
    if kind == "qwen2":  # q/k/v projections with a bias, no q/k norms
        model = small_decoder("qwen2", max_position_embeddings=256)
    else:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        extra = dict(rope_parameters=rope, mlp_bias=True, attention_bias=True)
        model = small_decoder("llama", max_position_embeddings=256, **extra)
    with torch.no_grad():  # biases and norm weights start at 0 and 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape) * 0.3)
    return model


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_the_other_families_it_claims_decode_as_their_forward_does(kind):
    """Qwen2 (q/k/v biases) and Llama (llama3 rope scaling, biases everywhere): same tokens and
    log-probs to 1e-5 as the model's own forward, through the engine."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 11, 23)]
    outs = {}
    for name in ("model", "fused"):
        model = _tiny(kind)
        assert unsupported(model) is None
        eng = HFEngine(model, share_weights=True, decode_step=name, seed=5, stop_at_eos=False)
        assert eng.decode_step == name

        async def go(eng=eng):
            return await asyncio.gather(
                *(eng.generate(p, SamplingParams(max_tokens=20, temperature=1.0)) for p in prompts)
            )

        outs[name] = asyncio.run(go())
    assert [o.token_ids for o in outs["fused"]] == [o.token_ids for o in outs["model"]]
    gap = max(abs(a - b) for x, y in zip(outs["model"], outs["fused"]) for a, b in zip(x.logprobs, y.logprobs))
    assert gap <= 1e-5, gap
