"""``trainer.one_step_off_policy``: the next step's rollout runs beside this step's update.

Checked on the real tiny model, real episodes and the calculator: which weights generated each
batch (the engine's log-probs against the actor's at the weights before and after an update), that
the prompts per step are those of an on-policy run, that a held-out evaluation and the end of the
run see the engine with the actor's weights, what a checkpoint saves of a rollout in flight, and the
recipe killed and resumed as a subprocess.
"""

import copy
import json
import os
import subprocess

import pytest
import torch

from otb_tir import ConfigError
from otb_tir.trainer.actor import compute_old_stats
from otb_tir.trainer.checkpoint import load_latest
from tests.otb_tir.trainer.test_trainer import SMALL, _trainer, asyncio_close, kill_at_first_checkpoint, recipe_args

OFF = ["trainer.one_step_off_policy=true"]


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _log_probs_at(tr, weights, tensors) -> torch.Tensor:
    model = copy.deepcopy(tr.model)
    model.load_state_dict(weights)
    return compute_old_stats(model, dict(tensors), tr.settings.actor).log_probs


def _gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


def _same(model, weights) -> bool:
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_each_batch_is_sampled_by_the_weights_of_one_update_before(tmp_path, tiny_model_dir):
    tr = _trainer(tmp_path / "off", tiny_model_dir, OFF + ["trainer.total_steps=3", "trainer.save_every=0"])
    assert tr.settings.rollout_is  # null (auto) turns the IS correction on for off-policy samples
    assert tr.engine.model is not tr.model  # the engine rolls out on its own copy
    thetas, results = [], []
    for _ in range(3):
        thetas.append(_weights(tr.model))
        results.append(tr.train_step())
        tr.step += 1
        if tr.step < 3:  # a rollout of the next step ran beside this update: the engine is one update behind
            assert tr._ahead is not None and _same(tr.engine.model, thetas[-1])
            assert not _same(tr.engine.model, _weights(tr.model))
    assert [r.metrics["rollout/policy_lag"] for r in results] == [0.0, 1.0, 1.0]
    for k, res in enumerate(results):
        t = res.batch.tensors
        mask = t["response_mask"].float()
        made_by = thetas[k - 1] if k else thetas[0]  # step k's batch: the weights step k-1 started with
        # the engine's log-probs are those of the weights that sampled them, up to batching noise
        assert _gap(t["rollout_log_probs"], _log_probs_at(tr, made_by, t), mask) < 1e-4
        if k:  # and not those of the weights the step trained (lr 1e-2 moved them)
            assert _gap(t["rollout_log_probs"], _log_probs_at(tr, thetas[k], t), mask) > 1e-3
    # the last step ran alone: the engine has the actor's final weights
    assert tr._ahead is None and _same(tr.engine.model, _weights(tr.model))
    asyncio_close(tr)

    # the same prompts, step by step, as an on-policy run; its first batch token for token
    on = _trainer(tmp_path / "on", tiny_model_dir, ["trainer.total_steps=3", "trainer.save_every=0"])
    assert not on.settings.rollout_is
    on_results = []
    for _ in range(3):
        on_results.append(on.train_step())
        on.step += 1
    assert all(r.metrics["rollout/policy_lag"] == 0.0 for r in on_results)
    for a, b in zip(results, on_results):
        assert [t.prompt_ids for t in a.batch.trajectories] == [t.prompt_ids for t in b.batch.trajectories]
    assert [t.response_ids for t in results[0].batch.trajectories] == [
        t.response_ids for t in on_results[0].batch.trajectories
    ]
    asyncio_close(on)


