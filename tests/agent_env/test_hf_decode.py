"""HFEngine's written-out decode step (agent_env.engines.hf_decode) against the model's own forward.

The oracle is the model's forward (``decode_step="model"``): the same requests, under the same seed,
through an engine that decodes with it and one that decodes with the fused step, eager or compiled,
with the projections concatenated or apart (``FUSE_BYTES`` lowered: a large model's branch), must
give the same tokens and log-probs to 1e-5 — with rows joining and leaving the running batch, next
turns prefilled on kept keys/values, greedy and sampled rows, the trainer changing the shared weights
in place between two rollouts, and in bfloat16/float16 (where 1e-5 means the same logits bit for bit).
After weight changes that no version counter shows, the oracle is a fresh forward of the model.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from agent_env.engines import EngineError, HFEngine, SamplingParams, hf_decode
from agent_env.engines.hf_decode import FusedDecoder, unsupported
from agent_env.engines.hf_weights import WeightWatch
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


@pytest.mark.parametrize("step", ["fused", "compiled", "unfused"])
def test_the_fused_decode_step_equals_the_models_forward(tiny_model_factory, monkeypatch, step):
    """``unfused``: the fused step with the q/k/v and gate/up weights apart, as for a model over
    ``FUSE_BYTES`` (no norm folded, the step reads the model's own weights)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (5, 17, 30, 9, 12, 40)]
    if step == "unfused":
        monkeypatch.setattr(hf_decode, "FUSE_BYTES", 0)
    results = {}
    for name in ("model", step):
        model = tiny_model_factory()
        kind = "fused" if name == "unfused" else name
        eng = HFEngine(model, share_weights=True, decode_step=kind, seed=3, stop_at_eos=False, max_batch_size=4)
        if name != "model":
            assert eng._decoder.fuse == (step != "unfused") and eng._decoder.fold == eng._decoder.fuse
        results[name] = _rollouts(eng, model, prompts)
        assert eng.decode_step == kind
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


def _tiny(kind: str, dtype: torch.dtype = torch.float32):
    """A random model of each family the fused step claims (seeded; nothing downloaded)."""
    if kind == "qwen2":  # q/k/v projections with a bias, no q/k norms
        model = small_decoder("qwen2", max_position_embeddings=256)
    elif kind == "qwen3":  # q/k norms
        model = small_decoder("qwen3", max_position_embeddings=256)
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
    return model.to(dtype)


@pytest.mark.parametrize("fuse", [True, False], ids=["concatenated", "apart"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_the_families_it_claims_decode_as_their_forward_does(kind, dtype, fuse, monkeypatch):
    """Qwen2 (q/k/v biases), Llama (llama3 rope scaling, biases everywhere) and Qwen3 (q/k norms),
    in float32, bfloat16 and float16, the projections concatenated or apart: same tokens and
    log-probs to 1e-5 as the model's own forward, through the engine; the start-up probe's gap too.
    (bfloat16 and float16: the norm weights are not folded and the attention is the model's sdpa;
    folded, or with the float32 step's two products, the log-probs were up to 2e-3 and 6e-3 off.)"""
    if not fuse:
        monkeypatch.setattr(hf_decode, "FUSE_BYTES", 0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 11, 23)]
    outs = {}
    for name in ("model", "fused"):
        model = _tiny(kind, dtype)
        assert unsupported(model) is None
        eng = HFEngine(model, share_weights=True, decode_step=name, seed=5, stop_at_eos=False)
        assert eng.decode_step == name
        if name == "fused":
            assert eng._decoder.fuse == fuse and eng._decoder.fold == (fuse and dtype == torch.float32)
            assert eng._decoder.probe() <= 1e-5

        async def go(eng=eng):
            return await asyncio.gather(
                *(eng.generate(p, SamplingParams(max_tokens=20, temperature=1.0)) for p in prompts)
            )

        outs[name] = asyncio.run(go())
    assert [o.token_ids for o in outs["fused"]] == [o.token_ids for o in outs["model"]]
    gap = max(abs(a - b) for x, y in zip(outs["model"], outs["fused"]) for a, b in zip(x.logprobs, y.logprobs))
    assert gap <= 1e-5, gap


def _greedy_gap(eng: HFEngine, model, prompts: list[list[int]], tokens: int = 12) -> float:
    """Largest |difference| between the engine's greedy log-probs and one fresh forward of ``model``
    over each prompt and what the engine wrote (the oracle: the model as it is now)."""

    async def go():
        return await asyncio.gather(
            *(eng.generate(p, SamplingParams(max_tokens=tokens, temperature=0.0)) for p in prompts)
        )

    outs = asyncio.run(go())
    gap = 0.0
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p + o.token_ids[:-1]])
            logp = model(input_ids=ids).logits[0, len(p) - 1 :].float().log_softmax(-1)
            ref = logp.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
            gap = max(gap, float((ref - torch.tensor(o.logprobs)).abs().max()))
    return gap


