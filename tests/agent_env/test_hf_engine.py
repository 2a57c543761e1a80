"""HFEngine with the real tiny model: log-probs, batching/padding, stops, seeds, concurrency, weights."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_env.engines import Engine, EngineError, HFEngine, SamplingParams
from agent_env.engines.hf_sampling import sample


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, max_batch_size=64)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    """Chat prompts of clearly different lengths (padding must not leak into any row)."""
    rng = random.Random(0)
    out = []
    for i in range(8):
        q = f"Compute {rng.randint(2, 999)} * {rng.randint(2, 99)}." + " Explain step by step." * (i * 3 % 7)
        text = tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        out.append(tiny_tokenizer.encode(text, add_special_tokens=False))
    assert len({len(p) for p in out}) >= 5
    return out


def run(coro):
    return asyncio.run(coro)


async def gen_all(engine, prompts, params):
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    return await asyncio.gather(*[engine.generate(p, sp) for p, sp in zip(prompts, params)])


def teacher_forced(model, prompt, out_ids, temperature: float) -> torch.Tensor:
    """Reference log-probs: one unpadded forward of prompt + output, log_softmax(logits / T)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out_ids])).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(out_ids)[:, None]).flatten()


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, Engine)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.6])
def test_logprobs_match_teacher_forcing_across_padded_batch(engine, tiny_model, prompts, temperature):
    mixed = [
        SamplingParams(
            max_tokens=24, temperature=temperature, seed=i, top_k=[-1, 5, 50][i % 3], top_p=[1.0, 0.9, 0.5][i % 3 - 1]
        )
        for i in range(len(prompts))
    ]
    outs = run(gen_all(engine, prompts, mixed))
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == len(out.logprobs) >= 1
        ref = teacher_forced(tiny_model, prompt, out.token_ids, temperature)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0), (
            (ref - torch.tensor(out.logprobs)).abs().max()
        )


def test_logprobs_match_with_requests_joining_mid_decode(engine, tiny_model, prompts):
    """Continuous batching: late requests are prefilled and merged into a running batch."""

    async def staggered():
        async def one(i, p):
            await asyncio.sleep(0.01 * i)
            return await engine.generate(p, SamplingParams(max_tokens=30 - 2 * i, temperature=0.9, seed=100 + i))

        return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

    before = dict(engine.stats)
    outs = run(staggered())
    assert engine.stats["prefills"] - before["prefills"] >= 2  # several joins happened
    for prompt, out in zip(prompts, outs):
        ref = teacher_forced(tiny_model, prompt, out.token_ids, 0.9)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_greedy_batched_equals_one_by_one(engine, prompts):
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    batched = run(gen_all(engine, prompts, sp))

    async def sequential():
        return [await engine.generate(p, sp) for p in prompts[::2]]

    single = run(sequential())
    for b, s in zip(batched[::2], single):
        assert b.token_ids == s.token_ids
        assert b.finish_reason == s.finish_reason
        assert max(abs(x - y) for x, y in zip(b.logprobs, s.logprobs)) < 1e-4


def test_max_tokens_gives_length(engine, prompts):
    outs = run(gen_all(engine, prompts[:3], [SamplingParams(max_tokens=n, temperature=0.0) for n in (1, 5, 17)]))
    assert [len(o.token_ids) for o in outs] == [1, 5, 17]
    assert all(o.finish_reason == "length" for o in outs)


def test_stop_token_ids_included_and_respected(engine, prompts):
    sp = SamplingParams(max_tokens=40, temperature=0.0)
    full = run(gen_all(engine, prompts[:4], sp))
    params = []
    for out in full:
        stop_tok = out.token_ids[6]
        params.append(SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_tok]))
    cut = run(gen_all(engine, prompts[:4], params))
    for out, c, sp_i in zip(full, cut, params):
        k = out.token_ids.index(sp_i.stop_token_ids[0])  # first occurrence (may be before 6)
        assert c.token_ids == out.token_ids[: k + 1]
        assert c.finish_reason == "stop"
        assert c.logprobs == pytest.approx(out.logprobs[: k + 1], abs=1e-5)


