"""otb_tir.verl.v1 on verl's own V1 classes and functions, without Ray: the modes are registered in
verl's trainer registry by the installed entry point alone; the Σπ² request is made in the
old-log-prob pass only; the advantage step hands Σπ², old log-probs and IS weights to verl's own
``compute_advantage`` (which fails without them, upstream's gap), equal to verl's estimator; the
staleness and IS figures; the glue table. The real runs are in ``test_verl_e2e.py``."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.optional import need

need("verl")
need("transfer_queue")

from otb_tir.verl import v1  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------- registration
def test_the_installed_entry_point_registers_the_modes_in_verls_registry(tmp_path):
    """A user's plain `import verl` (no VERL_USE_EXTERNAL_MODULES, another folder) finds otb_sync & co.
    through verl's `verl.plugins` entry points, each over verl's own class for that mode."""
    code = (
        "import os; os.environ.pop('VERL_USE_EXTERNAL_MODULES', None)\n"
        "import verl\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "from verl.trainer.ppo.v1 import PPOTrainerSync, PPOTrainerColocateAsync, PPOTrainerSeparateAsync\n"
        "from otb_tir.verl.v1 import OTBTrainerMixin\n"
        "for name, base in [('otb_sync', PPOTrainerSync), ('otb_colocate_async', PPOTrainerColocateAsync),"
        " ('otb_separate_async', PPOTrainerSeparateAsync)]:\n"
        "    cls = get_trainer_cls(name)\n"
        "    assert cls.__mro__[1:3] == (OTBTrainerMixin, base), cls.__mro__\n"
        "    assert cls.verl_mode == name[4:]\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# --------------------------------------------------------------------------- a TransferQueue in memory
class _Meta:
    """What the trainer passes around: keys, a partition, tags and the extra_info of the next pass."""

    def __init__(self, keys, partition_id="train"):
        self.keys, self.partition_id, self.extra_info = list(keys), partition_id, {}
        self.tags = [{} for _ in keys]

    def __len__(self):
        return len(self.keys)


class _TQ:
    """kv_batch_get / kv_batch_put over a dict (the two calls the mixin makes), nested tensors per field."""

    def __init__(self):
        self.rows: dict[str, dict[str, torch.Tensor]] = {}

    def kv_batch_get(self, keys, partition_id, select_fields):
        from tensordict import TensorDict

        present = [f for f in select_fields if all(f in self.rows[k] for k in keys)]
        return TensorDict(
            {f: torch.nested.as_nested_tensor([self.rows[k][f] for k in keys], layout=torch.jagged) for f in present},
            batch_size=len(keys),
        )

    def kv_batch_put(self, keys, partition_id, fields):
        for f in fields.keys():
            for k, t in zip(keys, fields[f].unbind()):
                self.rows.setdefault(k, {})[f] = t
        return _Meta(keys, partition_id)


def _config(estimator="tir_optimal_token_baseline", rollout_is="token", bypass=False):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "algorithm": {
                "adv_estimator": estimator,
                "gamma": 1.0,
                "lam": 1.0,
                "norm_adv_by_std_in_grpo": True,
                "use_kl_in_reward": False,
                "rollout_correction": {"rollout_is": rollout_is, "rollout_is_threshold": 2.0, "bypass_mode": bypass},
            },
            "actor_rollout_ref": {"actor": {"calculate_sum_pi_squared": True}, "rollout": {"n": 4}},
            "trainer": {"v1": {"trainer_mode": "otb_sync"}},
        }
    )


def _episodes(seed: int, groups: int = 2, n: int = 4, prompt: int = 3, dtype: torch.dtype = torch.float32):
    """Multi-turn rows as verl's V1 agent loop stores them: per key, prompt + response ids, a response
    mask with a tool span (0) between policy spans, rm_scores on the last policy token, rollout and
    actor log-probs, the actor's Σπ² over prompt + response."""
    g = torch.Generator().manual_seed(seed)
    tq = _TQ()
    keys = []
    for i in range(groups * n):
        a, tool, b = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 5), (1, 4), (1, 5)))
        length = a + tool + b
        mask = torch.cat([torch.ones(a), torch.zeros(tool), torch.ones(b)])
        scores = torch.zeros(length)
        scores[-1] = float(torch.randint(0, 2, (1,), generator=g))
        rollout = -torch.rand(length, generator=g) * mask
        key = f"g{i // n}_{i % n}_0"
        keys.append(key)
        tq.rows[key] = {
            "uid": torch.tensor(0),
            "response_mask": mask,
            "rm_scores": scores,
            "rollout_log_probs": rollout,
            # the actor's old log-probs: off the rollout's by up to ±0.9 (truncation at 2.0 happens)
            # in the actor's compute dtype, as verl's V1 stores them (bf16 under FSDP mixed precision)
            "old_log_probs": ((rollout + (torch.rand(length, generator=g) - 0.5) * 1.8) * mask).to(dtype),
            # model outputs over prompt + response (position t predicts token t + 1)
            "sum_pi_squared": (torch.rand(prompt + length, generator=g) * 0.9 + 0.05).to(dtype),
        }
    return tq, keys