def _change(model, kind: str) -> None:
    """The shared weights changed as a trainer or a user may change them, none of which the
    parameters' version counters see."""
    g = torch.Generator().manual_seed(3)
    if kind == "data_copy":  # `.data` is a new tensor with its own version counter
        for p in model.parameters():
            p.data.copy_(p.data + torch.randn(p.shape, generator=g) * 0.05)
    elif kind == "fused_adamw":  # writes the weights without bumping their version counters
        opt = torch.optim.AdamW(model.parameters(), lr=2e-2, fused=True)
        ids = torch.randint(10, 2000, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    else:  # new Parameter objects in the modules' slots
        for layer in model.model.layers:
            for mod in (layer.self_attn.q_proj, layer.mlp.up_proj, layer.input_layernorm):
                w = mod.weight.detach()
                mod.weight = torch.nn.Parameter(w + torch.randn(w.shape, generator=g) * 0.1)


@pytest.mark.parametrize("kind", ["data_copy", "fused_adamw", "new_parameter"])
def test_weight_changes_the_version_counters_miss_reach_the_fused_step(tiny_model_factory, kind):
    """After each kind of change the engine decodes with the new weights: its log-probs are a fresh
    forward's. A fused optimizer step and new Parameter objects are seen by the engine itself; a write
    through ``p.data`` only through ``update_weights`` (what the trainer calls after every update)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (7, 19)]
    model = tiny_model_factory()
    eng = HFEngine(model, share_weights=True, decode_step="fused", seed=0, stop_at_eos=False)
    assert _greedy_gap(eng, model, prompts) <= 1e-4  # the fused weights are built
    _change(model, kind)
    if kind == "data_copy":
        asyncio.run(eng.update_weights({}))
    assert _greedy_gap(eng, model, prompts) <= 1e-4
    asyncio.run(eng.close())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_probe_holds_half_precision_to_the_models_bits(dtype):
    """A layer whose norm's epsilon differs from the first layer's (the step uses the first's):
    2e-3 to 6e-3 off in log-probs, which a tolerance of 0.1 let through; refused now. And the
    compiled step, whose kernels round these dtypes otherwise, runs eagerly and says why."""
    model = small_decoder("qwen3", dtype=dtype)
    assert FusedDecoder(model).probe() <= 1e-5
    eng = HFEngine(model, share_weights=True, decode_step="compiled")
    assert eng.decode_step == "fused" and "float32 only" in eng.compile_error
    model.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-4
    with pytest.raises(EngineError, match="does not reproduce this model's forward"):
        FusedDecoder(model)


def test_the_weight_watch_counts_optimizer_steps_over_its_own_weights_only(tiny_model_factory):
    """A fused optimizer step over another model (the trainer's, beside an engine with its own copy)
    leaves the watch as it was: that engine's kept keys/values stay; one over its own changes it."""
    mine, other = tiny_model_factory(), tiny_model_factory()
    watch = WeightWatch(mine)
    before = watch.signature()
    for model in (other, mine):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        assert (watch.signature() == before) == (model is other)