def test_eos_stops_by_default(tiny_model_dir, tiny_tokenizer, prompts):
    eng = HFEngine(tiny_model_dir)
    eos = tiny_tokenizer.eos_token_id
    assert eos in eng._eos_ids
    # The random model rarely samples eos: declare its first greedy token to be eos instead.
    first = run(eng.generate(prompts[0], SamplingParams(max_tokens=1, temperature=0.0))).token_ids[0]
    eng._eos_ids = frozenset({first})
    out = run(eng.generate(prompts[0], SamplingParams(max_tokens=10, temperature=0.0)))
    assert out.token_ids == [first] and out.finish_reason == "stop"
    off = HFEngine(tiny_model_dir, stop_at_eos=False)
    assert not off._eos_ids
    run(eng.close())
    run(off.close())


def test_stop_strings_included_and_respected(engine, tiny_tokenizer, prompts):
    sp = SamplingParams(max_tokens=48, temperature=0.0)
    full = run(gen_all(engine, prompts[:6], sp))
    cases = []
    for j, out in enumerate(full):
        text = tiny_tokenizer.decode(out.token_ids[8:14])
        stop = text[1 : 1 + (2 + j % 3)]  # a stop string that may straddle token boundaries
        if not stop.strip():
            continue
        cases.append((prompts[j], out, stop))
    assert len(cases) >= 3
    cut = run(
        gen_all(
            engine,
            [c[0] for c in cases],
            [SamplingParams(max_tokens=48, temperature=0.0, stop=["<never>", c[2]]) for c in cases],
        )
    )
    for (_prompt, out, stop), c in zip(cases, cut):
        # brute-force reference: the shortest prefix whose text contains the stop string
        k = next(k for k in range(1, len(out.token_ids) + 1) if stop in tiny_tokenizer.decode(out.token_ids[:k]))
        assert c.token_ids == out.token_ids[:k]
        assert c.finish_reason == "stop"
        assert stop in tiny_tokenizer.decode(c.token_ids)


def test_stop_string_in_prompt_is_ignored(engine, tiny_tokenizer, prompts):
    full = run(engine.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0.0)))
    out_text = tiny_tokenizer.decode(full.token_ids)
    prompt_text = tiny_tokenizer.decode(prompts[0])
    stop = next(prompt_text[i : i + 6] for i in range(len(prompt_text)) if prompt_text[i : i + 6] not in out_text)
    out = run(engine.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0.0, stop=[stop])))
    assert out.token_ids == full.token_ids and out.finish_reason == "length"


def test_step_failure_reaches_callers_and_engine_recovers(tiny_model_factory, prompts):
    eng = HFEngine(tiny_model_factory())
    real = eng._decode_forward  # the decode step, whichever runs it (fused by default, the model's forward)
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    eng._decode_forward = flaky
    sp = SamplingParams(max_tokens=10, temperature=0.0)
    with pytest.raises(EngineError, match="boom"):
        run(gen_all(eng, prompts[:3], sp))
    again = run(eng.generate(prompts[0], sp))
    assert len(again.token_ids) == 10 and again.finish_reason == "length"
    run(eng.close())