# --------------------------------------------------------------------------- the Σπ² request
def test_sum_pi_squared_is_asked_for_in_the_old_log_prob_pass_only(monkeypatch):
    import transfer_queue

    tq, keys = _episodes(0)
    monkeypatch.setattr(transfer_queue, "kv_batch_get", tq.kv_batch_get)
    monkeypatch.setattr(transfer_queue, "kv_batch_put", tq.kv_batch_put)
    seen = []

    class Base:  # stands for verl's PPOTrainer: what each pass sees in the batch's extra_info
        def _compute_old_log_prob(self, batch, metrics):
            seen.append(("old_log_prob", batch.extra_info.get("calculate_sum_pi_squared", False)))
            return batch

        def _compute_ref_log_prob(self, batch, metrics):
            seen.append(("ref", batch.extra_info.get("calculate_sum_pi_squared", False)))
            return batch

        def _update_actor(self, batch, metrics):
            seen.append(("update", batch.extra_info.get("calculate_sum_pi_squared", False)))
            return batch

    class Trainer(v1.OTBTrainerMixin, Base):
        pass

    t = object.__new__(Trainer)
    t._otb_spi2, t._otb_run = True, None
    batch = _Meta(keys)
    t._compute_old_log_prob(batch, {})
    t._compute_ref_log_prob(batch, {})
    t._update_actor(batch, {})
    assert seen == [("old_log_prob", True), ("ref", False), ("update", False)]
    # stored over the response, cut as verl cuts the log-probs (shifted by one)
    for k in keys:
        length = tq.rows[k]["response_mask"].numel()
        full = tq.rows[k]["sum_pi_squared"]
        assert torch.equal(tq.rows[k][v1.SPI2_FIELD], full[-length - 1 : -1])


# --------------------------------------------------------------------------- the advantage step
def _v1_advantage_batch(tq, keys):
    """What verl's V1 _compute_advantage builds before calling compute_advantage_for_multi_trajectories."""
    from verl.protocol import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    data = tq.kv_batch_get(keys, "train", ["response_mask", "rm_scores", "rollout_log_probs", "old_log_probs"])
    data = DataProto(batch=data.to_padded_tensor())
    data.batch["token_level_scores"] = data.batch["rm_scores"]
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    data.non_tensor_batch["uid"] = np.array([k.split("_")[0] for k in keys], dtype=object)
    data, _ = compute_rollout_correction_and_add_to_batch(data, _config().algorithm.rollout_correction)
    return data


def _trainer_for_advantage(config):
    from otb_tir.verl import plugin

    class Trainer(v1.OTBTrainerMixin):
        pass

    t = object.__new__(Trainer)
    t.config = config
    t._otb_verl_estimators = plugin.install()
    t._otb_spi2 = True
    return t


