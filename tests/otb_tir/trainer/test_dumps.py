"""Every step's trajectories on disk (trainer.rollout_data_dir): one Parquet file per step whose
per-token fields recompute the step's TIR-OTB advantages with verl's own function."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from otb_tir.builders import build_tools
from otb_tir.trainer.config import load_config
from otb_tir.trainer.distributed import DistInfo
from otb_tir.trainer.dumps import TOKEN_COLUMNS, TRAJECTORY_COLUMNS, read_step
from otb_tir.trainer.parts import build_parts, trainer_settings
from otb_tir.trainer.trainer import Trainer
from tests.otb_tir.trainer.test_trainer import SMALL as TRAINER_SMALL
from tests.otb_tir.trainer.test_trainer import _length_reward
from tests.support.optional import need

ROOT = Path(__file__).resolve().parents[3]
# test_trainer's small run at the default learning rate (its 1e-2 makes step 2's groups identical), no checkpoints
SMALL = [*(o for o in TRAINER_SMALL if not o.startswith("actor.optim.lr=")), "trainer.save_every=0"]


def _fit(tmp_path, tiny_model_dir, *overrides):
    cfg = load_config(None, SMALL + [f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}", *overrides])
    parts = build_parts(cfg, build_tools(cfg), DistInfo(), torch.device("cpu"), reward_fn=_length_reward)
    trainer = Trainer(trainer_settings(cfg), parts)
    return trainer.fit(progress=False)


def _padded(rows, key, dtype=torch.float32):
    width = max(len(r[key]) for r in rows)
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r[key])] = torch.tensor(r[key], dtype=dtype)
    return out


def test_a_step_dump_recomputes_tir_otb_with_verls_function(tmp_path, tiny_model_dir):
    core_algos = need("verl.trainer.ppo.core_algos", reason="verl==0.9.1 is the oracle")
    history = _fit(tmp_path, tiny_model_dir, "trainer.total_steps=2")
    files = sorted((tmp_path / "rollout_data").glob("*.parquet"))
    assert [f.name for f in files] == ["step_000001.parquet", "step_000002.parquet"]
    assert all(h["timing/dump_s"] >= 0 for h in history)
    for step, f in enumerate(files, start=1):
        rows = read_step(f)
        assert len(rows) == 2 * 4 and set(rows[0]) == {*TRAJECTORY_COLUMNS, *TOKEN_COLUMNS}
        assert {r["step"] for r in rows} == {step} and {r["policy_version"] for r in rows} == {step - 1}
        for r in rows:
            n = len(r["response_ids"])
            assert all(len(r[k]) == n for k in TOKEN_COLUMNS)
            assert r["messages"][-1]["role"] in ("assistant", "tool") and isinstance(r["turns"], list)
            assert all(math.isnan(w) for w in r["is_weights"])  # on-policy: no IS weights
            tool = [i for i, m in enumerate(r["response_mask"]) if not m]
            assert all(r["advantages"][i] == 0 and r["path_weight"][i] == 0 for i in tool)
        # the oracle: verl's multi-turn OTB on the dumped fields, the reward on each row's last policy token
        mask = _padded(rows, "response_mask")
        rewards = torch.zeros_like(mask)
        for i, r in enumerate(rows):
            last = max(j for j, m in enumerate(r["response_mask"]) if m)
            rewards[i, last] = r["reward"]
        old, sp = _padded(rows, "old_log_probs"), _padded(rows, "sum_pi_squared")
        index = np.array([r["uid"] for r in rows], dtype=object)
        want, want_returns = core_algos.compute_multi_turn_optimal_token_baseline_advantage(
            rewards, mask, index, old, sp, handle_zero_tail=True
        )
        got = _padded(rows, "advantages")
        torch.testing.assert_close(got * mask, want * mask, rtol=1e-5, atol=1e-6)
        assert float((got * mask).abs().sum()) > 0  # the rewards differed: a real signal was dumped
        torch.testing.assert_close(_padded(rows, "returns") * mask, want_returns * mask, rtol=1e-5, atol=1e-6)
        base = _padded(rows, "baseline")
        torch.testing.assert_close(base, (_padded(rows, "returns") - got) * mask, rtol=1e-5, atol=1e-6)
        w = ((1 - 2 * old.exp() + sp) * mask).cumsum(-1) * mask  # W_t over policy tokens only
        torch.testing.assert_close(_padded(rows, "path_weight"), w, rtol=1e-4, atol=1e-5)
        lp = _padded(rows, "rollout_log_probs")
        assert float(((lp - old).abs() * mask).max()) < 0.05  # the engine's and the actor's, same weights


def test_dumps_follow_every_and_stop_at_the_byte_bound(tmp_path, tiny_model_dir, caplog):
    _fit(tmp_path / "a", tiny_model_dir, "trainer.total_steps=3", "trainer.rollout_data_every=2")
    assert sorted(p.name for p in (tmp_path / "a" / "rollout_data").glob("*")) == [
        "step_000002.parquet",  # every 2 steps
        "step_000003.parquet",  # and the last
    ]
    with caplog.at_level(logging.WARNING, logger="otb_tir.trainer.dumps"):
        _fit(tmp_path / "b", tiny_model_dir, "trainer.total_steps=2", "trainer.rollout_data_max_bytes=1")
    assert [p.name for p in (tmp_path / "b" / "rollout_data").glob("*")] == ["step_000001.parquet"]
    assert "rollout_data_max_bytes" in caplog.text and "no dumps from step 2 on" in caplog.text
    _fit(tmp_path / "c", tiny_model_dir, "trainer.total_steps=1", "trainer.rollout_data_dir=null")
    assert not (tmp_path / "c" / "rollout_data").exists()


def test_negative_bounds_are_refused_at_start():
    from otb_tir import ConfigError

    for key in ("trainer.rollout_data_every", "trainer.rollout_data_max_bytes"):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [f"{key}=-1"])


@pytest.mark.slow
def test_the_default_recipe_dumps_its_steps_from_another_folder(tmp_path):
    """README command 1's recipe, 2 steps, from a folder outside the project: the run folder gets one
    file per step, readable with pyarrow alone."""
    import pyarrow.parquet as pq

    work = Path("/tmp") / f"otb-dumps-{os.getpid()}"
    work.mkdir(exist_ok=True)
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "recipes" / "train_tir_math.py"), "trainer.total_steps=2"]
    proc = subprocess.run(
        [*cmd, f"trainer.output_dir={out}", "eval.before=false", "eval.after=false", "trainer.save_every=0"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted((out / "rollout_data").glob("*.parquet"))
    assert [f.name for f in files] == ["step_000001.parquet", "step_000002.parquet"]
    table = pq.read_table(files[-1], columns=["uid", "reward", "response_ids", "advantages"])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(out / "config.yaml")
    assert table.num_rows == cfg.data.train_batch_size * cfg.rollout.n  # every trajectory of the step
    assert len(set(table.column("uid").to_pylist())) == cfg.data.train_batch_size  # one group per prompt
    # the same episodes the step's metrics describe
    assert abs(np.mean(table.column("reward").to_pylist()) - metrics[-1]["reward/mean"]) < 1e-6
    lengths = [len(x) for x in table.column("response_ids").to_pylist()]
    assert abs(np.mean(lengths) - metrics[-1]["response/length_mean"]) < 1e-6