def test_seeds_reproducible_and_independent_of_batch(engine, prompts, tiny_model_dir):
    sp = SamplingParams(max_tokens=30, temperature=1.0, seed=1234)
    alone = run(engine.generate(prompts[2], sp))
    crowd = run(
        gen_all(
            engine,
            prompts,
            [sp if i == 2 else SamplingParams(max_tokens=30, temperature=1.0, seed=i) for i in range(len(prompts))],
        )
    )
    assert crowd[2].token_ids == alone.token_ids
    other = run(engine.generate(prompts[2], SamplingParams(max_tokens=30, temperature=1.0, seed=4321)))
    assert other.token_ids != alone.token_ids

    # engine-wide seed: the same requests in the same order give the same samples
    async def sample_with(eng):
        return await gen_all(eng, prompts[:5], SamplingParams(max_tokens=20, temperature=1.0))

    e1, e2 = HFEngine(tiny_model_dir, seed=7), HFEngine(tiny_model_dir, seed=7)
    a, b = run(sample_with(e1)), run(sample_with(e2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) > 1
    run(e1.close())
    run(e2.close())


def test_32_concurrent_greedy_calls_equal_single_requests(tiny_model_dir, prompts):
    eng = HFEngine(tiny_model_dir, max_batch_size=8)  # forces queueing and joins mid-decode
    reqs = [(i % len(prompts), SamplingParams(max_tokens=3 + (i * 7) % 13, temperature=0.0)) for i in range(32)]

    async def concurrent():
        return await asyncio.gather(*[eng.generate(prompts[j], sp) for j, sp in reqs])

    many = run(concurrent())
    assert eng.stats["max_running"] == 8

    # Reference: each prompt alone, once, with the longest budget any request gave it; greedy
    # with max_tokens=k is the first k tokens of that.
    longest = {j: max(sp.max_tokens for jj, sp in reqs if jj == j) for j, _ in reqs}

    async def sequential():
        return {
            j: await eng.generate(prompts[j], SamplingParams(max_tokens=n, temperature=0.0)) for j, n in longest.items()
        }

    single = run(sequential())
    for m, (j, sp) in zip(many, reqs):
        ref = single[j]
        assert ref.finish_reason == "length"  # no stop inside, so the prefix argument holds
        assert m.token_ids == ref.token_ids[: sp.max_tokens]
        assert m.finish_reason == "length"
        assert m.logprobs == pytest.approx(ref.logprobs[: sp.max_tokens], abs=1e-4)
    run(eng.close())


def test_sampler_matches_distribution():
    """Inverse-CDF sampling with per-row generators reproduces softmax(l/T), top-k and top-p."""
    torch.manual_seed(0)
    logits = torch.randn(12) * 2
    n = 8000
    cases = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.6),
    ]
    for sp in cases:
        gens = [torch.Generator().manual_seed(i) for i in range(n)]
        tokens, lps = sample(logits.repeat(n, 1), [sp] * n, gens)
        probs = torch.softmax(logits / sp.temperature, -1)
        assert torch.allclose(lps, probs.log()[tokens], atol=1e-5)
        order = probs.argsort(descending=True)
        keep = torch.zeros(12, dtype=torch.bool)
        mass = 0.0
        for rank, t in enumerate(order.tolist()):
            if (sp.top_k > 0 and rank >= sp.top_k) or (rank > 0 and mass >= sp.top_p):
                break
            keep[t] = True
            mass += probs[t].item()
        target = torch.where(keep, probs, 0.0)
        target /= target.sum()
        freq = torch.bincount(tokens, minlength=12).float() / n
        assert (freq - target).abs().max() < 0.025, (freq, target)
        assert freq[~keep].sum() == 0


def test_sampler_never_picks_a_zero_probability_token_at_the_top_of_the_cdf(monkeypatch):
    """A draw of 1.0 (a float64 uniform just under 1 rounds to 1.0 in float32) lands past the last
    token with probability > 0: masked tokens (-inf) at the end of the vocabulary, or the tail that
    top-k / top-p cut. The sampler must pick the last kept token, on the CPU's lazy guard too."""
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: real_rand(*a, **k) * 0 + 1.0)
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0, float("-inf"), float("-inf")]] * 3)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=0)]
    tokens, lps = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(3)])
    # row 0: the last finite token; row 1: the second most likely (top_k=2); row 2: greedy
    assert tokens.tolist() == [3, 2, 1]
    assert torch.isfinite(lps).all()


def test_sampler_leaves_the_logits_on_their_device():
    """The [B, V] logits are never copied to the host (on a GPU that copy cost 10 ms of a 90 ms
    decode step): only the sampled tokens and their log-probs leave the device, in the engine."""

    class Spy(torch.Tensor):
        moved: list = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist):
                cls.moved.append(func.__name__)
            if func is torch.Tensor.to and any(str(a) == "cpu" for a in [*args[1:], *(kwargs or {}).values()]):
                cls.moved.append("to(cpu)")
            return super().__torch_function__(func, types, args, kwargs or {})

    torch.manual_seed(0)
    logits = (torch.randn(5, 40) * 2).as_subclass(Spy)
    params = [SamplingParams(temperature=t, top_k=k) for t, k in ((1.0, -1), (0.0, -1), (0.7, 5), (1.0, 3), (0.0, -1))]
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    tokens, lps = sample(logits, params, gens)
    assert Spy.moved == [], Spy.moved
    plain = sample(logits.as_subclass(torch.Tensor), params, [torch.Generator().manual_seed(i) for i in range(5)])
    assert torch.equal(tokens.as_subclass(torch.Tensor), plain[0])
    assert torch.equal(lps.as_subclass(torch.Tensor), plain[1])


