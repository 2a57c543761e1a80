"""The local trainer on the real tiny model, real episodes and the real calculator.

A shaped reward (more distinct tokens score higher) guarantees a learning signal from a random policy,
so these tests check that a step moves the weights the way the advantages say, that every
estimator runs through the loop, and that a SIGKILLed run resumes without losing a step.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agent_env.math_task.data import make_split
from otb_tir.builders import build_tools
from otb_tir.trainer.config import FilterConfig, load_config
from otb_tir.trainer.distributed import DistInfo
from otb_tir.trainer.parts import build_parts, trainer_settings
from otb_tir.trainer.step import filter_loss_mask
from otb_tir.trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]

SMALL = [
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=4",
    "rollout.response_length=48",
    "rollout.max_tokens_per_turn=24",
    "multi_turn.max_assistant_turns=2",
    "multi_turn.tools=[calculator]",
    "multi_turn.tool_timeout=60",
    "data.train_size=16",
    "data.val_size=4",
    "eval.size=4",
    "trainer.loggers=[jsonl]",
    "actor.optim.lr=1e-2",
]


def _length_reward(text, ground_truth, traj):
    # varies between samples of one prompt even for a random policy (distinct tokens written)
    return len(set(traj.response_ids)) / 48.0


def _trainer(tmp_path, tiny_model_dir, overrides=()):
    """The run's trainer, built from its parts (the tiny policy, the shaped reward)."""
    cfg = load_config(None, SMALL + [f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}", *overrides])
    parts = build_parts(cfg, build_tools(cfg), DistInfo(), torch.device("cpu"), reward_fn=_length_reward)
    return Trainer(trainer_settings(cfg), parts)


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["tir_optimal_token_baseline", "optimal_token_baseline", "grpo", "rloo"])
def test_one_step_updates_policy_for_every_estimator(tmp_path, tiny_model_dir, estimator):
    tr = _trainer(tmp_path, tiny_model_dir, [f"algorithm.adv_estimator={estimator}"])
    before = {k: v.detach().clone() for k, v in tr.model.named_parameters()}
    res = tr.train_step()
    m = res.metrics
    batch = res.batch
    assert batch["responses"].shape == (8, 48)
    # rewards differ within groups → non-zero advantages only on policy tokens, a real gradient
    assert m["advantages/std"] > 0 and m["actor/grad_norm"] > 0
    assert torch.all(batch["response_mask"].sum(1) > 0)
    changed = sum(not torch.equal(before[k], v) for k, v in tr.model.named_parameters())
    assert changed > 0
    for key in (
        "reward/mean",
        "tools/call_rate",
        "episode/turns_mean",
        "variance_proxy/proxy2_total_power",
        "timing/rollout_s",
        "timing/update_s",
        "actor/clip_frac",
    ):
        assert key in m and m[key] == m[key], key  # present and not NaN
    asyncio_close(tr)


def asyncio_close(tr):
    from agent_env.rollout import run_sync

    run_sync(tr.engine.close())  # on the trainer's persistent loop, where its rollouts ran
    run_sync(tr.env.tools.close())  # the run's tool set (build_parts does not own it)


@pytest.mark.slow
def test_step_raises_logprob_of_positive_advantage_trajectories(tmp_path, tiny_model_dir):
    """After one PPO step, the policy's log-prob moves in the direction of each row's advantage."""
    from otb_tir.trainer.actor import compute_old_stats

    tr = _trainer(tmp_path, tiny_model_dir, ["actor.optim.lr=3e-3"])
    res = tr.train_step()
    t = dict(res.batch.tensors)
    new = compute_old_stats(tr.model, t, tr.settings.actor).log_probs
    mask = t["response_mask"].float()
    # re-derive the advantages the step used and the old log-probs it saw
    stats_before = res.batch.tensors  # rollout log-probs are the pre-update policy's (shared weights)
    delta = ((new - stats_before["rollout_log_probs"]) * mask).sum(1)
    adv_row = torch.tensor([tr_row for tr_row in _row_adv(res)])
    pos, neg = adv_row > 0, adv_row < 0
    assert pos.any() and neg.any()
    assert delta[pos].mean() > delta[neg].mean()
    asyncio_close(tr)