@pytest.mark.slow
def test_no_rollout_runs_ahead_of_a_held_out_evaluation_and_checkpoints_keep_its_prompts(tmp_path, tiny_model_dir):
    """eval.every=2 over 4 steps: steps 2 and 4 are rolled out beside the update before them, steps 1
    and 3 not (an evaluation follows step 2, with the engine at the actor's weights). A checkpoint
    taken while a rollout is ahead saves the data cursor of before its prompts were drawn."""
    overrides = OFF + ["trainer.total_steps=4", "trainer.save_every=1", "trainer.keep_checkpoints=5", "eval.every=2"]
    tr = _trainer(tmp_path, tiny_model_dir, overrides)
    evaluated = []
    real_evaluate = tr.evaluate

    def evaluate(*a, **k):  # the engine must hold the actor's weights when it evaluates
        evaluated.append((tr.step, _same(tr.engine.model, _weights(tr.model))))
        return real_evaluate(*a, **k)

    tr.evaluate = evaluate
    rows = tr.fit(progress=False)
    assert [r["rollout/policy_lag"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    from otb_tir.trainer.timing import STEP_PHASES

    for m in rows:  # the phases stay disjoint and cover the step; the update's wall holds both halves
        inner = [k for k in STEP_PHASES if k != "timing/eval_s"]
        assert sum(m[k] for k in inner) == pytest.approx(m["timing/step_s"], abs=1e-6)
        if "timing/next_rollout_s" in m:  # rows 1 and 3: the next step's rollout ran beside their update
            # both halves ran inside the wall of the two together: update_s plus the old-stats and
            # advantage phases that ran within it (kept out of update_s so the phases stay disjoint)
            together = m["timing/update_s"] + m["timing/advantage_s"] + m["timing/old_log_prob_s"] + 1e-6
            assert 0 < m["timing/next_rollout_s"] <= together
            assert 0 < m["timing/update_own_s"] <= together
    assert ["timing/next_rollout_s" in m for m in rows] == [True, False, True, False]
    assert rows[1]["timing/gen_s"] == 0.0 and rows[2]["timing/gen_s"] > 0  # row 2's batch: rolled out before
    assert evaluated == [(2, True)] and "val/reward/accuracy" in rows[1] and "val/reward/accuracy" not in rows[0]
    assert _same(tr.engine.model, _weights(tr.model))
    asyncio_close(tr)

    # the cursor each checkpoint saved is that of an on-policy run after as many steps
    cursor = _trainer(tmp_path / "ref", tiny_model_dir, ["trainer.total_steps=4"]).cursor
    for step in range(1, 5):
        cursor.next_batch()
        state = torch.load(tmp_path / "checkpoints" / f"step_{step}" / "state.pt", weights_only=False)
        assert state["cursor"] == cursor.state(), step
    assert load_latest(tmp_path / "checkpoints")[0] == 4


def test_the_weaker_mode_is_refused_where_it_cannot_run(tmp_path, tiny_model_dir):
    from dataclasses import replace

    from agent_env.rollout import run_sync
    from otb_tir.builders import build_tools
    from otb_tir.trainer.config import load_config
    from otb_tir.trainer.distributed import DistInfo
    from otb_tir.trainer.parts import build_parts, trainer_settings
    from otb_tir.trainer.trainer import Trainer

    cfg = load_config(None, SMALL + [f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}"])
    parts = build_parts(cfg, build_tools(cfg), DistInfo(), torch.device("cpu"))
    assert parts.weights_fn is None  # the default engine shares the actor's weights
    with pytest.raises(ConfigError, match="own copy of the weights"):
        Trainer(replace(trainer_settings(cfg), one_step_off_policy=True), parts)
    run_sync(parts.engine.close())
    run_sync(parts.env.tools.close())


@pytest.mark.slow
def test_recipe_killed_with_a_rollout_ahead_resumes_and_rolls_it_out_again(tmp_path, tiny_model_dir):
    """The recipe as a user runs it, from another folder: SIGKILL after the first checkpoint, then
    ``--resume``. The resumed run has every step once, and the step after its checkpoint was rolled
    out again with the checkpoint's weights (policy lag 0), not taken from the lost run."""
    out = tmp_path / "run"
    args = recipe_args(tiny_model_dir, out, *OFF, "trainer.total_steps=4", "trainer.keep_checkpoints=5")
    kill_at_first_checkpoint(args, out, cwd=tmp_path)
    killed_at = load_latest(out / "checkpoints")[0]
    assert killed_at < 4, "the run finished before the kill: nothing to resume"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(args + ["--resume"], capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    lags = [r["rollout/policy_lag"] for r in rows]
    # step 1 rolls out alone; the step after the checkpoint resumed from is rolled out again (lag 0);
    # every other step after the first came from a rollout beside the update before it (lag 1)
    want = [0.0] + [0.0 if step == killed_at + 1 else 1.0 for step in range(2, 5)]
    assert lags == want
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["policy_lag"] == 1
    assert (out / "checkpoints" / "step_4" / "state.pt").is_file()