def test_update_weights_copies_and_drops_stale_cache(tiny_model_dir, tiny_model_factory, prompts):
    trainer_model = tiny_model_factory()
    eng = HFEngine(trainer_model)  # a copy
    assert eng.model is not trainer_model
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    old = run(eng.generate(prompts[0], sp))
    run(eng.update_weights(trainer_model.state_dict()))
    new = run(eng.generate(prompts[0], sp))
    ref = teacher_forced(trainer_model, prompts[0], new.token_ids, 0.0)
    assert torch.allclose(torch.tensor(new.logprobs), ref, atol=1e-4, rtol=0)
    assert new.logprobs != old.logprobs

    # update in the middle of a generation: every token after the switch must match a forward of
    # the *new* model over the whole context (a stale KV cache would not)
    fresh = tiny_model_factory()

    async def mid_flight():
        task = asyncio.create_task(eng.generate(prompts[1], SamplingParams(max_tokens=60, temperature=0.8, seed=5)))
        while not eng._active:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)
        await eng.update_weights(fresh.state_dict().items())
        return await task

    out = run(mid_flight())
    lp = torch.tensor(out.logprobs)
    ref_new = teacher_forced(fresh, prompts[1], out.token_ids, 0.8)
    ref_old = teacher_forced(trainer_model, prompts[1], out.token_ids, 0.8)
    match_new = (lp - ref_new).abs() < 1e-4
    match_old = (lp - ref_old).abs() < 1e-4
    switch = int(match_new.long().argmax())
    assert match_new[switch:].all() and match_old[:switch].all()
    assert 0 < switch < len(out.token_ids), "the update should land mid-generation"

    with pytest.raises(EngineError, match="does not have"):
        run(eng.update_weights({"not.a.weight": torch.zeros(1)}))
    run(eng.close())


def test_share_weights_uses_trainer_model(tiny_model_factory, tiny_tokenizer, prompts):
    model = tiny_model_factory().train()
    eng = HFEngine(model, tokenizer=tiny_tokenizer, share_weights=True)
    assert eng.model is model
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    before = run(eng.generate(prompts[0], sp))
    assert model.training  # the engine restores the trainer's mode
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)  # a trainer step, in place
    run(eng.update_weights([]))  # nothing to copy
    after = run(eng.generate(prompts[0], sp))
    model.eval()
    ref = teacher_forced(model, prompts[0], after.token_ids, 0.0)
    assert torch.allclose(torch.tensor(after.logprobs), ref, atol=1e-4, rtol=0)
    assert before.logprobs != after.logprobs
    run(eng.close())


def test_bad_input_raises_clear_errors(engine, tmp_path, tiny_model):
    bad = [
        ([], SamplingParams(), "empty"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
        ([1, 2], SamplingParams(top_p=0), "top_p"),
        ([1, 2], SamplingParams(top_k=0), "top_k"),
        ([10**7], SamplingParams(), "vocabulary"),
    ]
    for ids, sp, match in bad:
        with pytest.raises(EngineError, match=match):
            run(engine.generate(ids, sp))
    with pytest.raises(EngineError, match="no model folder"):
        HFEngine(tmp_path)
    with pytest.raises(EngineError, match="tokenizer"):
        run(HFEngine(tiny_model).generate([1, 2], SamplingParams(stop=["x"])))


def test_cancel_and_close(tiny_model_dir, prompts):
    eng = HFEngine(tiny_model_dir)

    async def scenario():
        keep = asyncio.create_task(eng.generate(prompts[0], SamplingParams(max_tokens=30, temperature=0.0)))
        drop = asyncio.create_task(eng.generate(prompts[1], SamplingParams(max_tokens=500, temperature=0.0)))
        await asyncio.sleep(0.05)
        drop.cancel()
        out = await keep
        with pytest.raises(asyncio.CancelledError):
            await drop
        late = asyncio.create_task(eng.generate(prompts[2], SamplingParams(max_tokens=5000, temperature=0.0)))
        while not any(r.prompt_ids == prompts[2] for r in eng._active):
            await asyncio.sleep(0.001)
        await eng.close()
        return out, await late

    out, late = run(scenario())
    assert len(out.token_ids) == 30 and out.finish_reason == "length"
    assert late.finish_reason == "abort" and len(late.token_ids) < 5000
    with pytest.raises(EngineError, match="closed"):
        run(eng.generate(prompts[0], SamplingParams()))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(3, 2000), min_size=1, max_size=40),  # prompt ids, length 1..40
            st.integers(1, 12),  # max_tokens
            st.integers(0, 3),  # arrival delay (engine steps, roughly)
            st.sampled_from([0.0, 0.8, 1.0]),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_property_logprobs_and_greedy_under_random_batches(engine, tiny_model, reqs):
    """Random prompt lengths, budgets and arrival times: every row still equals an unpadded forward."""

    async def go():
        async def one(i, prompt, n, delay, temp):
            await asyncio.sleep(0.005 * delay)
            return await engine.generate(prompt, SamplingParams(max_tokens=n, temperature=temp, seed=i))

        return await asyncio.gather(*[one(i, *r) for i, r in enumerate(reqs)])

    outs = run(go())
    for (prompt, n, _, temp), out in zip(reqs, outs):
        assert 1 <= len(out.token_ids) <= n
        assert out.finish_reason == (
            "length" if len(out.token_ids) == n and out.token_ids[-1] not in engine._eos_ids else "stop"
        )
        ref = teacher_forced(tiny_model, prompt, out.token_ids, temp)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
        if temp == 0.0:
            with torch.no_grad():
                logits = tiny_model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
            assert logits.argmax(-1).tolist() == out.token_ids