@pytest.mark.slow
@pytest.mark.parametrize("micro", [8, 4])
def test_on_policy_step_takes_old_stats_from_the_update_forward(tmp_path, tiny_model_dir, micro):
    """SMALL's step is exactly on-policy (one epoch, one mini-batch of 8 rows, 2 groups of 4): in one
    micro-batch, or in two of one whole group each (TIR-OTB is group-local), by default it skips the
    old-log-prob pass and gives the update the trainer makes with the pass
    (actor.reuse_update_forward=false), on the same episodes."""
    runs = {}
    for reuse in ("true", "false"):
        over = [f"actor.reuse_update_forward={reuse}", f"actor.ppo_micro_batch_size={micro}"]
        tr = _trainer(tmp_path / reuse, tiny_model_dir, over)
        res = tr.train_step()
        weights = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
        runs[reuse] = (res, weights)
        asyncio_close(tr)
    (one, w_one), (two, w_two) = runs["true"], runs["false"]
    assert one.metrics["actor/one_forward"] == 1.0 and two.metrics["actor/one_forward"] == 0.0
    assert one.metrics["actor/one_forward_micro_batches"] == 8 // micro
    assert one.metrics["timing/old_log_prob_s"] == 0.0 and two.metrics["timing/old_log_prob_s"] > 0
    assert one.metrics["timing/advantage_s"] > 0 and one.metrics["timing/update_s"] > 0
    assert [t.response_ids for t in one.batch.trajectories] == [t.response_ids for t in two.batch.trajectories]
    assert one.metrics["advantages/std"] > 0
    for key in ("advantages/std", "actor/pg_loss", "actor/grad_norm", "variance_proxy/proxy2_total_power"):
        assert one.metrics[key] == pytest.approx(two.metrics[key], rel=1e-4, abs=1e-7), key
    # AdamW's first step moves a weight by about lr = 1e-2 whatever its gradient's size: where a gradient
    # is ~0, the float order of the two paths' sums (the two-pass update permutes the rows) shows up to
    # 1e-3 of a step; an update that differed would differ by whole steps
    torch.testing.assert_close(w_one, w_two, rtol=0, atol=1e-4)


def _row_adv(res):
    rewards = torch.tensor([t.reward for t in res.batch.trajectories])
    uid = res.batch["uid"]
    out = []
    for i, u in enumerate(uid):
        grp = [j for j, v in enumerate(uid) if v == u]
        out.append(float(rewards[i] - rewards[grp].mean()))
    return out


def test_filters_mask_whole_trajectories(tmp_path, tiny_model_dir):
    tr = _trainer(tmp_path, tiny_model_dir)
    batch = tr._rollout(make_split("train", 2), 3, seed=1)
    filters = FilterConfig(all_equal_reward_groups=True, overlong=True)
    for t in batch.trajectories[:3]:
        t.reward = 0.5  # first group: flat rewards
    mask, m = filter_loss_mask(batch, filters)
    assert torch.all(mask[:3] == 0)
    for i, t in enumerate(batch.trajectories[3:], start=3):
        expect_kept = t.finish_reason not in ("length", "turn_length", "tool_overflow")
        kept_group = len({x.reward for x in batch.trajectories[3:]}) > 1
        assert bool(mask[i].sum() > 0) == (expect_kept and kept_group and sum(t.response_mask) > 0)
    assert 0 <= m <= 1
    asyncio_close(tr)


def test_void_turn_filter_masks_exactly_the_rows_with_a_void_turn(tmp_path, tiny_model_dir):
    """`algorithm.filter.void_turns` (SimpleTIR) zeroes the loss mask of every trajectory with a
    void turn and leaves every other row bit-identical; off, it changes nothing."""
    import random

    tr = _trainer(tmp_path, tiny_model_dir)
    batch = tr._rollout(make_split("train", 4), 4, seed=3)
    off = FilterConfig()
    on = trainer_settings(load_config(None, ["algorithm.filter.void_turns=true"])).filters
    assert on == FilterConfig(void_turns=True)
    base, m_off = filter_loss_mask(batch, off)
    assert torch.equal(base, batch["response_mask"].float()) and m_off == 1.0
    rng = random.Random(0)
    # the real episodes' void turns, then random assignments (rows with and without a void turn)
    for trial in range(6):
        if trial:
            for t in batch.trajectories:
                t.void_turns = rng.choice([0, 0, 1, 2])
        void = torch.tensor([t.void_turns > 0 for t in batch.trajectories])
        if trial:
            assert void.any() and (~void).any()
        mask, m = filter_loss_mask(batch, on)
        assert torch.all(mask[void] == 0)
        assert torch.equal(mask[~void], base[~void])
        assert m == pytest.approx(float((~void).float().mean()))
        assert torch.equal(filter_loss_mask(batch, off)[0], base)  # off: the void turns are ignored
    asyncio_close(tr)