def test_verls_v1_advantage_step_fails_for_otb_without_the_mixin():
    """Upstream's gap, shown on verl's own function: V1's batch has no Σπ²."""
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    tq, keys = _episodes(1)
    data = _v1_advantage_batch(tq, keys)
    with pytest.raises(AssertionError, match="sum_pi_squared"):
        compute_advantage_for_multi_trajectories(
            data, batch_keys=keys, adv_estimator="tir_optimal_token_baseline", num_repeat=4, config=_config().algorithm
        )


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_advantage_step_hands_sum_pi_squared_and_is_weights_to_verls_estimator(seed, dtype):
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    from verl.trainer.ppo.core_algos import compute_multi_turn_optimal_token_baseline_advantage as verl_tir_otb

    from otb_tir.verl.glue import wrapped_v1_advantage

    tq, keys = _episodes(seed, dtype=dtype)
    for k in keys:  # what the mixin's old-log-prob pass stores
        length = tq.rows[k]["response_mask"].numel()
        tq.rows[k][v1.SPI2_FIELD] = tq.rows[k]["sum_pi_squared"][-length - 1 : -1]
    data = _v1_advantage_batch(tq, keys)
    assert "rollout_is_weights" in data.batch.keys()
    t = _trainer_for_advantage(_config())
    extra = tq.kv_batch_get(keys, "train", [v1.SPI2_FIELD, "response_mask"])
    original = trainer_base.compute_advantage_for_multi_trajectories
    import functools

    with wrapped_v1_advantage(functools.partial(t._otb_advantage, extra)):
        assert trainer_base.compute_advantage_for_multi_trajectories is not original
        out = trainer_base.compute_advantage_for_multi_trajectories(
            data, batch_keys=keys, adv_estimator="tir_optimal_token_baseline", num_repeat=4, config=_config().algorithm
        )
    assert trainer_base.compute_advantage_for_multi_trajectories is original  # restored
    b = out.batch
    assert b["old_log_probs"].dtype == b["sum_pi_squared"].dtype == torch.float32  # what verl's estimator needs
    # the oracle: verl's own TIR-OTB on the same inputs, IS weights included (W_t scaled by ρ̄²)
    want, _ = verl_tir_otb(
        token_level_rewards=b["token_level_rewards"],
        response_mask=b["response_mask"],
        index=out.non_tensor_batch["uid"],
        old_log_probs=b["old_log_probs"],
        sum_pi_squared=b["sum_pi_squared"],
        rollout_is_weights=b["rollout_is_weights"],
    )
    assert torch.equal(b["advantages"], want)
    m = t._otb_adv_metrics
    assert m["contract/adv_max_abs_diff_vs_verl"] == 0.0 and m["contract/is_weights_in_estimator"] == 1.0
    assert m["contract/tool_token_adv_max_abs"] == 0.0 and m["contract/tool_tokens"] > 0
    assert m["is/applied"] == 1.0 and 0.0 <= m["is/truncated_frac"] <= 1.0 and m["is/weight_max"] <= 2.0 + 1e-6
    ratio = torch.exp(b["old_log_probs"] - b["rollout_log_probs"])[b["response_mask"].bool()]
    assert m["is/truncated_frac"] == pytest.approx(float((ratio > 2.0).float().mean()), abs=1e-6)
    assert m["is/adv_change_max_abs"] >= 0.0


def test_otb_with_bypass_mode_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="bypass_mode=true.*sum_pi_squared"):
        v1.check_bypass(_config(bypass=True))
    v1.check_bypass(_config())  # decoupled mode is fine
    v1.check_bypass(_config(estimator="grpo", bypass=True))  # GRPO needs no Σπ²


# --------------------------------------------------------------------------- figures
def test_staleness_histogram_counts_samples_per_lag():
    tags = [
        {"min_global_steps": 3, "max_global_steps": 4},  # lag 0 at step 5
        {"min_global_steps": 3, "max_global_steps": 3},  # lag 1
        {"min_global_steps": 2, "max_global_steps": 3},  # lag 1, worst lag 2
        {"min_global_steps": 2, "max_global_steps": 2},  # lag 2
        {"min_global_steps": 0, "max_global_steps": 0, "is_padding": True},  # ignored
    ]
    m = v1.staleness_metrics(tags, global_steps=5)
    assert (m["staleness/lag_0"], m["staleness/lag_1"], m["staleness/lag_2"]) == (1.0, 2.0, 1.0)
    assert m["staleness/max"] == 2.0 and m["staleness/mean"] == pytest.approx(1.0)
    assert m["staleness/worst_max"] == 2.0 and m["staleness/stale_frac"] == 0.75 and m["staleness/samples"] == 4
    assert v1.staleness_metrics([], 3) == {}


