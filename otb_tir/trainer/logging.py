"""Metrics sinks: console, JSONL, TensorBoard, W&B (optional), and a ``curves.png`` a person can open."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

log = logging.getLogger(__name__)

#: the mark of a row logged ahead of its step's full row (``MetricsLogger.log(provisional=True)``)
PROVISIONAL = "row/provisional"

# The curves drawn in curves.png (those present in the metrics).
CURVES = (
    "reward/mean",
    "reward/accuracy",
    "val/accuracy",
    "tools/call_rate",
    "tools/success_rate",
    "episode/turns_mean",
    "response/length_mean",
    "advantages/std",
    "variance_proxy/proxy3_pure_noise",
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "timing/step_s",
)


class MetricsLogger:
    """Writes one dict of floats per step to every configured sink.

    ``metrics.jsonl`` (one JSON object per line, with ``step``), TensorBoard event files under
    ``tensorboard/``, an optional W&B run, and ``curves.png``. The PNG is redrawn at the first
    step, at :meth:`close`, and in between either every ``plot_every`` steps or, by default
    (``plot_every=None``), whenever the time since the last redraw exceeds the last redraw's
    duration divided by ``plot_budget``: drawing a dozen matplotlib panels takes ~1.7 s on
    2 CPU cores, which redrawn every step was 20 % of a default step.

    A row logged with ``provisional=True`` (a verl step's row written before its checkpoint, see
    :mod:`otb_tir.verl.v1`) goes to the history and ``metrics.jsonl`` only, marked
    ``row/provisional`` = 1; the next row of the same step replaces it there and is the one
    TensorBoard, W&B and the console get, once. A provisional row nothing replaced reaches them when
    a later step is logged or at :meth:`close`.
    """

    def __init__(
        self,
        output_dir: str | Path,
        loggers: Iterable[str] = ("console", "jsonl", "tensorboard"),
        project: str = "otb-tir",
        experiment: str = "run",
        config: Mapping[str, Any] | None = None,
        plot_every: int | None = None,
        resume: bool = False,
        plot_budget: float = 0.05,
    ):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.loggers = set(loggers)
        unknown = self.loggers - {"console", "jsonl", "tensorboard", "wandb"}
        if unknown:
            from otb_tir import ConfigError

            raise ConfigError(f"unknown logger(s) {sorted(unknown)}; valid: console, jsonl, tensorboard, wandb")
        self.plot_every = plot_every
        self.plot_budget = plot_budget
        self._last_plot: tuple[float, float] | None = None  # (when it ended, how long it took)
        self.history: list[dict[str, float]] = []
        self.jsonl_path = self.dir / "metrics.jsonl"
        if resume and self.jsonl_path.exists():
            self.history = [json.loads(line) for line in self.jsonl_path.read_text().splitlines() if line.strip()]
        elif self.jsonl_path.exists():
            self.jsonl_path.unlink()
        self._pending: dict[str, float] | None = None  # the provisional last row, not yet sent on
        self._tb = None  # opened on first use (after a resume's truncate: with its purge step)
        self._tb_writer: Any = None
        self._tb_purge: int | None = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb_writer = SummaryWriter
        self._wandb = None
        if "wandb" in self.loggers:
            try:
                import wandb
            except ImportError as e:  # pragma: no cover - optional
                raise ImportError("logger 'wandb' needs: pip install wandb") from e
            self._wandb = wandb.init(project=project, name=experiment, config=dict(config or {}), dir=str(self.dir))

    def truncate(self, step: int) -> None:
        """Forget metrics after ``step`` (a resumed run re-does the steps after its checkpoint), in
        ``metrics.jsonl`` and in TensorBoard: the writer reopens with ``purge_step`` (TensorBoard's
        own mechanism: readers drop the earlier files' points from that step on). A provisional row
        kept last (its run was killed before the full row) is sent on again from the same purge."""
        self.history = [h for h in self.history if h["step"] <= step]
        self._write_jsonl()
        last = self.history[-1] if self.history else None
        self._pending = last if last is not None and last.get(PROVISIONAL) == 1.0 else None
        if self._tb_writer is not None:
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            self._tb_purge = int(self._pending["step"]) if self._pending else step + 1

    def log(self, metrics: Mapping[str, Any], step: int, *, provisional: bool = False) -> None:
        row = {"step": step, **{k: _to_float(v) for k, v in metrics.items()}}
        if provisional:
            row[PROVISIONAL] = 1.0
        pending, self._pending = self._pending, None
        if pending is not None and pending["step"] == step:  # the full row of a step logged early
            self.history[-1] = row
            self._write_jsonl()
        else:
            if pending is not None:  # nothing replaced it: it is the step's row
                self._publish(pending)
            self.history.append(row)
            if "jsonl" in self.loggers:
                with open(self.jsonl_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
        if provisional:
            self._pending = row
            return
        self._publish(row)
        if self._plot_due(step):
            self.plot()

    def _write_jsonl(self) -> None:
        if "jsonl" not in self.loggers:
            return
        with open(self.jsonl_path, "w") as f:
            for h in self.history:
                f.write(json.dumps(h) + "\n")

    def _publish(self, row: Mapping[str, float]) -> None:
        """TensorBoard, W&B, the console: each row once."""
        step = int(row["step"])
        if self._tb_writer is not None:
            if self._tb is None:
                self._tb = self._tb_writer(str(self.dir / "tensorboard"), purge_step=self._tb_purge)
            for k, v in row.items():
                if k != "step" and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(dict(row), step=step)
        if "console" in self.loggers:
            log.info("step %d | %s", step, format_metrics(row))

    def _plot_due(self, step: int) -> bool:
        if self.plot_every is not None:
            return bool(self.plot_every) and step % self.plot_every == 0
        if self._last_plot is None:
            return True
        ended, took = self._last_plot
        return time.perf_counter() - ended >= took / max(self.plot_budget, 1e-9)

    def plot(self, path: str | Path | None = None) -> Path | None:
        """Redraw ``curves.png`` from the history (atomic replace)."""
        keys = [k for k in CURVES if any(k in h for h in self.history)]
        if not keys:
            return None
        t0 = time.perf_counter()
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        cols = 3
        rows = math.ceil(len(keys) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
        for ax, key in zip(axes.flat, keys):
            pts = [(h["step"], h[key]) for h in self.history if key in h and math.isfinite(h[key])]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3)
            ax.set_title(key, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(keys) :]:
            ax.axis("off")
        fig.tight_layout()
        out = Path(path) if path else self.dir / "curves.png"
        tmp = out.with_suffix(".tmp.png")
        fig.savefig(tmp, dpi=90)
        plt.close(fig)
        os.replace(tmp, out)
        now = time.perf_counter()
        self._last_plot = (now, now - t0)
        return out

    def close(self) -> None:
        if self._pending is not None:
            self._publish(self._pending)
            self._pending = None
        self.plot()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _to_float(v: Any) -> float:
    try:
        return float(v.item() if hasattr(v, "item") else v)
    except (TypeError, ValueError):
        return float("nan")


def format_metrics(
    row: Mapping[str, float],
    keys: Iterable[str] = (
        "reward/accuracy",
        "reward/mean",
        "tools/call_rate",
        "tools/success_rate",
        "episode/turns_mean",
        "response/length_mean",
        "actor/pg_loss",
        "actor/grad_norm",
        "timing/step_s",
    ),
) -> str:
    return " ".join(f"{k.split('/', 1)[-1]}={row[k]:.3g}" for k in keys if k in row)