def recipe_args(tiny_model_dir, out, *extra) -> list[str]:
    """The recipe's command line for SMALL's run into ``out``, without held-out passes."""
    return [
        sys.executable,
        str(ROOT / "recipes/train_tir_math.py"),
        "--model",
        str(tiny_model_dir),
        *SMALL,
        f"trainer.output_dir={out}",
        "trainer.save_every=1",
        "eval.before=false",
        "eval.after=false",
        *extra,
    ]


def kill_at_first_checkpoint(args, out, cwd=None) -> None:
    """Run ``args``, SIGKILL it as soon as its step-1 checkpoint is on disk."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
    deadline = time.time() + 600
    while not (out / "checkpoints" / "step_1" / "state.pt").exists():
        assert proc.poll() is None, "training exited before its first checkpoint"
        assert time.time() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_sigkill_then_resume_loses_no_step(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    args = recipe_args(tiny_model_dir, out, "trainer.total_steps=3")
    kill_at_first_checkpoint(args, out)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(args + ["--resume"], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (out / "checkpoints" / "step_3" / "state.pt").is_file()
    assert (out / "summary.json").is_file()


@pytest.mark.slow
def test_fit_attributes_every_phase_of_a_step(tmp_path, tiny_model_dir):
    """Each row names the disjoint phases of its step; the rollout's five parts add up to the
    rollout, the step's parts to the step, and the run totals to the rows (plus log/checkpoint)."""
    from otb_tir.trainer.timing import AFTER_ROW_PHASES, STEP_PHASES, step_time_summary

    tr = _trainer(tmp_path, tiny_model_dir, ["trainer.total_steps=2", "trainer.save_every=1"])
    rows = tr.fit(progress=False)
    assert len(rows) == 2
    rollout_parts = STEP_PHASES[:5]
    for m in rows:
        for key in STEP_PHASES + ("timing/prev_log_s", "timing/prev_checkpoint_s"):
            assert key in m and m[key] >= 0.0, key
        assert sum(m[k] for k in rollout_parts) == pytest.approx(m["timing/rollout_s"], abs=1e-6)
        assert m["timing/gen_s"] > 0  # the tiny model generated every turn of this step
        inner = [k for k in STEP_PHASES if k not in rollout_parts and k != "timing/eval_s"]
        assert sum(m[k] for k in inner) + m["timing/rollout_s"] == pytest.approx(m["timing/step_s"], abs=1e-6)
        assert 0.0 <= m["perf/pad_frac"] < 1.0 and m["perf/update_tokens_per_s"] > 0
        assert m["perf/process_cpu_s"] > 0  # this process's CPU seconds over the step (all its threads)
        # the peak resident set after each phase: monotone through the step, never below the resident set
        peaks = [m[f"memory/peak_rss_gib/{p}"] for p in ("rollout", "advantage", "update", "metrics")]
        assert peaks == sorted(peaks) and peaks[0] > 0.05
        assert all(m[f"memory/rss_gib/{p}"] <= m[f"memory/peak_rss_gib/{p}"] for p in ("rollout", "update"))
        # the padding share is of the columns the update's forward ran (its own count), not of the batch;
        # a group's prompt ran once (rollout.n samples share it): fewer real columns than the batch's tokens
        real = m["perf/update_tokens_per_s"] * m["timing/update_s"]
        ran_real = m["actor/forward_real_tokens"]
        assert m["perf/pad_frac"] == pytest.approx(1.0 - ran_real / m["actor/forward_tokens"], rel=1e-6)
        assert m["perf/shared_prompt_frac"] == pytest.approx(1.0 - ran_real / real, rel=1e-6)
        assert 0.0 < m["perf/shared_prompt_frac"] < 1.0
        # the HF engine shares the actor's weights: its log-probs are the actor's up to batching noise
        assert m["training/rollout_probs_diff_valid"] == 1.0 and m["training/rollout_probs_diff_max"] < 1e-4
    # step 1's checkpoint was written after its row: its seconds are in row 2
    assert rows[0]["timing/prev_checkpoint_s"] == 0.0 and rows[1]["timing/prev_checkpoint_s"] > 0
    for key in STEP_PHASES:
        assert tr.timing_totals[key] == pytest.approx(sum(m[key] for m in rows))
    assert set(AFTER_ROW_PHASES) <= set(tr.timing_totals) and tr.timing_totals["timing/checkpoint_s"] > 0
    s = step_time_summary(tr.timing_totals, fit_s=sum(tr.timing_totals.values()) + 1.0)
    assert s["unattributed_s"] == pytest.approx(1.0) and set(s["phases_s"]) >= {"gen", "update", "checkpoint"}
    asyncio_close(tr)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padding_trim_gives_the_untrimmed_stats_and_gradients(tiny_model_factory, seed):
    """The actor's forward on the micro-batch's used columns equals the full padded forward:
    same log-prob, entropy and Σπ² on every response token (0 beyond the trimmed end), and the
    same gradient of a loss on them."""
    from otb_tir.token_stats import token_stats_for_causal_lm
    from otb_tir.trainer.actor import ActorSettings, _stats, trim_padding

    g = torch.Generator().manual_seed(seed)
    P, R, b = 12, 20, 5
    plen = torch.randint(1, P + 1, (b,), generator=g)
    rlen = torch.randint(0, R - 4, (b,), generator=g)  # the last 4+ response columns are all padding
    plen[0] = P - 3  # and the first 3 prompt columns too
    plen[1:] = torch.clamp(plen[1:], max=P - 3)
    ids = torch.randint(3, 500, (b, P + R), generator=g)
    attn = torch.zeros(b, P + R, dtype=torch.long)
    for i in range(b):
        attn[i, P - plen[i] : P + rlen[i]] = 1
    ids = ids * attn  # pad id 0
    pos = torch.clamp(torch.cumsum(attn, 1) - 1, min=0)
    batch = {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "responses": ids[:, P:]}
    lo, hi = trim_padding(attn, R)
    assert lo == 3 and hi == P + int(rlen.max())
    model = tiny_model_factory()
    s = ActorSettings()
    rows = slice(0, b)
    trimmed = _stats(model, batch, rows, s, grad=True)
    full = token_stats_for_causal_lm(model, ids, attn, pos, response_length=R)
    rmask = attn[:, P:].bool()
    for a, f in zip(trimmed, full):
        assert a.shape == (b, R)
        torch.testing.assert_close(a[rmask], f[rmask], atol=2e-5, rtol=1e-5)
        assert torch.all(a[:, hi - P :] == 0)
    params = [p for p in model.parameters() if p.requires_grad]
    ga = torch.autograd.grad((trimmed.log_probs * rmask).sum(), params)
    gf = torch.autograd.grad((full.log_probs * rmask).sum(), params)
    for x, y in zip(ga, gf):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_grad_clip_zero_is_off_and_the_weights_move(tmp_path, tiny_model_dir):
    """``actor.grad_clip=0`` is documented "off": the step must move the weights by the unclipped
    gradient (clip_grad_norm_(…, 0) once scaled every gradient by 0 while grad_norm looked normal)."""
    tr = _trainer(tmp_path, tiny_model_dir, ["actor.grad_clip=0"])
    before = torch.cat([p.detach().flatten().clone() for p in tr.model.parameters()])
    m = tr.train_step().metrics
    after = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
    assert m["actor/grad_norm"] > 0
    # AdamW's first step moves a weight with a gradient by ~lr = 1e-2
    assert (after - before).abs().max() > 1e-3
    asyncio_close(tr)