# --------------------------------------------------------------------------- the prefix cache


def test_next_turn_is_prefilled_on_the_kept_keys_and_values(tiny_model_dir, tiny_model, prompts):
    """A multi-turn episode's next prompt = the last prompt + the turn it sampled + the tool's answer:
    only the new tokens are fed, and every log-prob still equals an unpadded forward of the whole
    context (as without the cache: same greedy tokens)."""
    answer = [17, 42, 99, 7, 256]  # a tool's answer, as tokens
    results = {}
    for size in (256 * 2**20, 0):
        eng = HFEngine(tiny_model_dir, prefix_cache_bytes=size)
        sp = SamplingParams(max_tokens=12, temperature=0.0)
        first = run(gen_all(eng, prompts[:4], sp))
        before = dict(eng.stats)
        nexts = [p + o.token_ids + answer for p, o in zip(prompts[:4], first)]
        params = [SamplingParams(max_tokens=10, temperature=0.7, seed=i) for i in range(4)]
        second = run(gen_all(eng, nexts, params))
        fed = eng.stats["prefilled_tokens"] - before["prefilled_tokens"]
        results[size] = (eng.stats["prefix_hits"] - before["prefix_hits"], fed, second)
        for prompt, out in zip(nexts, second):
            ref = teacher_forced(tiny_model, prompt, out.token_ids, 0.7)
            assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
        run(eng.close())
    hits, fed, second = results[256 * 2**20]
    assert hits == 4
    assert fed == 4 * (1 + len(answer))  # each turn's last sampled token (never fed) + the answer
    hits0, fed0, second0 = results[0]
    assert hits0 == 0 and fed0 == sum(len(p) for p in nexts)
    assert [o.token_ids for o in second] == [o.token_ids for o in second0]


def test_next_turns_and_new_prompts_arriving_together_share_one_prefill(tiny_model_dir, tiny_model, prompts):
    """Rows back from a tool (kept keys/values) and fresh prompts admitted in the same step go through
    the model in one forward, and every log-prob still equals an unpadded forward of its context."""
    eng = HFEngine(tiny_model_dir)
    first = run(gen_all(eng, prompts[:2], SamplingParams(max_tokens=6, temperature=0.0)))
    before = dict(eng.stats)
    mixed = [p + o.token_ids + [17, 42, 99] for p, o in zip(prompts[:2], first)] + [prompts[2], prompts[3]]
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=i) for i in range(len(mixed))]
    outs = run(gen_all(eng, mixed, params))
    assert eng.stats["prefills"] - before["prefills"] == 1
    assert eng.stats["prefix_hits"] - before["prefix_hits"] == 2
    for prompt, out in zip(mixed, outs):
        ref = teacher_forced(tiny_model, prompt, out.token_ids, 0.8)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
    run(eng.close())


