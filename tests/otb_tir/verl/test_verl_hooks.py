"""otb_tir.verl.hooks on verl's own classes (no Ray): the batch-contract check on a batch that
verl's ``compute_advantage`` filled with our TIR-OTB, its failures on broken batches, and the
metric names the verl run shares with the local trainer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.optional import need

need("verl")

from otb_tir.verl.hooks import ContractError, batch_metrics, check_contract, translate_metrics  # noqa: E402


def _batch(seed: int, groups: int = 3, n: int = 4, T: int = 24, P: int = 6):
    """Multi-turn rows: policy span, a tool-response span (mask 0, attended), policy span, padding;
    the reward on each row's last policy token."""
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    bs = groups * n
    response_mask = torch.zeros(bs, T)
    attention = torch.zeros(bs, P + T)
    attention[:, :P] = 1
    rewards = torch.zeros(bs, T)
    for i in range(bs):
        a = int(torch.randint(2, 6, (1,), generator=g))
        tool = int(torch.randint(1, 5, (1,), generator=g))
        b = int(torch.randint(1, 6, (1,), generator=g))
        length = a + tool + b
        response_mask[i, :a] = 1
        response_mask[i, a + tool : length] = 1
        attention[i, P : P + length] = 1
        rewards[i, length - 1] = float(torch.randint(0, 2, (1,), generator=g))
    uid = np.array([f"g{i // n}" for i in range(bs)], dtype=object)
    old_log_probs = -torch.rand(bs, T, generator=g) * 2 * response_mask
    sum_pi_squared = (torch.rand(bs, T, generator=g) * 0.9 + 0.05) * response_mask
    batch = {
        "responses": torch.zeros(bs, T, dtype=torch.long),
        "attention_mask": attention,
        "response_mask": response_mask,
        "token_level_rewards": rewards,
        "token_level_scores": rewards.clone(),
        "old_log_probs": old_log_probs,
        "sum_pi_squared": sum_pi_squared,
    }
    return DataProto.from_dict(tensors=batch, non_tensors={"uid": uid})


def _advantage(data, name="tir_optimal_token_baseline"):
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer

    from otb_tir.verl import plugin

    originals = plugin.install()
    data = ray_trainer.compute_advantage(data, adv_estimator=name, config=AlgoConfig())
    return data, originals[name]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_verls_batch_with_our_tir_otb_keeps_the_contract_and_matches_verls_estimator(seed):
    data, verl_fn = _advantage(_batch(seed))
    figures = check_contract(data, "tir_optimal_token_baseline", verl_fn)
    assert figures["contract/tool_tokens"] > 0 and figures["contract/tool_token_adv_max_abs"] == 0.0
    assert figures["contract/reward_off_last_policy_token"] == 0.0
    assert figures["contract/adv_max_abs_diff_vs_verl"] <= 1e-6
    if figures["contract/informative_groups"]:
        assert figures["contract/informative_policy_adv_nonzero_frac"] > 0.0
    # where the OTB baseline must differ from a row's return, every advantage is non-zero
    if figures["contract/contested_tokens"]:
        assert figures["contract/contested_adv_nonzero_frac"] == 1.0