@pytest.mark.slow
def test_rollout_is_weights_reach_the_loss_and_lr_is_the_rate_used(tmp_path, tiny_model_dir, monkeypatch):
    """``algorithm.rollout_is=true`` on the local trainer: the truncated IS weights π_old/π_rollout
    multiply the loss's per-token surrogate (pg_loss checked by hand), and ``actor/lr`` is the rate
    the optimizer stepped with (the scheduler's warmup moves it after the step)."""
    from otb_tir.trainer import actor as actor_mod
    from otb_tir.trainer.ppo import truncated_is_weights

    tr = _trainer(tmp_path, tiny_model_dir, ["algorithm.rollout_is=true", "actor.optim.warmup_steps=4"])
    seen, used_lr = [], []
    real_loss, real_step = actor_mod.ppo_policy_loss, tr.optimizer.step

    def loss_spy(*args, **kw):
        seen.append((args, kw))
        return real_loss(*args, **kw)

    def step_spy(*a, **k):
        used_lr.append(tr.optimizer.param_groups[0]["lr"])
        return real_step(*a, **k)

    monkeypatch.setattr(actor_mod, "ppo_policy_loss", loss_spy)
    monkeypatch.setattr(tr.optimizer, "step", step_spy)
    real_rollout = tr._rollout

    def skewed_rollout(*a, **k):  # rollout log-probs off by up to ±0.5: IS weights well away from 1
        b = real_rollout(*a, **k)
        t = b.tensors
        noise = torch.rand(t["rollout_log_probs"].shape, generator=torch.Generator().manual_seed(3)) - 0.5
        t["rollout_log_probs"] = t["rollout_log_probs"] + noise * t["response_mask"].float()
        return b

    tr._rollout = skewed_rollout
    m = tr.train_step().metrics
    assert len(seen) == 1 and len(used_lr) == 1  # SMALL's step is one forward, one optimizer step
    (_log_probs, old, adv, loss_mask), kw = seen[0][0], seen[0][1]
    b = tr.batch.tensors
    mask = b["response_mask"].float()
    want_w = truncated_is_weights(old, b["rollout_log_probs"], mask, tr.settings.rollout_is_threshold)
    assert kw.get("rollout_is_weights") is not None, "the IS weights never reached the loss"
    torch.testing.assert_close(kw["rollout_is_weights"], want_w)
    assert (want_w[mask.bool()] - 1).abs().max() > 0.1
    # on-policy (ratio 1): pg_loss = −Σ adv·w / Σ mask over the loss mask
    by_hand = float(-(adv * want_w * loss_mask).sum() / loss_mask.sum())
    unweighted = float(-(adv * loss_mask).sum() / loss_mask.sum())
    assert m["actor/pg_loss"] == pytest.approx(by_hand, rel=1e-4, abs=1e-7)
    assert abs(by_hand - unweighted) > 1e-4
    # warmup of 4: the first step's rate is lr/4, the next step's lr/2
    assert used_lr[0] == pytest.approx(1e-2 / 4)
    assert m["actor/lr"] == pytest.approx(used_lr[0])
    asyncio_close(tr)


