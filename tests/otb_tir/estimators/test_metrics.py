"""Variance-proxy metrics against verl 0.9.1's, and advantage statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otb_tir import ConfigError
from otb_tir.advantage import grpo, optimal_token_baseline
from otb_tir.metrics import advantage_stats, variance_proxy_metrics
from tests.support.optional import need


@pytest.fixture(scope="module")
def verl_metrics():
    metric_utils = need("verl.trainer.ppo.metric_utils", reason="verl==0.9.1 is the test oracle")
    from verl import DataProto

    return metric_utils.compute_variance_proxy_metrics, DataProto


def _batch(seed: int, batch: int, resp: int):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, resp, generator=gen) < 0.7).float()
    mask[0] = 0.0  # an empty row
    pi = torch.rand(batch, resp, generator=gen) * 0.98 + 0.01
    return {
        "advantages": torch.randn(batch, resp, generator=gen) * mask,
        "response_mask": mask,
        "old_log_probs": pi.log(),
        "sum_pi_squared": pi.square() + torch.rand(batch, resp, generator=gen) * (1 - pi.square()),
        "rollout_is_weights": torch.rand(batch, resp, generator=gen) * 2,
    }


@settings(deadline=None, max_examples=40)
@given(
    seed=st.integers(0, 2**31),
    batch=st.integers(1, 12),
    resp=st.integers(1, 20),
    use_is=st.booleans(),
    grad_norm=st.one_of(st.none(), st.floats(0.0, 3.0)),
)
def test_variance_proxies_equal_verl(verl_metrics, seed, batch, resp, use_is, grad_norm):
    compute, DataProto = verl_metrics
    data = _batch(seed, batch, resp)
    if not use_is:
        data.pop("rollout_is_weights")
    ref = compute(DataProto.from_dict(tensors=dict(data)), gradient_norm=grad_norm)
    ours = variance_proxy_metrics(**data, gradient_norm=grad_norm)
    assert set(ours) == set(ref)
    for key, value in ref.items():
        assert isinstance(ours[key], float)
        assert ours[key] == pytest.approx(float(value), rel=1e-5, abs=1e-7), key


def test_otb_has_lower_total_power_than_grpo():
    """On a batch where rewards follow the path-variance proxy, OTB's advantages carry less power."""
    gen = torch.Generator().manual_seed(3)
    batch, resp, n = 64, 32, 8
    lengths = torch.randint(4, resp + 1, (batch,), generator=gen)
    mask = (torch.arange(resp)[None] < lengths[:, None]).float()
    rewards = torch.zeros(batch, resp)
    rewards[torch.arange(batch), lengths - 1] = (torch.rand(batch, generator=gen) < 0.5).float()
    pi = torch.rand(batch, resp, generator=gen) * 0.9 + 0.05
    sp = pi.square() + torch.rand(batch, resp, generator=gen) * (1 - pi.square())
    index = np.array([i // n for i in range(batch)], dtype=object)
    stats = {}
    for name, est in (("otb", optimal_token_baseline), ("grpo", grpo)):
        adv, _ = est(rewards, mask, index, pi.log(), sp, norm_adv_by_std_in_grpo=False)
        stats[name] = variance_proxy_metrics(adv, mask, pi.log(), sp)["variance_proxy/proxy2_total_power"]
    assert stats["otb"] > 0 and stats["grpo"] > 0
    assert stats["otb"] <= stats["grpo"] * 1.05


def test_advantage_stats():
    adv = torch.tensor([[1.0, 2.0, 100.0], [-3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    stats = advantage_stats(adv, mask)
    values = np.array([1.0, 2.0, -3.0])
    assert stats["advantages/mean"] == pytest.approx(values.mean())
    assert stats["advantages/std"] == pytest.approx(values.std(ddof=1))
    assert stats["advantages/min"] == -3.0 and stats["advantages/max"] == 2.0
    assert stats["advantages/num_tokens"] == 3.0
    empty = advantage_stats(adv, torch.zeros_like(mask))
    assert empty["advantages/num_tokens"] == 0.0 and empty["advantages/mean"] == 0.0
    with pytest.raises(ConfigError):
        advantage_stats(adv, mask[:, :2])
    with pytest.raises(ConfigError):
        variance_proxy_metrics(adv, mask, adv, adv[:, :2])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 12), st.integers(0, 2**31 - 1), st.booleans())
def test_rollout_actor_gap_equals_verls_debug_metrics(rows: int, cols: int, seed: int, empty: bool) -> None:
    """The gap the local trainer logs every step, against verl's own calculate_debug_metrics."""
    need("verl")
    from verl import DataProto
    from verl.utils.debug.metrics import calculate_debug_metrics

    from otb_tir.metrics import rollout_actor_gap

    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3
    rollout = old + torch.randn(rows, cols, generator=g, dtype=torch.float64) * 0.1
    mask = (torch.rand(rows, cols, generator=g) < 0.7).long()
    if empty:
        mask.zero_()
    rollout = rollout * mask  # the batch's convention: 0 off the policy tokens
    data = DataProto.from_dict(
        tensors={
            "rollout_log_probs": rollout,
            "old_log_probs": old,
            "response_mask": mask,
            "responses": torch.zeros(rows, cols, dtype=torch.long),
        }
    )
    want = calculate_debug_metrics(data)
    got = rollout_actor_gap(rollout, old, mask)
    assert set(got) == set(want)
    for key, value in want.items():
        value = float(value)
        if math.isnan(value):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