def test_samples_of_one_prompt_are_prefilled_once(tiny_model_dir, tiny_model, prompts):
    """n samples of one prompt arriving together: the prompt goes through the model once, every
    sample's log-probs still equal an unpadded forward, and greedy samples are all alike."""
    eng = HFEngine(tiny_model_dir)
    group = [prompts[0]] * 4 + [prompts[1]] * 3
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=i) for i in range(len(group))]
    outs = run(gen_all(eng, group, params))
    assert eng.stats["prefills"] == 1 and eng.stats["prefill_rows_shared"] == 5
    assert eng.stats["prefilled_tokens"] == len(prompts[0]) + len(prompts[1])
    for prompt, out in zip(group, outs):
        ref = teacher_forced(tiny_model, prompt, out.token_ids, 0.9)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
    greedy = run(gen_all(eng, [prompts[2]] * 3, SamplingParams(max_tokens=8, temperature=0.0)))
    assert greedy[0].token_ids == greedy[1].token_ids == greedy[2].token_ids
    run(eng.close())


def test_prompts_after_one_system_prompt_feed_it_once_with_the_same_tokens_and_logprobs(
    tiny_model_dir, tiny_model, tiny_tokenizer, prompts
):
    """Different prompts that start alike (one system prompt with tool schemas, then each its own
    question) admitted together: the common part goes through the model once and each row only its
    own tokens; every log-prob still equals an unpadded forward of its context, and the tokens are
    those of an engine that feeds every prompt whole (prefix reuse off), seed for seed."""
    system = "You are a careful assistant. Tools: calculator(expression), python(code). " * 4
    fresh = [
        tiny_tokenizer.encode(
            tiny_tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": q}],
                tokenize=False,
                add_generation_prompt=True,
            ),
            add_special_tokens=False,
        )
        for q in ("What is 17 * 23?", "Solve 2x + 3 = 7.", "Compute 3/4 + 1/6, then double it.")
    ]
    common = next(k for k in range(min(map(len, fresh))) if len({p[k] for p in fresh}) > 1)
    assert common >= 32
    eng, whole = HFEngine(tiny_model_dir), HFEngine(tiny_model_dir, prefix_cache_bytes=0)
    first = run(gen_all(eng, prompts[:1], SamplingParams(max_tokens=6, temperature=0.0)))
    mixed = [*fresh, *fresh[:1], prompts[0] + first[0].token_ids + [17, 42, 99]]  # a copy, a next turn
    params = [SamplingParams(max_tokens=10, temperature=0.9, seed=i) for i in range(len(mixed))]
    before = dict(eng.stats)
    outs = run(gen_all(eng, mixed, params))
    ref_outs = run(gen_all(whole, mixed, params))
    assert eng.stats["shared_prefix_tokens"] - before["shared_prefix_tokens"] == common * 2  # 3 prompts, fed once
    assert eng.stats["prefix_hits"] - before["prefix_hits"] == 1  # the next turn's own kept keys/values
    assert eng.stats["prefilled_tokens"] - before["prefilled_tokens"] == (
        common + sum(len(p) - common for p in fresh) + 4
    )  # the next turn feeds its last sampled token (never fed while it was sampled) and the 3 added
    assert whole.stats["shared_prefix_tokens"] == 0
    for prompt, out, ref_out in zip(mixed, outs, ref_outs):
        assert out.token_ids == ref_out.token_ids
        ref = teacher_forced(tiny_model, prompt, out.token_ids, 0.9)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
    run(eng.close())
    run(whole.close())


