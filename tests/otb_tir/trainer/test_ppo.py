"""PPO loss: verl 0.9.1's policy loss is the oracle; micro-batch accumulation equals the full mean."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otb_tir.trainer.ppo import kl_low_var, masked_mean, ppo_policy_loss, truncated_is_weights
from tests.support.optional import need


@pytest.fixture(scope="module")
def verl_core():
    need("verl")
    from verl.trainer.ppo import core_algos

    return core_algos


def _batch(seed, b=6, t=11):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    new = old + torch.randn(b, t, generator=g) * 0.4
    adv = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    return old, new, adv, mask


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), low=st.floats(0.05, 0.4), high=st.floats(0.05, 0.5), c=st.floats(1.5, 5.0))
def test_policy_loss_matches_verl(verl_core, seed, low, high, c):
    old, new, adv, mask = _batch(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_loss, ref_clip, ref_kl, _ = verl_core.compute_policy_loss(
            old, new, adv, mask, cliprange_low=low, cliprange_high=high, clip_ratio_c=c
        )
    out = ppo_policy_loss(new, old, adv, mask, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.clip_frac, ref_clip, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.approx_kl, ref_kl, atol=1e-6, rtol=1e-6)


def test_kl_matches_verl_low_var_kl(verl_core):
    old, new, _, _ = _batch(3)
    torch.testing.assert_close(kl_low_var(new, old), verl_core.kl_penalty(new, old, "low_var_kl"))


def test_micro_batches_sum_to_full_token_mean():
    old, new, adv, mask = _batch(7, b=8)
    new = new.clone().requires_grad_(True)
    full = ppo_policy_loss(new, old, adv, mask, clip_ratio_c=None).loss
    (g_full,) = torch.autograd.grad(full, new)
    n = mask.sum()
    acc = sum(
        ppo_policy_loss(
            new[i : i + 3], old[i : i + 3], adv[i : i + 3], mask[i : i + 3], clip_ratio_c=None, num_tokens=n
        ).loss
        for i in range(0, 8, 3)
    )
    (g_acc,) = torch.autograd.grad(acc, new)
    torch.testing.assert_close(acc, full)
    torch.testing.assert_close(g_acc, g_full)


def test_masked_tokens_get_no_gradient_and_empty_mask_is_zero():
    old, new, adv, mask = _batch(11)
    new = new.clone().requires_grad_(True)
    out = ppo_policy_loss(new, old, adv, mask)
    (g,) = torch.autograd.grad(out.loss, new)
    assert torch.all(g[mask == 0] == 0)
    assert g[mask == 1].abs().sum() > 0
    empty = ppo_policy_loss(new, old, adv, torch.zeros_like(mask))
    assert empty.loss.item() == 0.0 and torch.isfinite(empty.loss)
    assert masked_mean(torch.ones(3), torch.zeros(3)).item() == 0.0


def test_on_policy_gradient_is_advantage_weighted_logprob_gradient():
    # At ratio 1 the clipped surrogate's gradient equals -mean(A * grad log pi).
    old, _, adv, mask = _batch(5)
    new = old.clone().requires_grad_(True)
    out = ppo_policy_loss(new, old, adv, mask)
    (g,) = torch.autograd.grad(out.loss, new)
    torch.testing.assert_close(g, -adv * mask / mask.sum())
    assert out.clip_frac.item() == 0.0


def test_truncated_is_weights():
    old = torch.tensor([[0.0, -1.0, -2.0]])
    roll = torch.tensor([[-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    w = truncated_is_weights(old, roll, mask, threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 1.0]]))