@pytest.mark.parametrize("name", ["tir_optimal_token_baseline", "optimal_token_baseline"])
def test_a_length_capped_loser_has_zero_advantages_where_it_is_alone_and_none_where_contested(name):
    """The async CI flake: a wrong, length-capped row much longer than its group's right rows. Past
    their length it is alone (``handle_zero_tail``: baseline 0, its return 0), so most of the
    informative group's policy tokens legitimately get advantage 0; at every index where rows with
    different rewards carry weight, none does. A row whose probabilities sit at 1 (W = 0) carries none."""
    data = _batch(3, groups=1, n=4, T=24)
    b = data.batch
    P = b["attention_mask"].shape[1] - 24
    b["response_mask"].zero_()
    b["token_level_rewards"].zero_()
    b["attention_mask"][:, P:] = 0
    for i, length in enumerate([3, 3, 3, 20]):
        b["response_mask"][i, :length] = 1
        b["attention_mask"][i, P : P + length] = 1
        b["token_level_rewards"][i, length - 1] = 1.0 if length == 3 else 0.0
    b["old_log_probs"] *= b["response_mask"]
    b["sum_pi_squared"] = b["sum_pi_squared"].clamp_min(0.05) * b["response_mask"]
    b["token_level_scores"] = b["token_level_rewards"].clone()
    done, verl_fn = _advantage(data, name)
    figures = check_contract(done, name, verl_fn)
    assert figures["contract/informative_policy_adv_nonzero_frac"] < 0.5  # 17 of 29 tokens alone, A = 0
    assert figures["contract/contested_tokens"] == 3 * 4  # the first three indices, four rows each
    assert figures["contract/contested_adv_nonzero_frac"] == 1.0
    # the right rows saturated (π = 1, Σπ² = 1: W = 0): no row with a different reward carries weight
    sat = done[:]
    sat.batch["old_log_probs"] = sat.batch["old_log_probs"].clone()
    sat.batch["sum_pi_squared"] = sat.batch["sum_pi_squared"].clone()
    sat.batch["old_log_probs"][:3] = 0.0
    sat.batch["sum_pi_squared"][:3] = b["response_mask"][:3]
    sat, _ = _advantage(sat, name)
    assert check_contract(sat, name, verl_fn)["contract/contested_tokens"] == 0


def test_a_broken_batch_stops_the_run_naming_what_broke():
    data, verl_fn = _advantage(_batch(1))
    b = data.batch
    tool = (b["attention_mask"][:, -b["responses"].shape[1] :] == 1) & (b["response_mask"] == 0)
    bad = data[:]  # a copy
    bad.batch["advantages"] = b["advantages"].clone()
    bad.batch["advantages"][tool] = 0.25
    with pytest.raises(ContractError, match="tool tokens carry advantages"):
        check_contract(bad, "tir_optimal_token_baseline", None)
    moved = data[:]
    moved.batch["token_level_rewards"] = torch.roll(b["token_level_rewards"], shifts=-1, dims=1)
    moved.batch["token_level_rewards"][:, -1] = 0
    if moved.batch["token_level_rewards"].abs().sum():
        with pytest.raises(ContractError, match="not on the last policy token"):
            check_contract(moved, "tir_optimal_token_baseline", None)
    off = data[:]
    off.batch["advantages"] = b["advantages"] * 1.01
    with pytest.raises(ContractError, match="differs from verl's"):
        check_contract(off, "tir_optimal_token_baseline", verl_fn)


def test_batch_metrics_pool_the_agent_loops_counts_with_the_local_definition():
    from types import SimpleNamespace

    from agent_env.tool_metrics import COUNT_KEYS, episode_counts, tool_metrics

    data, _ = _advantage(_batch(2, groups=1, n=3))

    def call(ok, executed=True, error=None):
        return SimpleNamespace(ok=ok, executed=executed, error=error, text="", infra_retries=0)

    trajs = [
        SimpleNamespace(
            turns=[SimpleNamespace(tool_calls=calls)],
            tool_errors=sum(not c.ok and c.executed for c in calls),
            malformed_calls=0,
        )
        for calls in ([call(True), call(False, error="timeout")], [], [call(False, executed=False)])
    ]
    for key in COUNT_KEYS:
        data.non_tensor_batch[f"tool_{key}"] = np.array([episode_counts(t)[key] for t in trajs])
    data.non_tensor_batch["tool_rewards"] = np.array([[], [], []], dtype=object)  # verl's own field, not a count
    mine = batch_metrics(data)
    for k, v in tool_metrics(trajs).items():
        assert mine[k] == pytest.approx(v, nan_ok=True), k
    assert mine["reward/mean"] == pytest.approx(float(data.batch["token_level_scores"].sum(-1).mean()))


