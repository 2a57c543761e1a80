"""benchmarks/bench_estimators.py: the paired gradient-noise measurement.

On one fixed synthetic multi-turn batch, every estimator's proxies must be exactly what verl's
``compute_variance_proxy_metrics`` gives on *that estimator's* advantages (computed by verl's own
estimator functions), so the comparison is paired; and the signal term's gradient norm must be
the true policy-gradient norm of the real tiny model (autograd of −Σ A·log π / N), leaving the
weights unchanged.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.optional import need

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_estimators", ROOT / "benchmarks" / "bench_estimators.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_estimators"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("bench_estimators", None)


def _batch(seed: int = 0, groups: int = 4, n: int = 4, resp: int = 24, with_is: bool = False) -> dict:
    """Right-padded rows with tool spans (mask 0) inside, binary rewards on the last policy token."""
    gen = torch.Generator().manual_seed(seed)
    b = groups * n
    col = torch.arange(resp)[None]
    lengths = torch.randint(resp // 2, resp + 1, (b, 1), generator=gen)
    mask = col < lengths
    start = torch.randint(2, resp // 2 - 2, (b, 1), generator=gen)
    mask &= ~((col >= start) & (col < start + 3))
    mask = mask.float()
    last = (mask * col).argmax(-1)
    rewards = torch.zeros(b, resp)
    rewards[torch.arange(b), last] = (torch.rand(b, generator=gen) < 0.5).float()
    rewards[:n, :] = 0.0  # one group with equal rewards (no signal)
    pi = torch.rand(b, resp, generator=gen) * 0.9 + 0.05
    inputs = {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "index": np.array([f"g{i // n}" for i in range(b)], dtype=object),
        "old_log_probs": pi.log() * mask,
        "sum_pi_squared": (pi.square() + torch.rand(b, resp, generator=gen) * (1 - pi.square())) * mask,
        "rollout_is_weights": (torch.rand(b, resp, generator=gen) * 1.5 + 0.25) * mask if with_is else None,
        "handle_zero_tail": True,
        "norm_adv_by_std_in_grpo": True,
    }
    return inputs


def _verl_advantages(name: str, inp: dict) -> torch.Tensor:
    from verl.trainer.ppo import core_algos as ca

    common = dict(
        token_level_rewards=inp["token_level_rewards"], response_mask=inp["response_mask"], index=inp["index"]
    )
    otb = dict(
        old_log_probs=inp["old_log_probs"],
        sum_pi_squared=inp["sum_pi_squared"],
        rollout_is_weights=inp["rollout_is_weights"],
        handle_zero_tail=True,
    )
    if name == "tir_optimal_token_baseline":
        return ca.compute_multi_turn_optimal_token_baseline_advantage(**common, **otb)[0]
    if name == "optimal_token_baseline":
        return ca.compute_optimal_token_baseline_advantage(**common, **otb)[0]
    if name == "grpo":
        return ca.compute_grpo_outcome_advantage(**common, norm_adv_by_std_in_grpo=True)[0]
    if name == "grpo_no_std":
        return ca.compute_grpo_outcome_advantage(**common, norm_adv_by_std_in_grpo=False)[0]
    if name == "rloo":
        return ca.compute_rloo_outcome_advantage(**common)[0]
    raise AssertionError(name)


@pytest.mark.parametrize("with_is", [False, True])
def test_paired_proxies_equal_verls_on_each_estimators_own_advantages(bench, with_is):
    need("verl", reason="verl==0.9.1 is the test oracle")
    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_variance_proxy_metrics

    inp = _batch(with_is=with_is)
    loss_mask = inp["response_mask"].clone()
    loss_mask[5] = 0.0  # a filtered trajectory, as the trainer's filters do
    norms = {}

    def fake_norm(adv, mask):  # a distinct, known ‖ḡ‖ per estimator: proxy1/proxy3 must use its own
        norms[len(norms)] = float(adv.abs().sum()) / 100
        return norms[len(norms) - 1]

    got = bench.paired_proxies(inp, bench.PAIRED, loss_mask=loss_mask, grad_norm_fn=fake_norm)
    assert list(got) == list(bench.PAIRED)
    powers = set()
    for name in bench.PAIRED:
        adv = _verl_advantages(name, inp).float() * loss_mask
        gnorm = float(adv.abs().sum()) / 100
        tensors = {
            "advantages": adv,
            "response_mask": loss_mask,
            "old_log_probs": inp["old_log_probs"],
            "sum_pi_squared": inp["sum_pi_squared"],
        }
        if with_is:
            tensors["rollout_is_weights"] = inp["rollout_is_weights"]
        ref = compute_variance_proxy_metrics(DataProto.from_dict(tensors=tensors), gradient_norm=gnorm)
        assert set(ref) | {"grad_norm"} == set(got[name])
        for key, value in ref.items():
            assert got[name][key] == pytest.approx(float(value), rel=1e-5, abs=1e-7), (name, key)
        assert got[name]["grad_norm"] == pytest.approx(gnorm, rel=1e-5)
        powers.add(round(got[name]["variance_proxy/proxy2_total_power"], 6))
    assert len(powers) == len(bench.PAIRED)  # the estimators really differ on this batch
    # without a gradient-norm function the signal and noise terms are 0, as verl reports them
    plain = bench.paired_proxies(inp, ["grpo"])
    assert plain["grpo"]["variance_proxy/proxy3_pure_noise"] == 0.0 and math.isnan(plain["grpo"]["grad_norm"])
    # the aggregate pairs batches: a ratio per batch, then their geometric mean
    runs = [{"paired": [{"proxies": got}, {"proxies": got}]}]
    agg = bench.aggregate(runs, bench.PAIRED)
    r = agg["estimators"]["rloo"]["proxy2_total_power_ratio_to_grpo"]
    expect = got["rloo"]["variance_proxy/proxy2_total_power"] / got["grpo"]["variance_proxy/proxy2_total_power"]
    assert r["of"] == 2 and r["geo_mean"] == pytest.approx(expect)


def test_policy_gradient_norm_is_the_true_gradient_and_leaves_weights(bench, tiny_model_factory):
    from otb_tir.trainer.actor import ActorSettings, compute_old_stats

    torch.manual_seed(0)
    model = tiny_model_factory()
    b, p, r = 6, 5, 10
    vocab = model.config.vocab_size
    input_ids = torch.randint(3, vocab, (b, p + r))
    attention_mask = torch.ones(b, p + r, dtype=torch.long)
    attention_mask[0, :2] = 0  # left-padded prompt
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    response_mask = torch.ones(b, r)
    response_mask[1, 6:] = 0.0
    response_mask[2, 2:4] = 0.0  # a tool span
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": input_ids[:, p:],
        "response_mask": response_mask,
    }
    settings = ActorSettings(ppo_micro_batch_size=4, grad_clip=0.5, kl_loss_coef=0.1, entropy_coeff=0.01)
    tensors["old_log_probs"] = compute_old_stats(model, tensors, settings).log_probs
    adv = torch.randn(b, r) * response_mask
    before = {k: v.detach().clone() for k, v in model.named_parameters()}

    got = bench.policy_gradient_norm(model, tensors, adv, response_mask, settings)

    assert all(torch.equal(before[k], v) for k, v in model.named_parameters())
    assert all(v.grad is None for v in model.parameters())
    # the oracle: autograd of the token-mean policy-gradient loss −Σ A·log π / N over the whole batch
    from otb_tir.token_stats import token_stats_for_causal_lm

    model.train()
    st = token_stats_for_causal_lm(model, input_ids, attention_mask, position_ids, response_length=r, fused=False)
    loss = -(adv * st.log_probs * response_mask).sum() / response_mask.sum()
    grads = torch.autograd.grad(loss, [q for q in model.parameters() if q.requires_grad], allow_unused=True)
    want = torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None))
    assert got == pytest.approx(float(want), rel=1e-4)
    assert got > settings.grad_clip  # the trainer's clipping did not cap the measured norm
