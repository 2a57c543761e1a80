"""Packed rows through the actor's forward (``token_stats.pack_rows``, ``actor.pack_rows``): the same
statistics and gradients as the padded forward, on real tiny transformers models, with the packing
checked by transformers' own packed-sequence masking (and a model that breaks it refused)."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otb_tir.token_stats import pack_rows, token_stats_for_causal_lm
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