def test_kept_keys_and_values_are_never_used_after_the_weights_change(tiny_model_factory, prompts):
    """Shared weights changed in place (an optimizer step) without update_weights: the kept entries
    are stale, so the next turn is prefilled in full and matches the new weights."""
    model = tiny_model_factory()
    eng = HFEngine(model, share_weights=True)
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    out = run(eng.generate(prompts[0], sp))
    assert len(eng._prefix) == 1
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    nxt = prompts[0] + out.token_ids + [5, 6]
    again = run(eng.generate(nxt, sp))
    assert eng.stats["prefix_hits"] == 0
    ref = teacher_forced(model, nxt, again.token_ids, 0.0)
    assert torch.allclose(torch.tensor(again.logprobs), ref, atol=1e-4, rtol=0)
    # and update_weights drops them too
    out = run(eng.generate(prompts[1], sp))
    run(eng.update_weights([]))
    assert len(eng._prefix) == 0
    run(eng.close())


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=8),
    st.lists(st.integers(0, 3), min_size=1, max_size=8),
    st.integers(0, 600),
)
def test_prefix_cache_takes_the_longest_strict_prefix_within_its_bytes(stored, prompt, max_bytes):
    """Against brute force: which entries survive the byte bound (oldest out first) and which one
    ``take`` returns (the longest stored strict prefix of the prompt, removed once taken)."""
    from agent_env.engines.hf_batch import PrefixCache

    cache = PrefixCache(max_bytes)
    kept: list[tuple[int, ...]] = []  # brute force: tokens in insertion order, 8 bytes a token
    uses: dict[tuple[int, ...], int] = {}  # stores of the tokens while held
    for tokens in stored:
        key = tuple(tokens)
        kv = [(torch.zeros(1, 1, len(key), 1), torch.zeros(1, 1, len(key), 1))]  # 8 bytes per token
        cache.put(key, kv, torch.ones(len(key), dtype=torch.long), weights=0)
        if key in kept:  # stored again: one copy, one more use, most recently stored
            kept = [k for k in kept if k != key] + [key]
            uses[key] += 1
        elif 8 * len(key) <= max_bytes:
            kept.append(key)
            uses[key] = 1
            while sum(8 * len(k) for k in kept) > max_bytes:
                kept.pop(0)
    assert len(cache) == len(kept) and cache.nbytes == sum(8 * len(k) for k in kept)
    strict = [k for k in kept if len(k) < len(prompt) and tuple(prompt[: len(k)]) == k]
    got = cache.take(prompt, weights=0)
    if not strict:
        assert got is None
    else:
        n, kv, mask = got
        best = max(strict, key=len)
        assert n == len(best) and kv[0][0].shape[2] == n and int(mask.sum()) == n
        assert len(cache) == len(kept) - (uses[best] == 1)
    assert cache.take(prompt, weights=1) is None and len(cache) == 0  # other weights: all stale


@pytest.mark.parametrize("worker_thread", [None, True])
def test_steps_run_on_the_loops_thread_on_cpu_and_the_loop_still_serves_others(tiny_model_dir, prompts, worker_thread):
    """On the CPU (default) each step runs on the event loop's thread: one OpenMP team with the
    caller's torch work. Either way other coroutines (a tool's reply, a next turn) progress while a
    long generation runs, and greedy outputs are the same."""
    import threading

    eng = HFEngine(tiny_model_dir, max_batch_size=8, worker_thread=worker_thread)
    assert eng.worker_thread is (worker_thread is True)
    threads: set[int] = set()  # where the engine's compute steps ran (the model's forward may not run)
    step = eng._step_locked
    eng._step_locked = lambda: (threads.add(threading.get_ident()), step())[1]

    async def go():
        ticks = []

        async def other():  # another episode's work on the loop: many short awaits
            for _ in range(20):
                await asyncio.sleep(0)
                ticks.append(eng.stats["steps"])

        long = asyncio.create_task(eng.generate(prompts[0], SamplingParams(max_tokens=40, temperature=0.0)))
        await asyncio.sleep(0)
        await other()
        out = await long
        await eng.close()
        return out, ticks

    out, ticks = run(go())
    loop_thread = threading.get_ident()  # asyncio.run runs the loop on this thread
    assert (threads == {loop_thread}) is (worker_thread is None), threads
    assert len(out.token_ids) == 40
    assert ticks[-1] < 40  # the other coroutine finished while the generation was still running
    ref = HFEngine(tiny_model_dir, worker_thread=True)
    assert run(ref.generate(prompts[0], SamplingParams(max_tokens=40, temperature=0.0))).token_ids == out.token_ids
    run(ref.close())