def test_legacy_batch_metrics_measure_the_weight_sync_on_policy_tokens():
    """The legacy trainer is synchronous: every row is at lag 0, and |π_rollout − π_actor| is averaged
    over the policy tokens only (tool tokens and padding left out), checked by brute force."""
    data, _ = _advantage(_batch(3, groups=2, n=2))
    b = data.batch
    mask = b["response_mask"].float()
    assert "sync/tokens_lag_0" not in batch_metrics(data)  # no rollout log-probs: nothing to compare
    gen = torch.Generator().manual_seed(0)
    b["old_log_probs"] = -torch.rand(mask.shape, generator=gen)
    b["rollout_log_probs"] = -torch.rand(mask.shape, generator=gen)
    mine = batch_metrics(data)
    diffs = [
        abs(math.exp(float(b["rollout_log_probs"][i, j])) - math.exp(float(b["old_log_probs"][i, j])))
        for i in range(mask.shape[0])
        for j in range(mask.shape[1])
        if mask[i, j]
    ]
    assert mine["sync/tokens_lag_0"] == len(diffs) > 0
    assert mine["sync/prob_diff_mean_lag_0"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-5)
    assert not any(k.startswith("sync/") and not k.endswith("_lag_0") for k in mine)


def test_verl_metric_names_map_to_the_local_trainers():
    m = translate_metrics(
        {
            "timing_s/gen": 1.5,
            "timing_s/update_weights": 0.1,
            "timing_s/agent_loop/x/min": 3,
            "val-core/otb_tir/arith/acc/mean@1": 0.4,
            "actor/pg_clipfrac": 0.1,
            "text": "skip",
            "timing_s/agent_loop/tool_calls/mean": 0.2,
        }
    )
    assert m["timing/gen_s"] == 1.5 and m["timing/update_weights_s"] == 0.1 and "timing/agent_loop/x/min_s" not in m
    assert m["timing/episode_tools_s"] == 0.2
    assert m["val/accuracy"] == 0.4 and m["actor/clip_frac"] == 0.1 and "text" not in m


def test_progress_names_the_innermost_open_phase_that_failed(tmp_path):
    """verl opens ``gen`` in one hook and closes it in another; an exception inside it (a rollout
    replica that died) skips the closing hook. ``progress.json`` must name ``gen``, not the ``step``
    around it, for the watchdog's error."""
    import json as _json

    from otb_tir.verl.hooks import Progress

    p = Progress(tmp_path / "progress.json")
    p.step = 3
    with pytest.raises(RuntimeError):
        with p.phase("step"):
            p.enter("gen")
            raise RuntimeError("the replica died")
    row = _json.loads((tmp_path / "progress.json").read_text())
    assert row["failed"] == "gen" and row["phase"] == "between_phases" and row["step"] == 3
    with pytest.raises(RuntimeError):
        with p.phase("update_actor"):
            raise RuntimeError("oom")
    assert _json.loads((tmp_path / "progress.json").read_text())["failed"] == "update_actor"
    # gen's closing hook raises (verl's on_sample_end sleeps a replica that died: ActorDiedError), as
    # otb_tir.verl.v1's on_sample_end reports it: gen is closed before the step sees the exception
    # (CI, 2026-12-05: the watchdog said "phase 'step'")
    with pytest.raises(RuntimeError):
        with p.phase("step"):
            p.enter("gen")
            try:
                raise RuntimeError("the actor died unexpectedly")
            except RuntimeError as exc:
                p.fail(exc, "gen")
                raise
            finally:
                p.leave("gen")
    assert _json.loads((tmp_path / "progress.json").read_text())["failed"] == "gen"
    # a later, unrelated failure is named where it happened
    with pytest.raises(RuntimeError):
        with p.phase("old_log_prob"):
            raise RuntimeError("another")
    assert _json.loads((tmp_path / "progress.json").read_text())["failed"] == "old_log_prob"
