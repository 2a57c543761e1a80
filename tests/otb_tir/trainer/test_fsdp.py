"""The local trainer under torchrun with FSDP2, for real: 2 ranks on CPU/gloo, the tiny Qwen3 policy,
real episodes with the calculator tool, a shaped reward so every step moves the weights.

Runs once (module fixture; every process start costs ~10 s of CPU in imports, so only two launches):
  S  one process (in this process), 2 steps        (the reference)
  B  torchrun --nproc_per_node 2 (subprocess): every rank SIGKILLs itself right after the step-1
     checkpoint; then the same command with trainer.resume=true runs step 2.
Step 1 of B is the uninterrupted FSDP step; step 2 is the resumed one.
Micro-batches of one trajectory, so each rank accumulates gradients over several micro-batches
(FSDP's gradient sync only on the last) and the token-mean's denominator must be the global one.
One PPO mini-batch per step: the 2-rank step then uses exactly the rows of the one-process step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otb_tir.trainer.distributed import shard_items, shard_range

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).resolve().parents[2] / "support" / "fsdp_worker.py"
LR = 1e-2
SMALL = [
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    "rollout.response_length=24",
    "rollout.max_tokens_per_turn=12",
    "multi_turn.max_assistant_turns=2",
    "multi_turn.tools=[calculator]",
    "multi_turn.tool_timeout=60",
    "data.train_size=16",
    "eval.size=3",
    "trainer.loggers=[jsonl]",
    f"actor.optim.lr={LR}",
    "actor.ppo_micro_batch_size=1",
    "trainer.total_steps=2",
    "trainer.save_every=1",
    "trainer.keep_checkpoints=3",
    "trainer.device=cpu",
    "actor.grad_clip=1e9",
]  # no clipping: the gradient's scale reaches the weights


# ---------------------------------------------------------------------------------- unit tests


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), world=st.integers(1, 9))
def test_shard_range_tiles_in_rank_order(n, world):
    ranges = [shard_range(n, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, rank order
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_shard_range_rejects_bad_rank():
    from otb_tir import ConfigError

    with pytest.raises(ConfigError, match="rank 2"):
        shard_range(4, 2, 2)


@settings(max_examples=25, deadline=None)
@given(
    groups=st.integers(1, 6),
    n=st.integers(1, 4),
    world=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 10_000),
    estimator=st.sampled_from(["tir_optimal_token_baseline", "optimal_token_baseline", "grpo", "rloo"]),
)
def test_advantages_of_rank_blocks_equal_the_whole_batch(groups, n, world, seed, estimator):
    """Each rank's rows (whole uid groups, as the trainer splits prompts) give exactly the
    advantages the one-process batch gives those rows: group baselines never need other ranks."""
    from otb_tir.advantage import get_estimator

    bs = groups * world  # the trainer requires train_batch_size % world == 0
    g = torch.Generator().manual_seed(seed)
    rows, R = bs * n, 7
    mask = (torch.rand(rows, R, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    rewards = torch.zeros(rows, R)
    last = (mask * torch.arange(R)).argmax(1)
    rewards[torch.arange(rows), last] = torch.randint(0, 3, (rows,), generator=g).float()
    logp = -torch.rand(rows, R, generator=g) * 3 * mask
    spp = torch.rand(rows, R, generator=g) * mask
    uid = np.array([f"u{i // n}" for i in range(rows)], dtype=object)
    est = get_estimator(estimator)
    kw = dict(handle_zero_tail=True, norm_adv_by_std_in_grpo=True)
    whole, _ = est(
        token_level_rewards=rewards, response_mask=mask, index=uid, old_log_probs=logp, sum_pi_squared=spp, **kw
    )
    parts = []
    for r in range(world):
        _, offset = shard_items(list(range(bs)), r, world)
        k = len(shard_items(list(range(bs)), r, world)[0])
        sl = slice(offset * n, (offset + k) * n)
        adv, _ = est(
            token_level_rewards=rewards[sl],
            response_mask=mask[sl],
            index=uid[sl],
            old_log_probs=logp[sl],
            sum_pi_squared=spp[sl],
            **kw,
        )
        parts.append(adv)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-6)


def test_rank_blocks_roll_out_the_same_episodes_as_one_process(tmp_path, tiny_model_dir):
    """Trainer._rollout of each rank's block (shard_items, offset) gives the uids and sampled
    tokens of a one-process rollout of the whole batch: every uid group on exactly one rank."""
    import dataclasses

    from agent_env.math_task.data import make_split
    from agent_env.rollout import run_sync
    from otb_tir.builders import build_tools
    from otb_tir.trainer.config import load_config
    from otb_tir.trainer.distributed import DistInfo
    from otb_tir.trainer.parts import build_parts, trainer_settings
    from otb_tir.trainer.trainer import Trainer

    cfg = load_config(
        None, SMALL + ["data.train_batch_size=4", f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}"]
    )
    tools = build_tools(cfg)
    parts = build_parts(cfg, tools, DistInfo(), torch.device("cpu"))
    items = make_split("train", 4)
    world = 2
    # the same parts seen from each rank of two (no process group: _rollout needs none)
    trainers = [
        Trainer(trainer_settings(cfg), dataclasses.replace(parts, info=DistInfo(r, world))) for r in range(world)
    ]
    try:
        whole = trainers[0]._rollout(items, 2, seed=123)  # what one process rolls out (rank 0 of 1 would)
        blocks = []
        for r, tr in enumerate(trainers):
            mine, offset = shard_items(items, r, world)
            blocks += tr._rollout(mine, 2, seed=123, offset=offset).trajectories
        assert [t.uid for t in blocks] == [t.uid for t in whole.trajectories]
        assert [t.response_ids for t in blocks] == [t.response_ids for t in whole.trajectories]
        assert len({t.uid for t in whole.trajectories}) == 4
        # a uid's samples all come from one rank's block
        per_rank = [{t.uid for t in tr_trajs} for tr_trajs in (blocks[:4], blocks[4:])]
        assert not (per_rank[0] & per_rank[1])
    finally:
        run_sync(parts.engine.close())  # the trainers' persistent loop
        run_sync(tools.close())


def _two_pass_update(tiny_model_factory, batch: dict, micro: int):
    """compute_old_stats, then ppo_update of fixed random advantages as one mini-batch in
    micro-batches of ``micro`` rows (SGD, lr 0.1), on a fresh tiny model: (old stats as a dict,
    metrics, weights)."""
    from otb_tir.trainer.actor import ActorSettings, compute_old_stats, ppo_update
    from otb_tir.trainer.ppo import Advantages

    torch.manual_seed(0)
    model = tiny_model_factory()
    s = ActorSettings(ppo_micro_batch_size=micro)
    old = compute_old_stats(model, batch, s)
    mask = batch["response_mask"]
    adv = Advantages(torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask, mask)
    rows = [torch.arange(batch["responses"].shape[0])]
    m = ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, old, adv, rows, s)
    t = {"old_log_probs": old.log_probs, "entropy": old.entropy, "sum_pi_squared": old.sum_pi_squared}
    return t, m, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_loss_terms_do_not_depend_on_the_micro_batch_size(tiny_model_factory):
    """Gradient accumulation: one mini-batch in 1 or 4 micro-batches gives the same update and the
    same (token-mean) loss, entropy and grad-norm metrics."""

    g = torch.Generator().manual_seed(0)
    B, P, R = 4, 6, 10
    ids = torch.randint(5, 1500, (B, P + R), generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(P + R).expand(B, -1),
        "responses": ids[:, P:],
        "response_mask": (torch.rand(B, R, generator=g) > 0.2).float(),
    }
    out = {micro: _two_pass_update(tiny_model_factory, batch, micro)[1:] for micro in (1, 4)}
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert out[1][0][k] == pytest.approx(out[4][0][k], rel=1e-5, abs=1e-7), k
    assert out[1][0]["actor/entropy"] > 1.0  # a token-mean entropy, not divided by the micro-batch count
    torch.testing.assert_close(out[1][1], out[4][1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("micro", [6, 3, 4])
def test_one_forward_update_equals_the_two_pass_update(tiny_model_factory, micro):
    """on_policy_update (old statistics from the update's own forwards, the advantages of each
    micro-batch's whole groups computed on its forward) against the oracle, the two passes it
    replaces: compute_old_stats, the TIR-OTB advantages of the whole batch on them, then ppo_update
    on one mini-batch. Micro-batches of 6 rows (all), 3 (one group each) and 4 (one group each: two
    groups of 3 do not fit): the same old log-probs, Σπ² and advantages, the same update and metrics."""
    from otb_tir.advantage import get_estimator
    from otb_tir.trainer.actor import (
        ActorSettings,
        compute_old_stats,
        on_policy_micro_batches,
        on_policy_update,
        ppo_update,
    )
    from otb_tir.trainer.ppo import Advantages

    g = torch.Generator().manual_seed(0)
    B, P, R = 6, 5, 12
    ids = torch.randint(5, 1500, (B, P + R), generator=g)
    mask = (torch.rand(B, R, generator=g) > 0.3).float()
    rewards = torch.zeros(B, R)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(P + R).expand(B, -1),
        "responses": ids[:, P:],
        "response_mask": mask,
        "token_level_rewards": rewards,
    }
    uid = np.array(["b", "a", "b", "a", "a", "b"], dtype=object)  # groups interleaved, as rows may be
    estimator = get_estimator("tir_optimal_token_baseline")
    calls = []

    def estimate(rows, old):
        calls.append(sorted(set(uid[rows.numpy()])))
        adv, _ = estimator(
            token_level_rewards=rewards[rows],
            response_mask=mask[rows],
            index=uid[rows.numpy()],
            old_log_probs=old.log_probs,
            sum_pi_squared=old.sum_pi_squared,
        )
        return adv, None

    s = ActorSettings(ppo_micro_batch_size=micro, clip_ratio_c=3.0)
    micro_batches = on_policy_micro_batches(s, uid, B, B, 1, group_local=estimator.group_local)
    assert [sorted(set(uid[m.numpy()])) for m in micro_batches] == ([["a", "b"]] if micro == 6 else [["a"], ["b"]])
    runs = {}
    for way in ("two_pass", "one_forward"):
        model = tiny_model_factory()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if way == "two_pass":
            old = compute_old_stats(model, batch, s)
            a, _ = estimate(torch.arange(B), old)
            adv = a.float() * mask
            m = ppo_update(model, opt, batch, old, Advantages(adv, mask), [torch.arange(B)], s)
        else:
            calls.clear()
            old, adv, is_w, m = on_policy_update(model, opt, batch, s, micro_batches, mask, estimate)
            assert calls == [sorted(set(uid[x.numpy()])) for x in micro_batches] and is_w is None
        t = {"old_log_probs": old.log_probs, "sum_pi_squared": old.sum_pi_squared, "entropy": old.entropy}
        t["advantages"] = adv
        runs[way] = (t, m, torch.cat([p.detach().flatten() for p in model.parameters()]))
    (t2, m2, w2), (t1, m1, w1) = runs["two_pass"], runs["one_forward"]
    for key in ("old_log_probs", "sum_pi_squared", "entropy", "advantages"):
        torch.testing.assert_close(t1[key], t2[key], rtol=0, atol=1e-6, msg=key)
    assert t1["advantages"].abs().sum() > 0
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/clip_frac"):
        assert m1[k] == pytest.approx(m2[k], rel=1e-5, abs=1e-7), k
    assert m1["actor/ppo_kl"] == 0.0  # the ratio is exactly 1: old and new are the same forward
    assert not torch.equal(w1, torch.cat([p.detach().flatten() for p in tiny_model_factory().parameters()]))
    torch.testing.assert_close(w1, w2, rtol=0, atol=1e-6)


def test_micro_batches_by_length_give_each_row_its_own_statistics_and_the_same_update(tiny_model_factory):
    """Rows of different response lengths (right padding): micro-batches of rows ordered by length
    (by_length) give every row the statistics a one-row forward gives it, in its own place, and the
    update of one micro-batch per row."""
    from otb_tir.trainer.actor import by_length

    g = torch.Generator().manual_seed(3)
    B, P, R = 7, 4, 12
    ids = torch.randint(5, 1500, (B, P + R), generator=g)
    lengths = torch.tensor([12, 3, 7, 12, 1, 5, 9])
    attn = torch.ones(B, P + R, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        attn[i, P + n :] = 0
    batch = {
        "input_ids": ids * attn,
        "attention_mask": attn,
        "position_ids": torch.arange(P + R).expand(B, -1),
        "responses": (ids * attn)[:, P:],
        "response_mask": attn[:, P:].float(),
    }
    assert by_length(batch, torch.arange(B)).tolist() == [4, 1, 5, 2, 6, 0, 3]
    assert by_length(batch, torch.tensor([3, 1, 0])).tolist() == [1, 3, 0]  # stable among equal lengths
    out = {micro: _two_pass_update(tiny_model_factory, batch, micro) for micro in (1, 3)}
    for key in ("old_log_probs", "sum_pi_squared", "entropy"):
        torch.testing.assert_close(out[3][0][key], out[1][0][key], rtol=0, atol=1e-5, msg=key)
    assert ((out[3][0]["old_log_probs"] != 0) == batch["response_mask"].bool()).all()  # each row in its place
    assert out[1][1]["actor/pg_loss"] == pytest.approx(out[3][1]["actor/pg_loss"], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(out[3][2], out[1][2], rtol=0, atol=1e-6)


def test_one_forward_applies_only_to_exactly_on_policy_steps():
    from otb_tir.trainer.actor import ActorSettings, on_policy_micro_batches

    s = ActorSettings(ppo_micro_batch_size=16)
    uid = np.repeat(np.arange(8), 4).astype(object)  # 8 groups of 4
    one = on_policy_micro_batches(s, uid[:16], 16, 16, 1, group_local=False)
    assert [m.tolist() for m in one] == [list(range(16))]  # all rows in one micro-batch: any estimator
    assert on_policy_micro_batches(s, uid[:16], 16, 16, 2, True) is None  # a second epoch is off-policy
    assert on_policy_micro_batches(s, uid[:16], 16, 8, 1, True) is None  # two optimizer steps
    # two micro-batches and an estimator that may read the whole batch
    assert on_policy_micro_batches(s, uid, 32, 32, 1, group_local=False) is None
    two = on_policy_micro_batches(s, uid, 32, 32, 1, group_local=True)  # two micro-batches of whole groups
    assert [m.tolist() for m in two] == [list(range(16)), list(range(16, 32))]
    assert on_policy_micro_batches(ActorSettings(ppo_micro_batch_size=3), uid, 32, 32, 1, True) is None  # group > micro
    off = ActorSettings(ppo_micro_batch_size=16, reuse_update_forward=False)
    assert on_policy_micro_batches(off, uid[:16], 16, 16, 1, True) is None


# ------------------------------------------------------------------------ torchrun (2 ranks)


def _launch(args: list[str], nproc: int, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = (
        [sys.executable, str(WORKER), *args]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(WORKER),
            *args,
        ]
    )
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    import importlib.util

    from otb_tir.trainer.config import load_config
    from otb_tir.trainer.run import run

    root = tmp_path_factory.mktemp("fsdp_runs")
    base = SMALL + [f"model.path={tiny_model_dir}"]
    out = {name: root / name for name in ("S", "B")}
    spec = importlib.util.spec_from_file_location("fsdp_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    run(load_config(None, base + [f"trainer.output_dir={out['S']}"]), reward_fn=worker.parity_reward)

    killed = _launch(["--kill-after-save", "1", *base, f"trainer.output_dir={out['B']}"], 2)
    assert killed.returncode != 0, "the run meant to die after its step-1 checkpoint finished"
    ck = out["B"] / "checkpoints"
    killed_state = {
        "step_1": (ck / "step_1" / "state.pt").is_file(),
        "step_2": (ck / "step_2").exists(),
        "final": (out["B"] / "final").exists(),
    }
    killed_metrics = _metrics(out["B"])
    resumed = _launch(base + [f"trainer.output_dir={out['B']}", "trainer.resume=true"], 2)
    assert resumed.returncode == 0, f"resume failed:\n{resumed.stderr[-4000:]}"
    return out, killed_state, killed_metrics


def _ckpt_model(run: Path, step: int, tmp: Path) -> dict[str, torch.Tensor]:
    path = run / "checkpoints" / f"step_{step}"
    if (path / "dcp").is_dir():  # FSDP run: read the DCP shards offline, strip the TokenStatsModule prefix
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dst = tmp / f"{run.name}_{step}.pt"
        dcp_to_torch_save(path / "dcp", dst)
        sd = torch.load(dst, weights_only=False)["model"]
        return {k.removeprefix("model."): v for k, v in sd.items()}
    return torch.load(path / "state.pt", weights_only=False)["model"]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.fsdp
def test_two_ranks_take_the_one_process_steps(runs, tmp_path, tiny_model_dir):
    """(a) After step 1 (uninterrupted) and step 2 (after kill + resume) the FSDP2 parameters equal
    the one-process ones (fp32), and every metric computed over all ranks' rows equals the
    one-process value: same rollouts (weights synced into each rank's engine), same advantages,
    same global token-mean gradient (grad norm, loss)."""
    from transformers import AutoModelForCausalLM

    out, _, _ = runs
    init = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for step in (1, 2):
        s, b = _ckpt_model(out["S"], step, tmp_path), _ckpt_model(out["B"], step, tmp_path)
        ds = torch.cat([(s[k] - init[k]).flatten() for k in sorted(s)])
        db = torch.cat([(b[k] - init[k]).flatten() for k in sorted(s)])
        assert ds.abs().max() > 0.5 * LR  # Adam moves weights by ~lr per step: a real update
        # Adam's g / (|g| + 1e-8) turns fp32 reduction-order noise on (near-)zero gradient entries
        # into visible differences on a few entries (measured: ~1e-4 of the update's norm, < 1e-4 of
        # the entries off by more than lr / 100); a wrong gradient (a rank's rows lost, a sign, a lost
        # optimizer state) changes the update by O(its norm). The gradient's scale, which Adam hides,
        # is checked through the grad-norm and loss metrics below.
        rel = float((ds - db).norm() / ds.norm())
        off = float(((ds - db).abs() > LR / 100).float().mean())
        assert rel < 3e-3 and off < 1e-3, (step, rel, off)
    ms, mb = _metrics(out["S"]), _metrics(out["B"])
    assert [m["step"] for m in mb] == [1, 2]
    for x, y in zip(ms, mb):
        for key in (
            "reward/mean",
            "response/policy_tokens_mean",
            "advantages/std",
            "advantages/num_tokens",
            "actor/grad_norm",
            "actor/pg_loss",
            "actor/entropy",
            "variance_proxy/proxy2_total_power",
        ):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), key
        assert x["actor/grad_norm"] > 0 and x["advantages/std"] > 0


@pytest.mark.fsdp
def test_killed_run_resumes_at_the_next_step(runs):
    """(b) Every rank dies right after the step-1 checkpoint; the resumed run continues at step 2
    from the DCP shards, the data cursor and every rank's RNG (its step-2 weights and metrics are
    checked against the uninterrupted one-process run above)."""
    out, killed, killed_metrics = runs
    assert killed == {"step_1": True, "step_2": False, "final": False}
    assert [m["step"] for m in killed_metrics] == [1]
    metrics = _metrics(out["B"])
    assert [m["step"] for m in metrics] == [1, 2] and metrics[0] == killed_metrics[0]
    state = torch.load(out["B"] / "checkpoints" / "step_2" / "state.pt", weights_only=False)
    assert state["distributed"] and state["world_size"] == 2 and len(state["rng_per_rank"]) == 2
    assert state["cursor"] == {"epoch": 0, "position": 4} and state["step"] == 2


@pytest.mark.fsdp
def test_final_folder_is_a_plain_hf_model_with_the_trained_weights(runs, tmp_path):
    """(c) final/ (written by rank 0 from its engine copy) loads with from_pretrained and holds the
    weights of the last sharded update."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _, _ = runs
    model = AutoModelForCausalLM.from_pretrained(out["B"] / "final")
    AutoTokenizer.from_pretrained(out["B"] / "final")
    assert _max_diff(model.state_dict(), _ckpt_model(out["B"], 2, tmp_path)) == 0.0
    summary = json.loads((out["B"] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final_model"] == str(out["B"] / "final")


@pytest.mark.fsdp
def test_eval_split_over_ranks_matches_one_process(runs):
    """Held-out episodes split over the ranks (3 items: 2 + 1) and gathered give the one-process
    before/after figures; the resumed run reuses the before-figures of the killed one."""
    out, _, _ = runs
    s = json.loads((out["S"] / "summary.json").read_text())
    b = json.loads((out["B"] / "summary.json").read_text())
    assert s["before"]["n"] == b["before"]["n"] == 3
    for phase in ("before", "after"):
        for key, value in s[phase].items():
            assert b[phase][key] == pytest.approx(value, nan_ok=True), (phase, key)
