"""The step's algorithm without a Trainer: ``score``, ``advantages`` and ``update`` of
:mod:`otb_tir.trainer.step` on a collated batch of multi-turn trajectories (policy spans with tool
spans between them) and the real tiny model. Oracles: the transformers model's own logits for
``score``; GRPO by hand (numpy, per group) for ``advantages``; for ``update``, zero advantages leave
the weights where they were and a positive advantage raises exactly its row's log-prob."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from agent_env.records import Prompt, Trajectory
from agent_env.rollout import collate
from otb_tir.advantage import get_estimator
from otb_tir.trainer.actor import ActorSettings
from otb_tir.trainer.config import FilterConfig
from otb_tir.trainer.settings import TrainerSettings
from otb_tir.trainer.step import advantages, score, update


def _trajectory(rng: random.Random, uid: str, reward: float, finish: str = "answer") -> Trajectory:
    """A multi-turn row: policy tokens, a tool observation (mask 0), policy tokens again."""
    prompt = [rng.randrange(5, 1500) for _ in range(rng.randint(3, 6))]
    spans = [(1, rng.randint(2, 5)), (0, rng.randint(2, 4)), (1, rng.randint(1, 4))]
    mask = [m for m, n in spans for _ in range(n)]
    ids = [rng.randrange(5, 1500) for _ in mask]
    return Trajectory(
        uid=uid,
        prompt_ids=prompt,
        response_ids=ids,
        response_mask=mask,
        rollout_logprobs=[-rng.random() * 3 if m else 0.0 for m in mask],
        turns=[],
        messages=[],
        reward=reward,
        reward_details={},
        finish_reason=finish,
        num_turns=2,
        void_turns=0,
        malformed_calls=0,
        num_tool_calls=1,
        tool_errors=0,
        template_mismatch=None,
        timings={},
    )


def _batch(rewards, seed=0, finish=None):
    rng = random.Random(seed)
    trajs = [_trajectory(rng, f"g{i // 4}", r, (finish or {}).get(i, "answer")) for i, r in enumerate(rewards)]
    return collate(trajs, pad_token_id=0, response_length=16)


def _settings(**kw) -> TrainerSettings:
    kw.setdefault("n", 4)
    kw.setdefault("ppo_mini_batch_size", 2)
    return TrainerSettings(**kw)


def test_score_is_the_models_own_log_probs_on_policy_tokens_only(tiny_model):
    batch = _batch([1, 0, 1, 0, 0, 0, 1, 1])
    old = score(tiny_model, batch, ActorSettings(ppo_micro_batch_size=3))
    mask = batch["response_mask"].bool()
    for i, t in enumerate(batch.trajectories):  # one row at a time, unpadded, from the logits
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = tiny_model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits[len(t.prompt_ids) - 1 : -1], -1)
        want = lp.gather(1, torch.tensor(t.response_ids)[:, None])[:, 0]
        got = old.log_probs[i, : len(t.response_ids)]
        m = mask[i, : len(t.response_ids)]
        torch.testing.assert_close(got[m], want[m], rtol=0, atol=2e-5)
        sum_pi2 = lp.exp().square().sum(-1)
        torch.testing.assert_close(old.sum_pi_squared[i, : len(t.response_ids)][m], sum_pi2[m], rtol=0, atol=2e-5)
    for t in old:  # tool tokens and padding carry no statistics
        assert torch.all(t[~mask] == 0)


def test_advantages_are_grpo_by_hand_on_policy_tokens_and_zero_on_tool_tokens():
    rewards = [1.0, 0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 1.0]
    batch = _batch(rewards)
    mask = batch["response_mask"].float()
    old = score_free(batch)
    got = advantages(batch, old, get_estimator("grpo"), _settings())
    r = np.array(rewards)
    for g in range(2):
        rows = slice(4 * g, 4 * g + 4)
        want = (r[rows] - r[rows].mean()) / (r[rows].std(ddof=1) + 1e-6)
        for i, a in zip(range(4 * g, 4 * g + 4), want):
            on = got.advantages[i][mask[i] == 1]
            torch.testing.assert_close(on, torch.full_like(on, a))
    assert torch.all(got.advantages[mask == 0] == 0)  # tool tokens and padding: advantage 0
    assert got.rollout_is_weights is None and got.kept_frac == 1.0
    assert torch.equal(got.loss_mask, mask)


def score_free(batch):
    """Old statistics equal to the rollout's log-probs (no model needed for the estimator tests)."""
    from otb_tir.token_stats import TokenStats

    lp = batch["rollout_log_probs"]
    return TokenStats(lp.clone(), torch.zeros_like(lp), torch.full_like(lp, 0.5) * batch["response_mask"])


