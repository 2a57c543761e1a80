"""Metrics sinks and checkpoints: files a person or a restarted run can actually use."""

import json
import random

import numpy as np
import pytest
import torch

from otb_tir import ConfigError
from otb_tir.trainer.checkpoint import list_checkpoints, load_latest, rng_state, save_checkpoint, set_rng_state
from otb_tir.trainer.logging import MetricsLogger


def test_metrics_logger_writes_jsonl_tensorboard_and_png(tmp_path):
    lg = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard"])
    for step in range(1, 4):
        lg.log(
            {"reward/mean": step / 10, "reward/accuracy": torch.tensor(0.5), "tools/call_rate": np.float32(0.25)}, step
        )
    lg.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["reward/mean"] == pytest.approx(0.3)
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/accuracy")] == [0.5, 0.5, 0.5]


def test_resumed_logger_truncates_steps_after_checkpoint(tmp_path):
    lg = MetricsLogger(tmp_path, loggers=["jsonl"])
    for s in range(1, 6):
        lg.log({"reward/mean": s}, s)
    lg2 = MetricsLogger(tmp_path, loggers=["jsonl"], resume=True)
    lg2.truncate(3)
    lg2.log({"reward/mean": 40}, 4)
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def _tb_points(path, tag="reward/mean"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_resumed_logger_truncates_tensorboard_too(tmp_path):
    """TensorBoard, read back the way TensorBoard reads it, shows the resumed run's rows past the
    checkpoint, not the killed run's (SummaryWriter's purge_step)."""
    lg = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard"])
    for s in range(1, 6):
        lg.log({"reward/mean": s}, s)
    lg._tb.flush()  # killed: no close
    lg2 = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard"], resume=True)
    lg2.truncate(3)
    lg2.log({"reward/mean": 40}, 4)
    lg2.close()
    assert _tb_points(tmp_path) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_a_provisional_row_reaches_tensorboard_once_as_its_replacement(tmp_path):
    """A row logged ahead of its step's full row (verl's row before its checkpoint) is replaced by the
    full one in metrics.jsonl and TensorBoard gets one point per step, the full row's; a provisional
    row a killed run never replaced is kept by the resumed run and shown in TensorBoard once."""
    lg = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard"])
    lg.log({"reward/mean": 1}, 1)
    lg.log({"reward/mean": 0.25}, 2, provisional=True)
    assert _jsonl(tmp_path)[-1] == {"step": 2, "reward/mean": 0.25, "row/provisional": 1.0}
    lg.log({"reward/mean": 2}, 2)
    lg.log({"reward/mean": 0.5}, 3, provisional=True)  # killed before step 3's full row (no close)
    lg._tb.flush()
    assert [(r["step"], r["reward/mean"]) for r in _jsonl(tmp_path)] == [(1, 1), (2, 2), (3, 0.5)]
    assert _tb_points(tmp_path) == [(1, 1.0), (2, 2.0)]
    lg2 = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard"], resume=True)
    lg2.truncate(3)  # resumed after checkpoint 3: its early row is step 3's row
    lg2.log({"reward/mean": 4}, 4)
    lg2.close()
    assert _tb_points(tmp_path) == [(1, 1.0), (2, 2.0), (3, 0.5), (4, 4.0)]
    assert [r["step"] for r in _jsonl(tmp_path)] == [1, 2, 3, 4]


def _jsonl(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_unknown_logger_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="valid: console"):
        MetricsLogger(tmp_path, loggers=["jsonl", "mlflow"])


def test_checkpoint_roundtrip_keeps_last_k_and_restores_rng(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    for step in (1, 2, 3):
        save_checkpoint(
            tmp_path,
            step,
            {"model": model.state_dict(), "optim": opt.state_dict(), "rng": rng_state(), "cursor": step * 8},
            keep=2,
        )
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_3"]
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    step, state = load_latest(tmp_path)
    assert step == 3 and state["cursor"] == 24
    set_rng_state(state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    model2 = torch.nn.Linear(3, 2)
    model2.load_state_dict(state["model"])
    assert torch.equal(model2.weight, model.weight)


def test_incomplete_checkpoint_is_ignored(tmp_path):
    save_checkpoint(tmp_path, 1, {"x": 1})
    (tmp_path / ".tmp_step_2_123").mkdir()  # a save killed midway
    (tmp_path / "step_3").mkdir()  # no state.pt: not complete
    step, state = load_latest(tmp_path)
    assert step == 1 and state["x"] == 1
    assert load_latest(tmp_path / "missing") is None


def test_curves_png_is_redrawn_within_its_time_budget(tmp_path, monkeypatch):
    """Default schedule: drawn at step 1, then only once the wait exceeds the last draw's cost / budget."""
    import otb_tir.trainer.logging as lg_mod

    clock = [100.0]
    monkeypatch.setattr(lg_mod.time, "perf_counter", lambda: clock[0])
    lg = MetricsLogger(tmp_path, loggers=["jsonl"], plot_budget=0.1)
    drawn = []

    def fake_plot(path=None):  # a draw that takes 2 s of the fake clock
        drawn.append(lg.history[-1]["step"])
        clock[0] += 2.0
        lg._last_plot = (clock[0], 2.0)

    monkeypatch.setattr(lg, "plot", fake_plot)
    for step in range(1, 8):
        lg.log({"reward/mean": step}, step)
        clock[0] += 5.0  # a 5 s step
    # 2 s / 0.1 = 20 s between draws: step 1, then the first step ≥ 20 s after it ended
    assert drawn == [1, 5]
    lg2 = MetricsLogger(tmp_path / "b", loggers=["jsonl"], plot_every=2)
    monkeypatch.setattr(lg2, "plot", lambda path=None: drawn.append(("every", lg2.history[-1]["step"])))
    for step in range(1, 5):
        lg2.log({"reward/mean": step}, step)
    assert drawn[2:] == [("every", 2), ("every", 4)]
