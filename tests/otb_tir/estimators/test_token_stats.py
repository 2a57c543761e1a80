"""Tests of otb_tir.token_stats against direct float64 computations, autograd and a real tiny Qwen3."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from otb_tir import ConfigError
from otb_tir.token_stats import (
    DEFAULT_CHUNK_BYTES,
    TokenStats,
    chunk_at_most,
    sum_pi_squared_from_logits,
    token_stats_for_causal_lm,
    token_stats_from_hidden,
    token_stats_from_logits,
)
from tests.support.small_models import SMALL, small_decoder


def ref_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> TokenStats:
    """The textbook formulas on materialized float64 tensors (differentiable)."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    p = logp.exp()
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -torch.where(p > 0, p * logp, torch.zeros((), dtype=p.dtype)).sum(-1)
    sp = (p * p).sum(-1)
    return TokenStats(lp, ent, sp)


def assert_stats_close(got: TokenStats, want: TokenStats, atol: float, rtol: float = 0.0) -> None:
    for name, g, w in zip(TokenStats._fields, got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


def make_case(gen: torch.Generator, batch: tuple[int, ...], vocab: int, scale: float, dtype=torch.float64):
    logits = (torch.randn(*batch, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)
    labels = torch.randint(0, vocab, batch, generator=gen)
    return logits, labels


# ------------------------------------------------------------------------------ values


@settings(max_examples=60, deadline=None)
@given(
    batch=st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple),
    vocab=st.integers(1, 40),
    chunk=st.one_of(st.none(), st.integers(1, 9)),
    temperature=st.floats(0.25, 4.0),
    scale=st.sampled_from([0.1, 1.0, 10.0, 60.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_from_logits_matches_float64(batch, vocab, chunk, temperature, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    logits, labels = make_case(gen, batch, vocab, scale)
    got = token_stats_from_logits(logits, labels, temperature, chunk=chunk)
    assert all(t.shape == labels.shape and t.dtype == torch.float64 for t in got)
    assert_stats_close(got, ref_stats(logits, labels, temperature), atol=1e-12, rtol=1e-10)
    sp = sum_pi_squared_from_logits(logits, temperature, chunk=chunk)
    torch.testing.assert_close(sp, got.sum_pi_squared, atol=1e-14, rtol=1e-12)
    # float32 input: float32 accumulation, float32 output
    got32 = token_stats_from_logits(logits.float(), labels, temperature, chunk=chunk)
    assert all(t.dtype == torch.float32 for t in got32)
    assert_stats_close(got32, ref_stats(logits.float(), labels, temperature), atol=5e-5 * max(1.0, scale / temperature))


def test_sum_pi_squared_is_the_logsumexp_formula():
    gen = torch.Generator().manual_seed(1)
    for shape in [(17,), (3, 29), (2, 5, 101)]:
        z = torch.randn(*shape, generator=gen, dtype=torch.float64) * 4
        want = torch.exp(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))
        got = sum_pi_squared_from_logits(z, chunk=2)
        assert got.shape == shape[:-1]
        torch.testing.assert_close(got, want, atol=1e-15, rtol=1e-12)
        naive = torch.softmax(z / 0.6, -1).square().sum(-1)
        torch.testing.assert_close(sum_pi_squared_from_logits(z, 0.6, chunk=3), naive, atol=1e-15, rtol=1e-12)


@pytest.mark.parametrize("vocab", [1, 2, 7, 1000, 151_936])
def test_uniform_limit(vocab):
    logits = torch.full((3, vocab), 2.5)
    labels = torch.tensor([0, vocab // 2, vocab - 1])
    got = token_stats_from_logits(logits, labels, temperature=0.7)
    torch.testing.assert_close(got.sum_pi_squared, torch.full((3,), 1.0 / vocab), rtol=1e-6, atol=0)
    torch.testing.assert_close(got.entropy, torch.full((3,), math.log(vocab)), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.log_probs, torch.full((3,), -math.log(vocab)), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sum_pi_squared_from_logits(logits), torch.full((3,), 1.0 / vocab), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_one_hot_limit(dtype):
    vocab = 50
    logits = torch.zeros(4, vocab, dtype=dtype)
    hot = torch.tensor([0, 3, 17, 49])
    logits[torch.arange(4), hot] = 1.0e3  # π = one-hot up to e^-1000
    got = token_stats_from_logits(logits, hot)
    assert torch.equal(got.sum_pi_squared, torch.ones(4, dtype=got.sum_pi_squared.dtype))
    assert torch.equal(got.log_probs, torch.zeros(4, dtype=got.log_probs.dtype))
    assert got.entropy.abs().max() < 1e-30
    masked = torch.full((2, vocab), -math.inf, dtype=dtype)
    masked[:, 5] = 3.0  # every other entry masked out: exactly one-hot
    got = token_stats_from_logits(masked, torch.tensor([5, 6]))
    assert torch.equal(got.sum_pi_squared, torch.ones(2, dtype=got.sum_pi_squared.dtype))
    assert torch.equal(got.entropy, torch.zeros(2, dtype=got.entropy.dtype))
    assert got.log_probs[0] == 0 and got.log_probs[1] == -math.inf


def test_masked_vocabulary_minus_inf_values_and_grads():
    gen = torch.Generator().manual_seed(2)
    logits, labels = make_case(gen, (6,), 12, 3.0)
    mask = torch.rand(6, 12, generator=gen) < 0.4
    mask[torch.arange(6), labels] = False
    finite = logits.masked_fill(mask, -1.0e4).requires_grad_()  # exp(-1e4) is exactly 0 in float64
    logits = logits.masked_fill(mask, -math.inf).requires_grad_()
    got = token_stats_from_logits(logits, labels, 1.3, chunk=4)
    want = ref_stats(finite, labels, 1.3)
    assert_stats_close(got, want, atol=1e-12)
    w = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    (g,) = torch.autograd.grad((torch.stack(list(got)) * w).sum(), logits)
    (g_ref,) = torch.autograd.grad((torch.stack(list(want)) * w).sum(), finite)
    assert torch.isfinite(g).all() and torch.equal(g[mask], torch.zeros_like(g[mask]))
    torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=1e-10)


def test_bf16_logits_accumulate_in_float32():
    gen = torch.Generator().manual_seed(3)
    logits, labels = make_case(gen, (4, 37), 3001, 5.0, dtype=torch.bfloat16)
    got = token_stats_from_logits(logits, labels, 0.8, chunk=16)
    assert all(t.dtype == torch.float32 for t in got)
    # the exact statistics of the bf16 values: only float32 accumulation error remains
    assert_stats_close(got, ref_stats(logits, labels, 0.8), atol=2e-5)
    sp = sum_pi_squared_from_logits(logits, 0.8, chunk=5)
    assert sp.dtype == torch.float32
    torch.testing.assert_close(sp.double(), ref_stats(logits, labels, 0.8).sum_pi_squared, atol=1e-6, rtol=1e-5)


def test_default_chunk_and_chunk_larger_than_tokens():
    gen = torch.Generator().manual_seed(4)
    logits, labels = make_case(gen, (5,), 9, 2.0)
    want = ref_stats(logits, labels)
    for chunk in (None, 5, 6, 1000):
        assert_stats_close(token_stats_from_logits(logits, labels, chunk=chunk), want, atol=1e-12)
    assert DEFAULT_CHUNK_BYTES // (4 * 151_936) == 110  # the documented default at Qwen's vocabulary


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(1, 4096), vocab=st.integers(1, 300_000))
def test_chunk_at_most_keeps_a_buffer_within_the_default_bytes(tokens, vocab):
    c = chunk_at_most(tokens, vocab)
    assert 1 <= c <= tokens
    assert c == 1 or 4 * c * vocab <= DEFAULT_CHUNK_BYTES
    assert c == tokens or 4 * (c + 1) * vocab > DEFAULT_CHUNK_BYTES  # no smaller than it must be
    if vocab <= 32_768:
        assert c == min(tokens, 512) or tokens > 512


def test_the_actor_caps_its_chunk_at_a_large_vocabulary(monkeypatch):
    """actor.token_stats_chunk = 512 is a ceiling: at V = 151,936 the actor's chunk is 110 tokens
    (a [512, V] float32 buffer is 311 MB; on an H200 the fused path's peak was 2 GiB above the
    unfused one's with 512), while the tiny policy's vocabulary keeps 512."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import otb_tir.trainer.actor as actor

    seen = []
    real = actor.token_stats_for_causal_lm

    def spy(*a, **k):
        seen.append(k["chunk"])
        return real(*a, **k)

    monkeypatch.setattr(actor, "token_stats_for_causal_lm", spy)
    torch.manual_seed(0)
    for vocab, want in ((151_936, 110), (3072, 512)):
        cfg = Qwen3Config(
            vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=4, tie_word_embeddings=True,
        )  # fmt: skip
        model = Qwen3ForCausalLM(cfg)
        ids = torch.randint(0, vocab, (2, 7))
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(7).expand(2, -1),
            "responses": ids[:, 3:],
            "response_mask": torch.ones(2, 4),
        }
        out = actor.compute_old_stats(model, batch, actor.ActorSettings(ppo_micro_batch_size=2))
        assert seen[-1] == want and out.sum_pi_squared.shape == (2, 4)


# ------------------------------------------------------------------------------ gradients


def test_gradcheck_from_logits_all_outputs():
    gen = torch.Generator().manual_seed(5)
    logits, labels = make_case(gen, (2, 5), 7, 2.0)
    logits.requires_grad_()
    for t in (1.0, 0.6):
        assert torch.autograd.gradcheck(lambda x, t=t: tuple(token_stats_from_logits(x, labels, t, chunk=3)), (logits,))
    for k in range(3):  # each output alone (the backward skips the terms of unused outputs)
        assert torch.autograd.gradcheck(lambda x, k=k: token_stats_from_logits(x, labels, 1.7, chunk=4)[k], (logits,))


def test_gradcheck_fused_hidden_weight_bias():
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(2, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(9, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (2, 4), generator=gen)
    assert torch.autograd.gradcheck(
        lambda h, w: tuple(token_stats_from_hidden(h, w, labels, 0.8, chunk=3)), (hidden, weight)
    )
    assert torch.autograd.gradcheck(
        lambda h, w, b: tuple(token_stats_from_hidden(h, w, labels, 1.0, chunk=5, bias=b)), (hidden, weight, bias)
    )
    for k in range(3):
        assert torch.autograd.gradcheck(
            lambda h, w, k=k: token_stats_from_hidden(h, w, labels, 1.4, chunk=2)[k], (hidden, weight)
        )
    # only the weight requires grad (frozen backbone)
    h0 = hidden.detach()
    assert torch.autograd.gradcheck(lambda w: token_stats_from_hidden(h0, w, labels, chunk=3).log_probs, (weight,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_equals_materialized_logits_values_and_grads(dtype):
    gen = torch.Generator().manual_seed(7)
    n, hdim, vocab = 23, 16, 301
    hidden = torch.randn(n, hdim, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hdim, generator=gen, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    coef = torch.randn(3, n, generator=gen, dtype=torch.float64).to(dtype)

    got = token_stats_from_hidden(hidden, weight, labels, 0.9, chunk=5, bias=bias)
    grads = torch.autograd.grad((torch.stack(list(got)) * coef).sum(), (hidden, weight, bias))
    want = ref_stats(hidden @ weight.T + bias, labels, 0.9)
    grads_ref = torch.autograd.grad((torch.stack(list(want)) * coef).sum(), (hidden, weight, bias))
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert_stats_close(got, want, atol=tol, rtol=tol)
    for g, r in zip(grads, grads_ref):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), r.double(), atol=tol, rtol=tol)
    # and the logits path agrees with the fused path
    logits = (hidden @ weight.T + bias).detach()
    assert_stats_close(token_stats_from_logits(logits, labels, 0.9, chunk=7), got, atol=tol, rtol=tol)


def test_fused_bf16():
    gen = torch.Generator().manual_seed(8)
    n, hdim, vocab = 40, 32, 1000
    hidden = torch.randn(n, hdim, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hdim, generator=gen) * 0.3).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    got = token_stats_from_hidden(hidden, weight, labels, chunk=7)
    assert all(t.dtype == torch.float32 for t in got)
    # reference: nn.Linear-style bf16 logits, then exact statistics
    logits = hidden @ weight.T
    want = ref_stats(logits, labels)
    # per-chunk bf16 matmuls round like the full one on CPU; the rest is float32 accumulation
    assert_stats_close(got, want, atol=1e-4)
    assert_stats_close(got, token_stats_from_logits(logits.float(), labels), atol=1e-4)
    gh, gw = torch.autograd.grad(got.log_probs.sum(), (hidden, weight))
    rh, rw = torch.autograd.grad(want.log_probs.sum(), (hidden, weight))
    assert gh.dtype == gw.dtype == torch.bfloat16
    for g, r in ((gh, rh), (gw, rw)):
        rel = (g.double() - r.double()).norm() / r.double().norm()
        assert rel < 1e-2, rel  # bf16 gradients; the weight's is summed over chunks in float32


# ------------------------------------------------------------------------------ edge cases


def test_zero_tokens():
    for shape in [(0,), (2, 0), (0, 3)]:
        logits = torch.randn(*shape, 11, requires_grad=True)
        labels = torch.zeros(shape, dtype=torch.long)
        got = token_stats_from_logits(logits, labels)
        assert all(t.shape == shape for t in got)
        (g,) = torch.autograd.grad(sum(t.sum() for t in got), logits)
        assert g.shape == logits.shape
        assert sum_pi_squared_from_logits(logits).shape == shape
        hidden = torch.randn(*shape, 4, requires_grad=True)
        weight = torch.randn(11, 4, requires_grad=True)
        got = token_stats_from_hidden(hidden, weight, labels)
        assert all(t.shape == shape for t in got)
        gh, gw = torch.autograd.grad(sum(t.sum() for t in got), (hidden, weight))
        assert gh.shape == hidden.shape and torch.equal(gw, torch.zeros_like(weight))


def test_bad_input_raises_config_error():
    logits, labels = torch.randn(3, 5), torch.tensor([0, 1, 2])
    with pytest.raises(ConfigError, match="token ids in"):
        token_stats_from_logits(logits, torch.tensor([0, -100, 2]))
    with pytest.raises(ConfigError, match="token ids in"):
        token_stats_from_logits(logits, torch.tensor([0, 5, 2]))
    with pytest.raises(ConfigError, match="labels shape"):
        token_stats_from_logits(logits, labels[:2])
    with pytest.raises(ConfigError, match="integer"):
        token_stats_from_logits(logits, labels.float())
    with pytest.raises(ConfigError, match="floating-point"):
        token_stats_from_logits(logits.long(), labels)
    for bad_t in (0.0, -1.0, math.nan, math.inf, "hot"):
        with pytest.raises(ConfigError, match="temperature"):
            token_stats_from_logits(logits, labels, temperature=bad_t)
    for bad_c in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="chunk"):
            token_stats_from_logits(logits, labels, chunk=bad_c)
    with pytest.raises(ConfigError, match="vocabulary"):
        sum_pi_squared_from_logits(torch.randn(3, 0))
    with pytest.raises(ConfigError, match="H = 4"):
        token_stats_from_hidden(torch.randn(3, 5), torch.randn(7, 4), labels)
    with pytest.raises(ConfigError, match="share dtype"):
        token_stats_from_hidden(torch.randn(3, 4).double(), torch.randn(7, 4), labels)
    with pytest.raises(ConfigError, match="bias"):
        token_stats_from_hidden(torch.randn(3, 4), torch.randn(7, 4), labels, bias=torch.randn(6))


# ------------------------------------------------------------------------------ memory


class _AllocTracker(TorchDispatchMode):
    """Largest storage (bytes) created by any op run under it, forward and backward alike."""

    def __init__(self, known: list[torch.Tensor]):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.known and ptr not in inputs:  # a new allocation, not a view
                    self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_fused_path_never_allocates_token_by_vocab():
    n, hdim, vocab, chunk = 256, 16, 3000, 8
    hidden = torch.randn(n, hdim, requires_grad=True)
    weight = torch.randn(vocab, hdim, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    full = n * vocab * 4
    with _AllocTracker([hidden, weight, labels]) as tr:
        got = token_stats_from_hidden(hidden, weight, labels, chunk=chunk)
        (got.log_probs.sum() - 0.01 * got.entropy.sum()).backward()
    # the largest buffers are one [chunk, V] float32 block and the [V, H] weight gradient
    assert tr.largest <= max(chunk * vocab * 4, vocab * hdim * 4)
    assert tr.largest * 10 < full
    # the tracker does see a materialized [T, V] (so the assertion above can fail)
    with _AllocTracker([hidden, weight, labels]) as tr:
        ref_stats(hidden @ weight.T, labels).log_probs.sum().backward()
    assert tr.largest >= full


def test_logits_path_forward_extra_memory_is_per_chunk():
    n, vocab, chunk = 256, 3000, 8
    logits = torch.randn(n, vocab)
    labels = torch.randint(0, vocab, (n,))
    with _AllocTracker([logits, labels]) as tr:
        token_stats_from_logits(logits, labels, 0.7, chunk=chunk)
        sum_pi_squared_from_logits(logits, 0.7, chunk=chunk)
    assert tr.largest <= chunk * vocab * 4
    with _AllocTracker([logits, labels]) as tr:
        torch.softmax(logits, -1).square().sum(-1)
    assert tr.largest >= n * vocab * 4


# ------------------------------------------------------------------------------ a real causal LM


def _tiny_qwen3(tied: bool, dtype=torch.float32):
    model = small_decoder("qwen3", dtype=dtype, tie_word_embeddings=tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    return model


def _batch(prompt_len=7, response_len=9, bsz=3, vocab=300):
    gen = torch.Generator().manual_seed(11)
    input_ids = torch.randint(0, vocab, (bsz, prompt_len + response_len), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left-padded prompt
    attention_mask[2, -2:] = 0  # right-padded response
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    return input_ids, attention_mask, position_ids


def _grads(model, stats: TokenStats, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parameters' gradients of ``Σ weights × (log-prob, entropy, Σπ²)``."""
    loss = (torch.stack(list(stats)) * weights).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_causal_lm_matches_model_logits_and_grads(tied):
    model = _tiny_qwen3(tied)
    input_ids, attention_mask, position_ids = _batch()
    r, temp = 9, 0.8
    coef = torch.randn(3, input_ids.shape[0], r, generator=torch.Generator().manual_seed(12))

    def grads_of(stats: TokenStats):
        return _grads(model, stats, coef * attention_mask[:, -r:])

    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    want = ref_stats(logits[:, -r - 1 : -1].float(), input_ids[:, -r:], temp)
    g_ref = grads_of(want)
    for fused in (True, False):
        got = token_stats_for_causal_lm(model, input_ids, attention_mask, position_ids, r, temp, fused=fused, chunk=5)
        assert all(t.shape == (3, r) and t.dtype == torch.float32 for t in got)
        assert_stats_close(got, want, atol=2e-5, rtol=1e-5)
        g = grads_of(got)
        assert g.keys() == g_ref.keys()
        for k in g_ref:
            torch.testing.assert_close(g[k], g_ref[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_score_mask_scores_only_the_policy_tokens_with_the_same_values_and_gradients(shared_prompt):
    """The actor scores only response-mask tokens (tool results and the padding after a row's end
    are skipped): at those tokens the statistics and the gradients of any loss over them are the
    full pass's (the model's own logits are the oracle), elsewhere the statistics are 0."""
    model = _tiny_qwen3(True)
    input_ids, attention_mask, position_ids = _batch()
    if shared_prompt:  # rows 0 and 2 are one group's samples: packing sends their prompt once
        input_ids[2, :7] = input_ids[0, :7]
    r, temp = 9, 0.8
    score = torch.ones(3, r, dtype=torch.long)
    score[0, 2:5] = 0  # a tool result in the middle of row 0's response
    score[1, 6:] = 0
    score[2, -2:] = 0  # row 2's padding
    coef = torch.randn(3, 3, r, generator=torch.Generator().manual_seed(13))

    def grads_of(stats: TokenStats):
        return _grads(model, stats, coef * score)

    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    want = ref_stats(logits[:, -r - 1 : -1].float(), input_ids[:, -r:], temp)
    g_ref = grads_of(want)
    for fused, packed in ((True, True), (True, False), (False, False)):
        kw = dict(fused=fused, chunk=5, packed=packed, score_mask=score)
        got = token_stats_for_causal_lm(model, input_ids, attention_mask, position_ids, r, temp, **kw)
        for t, w in zip(got, want):
            assert t.shape == (3, r)
            torch.testing.assert_close(t[score == 1].double(), w[score == 1].double(), atol=2e-5, rtol=1e-5)
            assert bool((t[score == 0] == 0).all())
        g = grads_of(got)
        for k in g_ref:
            torch.testing.assert_close(g[k], g_ref[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    with pytest.raises(ConfigError, match="score_mask"):
        token_stats_for_causal_lm(model, input_ids, attention_mask, position_ids, r, score_mask=score[:, 1:])
    # nothing to score: every position is scored as without a mask (a loss over none still has a graph)
    none = token_stats_for_causal_lm(model, input_ids, attention_mask, position_ids, r, temp, score_mask=score * 0)
    assert_stats_close(none, want, atol=2e-5, rtol=1e-5)


def test_causal_lm_bf16_fused_matches_unfused():
    model = _tiny_qwen3(False, torch.bfloat16)
    input_ids, attention_mask, position_ids = _batch()
    a = token_stats_for_causal_lm(model, input_ids, attention_mask, position_ids, 9, fused=True, chunk=4)
    b = token_stats_for_causal_lm(model, input_ids, attention_mask, position_ids, 9, fused=False, chunk=4)
    assert all(t.dtype == torch.float32 for t in a)
    assert_stats_close(a, b, atol=1e-4)


def test_causal_lm_bad_arguments():
    model = _tiny_qwen3(False)
    input_ids, attention_mask, position_ids = _batch()
    with pytest.raises(ConfigError, match="response_length"):
        token_stats_for_causal_lm(model, input_ids, attention_mask, position_ids, 16)
    with pytest.raises(ConfigError, match="input_ids"):
        token_stats_for_causal_lm(model, input_ids[0], None, None, 3)
    got = token_stats_for_causal_lm(model, input_ids, attention_mask, position_ids, 0)
    assert all(t.shape == (3, 0) for t in got)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="fused=False"):
        token_stats_for_causal_lm(model, input_ids, attention_mask, position_ids, 3)


def test_causal_lm_softcapped_unfused_equals_model_forward():
    """Gemma2 soft-caps its logits inside ``forward`` (after the LM head): the refusal's remedy,
    ``fused=False``, must score the model's own logits, not ``head(hidden)`` (which it once did)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    # small: every logit is bent, so a missing cap shows
    cfg = Gemma2Config(**SMALL, final_logit_softcapping=0.5)
    model = Gemma2ForCausalLM(cfg).eval()
    input_ids, attention_mask, position_ids = _batch()
    r, temp = 9, 0.8
    with pytest.raises(ConfigError, match="own forward"):
        token_stats_for_causal_lm(model, input_ids, attention_mask, position_ids, r, temperature=temp)
    got = token_stats_for_causal_lm(model, input_ids, attention_mask, position_ids, r, temperature=temp, fused=False)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    assert_stats_close(got, ref_stats(logits[:, -r - 1 : -1].float(), input_ids[:, -r:], temp), atol=1e-5)
    # the control: the head alone (no cap) gives other statistics, so the check above can fail
    h = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)[0]
    uncapped = ref_stats(model.get_output_embeddings()(h[:, -r - 1 : -1]).float(), input_ids[:, -r:], temp)
    assert (got.log_probs - uncapped.log_probs).abs().max() > 1e-2