@pytest.mark.slow
def test_gradient_checkpointing_keeps_fewer_activations_and_gives_the_same_update(tmp_path, tiny_model_dir):
    """model.enable_gradient_checkpointing=true: the update's forwards keep for the backward only what
    lies outside the decoder layers (the bytes autograd saves, counted by a saved-tensors hook around
    the step: the layers' own checkpoint hooks take theirs, to recompute them), and the step's update
    is the one without it, on the same episodes."""
    runs = {}
    for on in ("false", "true"):
        tr = _trainer(tmp_path / on, tiny_model_dir, [f"model.enable_gradient_checkpointing={on}"])
        saved = [0]

        def pack(t, saved=saved):
            saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            res = tr.train_step()
        weights = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
        runs[on] = (res, weights, saved[0], tr.model.is_gradient_checkpointing)
        asyncio_close(tr)
    (off, w_off, b_off, g_off), (on_, w_on, b_on, g_on) = runs["false"], runs["true"]
    assert g_on and not g_off
    assert [t.response_ids for t in off.batch.trajectories] == [t.response_ids for t in on_.batch.trajectories]
    assert b_off > 0 and b_on < 0.5 * b_off, (b_on, b_off)
    assert off.metrics["actor/pg_loss"] == pytest.approx(on_.metrics["actor/pg_loss"], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(w_on, w_off, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_bfloat16_rollout_engine_keeps_its_own_copy_in_step_with_the_actor(tmp_path, tiny_model_dir):
    """rollout.dtype=bfloat16: the engine samples from a bfloat16 copy of the float32 actor, refreshed
    after every update (its weights are the actor's rounded to bfloat16 after each step); its log-probs
    are within the stated tolerance of the actor's float32 ones on the same tokens (probabilities: mean
    gap < 0.02, correlation > 0.99; the float32 engine's gap is ~1e-7), and the actor stays float32."""
    tr = _trainer(tmp_path / "bf16", tiny_model_dir, ["rollout.dtype=bfloat16", "trainer.total_steps=2"])
    assert tr.engine.model is not tr.model and next(tr.engine.model.parameters()).dtype == torch.bfloat16
    assert next(tr.model.parameters()).dtype == torch.float32
    for _ in range(2):
        res = tr.train_step()
        tr.step += 1
        m = res.metrics
        assert 0 < m["training/rollout_probs_diff_mean"] < 0.02, m["training/rollout_probs_diff_mean"]
        assert m["training/rollout_actor_probs_pearson_corr"] > 0.99
        actor = dict(tr.model.named_parameters())
        for name, p in tr.engine.model.named_parameters():  # the update's weights went in, rounded
            assert torch.equal(p, actor[name].detach().to(torch.bfloat16)), name
    asyncio_close(tr)
    fp32 = _trainer(tmp_path / "fp32", tiny_model_dir, [])
    assert fp32.engine.model is fp32.model  # float32: the engine shares the actor's weights
    assert fp32.train_step().metrics["training/rollout_probs_diff_mean"] < 1e-4
    asyncio_close(fp32)