def test_rollout_actor_probability_difference_per_lag_by_brute_force():
    tags = [
        {"min_global_steps": 4, "max_global_steps": 4},  # lag 0 at step 5: all of it from the actor's weights
        {"min_global_steps": 3, "max_global_steps": 4},  # begun before a sync, finished after: lag 1
        {"min_global_steps": 4, "max_global_steps": 4},  # lag 0
        {"min_global_steps": 0, "max_global_steps": 0, "is_padding": True},  # ignored
    ]
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=g)
    rollout = -torch.rand(4, 5, generator=g)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    m = v1.prob_diff_by_lag(tags, 5, old, rollout, mask)
    for lag, rows in ((0, (0, 2)), (1, (1,))):
        diffs = [abs(math.exp(rollout[i, t]) - math.exp(old[i, t])) for i in rows for t in range(5) if mask[i, t]]
        assert m[f"sync/tokens_lag_{lag}"] == len(diffs)
        assert m[f"sync/prob_diff_mean_lag_{lag}"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-6)
    assert set(m) == {
        "sync/tokens_lag_0",
        "sync/tokens_lag_1",
        "sync/prob_diff_mean_lag_0",
        "sync/prob_diff_mean_lag_1",
    }
    assert v1.prob_diff_by_lag([{"min_global_steps": 0, "is_padding": True}], 1, old[:1], rollout[:1], mask[:1]) == {}