def test_slack_layer_appends_in_place_and_holds_what_a_dynamic_layer_holds():
    """The running batch's KV layers (SlackLayer) against transformers' DynamicLayer, the oracle:
    the same keys/values after appends, after the rows are replaced from outside (a merge or a row
    drop assigns new tensors) and after a refill; between reallocations an append writes into the
    same buffer (no copy of the cache: what made a CPU decode step slow at long contexts)."""
    from transformers.cache_utils import DynamicLayer

    from agent_env.engines.hf_batch import SLACK_COLUMNS, slack_layer_class

    g = torch.Generator().manual_seed(0)

    def kv(b, t):
        return torch.randn(b, 2, t, 8, generator=g), torch.randn(b, 2, t, 8, generator=g)

    ref = DynamicLayer()
    ref.update(*kv(3, 5))
    slack = slack_layer_class()(ref.keys.clone(), ref.values.clone())
    ptrs = set()
    for _ in range(SLACK_COLUMNS + 3):  # past the first buffer's end: one reallocation
        k, v = kv(3, 1)
        got = slack.update(k, v)
        want = ref.update(k, v)
        ptrs.add(slack.keys.untyped_storage().data_ptr())
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert len(ptrs) == 2  # the first buffer, then one with new slack: never a copy per append
    # rows dropped / trimmed from outside, as RunningBatch._drop_rows does: the next append starts there
    idx = torch.tensor([0, 2])
    slack.keys, slack.values = slack.keys.index_select(0, idx)[:, :, 4:], slack.values.index_select(0, idx)[:, :, 4:]
    ref.keys, ref.values = ref.keys.index_select(0, idx)[:, :, 4:], ref.values.index_select(0, idx)[:, :, 4:]
    for t in (1, 1, 4):  # a multi-token append too
        k, v = kv(2, t)
        for a, b in zip(slack.update(k, v), ref.update(k, v)):
            assert torch.equal(a, b)
    assert slack.get_seq_length() == ref.get_seq_length() == 5 + SLACK_COLUMNS + 3 - 4 + 6
    # padding zeroed in place (zero_padding) reaches the buffer the next appends extend
    slack.keys[:, :, 0].zero_()
    ref.keys[:, :, 0].zero_()
    k, v = kv(2, 1)
    assert torch.equal(slack.update(k, v)[0], ref.update(k, v)[0])


@pytest.mark.parametrize("cpu_threads, tool_running", [(None, False), (None, True), (1, False), (0, True)])
def test_cpu_threads_hold_during_steps_and_torch_setting_is_back_after(
    tiny_model_dir, prompts, cpu_threads, tool_running
):
    """The engine's steps on the CPU run with its own thread count (None: all of torch's while no tool
    call of this process is under way, half of them, at least 1, while one is — a real Tool.invoke
    waiting beside the generation; N: N; 0: torch's); once it is empty again, and after a failed step,
    the process has torch's setting."""
    from tools.base import Tool, ToolResult, calls_in_flight

    before = torch.get_num_threads()
    want = {None: max(1, before // 2) if tool_running else before, 1: 1, 0: before}[cpu_threads]
    eng = HFEngine(tiny_model_dir, cpu_threads=cpu_threads, max_batch_size=8)
    seen = []
    real = eng._forward

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    class Waits(Tool):
        name = "waits"

        async def call(self, args, *, session_id=None):
            await self.release_me.wait()
            return ToolResult(text="done")

    async def with_tool(coro):
        if not tool_running:
            return await coro
        tool = Waits()
        tool.release_me = asyncio.Event()
        call = asyncio.ensure_future(tool.invoke({}))
        await asyncio.sleep(0)
        assert calls_in_flight() == 1
        try:
            return await coro
        finally:
            tool.release_me.set()
            assert (await call).ok and calls_in_flight() == 0

    eng._forward = spy
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    outs = run(with_tool(gen_all(eng, prompts[:4], sp)))
    assert all(len(o.token_ids) == 6 for o in outs)
    assert seen and set(seen) == {want}
    assert torch.get_num_threads() == before

    def boom(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise RuntimeError("boom")

    eng._forward = boom
    with pytest.raises(EngineError, match="boom"):
        run(with_tool(gen_all(eng, prompts[:2], sp)))
    assert seen[-1] == want and torch.get_num_threads() == before
    run(eng.close())


def test_cpu_threads_rejects_a_negative_count(tiny_model_dir):
    with pytest.raises(EngineError, match="cpu_threads must be >= 0"):
        HFEngine(tiny_model_dir, cpu_threads=-1)


def test_the_kv_cache_argument_follows_the_installed_transformers(tiny_model_factory):
    """transformers 5.2x renamed forward's ``past_key_values`` to ``cache`` (the old name warns and goes
    in 5.40): the engine passes and reads whichever the model's forward has. The installed model's own
    forward, and a forward in the new style."""
    import inspect

    from agent_env.engines.hf import cache_kwargs, returned_cache

    model = tiny_model_factory()
    params = inspect.signature(type(model).forward).parameters
    expected = "cache" if "cache" in params else "past_key_values"
    assert cache_kwargs(model, "C") == {expected: "C"}
    out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    assert returned_cache(out) is not None and returned_cache(out) is getattr(out, expected)

    class NewStyle(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None):
            return {"cache": cache}

    assert cache_kwargs(NewStyle(), "C") == {"cache": "C"}
    assert returned_cache(NewStyle()(cache="C")) == "C"
