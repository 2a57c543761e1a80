"""Packed rows through the actor's forward (``token_stats_packing.pack_rows``, ``actor.pack_rows``): the same
statistics and gradients as the padded forward, on real tiny transformers models, with the packing
checked by transformers' own packed-sequence masking (and a model that breaks it refused)."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otb_tir.token_stats import token_stats_for_causal_lm
from otb_tir.token_stats_packing import pack_rows
from otb_tir.trainer import actor
from tests.support.small_models import small_decoder

VOCAB = 300


def _model(kind: str = "qwen3", attn: str = "sdpa"):
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg).eval()
    return small_decoder(kind, vocab_size=VOCAB, attn_implementation=attn)


def _rows(prompts: list[int], responses: list[int], seed: int = 0):
    """Left-padded prompts and right-padded responses of the given lengths, as the rollout lays them
    out (``agent_env.rollout``: position ids = cumsum(mask) - 1)."""
    p, r, b = max(prompts), max(max(responses), 1), len(prompts)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (b, p + r), generator=gen)
    mask = torch.zeros_like(ids)
    for i, (pl, rl) in enumerate(zip(prompts, responses)):
        mask[i, p - pl : p + rl] = 1
    ids = ids * mask  # padding holds token 0, as the collate writes it
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids, mask, pos, r


def _grads(model, stats, coef, real):
    loss = (torch.stack(list(stats)) * coef * real).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _assert_same(model, ids, mask, pos, r, temperature=0.9):
    real = mask[:, -r:].float()
    coef = torch.randn(3, *real.shape, generator=torch.Generator().manual_seed(5))
    padded = token_stats_for_causal_lm(model, ids, mask, pos, r, temperature, chunk=7, packed=False)
    packed = token_stats_for_causal_lm(model, ids, mask, pos, r, temperature, chunk=7, packed=True)
    for a, b in zip(padded, packed):
        assert a.shape == b.shape == real.shape
        assert torch.isfinite(b).all()  # past a row's end too (masked by the caller, never NaN)
        torch.testing.assert_close(a * real, b * real, atol=2e-5, rtol=1e-5)
    g_pad, g_pack = _grads(model, padded, coef, real), _grads(model, packed, coef, real)
    assert g_pad.keys() == g_pack.keys()
    for k in g_pad:
        torch.testing.assert_close(g_pack[k], g_pad[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 14)), min_size=1, max_size=7),
    seed=st.integers(0, 1000),
)
def test_packed_equals_padded_statistics_and_gradients(lengths, seed):
    model = _model("qwen3")
    ids, mask, pos, r = _rows([p for p, _ in lengths], [q for _, q in lengths], seed)
    _assert_same(model, ids, mask, pos, r)


@pytest.mark.parametrize("kind,attn", [("llama", "eager"), ("gpt2", "sdpa")])
def test_packed_equals_padded_on_other_families(kind, attn):
    model = _model(kind, attn)
    ids, mask, pos, r = _rows([3, 8, 1, 5, 2], [12, 0, 4, 9, 1])
    _assert_same(model, ids, mask, pos, r)


def test_rows_share_packed_rows_and_keep_their_positions():
    ids, mask, pos, r = _rows([2, 6, 1, 3], [3, 10, 2, 1])  # lengths 5, 16, 3, 4 in width 16
    pk = pack_rows(ids, mask, pos, r)
    assert pk is not None
    assert pk.input_ids.shape == (2, 16) and pk.tokens == 32  # [16] and [5, 4, 3] (first fit, longest first)
    flat_ids, flat_pos = pk.input_ids.flatten(), pk.position_ids.flatten()
    for i in range(4):
        real = mask[i].bool()
        start = int(pk.index[i, 0]) + 1 - int(real[: ids.shape[1] - r].sum())  # the row's first token
        n = int(real.sum())
        assert flat_ids[start : start + n].tolist() == ids[i][real].tolist()
        assert flat_pos[start : start + n].tolist() == list(range(n))


def test_rows_that_cannot_be_packed_go_padded():
    ids, mask, pos, r = _rows([3, 4], [5, 2])
    holed = mask.clone()
    holed[0, -r + 1] = 0  # a hole inside a row's tokens
    assert pack_rows(ids, holed, pos, r) is None
    assert pack_rows(ids, mask, None, r) is None
    model = _model()
    a = token_stats_for_causal_lm(model, ids, holed, pos, r, packed=True)  # the padded forward runs
    b = token_stats_for_causal_lm(model, ids, holed, pos, r, packed=False)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_the_actor_checks_packing_once_and_refuses_a_model_that_mixes_rows(monkeypatch, caplog):
    """If the model's masking does not split packed rows (here transformers' detection is switched
    off, so each packed row is one causal sequence), the actor's check sees the log-probs differ and
    runs padded rows, saying so; a model that packs correctly is checked once and packs."""
    import transformers.masking_utils as mu

    ids, mask, pos, r = _rows([3, 8, 1, 5], [12, 2, 4, 9])
    kw = dict(response_length=r, temperature=1.0, fused=True, chunk=None)
    pk = pack_rows(ids, mask, pos, r)
    good = _model()
    assert actor.packing_agrees(good, (ids, mask, pos), kw, pk) is True
    calls = []
    monkeypatch.setattr(actor, "token_stats_for_causal_lm", lambda *a, **k: calls.append(k) or None)
    assert actor.packing_agrees(good, (ids, mask, pos), kw, pk) is True  # remembered: no forward
    assert calls == []
    monkeypatch.undo()

    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda position_ids: None)
    bad = _model()
    with caplog.at_level(logging.WARNING, logger="otb_tir.trainer.actor"):
        assert actor.packing_agrees(bad, (ids, mask, pos), kw, pk) is False
    assert "padded rows" in caplog.text and "Qwen3ForCausalLM" in caplog.text
    s = actor.ActorSettings(ppo_micro_batch_size=4)
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": pos,
        "responses": ids[:, -r:],
    }
    got = actor._stats(bad, batch, slice(None), s, grad=False)  # the padded forward: the true statistics
    want = token_stats_for_causal_lm(bad, ids, mask, pos, r, packed=False)
    torch.testing.assert_close(got.log_probs * mask[:, -r:], want.log_probs * mask[:, -r:])


# ------------------------------------------------------------------------------ rows sharing a prompt


def _group_rows(groups: list[tuple[int, list[int]]], seed: int = 0):
    """Rows laid out as the rollout collates a batch of groups: each group's samples share one prompt
    (``prompt length, [response lengths]``), left-padded prompts, right-padded responses."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for plen, resp in groups:
        prompt = torch.randint(1, VOCAB, (plen,), generator=gen).tolist()
        for n in resp:
            prompts.append(prompt)
            responses.append(torch.randint(1, VOCAB, (n,), generator=gen).tolist())
    p, r, b = max(map(len, prompts)), max(max(map(len, responses)), 1), len(prompts)
    ids = torch.zeros((b, p + r), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (pr, rs) in enumerate(zip(prompts, responses)):
        ids[i, p - len(pr) : p] = torch.tensor(pr)
        ids[i, p : p + len(rs)] = torch.tensor(rs, dtype=torch.long)
        mask[i, p - len(pr) : p + len(rs)] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp_min(0), r


@settings(max_examples=12, deadline=None)
@given(
    groups=st.lists(
        st.tuples(st.integers(1, 12), st.lists(st.integers(0, 10), min_size=1, max_size=5)), min_size=1, max_size=4
    ),
    seed=st.integers(0, 1000),
)
def test_rows_sharing_a_prompt_give_the_padded_statistics_and_gradients(groups, seed):
    """One copy of each repeated prompt, every response after it attending to it and to itself only: the
    padded forward's statistics and gradients (sdpa's boolean mask), whichever layout pack_rows picks."""
    model = _model("qwen3")
    ids, mask, pos, r = _group_rows(groups, seed)
    _assert_same(model, ids, mask, pos, r)


@pytest.mark.parametrize("kind,attn", [("qwen3", "sdpa"), ("llama", "eager")])
def test_a_batch_of_groups_goes_through_with_each_prompt_once(kind, attn):
    """4 prompts × 4 samples (the built-in run's shape): the forward runs each prompt once per packed row
    (fewer columns than packing each sample whole), the same statistics and gradients as padded rows,
    with sdpa's boolean mask and eager attention's additive one."""
    from otb_tir.token_stats_packing import prompt_sharing_mask_dtype

    groups = [(30, [9, 4, 12, 0]), (25, [7, 7, 3, 11]), (41, [2, 10, 6, 5]), (18, [12, 1, 8, 9])]
    ids, mask, pos, r = _group_rows(groups, seed=3)
    model = _model(kind, attn)
    plain = pack_rows(ids, mask, pos, r)
    shared = pack_rows(ids, mask, pos, r, share_prompts=prompt_sharing_mask_dtype(model))
    assert plain.attention_mask is None and shared.attention_mask is not None
    assert shared.attention_mask.dtype == (torch.bool if attn == "sdpa" else torch.float32)
    real_tokens = int(mask.sum())
    prompts_once = real_tokens - sum((n_prompt * (len(resp) - 1)) for n_prompt, resp in groups)
    assert shared.tokens < plain.tokens and shared.tokens >= prompts_once
    _assert_same(model, ids, mask, pos, r)


def test_a_model_that_ignores_the_shared_prompt_mask_packs_without_sharing(caplog):
    """A mask the model reads wrongly (here a boolean mask handed to eager attention, which adds it):
    the actor's check sees the gap, says so and packs the rows without sharing from then on; the
    statistics are the padded forward's."""
    ids, mask, pos, r = _group_rows([(20, [5, 9, 3]), (14, [8, 2, 6])], seed=1)
    model = _model("llama", "eager")
    kw = dict(response_length=r, temperature=1.0, fused=True, chunk=None)
    wrong = pack_rows(ids, mask, pos, r, share_prompts=torch.bool)
    assert wrong.attention_mask is not None
    with caplog.at_level(logging.WARNING, logger="otb_tir.trainer.actor"):
        assert actor.packing_agrees(model, (ids, mask, pos), kw, wrong) is False
    assert "sharing their prompt" in caplog.text and "without sharing" in caplog.text
    assert actor._PACKING[model] == {"shared": False}
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, -r:]}
    got = actor._stats(model, batch, slice(None), actor.ActorSettings(ppo_micro_batch_size=6), grad=False)
    assert actor._PACKING[model] == {"shared": False, "plain": True}  # then packed plainly, checked once
    want = token_stats_for_causal_lm(model, ids, mask, pos, r, packed=False)
    torch.testing.assert_close(got.log_probs * mask[:, -r:], want.log_probs * mask[:, -r:])