def test_is_weight_stats_without_weights_says_not_applied():
    old = torch.tensor([[-1.0, -0.1, 0.0]])
    rollout = torch.tensor([[-2.0, -0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    m = v1.is_weight_stats(old, rollout, mask, None)
    assert m["is/applied"] == 0.0 and m["is/ratio_max"] == pytest.approx(np.e)
    w = torch.tensor([[2.0, 1.0, 0.0]])
    m = v1.is_weight_stats(old, rollout, mask, w)
    assert m["is/applied"] == 1.0 and m["is/truncated_frac"] == 0.5 and m["is/weight_max"] == 2.0


# --------------------------------------------------------------------------- the glue table
def test_the_glue_table_in_docs_is_the_declared_one(tmp_path):
    from otb_tir.verl.glue import write_docs

    page = REPO / "docs" / "verl.md"
    copy = tmp_path / "verl.md"
    copy.write_text(page.read_text())
    assert write_docs(str(copy)) == page.read_text(), "docs/verl.md is stale: python -m otb_tir.verl.glue"


def test_every_patch_in_the_code_has_its_row():
    from otb_tir.verl import cpu
    from otb_tir.verl.glue import GLUE, patch_ids

    ids = {g.id for g in GLUE}
    assert set(cpu.PATCHES) <= ids  # each CPU patch apply() can install
    assert {"legacy_phase_timer", "legacy_contract", "legacy_metrics", "v1_advantage_inputs"} <= patch_ids()
    # every source file that assigns over a verl attribute is one the table names
    named = {g.where.split(".")[2] if g.where.startswith("otb_tir.verl.") else g.where for g in GLUE}
    for path in (REPO / "otb_tir" / "verl").glob("*.py"):
        text = path.read_text()
        patches = any(
            s in text for s in ("rt.compute_advantage =", ".log = log", "compute_advantage_for_multi_trajectories =")
        )
        if patches:
            assert path.stem in named, path
    assert all(g.why and g.upstream and g.kind in ("extension point", "patch", "config", "environment") for g in GLUE)


def test_the_recipe_files_hold_every_step_once_across_kills_and_resumes(tmp_path):
    """``metrics.jsonl`` of a verl run: a step's row logged before its checkpoint is replaced by the full
    one; a resumed run (restarting after checkpoint k) drops the killed run's rows past k, and the
    validation verl repeats at step k before its loop is not logged twice."""
    import json as _json

    from otb_tir.verl.v1_record import RecipeRun

    def steps():
        rows = [_json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r.get("kind")) for r in rows]

    run = RecipeRun(str(tmp_path), ["jsonl"], resume=False)
    run.log({"kind": 0.0}, 0, before_fit=True)  # held-out before
    for step in (1, 2, 3):
        run.log({"kind": 1.0}, step, provisional=True)  # logged before the checkpoint
        run.log({"kind": 2.0}, step)  # the full row
    assert steps() == [(0, 0.0), (1, 2.0), (2, 2.0), (3, 2.0)]
    # killed after checkpoint 2 (step 3 had been logged): resumed at 3, verl validates at 2 first
    run = RecipeRun(str(tmp_path), ["jsonl"], resume=True)
    run.log({"kind": 0.0}, 2, before_fit=True)
    run.log({"kind": 2.0}, 3)
    run.log({"kind": 2.0}, 4)
    assert steps() == [(0, 0.0), (1, 2.0), (2, 2.0), (3, 2.0), (4, 2.0)]
    # killed between checkpoint 4 and step 4's full row: only the early row exists; no validation first
    run = RecipeRun(str(tmp_path), ["jsonl"], resume=True)
    run.log({"kind": 2.0}, 5)
    assert [s for s, _ in steps()] == [0, 1, 2, 3, 4, 5]


def test_the_row_before_a_checkpoint_is_off_verls_timers_and_moe_counts_and_in_tensorboard_once(tmp_path):
    """The early row (``_save_checkpoint``) runs inside verl's `save_checkpoint` and `step` timers: the
    full row gets them without its time; it counts the MoE routed experts on a copy of verl's real
    accumulator (verl's row counts them once); TensorBoard gets one point for the step, the full row's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from verl.trainer.ppo.metric_utils import RolloutMoELoadBalanceMetricsAccumulator

    from otb_tir.verl.v1_record import RecipeRun

    routed = torch.zeros(2, 3, 1, 2, dtype=torch.long)  # [batch, seq, layers, top-k]
    once = RolloutMoELoadBalanceMetricsAccumulator()
    once.update(routed, torch.ones(2, 3), num_experts=2)  # what one step's counts add up to
    seen = []

    class Base:  # stands for verl's PPOTrainer: its _compute_metrics feeds the accumulator, as verl's does
        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            self._rollout_moe_lb_metrics_accumulator.update(routed, torch.ones(2, 3), num_experts=2)
            seen.append(dict(timing_raw))
            metrics.update({"timing_s/save_checkpoint": timing_raw.get("save_checkpoint", 0.0)})
            metrics["reward/mean"] = float(len(seen))

        def _save_checkpoint(self):
            pass

    class Trainer(v1.OTBTrainerMixin, Base):
        pass

    batch = _Meta(["a", "b"])
    batch.tags = [{"min_global_steps": 0, "max_global_steps": 0}] * 2
    t = object.__new__(Trainer)
    t._otb_run = RecipeRun(str(tmp_path), ["jsonl", "tensorboard"], resume=False)
    t._otb_rollout_log_probs = t._otb_spi2 = False
    t._otb_batch_metrics = lambda *a: {}  # reads TransferQueue: not what this test is about
    t._rollout_moe_lb_metrics_accumulator = RolloutMoELoadBalanceMetricsAccumulator()
    t.global_steps, t.steps_per_epoch = 1, 1
    timing_raw = {"gen": 1.0}
    t._otb_clock = {"step_begin": 0.0}
    t._otb_pending = (batch, {}, timing_raw)
    t._save_checkpoint()  # the early row
    # verl's timers close around it; then verl's own row ("5. record metrics")
    timing_raw.update(save_checkpoint=100.0, step=200.0)
    t._compute_metrics(batch, {}, timing_raw, 1, 0)
    t._otb_run.sink.close()
    spent = t._otb_clock["provisional_row"]
    assert spent > 0
    assert seen[-1]["save_checkpoint"] == 100.0 - spent
    assert seen[-1]["step"] == 200.0 - spent
    assert once.total_assignments() > 0
    assert t._rollout_moe_lb_metrics_accumulator.total_assignments() == once.total_assignments()  # not twice
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 2.0)]
    assert "row/provisional" not in acc.Tags()["scalars"]