def test_advantages_filter_rows_and_weigh_by_truncated_is():
    batch = _batch([1, 0, 1, 0, 1, 1, 1, 1], finish={1: "length"})
    mask = batch["response_mask"].float()
    old = score_free(batch)
    old = type(old)(old.log_probs + 0.3 * mask, old.entropy, old.sum_pi_squared)  # π_old > π_rollout
    s = _settings(
        rollout_is=True,
        rollout_is_threshold=1.2,
        filters=FilterConfig(overlong=True, all_equal_reward_groups=True),
    )
    got = advantages(batch, old, get_estimator("tir_optimal_token_baseline"), s)
    kept = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0], dtype=torch.bool)  # row 1 overlong; group 1 all equal
    assert torch.equal(got.loss_mask, mask * kept[:, None])
    assert got.kept_frac == pytest.approx(3 / 8)
    assert torch.all(got.advantages[~kept] == 0)
    w = got.rollout_is_weights
    assert torch.allclose(w[mask == 1], torch.full_like(w[mask == 1], min(math.exp(0.3), 1.2)))
    assert torch.all(w[mask == 0] == 1)


def test_update_moves_each_row_the_way_its_advantage_says(tiny_model_factory):
    batch = _batch([1, 0, 1, 0, 0, 0, 1, 1], seed=2)
    s = _settings(ppo_epochs=2, actor=ActorSettings(ppo_micro_batch_size=2))
    mask = batch["response_mask"].float()
    model = tiny_model_factory()
    before = [p.detach().clone() for p in model.parameters()]
    old = score(model, batch, s.actor)
    zero = advantages(batch, old, lambda **kw: (torch.zeros_like(mask), None), s)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    m = update(model, opt, batch, old, zero, s, step=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing to learn: no move
    assert m["actor/grad_norm"] == 0.0
    # row 0 only: a positive advantage raises its log-prob, a negative one lowers it
    for sign in (1.0, -1.0):
        model = tiny_model_factory()
        old = score(model, batch, s.actor)
        one = torch.zeros_like(mask)
        one[0] = sign * mask[0]
        adv = advantages(batch, old, lambda a=one, **kw: (a, a), s)
        update(model, torch.optim.SGD(model.parameters(), lr=0.5), batch, old, adv, s, step=0)
        new = score(model, batch, s.actor)
        delta = float(((new.log_probs - old.log_probs) * mask)[0].sum())
        assert delta * sign > 0, (sign, delta)


def test_prompt_from_row_reads_every_layout_once():
    row = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}, "data_source": "x"}
    p = Prompt.from_row(row, uid="u7")
    assert (p.prompt, p.ground_truth, p.uid, p.data_source) == (row["prompt"], "2", "u7", "x")
    assert Prompt.from_row({"prompt": "q", "answer": 3}).ground_truth == 3
    assert Prompt.from_row({"raw_prompt": "q", "uid": 5}, prompt_key="raw_prompt").uid == "5"
    assert Prompt.from_row("q") == Prompt("q")
    assert Prompt.from_row(p, uid="v").uid == "v"
    from agent_env import EnvError

    with pytest.raises(EnvError, match="without a 'prompt' key"):
        Prompt.from_row({"question": "q"}, index=3)
    with pytest.raises(EnvError, match="prompt 2 must be"):
        Prompt.from_row(7, index=2)
