#!/usr/bin/env python
"""The true policy-gradient variance of each advantage estimator at fixed checkpoints.

At each checkpoint (the weights stay fixed) and each group size n, draw K independent rollout
batches — B fresh training prompts × n samples at the training temperature, each batch — and on
every batch compute, for each estimator, the policy gradient the trainer's loss gives with that
estimator's advantages (:func:`bench_estimators.policy_gradient`: the trainer's own ``ppo_update``
on the whole batch as one mini-batch, ratio 1, tool tokens masked as in training, no optimizer
step). The estimators see the *same* rollouts, so the comparison is paired. Across the K batches:

    Var  = E‖g − E g‖²  ≈ (Σ_k ‖g_k‖² − K‖ḡ‖²) / (K − 1)     (unbiased; trace of the covariance)
    ‖E g‖²             ≈ ‖ḡ‖² − Var / K                       (unbiased; can come out negative)
    SNR  = ‖E g‖² / Var

The ratios of two estimators' variances (and SNRs) get 95 % CIs from a paired bootstrap over the K
batches (the K × K Gram matrix of each estimator's gradients is kept; the vectors only on disk
while their cell runs). Per batch it also records, over the prompt groups, how often the rewards vary, how
often both the reward and the path energy W vary (W: the cumulative OTB weight
Σ (1 − 2π + Σπ²) at a sequence's last policy token, as the OTB estimators compute it), and the
within-group Pearson correlation of reward and W where both vary: with 0/1 rewards OTB's advantage
differs from a group-mean baseline's only in such groups.

    python benchmarks/bench_grad_variance.py                   # the full measurement (see Budget)
    python benchmarks/bench_grad_variance.py --checkpoints arith_warm --ns 4 --k 4   # one small cell
    python benchmarks/bench_grad_variance.py --quick           # smoke: K=2, n=2, B=2, one checkpoint
    python benchmarks/bench_grad_variance.py --report-only     # tables and the plot from finished cells
    python benchmarks/record.py grad_variance "True gradient variance" -- \\
        python benchmarks/bench_grad_variance.py

**Checkpoints.** ``arith_warm``: the built-in ``arith`` task's SFT warm start (one tool call).
``chain_warm``: the ``chain`` task's warm start (two dependent calls). ``chain_mid``: the chain
warm start after ``--mid-steps`` steps of the training recipe (TIR-OTB, its defaults), trained
once as a subprocess of ``recipes/train_tir_math.py`` into ``<out>/mid_chain_s<S>/`` and loaded
from its ``final/`` folder; a finished one is reused. The prompts of the measurement are drawn
with ``--seed`` (not the training run's seed 0), so they are not the ones it trained on.

**Resumable.** Each (checkpoint, n) cell is written to ``<out>/cells/<checkpoint>_n<n>.json`` when
it finishes; a cell whose file exists with the same settings (K, B, seed, overrides, a superset of
the estimators) is not computed again, so killing the run loses at most the cell in progress.

**Written**: ``<out>/results.json`` (every cell, the ratios with their CIs, the verdicts),
``<out>/table.md`` (also printed) and ``<out>/grad_variance.png`` (variance and SNR by n, one
panel per checkpoint, log scale).

**Budget** (the default B=4, K=16, 5 estimators; measured on this shared 2-core machine, seconds
per batch, which is one rollout of B·n episodes plus five forward/backward passes over its B·n rows,
the passes about 60 % of it): ``arith_warm`` about 4.5 / 9 / 14 s at n = 4 / 8 / 16, ``chain_warm``
about 6 / 10 / 17 s, ``chain_mid`` about 8 / 10 / 20 s; so about 7 + 9 + 10 min for the three
checkpoints, plus about 1.5 min for the 8-step mid-training run and a few seconds to build each
checkpoint's trainer: about 30 min in all (up to 40 on a busy machine). The time scales with K·B.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from bench_estimators import PAIRED, SHORT, VARIANTS, estimator_advantages, policy_gradient  # a sibling script
from figures import figure  # a sibling module (benchmarks/)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "train_tir_math.py"

log = logging.getLogger("bench_grad_variance")

TIR_OTB = "tir_optimal_token_baseline"
REFERENCES = ("grpo", "grpo_no_std", "rloo")  # the verdict: TIR-OTB's variance against each


@dataclass(frozen=True)
class Checkpoint:
    name: str
    task: str
    mid: bool  # the warm start after --mid-steps training steps (else the warm start itself)
    label: str


CHECKPOINTS = {
    c.name: c
    for c in (
        Checkpoint("arith_warm", "arith", False, "arith (1 call), warm start"),
        Checkpoint("chain_warm", "chain", False, "chain (2 calls), warm start"),
        Checkpoint("chain_mid", "chain", True, "chain (2 calls), mid-training"),
    )
}


@dataclass
class Settings:
    k: int = 16  # independent rollout batches per cell
    batch: int = 4  # prompts per batch
    seed: int = 1234  # the measurement's prompts and sampling seeds (the training run uses 0)
    mid_steps: int = 8
    boot: int = 2000  # bootstrap resamples of the variance ratios
    overrides: list[str] = field(default_factory=list)  # key=value for every cell and the mid-training run

    def key(self, ckpt: Checkpoint, n: int) -> dict[str, Any]:
        """What a finished cell must match to be reused."""
        return {
            "checkpoint": ckpt.name,
            "n": n,
            "k": self.k,
            "batch": self.batch,
            "seed": self.seed,
            "mid_steps": self.mid_steps if ckpt.mid else None,
            "overrides": list(self.overrides),
        }


QUICK_OVERRIDES = [
    "rollout.response_length=64",
    "rollout.max_tokens_per_turn=32",
    "data.train_size=16",
    "data.val_size=4",
    "eval.size=4",
]


# ----------------------------------------------------------------------------- statistics


def variance_stats(sum_vec: np.ndarray, sum_sq: float, k: int) -> dict[str, float]:
    """From Σ_k g_k and Σ_k ‖g_k‖² over K batches: the unbiased E‖g − E g‖², ‖E g‖² and their ratio."""
    mean_sq = float(np.dot(sum_vec, sum_vec)) / (k * k)  # ‖ḡ‖²
    var = (sum_sq - k * mean_sq) / (k - 1) if k > 1 else math.nan
    signal = mean_sq - var / k
    return {
        "mean_sq_norm": sum_sq / k,  # E‖g‖²
        "norm2_of_mean": mean_sq,  # ‖ḡ‖² (biased up by Var / K)
        "variance": var,
        "signal": signal,  # unbiased ‖E g‖²
        "snr": signal / var if var > 0 else math.nan,
    }


def gram_variance(gram: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray | float:
    """The same variance from the Gram matrix G[i, j] = ⟨g_i, g_j⟩ of the K gradients; with
    ``counts`` ([R, K] multiplicities of R bootstrap resamples) one variance per resample."""
    return gram_stats(gram, counts)[0]


def gram_stats(gram: np.ndarray, counts: np.ndarray | None = None) -> tuple[Any, Any]:
    """(Var, SNR) from the Gram matrix, as :func:`variance_stats` computes them from the sums;
    with ``counts`` ([R, K] bootstrap multiplicities) arrays of R values."""
    k = gram.shape[0]
    if counts is None:
        counts = np.ones((1, k))
        one = True
    else:
        one = False
    diag = counts @ np.diag(gram)
    quad = np.einsum("rk,kl,rl->r", counts, gram, counts)  # K²‖ḡ‖²
    var = (diag - quad / k) / (k - 1)
    signal = quad / (k * k) - var / k
    with np.errstate(divide="ignore", invalid="ignore"):
        snr = np.where(var > 0, signal / var, np.nan)
    return (float(var[0]), float(snr[0])) if one else (var, snr)


#: fewest batches for a bootstrap CI (below it, resamples of few distinct batches dominate)
MIN_K_FOR_CI = 5


def ratio_ci(gram_a: np.ndarray, gram_b: np.ndarray, boot: int, seed: int = 0) -> dict[str, float]:
    """Var_a / Var_b and SNR_a / SNR_b on the same K batches, each with a 95 % percentile CI from a
    paired bootstrap over batches (each resample draws K batches with replacement, the same ones
    for both estimators). CIs are NaN below :data:`MIN_K_FOR_CI` batches."""
    k = gram_a.shape[0]
    (va, sa), (vb, sb) = gram_stats(gram_a), gram_stats(gram_b)
    nan = math.nan
    out = {
        "ratio": va / vb if vb > 0 else nan,
        "lo": nan,
        "hi": nan,
        "snr_ratio": sa / sb if sb > 0 and math.isfinite(sa) else nan,
        "snr_lo": nan,
        "snr_hi": nan,
    }
    if k < MIN_K_FOR_CI or boot <= 0 or not vb > 0:
        return out
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(k, np.full(k, 1.0 / k), size=boot).astype(np.float64)
    (ra, qa), (rb, qb) = gram_stats(gram_a, counts), gram_stats(gram_b, counts)
    ok = rb > 0
    if ok.sum() >= 0.9 * boot:
        r = ra[ok] / rb[ok]
        out["lo"], out["hi"] = float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))
    ok = np.isfinite(qa) & np.isfinite(qb) & (qb > 0)
    if ok.sum() >= 0.9 * boot and math.isfinite(out["snr_ratio"]):
        r = qa[ok] / qb[ok]
        out["snr_lo"], out["snr_hi"] = float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))
    return out


def group_reward_energy(rewards: np.ndarray, energy: np.ndarray, group: np.ndarray) -> dict[str, float]:
    """Over the prompt groups of one batch: the fraction whose rewards vary, the fraction where both
    the reward and the path energy W vary, and the mean within-group Pearson correlation of reward
    and W over the latter (NaN when there is none)."""
    groups = np.unique(group)
    varies, both, corrs = 0, 0, []
    for g in groups:
        r, w = rewards[group == g], energy[group == g]
        if len(r) < 2:
            continue
        r_var, w_var = np.ptp(r) > 0, np.ptp(w) > 1e-12 * max(1.0, float(np.abs(w).max()))
        varies += int(r_var)
        if r_var and w_var:
            both += 1
            corrs.append(float(np.corrcoef(r, w)[0, 1]))
    m = max(len(groups), 1)
    return {
        "groups": len(groups),
        "reward_varies_frac": varies / m,
        "both_vary_frac": both / m,
        "corr_reward_w": float(np.mean(corrs)) if corrs else math.nan,
    }


def path_energy(inputs: dict[str, Any]) -> np.ndarray:
    """W per row at its last policy token: Σ_t (1 − 2·π_t + Σπ²_t)·ρ_t² over the policy tokens, the
    cumulative weight the OTB estimators form (``otb_tir.advantage_otb``), from the same inputs."""
    import torch

    mask = inputs["response_mask"].double()
    w = 1 - 2 * torch.exp(inputs["old_log_probs"].double()) + inputs["sum_pi_squared"].double()
    rho = inputs.get("rollout_is_weights")
    if rho is not None:
        w = w * rho.double().square()
    return (w * mask).sum(-1).numpy()


# ----------------------------------------------------------------------------- checkpoints


def mid_dir(out: Path, steps: int) -> Path:
    return out / f"mid_chain_s{steps}"


def ensure_mid_checkpoint(out: Path, settings: Settings, quick: bool) -> Path:
    """The chain warm start after ``mid_steps`` steps of the recipe: trained once, then reused."""
    d = mid_dir(out, settings.mid_steps)
    final = d / "final"
    if (final / "config.json").is_file() and (d / "summary.json").is_file():
        log.info("mid-training checkpoint %s: done already, reused", final)
        return final
    d.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(RECIPE),
        "data.task=chain",
        "trainer.seed=0",
        f"trainer.total_steps={settings.mid_steps}",
        f"trainer.output_dir={d}",
        f"trainer.save_every={max(1, settings.mid_steps // 4)}",
        "trainer.keep_checkpoints=1",
        "trainer.resume=true",
        "trainer.loggers=[jsonl]",
        "eval.before=false",
        "eval.after=false",
        *(QUICK_OVERRIDES + ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2"] if quick else []),
        *settings.overrides,
    ]
    log.info("mid-training checkpoint: %d steps of the recipe on chain -> %s", settings.mid_steps, d)
    t0 = time.perf_counter()
    with open(d / "train.log", "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    if proc.returncode != 0 or not (final / "config.json").is_file():
        tail = (d / "train.log").read_text().splitlines()[-15:]
        raise SystemExit(f"the mid-training run {d} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    log.info("mid-training checkpoint written in %.0f s", time.perf_counter() - t0)
    return final


class Session:
    """A trainer built at one checkpoint (weights fixed: no update is ever applied); each cell draws
    its batches with it. The estimator part only records the trainer's estimator inputs."""

    def __init__(self, ckpt: Checkpoint, settings: Settings, out: Path, model_path: Path | None, quick: bool):
        from otb_tir.builders import build_tools, resolve_device, seed_everything
        from otb_tir.configs import CONFIG_DIR
        from otb_tir.defaults.policy import resolve_policy
        from otb_tir.trainer.config import load_config
        from otb_tir.trainer.distributed import DistInfo
        from otb_tir.trainer.parts import build_parts, trainer_settings
        from otb_tir.trainer.trainer import Trainer

        b = settings.batch
        overrides = [
            *(QUICK_OVERRIDES if quick else []),
            *settings.overrides,
            f"data.task={ckpt.task}",
            f"data.train_batch_size={b}",
            f"actor.ppo_mini_batch_size={b}",
            f"trainer.seed={settings.seed}",
            f"trainer.output_dir={out / 'work' / ckpt.name}",
            "trainer.loggers=[jsonl]",
            "trainer.save_every=0",
            *([f"model.path={model_path}"] if model_path is not None else []),
        ]
        self.cfg = cfg = load_config(CONFIG_DIR / "tir_math_cpu.yaml", overrides)
        resolve_policy(cfg)  # model.path, or the built-in warm-started tiny policy
        seed_everything(settings.seed)
        self.tools = build_tools(cfg)
        parts = build_parts(cfg, self.tools, DistInfo(), resolve_device(cfg.trainer.device))
        self.trainer = Trainer(trainer_settings(cfg, autocast_dtype=parts.autocast_dtype), parts)
        self.base_settings = self.trainer.settings
        self.items = list(parts.cursor.items)
        self.model_path = str(parts.policy_path)
        self.capture = _Capture()
        self.trainer.estimator = self.capture
        self.trainer.scheduler = None  # no optimizer step is ever taken: nothing to schedule
        self.n_params = sum(p.numel() for p in self.trainer.model.parameters())

    def close(self) -> None:
        from agent_env.rollout import run_sync

        run_sync(self.trainer.engine.close())
        if self.trainer.logger is not None:
            self.trainer.logger.close()
        run_sync(self.tools.close())

    def checksum(self) -> float:
        """A fingerprint of the weights (they must not move while a checkpoint is measured)."""
        import torch

        with torch.no_grad():
            return float(sum(p.double().square().sum() for p in self.trainer.model.parameters()))

    def start_cell(self, n: int, settings: Settings) -> None:
        """Every cell of a checkpoint sees the same prompts and sampling seeds (paired across n)."""
        from otb_tir.trainer.data import DataCursor

        tr = self.trainer
        tr.settings = dataclasses.replace(self.base_settings, n=n, ppo_epochs=0)  # rollout + advantages only
        tr.cursor = DataCursor(self.items, settings.batch, seed=settings.seed, shuffle=True)
        tr.step = 0
        if settings.k * settings.batch > len(self.items):
            log.warning(
                "K × B = %d prompts exceed the %d training prompts: later batches repeat prompts",
                settings.k * settings.batch,
                len(self.items),
            )

    def draw(self) -> tuple[dict[str, Any], dict[str, Any], Any, Any, dict[str, float]]:
        """One fresh rollout batch through the trainer's step (rollout, actor forward, reward
        placement, estimator inputs, filters) with no update: (estimator inputs, tensors for the
        gradient pass, loss mask, trajectories, the step's metrics)."""
        from otb_tir.trainer.step import filter_loss_mask

        tr = self.trainer
        res = tr.train_step()
        tr.step += 1
        inputs = self.capture.inputs
        batch = tr.batch
        tensors = dict(batch.tensors)
        tensors["old_log_probs"] = inputs["old_log_probs"]
        loss_mask, _ = filter_loss_mask(batch, tr.settings.filters)
        return inputs, tensors, loss_mask, batch, res.metrics


class _Capture:
    """The trainer's estimator part, recording its inputs; returns GRPO's result (with no update
    step it feeds only the step's own metrics)."""

    def __init__(self) -> None:
        self.inputs: dict[str, Any] = {}

    def __call__(self, **inputs):
        from otb_tir.advantage import get_estimator

        self.inputs = inputs
        return get_estimator("grpo")(**inputs)


# ----------------------------------------------------------------------------- one cell


def cell_path(out: Path, ckpt: str, n: int) -> Path:
    return out / "cells" / f"{ckpt}_n{n}.json"


def finished_cell(out: Path, key: dict[str, Any], estimators: Sequence[str]) -> dict[str, Any] | None:
    p = cell_path(out, key["checkpoint"], key["n"])
    if not p.is_file():
        return None
    try:
        cell = json.loads(p.read_text())
    except json.JSONDecodeError:
        return None
    if cell.get("key") != key or not set(estimators) <= set(cell.get("estimators", {})):
        return None
    return cell


def run_cell(session: Session, ckpt: Checkpoint, n: int, settings: Settings, estimators: Sequence[str], out: Path):
    """K batches at ``n`` samples per prompt; every estimator's gradient on each. Writes the cell."""
    import torch
    from tqdm.auto import tqdm

    k, p = settings.k, session.n_params
    scratch = out / "cells" / f".tmp_{ckpt.name}_n{n}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    vecs = {e: np.lib.format.open_memmap(scratch / f"{e}.npy", "w+", np.float32, (k, p)) for e in estimators}
    sums = {e: np.zeros(p, dtype=np.float64) for e in estimators}
    sum_sq = dict.fromkeys(estimators, 0.0)
    batches: list[dict[str, Any]] = []
    session.start_cell(n, settings)
    tr = session.trainer
    weights = session.checksum()
    t_cell = time.perf_counter()
    bar = tqdm(range(k), desc=f"{ckpt.name} n={n}", unit="batch")
    for i in bar:
        t0 = time.perf_counter()
        inputs, tensors, loss_mask, batch, metrics = session.draw()
        t_roll = time.perf_counter() - t0
        rewards = inputs["token_level_rewards"].double().sum(-1).numpy()
        energy = path_energy(inputs)
        _, group = np.unique(np.asarray(inputs["index"]), return_inverse=True)
        has_policy = inputs["response_mask"].sum(-1).numpy() > 0
        rec: dict[str, Any] = {
            "reward_mean": float(rewards.mean()),
            "accuracy": float(metrics.get("reward/accuracy", math.nan)),
            "policy_tokens_mean": float(metrics.get("response/policy_tokens_mean", math.nan)),
            "tool_token_share": float(metrics.get("response/tool_token_share", math.nan)),
            "tool_call_rate": float(metrics.get("tools/call_rate", math.nan)),
            "w_mean": float(energy[has_policy].mean()) if has_policy.any() else math.nan,
            **group_reward_energy(rewards[has_policy], energy[has_policy], group[has_policy]),
            "rollout_s": t_roll,
            "sq_norm": {},
            "flat_group_nonzero_frac": {},
        }
        flat = np.array([np.ptp(rewards[group == g]) == 0 for g in range(int(group.max()) + 1)])
        t1 = time.perf_counter()
        for e in estimators:
            adv = estimator_advantages(e, inputs).float() * loss_mask
            if bool(adv.ne(0).any()):
                g = policy_gradient(tr.model, tensors, adv, loss_mask, tr.settings.actor)
            else:  # zero advantages: a zero gradient, no backward pass needed
                g = torch.zeros(p)
            gv = g.numpy()
            vecs[e][i] = gv
            sums[e] += gv
            sq = float(np.dot(gv.astype(np.float64), gv))
            sum_sq[e] += sq
            rec["sq_norm"][e] = sq
            # flat-reward groups (no signal) where this estimator still gives a nonzero advantage
            nz = adv.ne(0).any(-1).numpy()
            rec["flat_group_nonzero_frac"][e] = (
                float(np.mean([nz[group == g].any() for g in np.flatnonzero(flat)])) if flat.any() else 0.0
            )
        rec["grad_s"] = time.perf_counter() - t1
        batches.append(rec)
        bar.set_postfix(acc=f"{rec['accuracy']:.2f}", s=f"{time.perf_counter() - t0:.1f}")
    bar.close()
    if session.checksum() != weights:
        raise RuntimeError(f"the weights of {ckpt.name} changed while its n={n} cell was measured")
    results: dict[str, Any] = {}
    for e in estimators:
        st = variance_stats(sums[e], sum_sq[e], k)
        gram = _gram(vecs[e])
        st["variance_from_gram"] = gram_variance(gram) if k > 1 else math.nan
        st["gram"] = gram.tolist()
        st["finite"] = bool(np.isfinite(sums[e]).all())
        results[e] = st
    del vecs
    shutil.rmtree(scratch, ignore_errors=True)
    wall = time.perf_counter() - t_cell
    cell = {
        "key": settings.key(ckpt, n),
        "label": ckpt.label,
        "model_path": session.model_path,
        "n_params": p,
        "estimators": results,
        "batches": batches,
        "context": _context(batches),
        "wall_s": wall,
        "batch_s": wall / k,
    }
    path = cell_path(out, ckpt.name, n)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cell, indent=1))
    os.replace(tmp, path)
    return cell


def _gram(vecs: np.ndarray, chunk: int = 1 << 18) -> np.ndarray:
    """⟨g_i, g_j⟩ of the K stored gradients, in float64, a block of parameters at a time."""
    k, p = vecs.shape
    gram = np.zeros((k, k))
    for c in range(0, p, chunk):
        x = np.asarray(vecs[:, c : c + chunk], dtype=np.float64)
        gram += x @ x.T
    return gram


def _context(batches: list[dict[str, Any]]) -> dict[str, float]:
    def mean(key: str) -> float:
        vals = [b[key] for b in batches if isinstance(b.get(key), (int, float)) and math.isfinite(b[key])]
        return float(np.mean(vals)) if vals else math.nan

    keys = ("reward_mean", "accuracy", "policy_tokens_mean", "tool_token_share", "tool_call_rate", "w_mean")
    out = {k: mean(k) for k in keys}
    out.update({k: mean(k) for k in ("reward_varies_frac", "both_vary_frac", "corr_reward_w", "rollout_s", "grad_s")})
    ests = batches[0]["flat_group_nonzero_frac"] if batches else {}
    out["flat_group_nonzero_frac"] = {
        e: float(np.mean([b["flat_group_nonzero_frac"][e] for b in batches])) for e in ests
    }
    return out


# ----------------------------------------------------------------------------- the report


def _g(x: float, digits: int = 3) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}g}"


def _ratio_text(r: dict[str, float], key: str = "") -> str:
    x, lo, hi = r[f"{key}ratio"], r[f"{key}lo"], r[f"{key}hi"]
    if not math.isfinite(x):
        return "n/a"
    ci = f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) else ""
    return f"{x:.2f}×{ci}"


def _word(r: dict[str, float], key: str = "") -> str:
    """' lower' / ' higher' when the 95 % CI excludes 1, ' ~same' when it holds it, '' without a CI."""
    lo, hi = r[f"{key}lo"], r[f"{key}hi"]
    if not math.isfinite(lo):
        return ""
    return " lower" if hi < 1 else " higher" if lo > 1 else " ~same"


def build_report(cells: dict[str, dict[int, dict]], estimators: Sequence[str], boot: int) -> dict[str, Any]:
    """Ratios (with bootstrap CIs) of every estimator's variance to each reference, per cell, and
    the verdict lines; ``cells[checkpoint][n]`` are finished cell records."""
    ratios: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for ck, by_n in cells.items():
        for n, cell in by_n.items():
            res = cell["estimators"]
            r = ratios.setdefault(ck, {}).setdefault(str(n), {})
            for a in estimators:
                for b in REFERENCES:
                    if a in res and b in res and a != b and len(res[a]["gram"]) > 1:
                        ga, gb = np.array(res[a]["gram"]), np.array(res[b]["gram"])
                        r[f"{a}/{b}"] = ratio_ci(ga, gb, boot, seed=n)
    verdicts = []
    for ck, by_n in cells.items():
        label = CHECKPOINTS[ck].label if ck in CHECKPOINTS else ck
        for what, key in (("gradient variance", ""), ("SNR", "snr_")):
            parts = []
            for b in REFERENCES:
                items = []
                for n in sorted(by_n):
                    rr = ratios[ck][str(n)].get(f"{TIR_OTB}/{b}")
                    if rr is None or not math.isfinite(rr[f"{key}ratio"]):
                        continue
                    items.append(f"n={n} {_ratio_text(rr, key)}{_word(rr, key)}")
                if items:
                    parts.append(f"vs {SHORT.get(b, b)}: " + ", ".join(items))
            if parts:
                verdicts.append(f"{label}: TIR-OTB {what} ÷ reference's = " + "; ".join(parts))
    return {"ratios": ratios, "verdicts": verdicts}


def table_markdown(cells: dict[str, dict[int, dict]], estimators: Sequence[str], report: dict[str, Any]) -> str:
    lines = [
        "Gradient variance across K independent batches (paired: every estimator on the same rollouts). "
        "Var = E‖g − E g‖², ‖E g‖² unbiased, SNR = ‖E g‖² / Var; ratios: Var / reference with a 95 % "
        f"paired-bootstrap CI over batches (none below K = {MIN_K_FOR_CI}). GRPO divides by the group std, so "
        "its gradient is on another scale: compare Var with GRPO (no std) and RLOO, SNR with all. RLOO's "
        "advantage is n/(n−1) × GRPO (no std)'s on the same rollouts: (n/(n−1))² its Var, the same SNR.",
        "",
        "| checkpoint | n | estimator | E‖g‖² | Var | ‖E g‖² | SNR | Var / GRPO | Var / GRPO (no std) | Var / RLOO |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ck, by_n in cells.items():
        for n in sorted(by_n):
            res = by_n[n]["estimators"]
            for e in estimators:
                if e not in res:
                    continue
                s = res[e]
                rat = [
                    _ratio_text(report["ratios"][ck][str(n)][f"{e}/{b}"])
                    if f"{e}/{b}" in report["ratios"].get(ck, {}).get(str(n), {})
                    else ("1 (ref)" if e == b else "n/a")
                    for b in REFERENCES
                ]
                lines.append(
                    f"| {ck} | {n} | {SHORT.get(e, e)} | {_g(s['mean_sq_norm'])} | {_g(s['variance'])} | "
                    f"{_g(s['signal'])} | {_g(s['snr'])} | " + " | ".join(rat) + " |"
                )
    lines += [
        "",
        "Per cell (means over its batches): training-temperature accuracy, policy tokens per episode, groups "
        "whose rewards vary, groups where reward and path energy W both vary, the within-group Pearson "
        "correlation of reward and W over those, flat-reward groups where TIR-OTB's advantage is still "
        "nonzero, seconds per batch.",
        "",
        "| checkpoint | n | K × B | accuracy | policy tokens | reward varies | both vary | corr(r, W) "
        "| flat groups, TIR-OTB ≠ 0 | s / batch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ck, by_n in cells.items():
        for n in sorted(by_n):
            c = by_n[n]
            x = c["context"]
            fz = x["flat_group_nonzero_frac"].get(TIR_OTB, math.nan)
            lines.append(
                f"| {ck} | {n} | {c['key']['k']} × {c['key']['batch']} | {_g(x['accuracy'], 2)} | "
                f"{_g(x['policy_tokens_mean'], 3)} | {_g(x['reward_varies_frac'], 2)} | "
                f"{_g(x['both_vary_frac'], 2)} | {_g(x['corr_reward_w'], 2)} | {_g(fz, 2)} | {c['batch_s']:.1f} |"
            )
    lines += ["", "Verdicts:", *[f"- {v}" for v in report["verdicts"]]]
    return "\n".join(lines)


def plot(cells: dict[str, dict[int, dict]], estimators: Sequence[str], path: Path) -> None:
    """Variance (top) and SNR (bottom) of each estimator's policy gradient against n, one column per
    checkpoint."""
    cks = list(cells)
    styles = dict(zip(PAIRED, [("o", "-"), ("s", "--"), ("^", "-"), ("D", "-"), ("v", ":")]))
    with figure(path, 2, len(cks), figsize=(4.5 * len(cks), 7)) as axes:
        for j, ck in enumerate(cks):
            ns = sorted(cells[ck])
            for e in estimators:
                for row, key in ((0, "variance"), (1, "snr")):
                    pts = [(n, cells[ck][n]["estimators"].get(e, {}).get(key, math.nan)) for n in ns]
                    pts = [(n, v) for n, v in pts if math.isfinite(v) and v > 0]  # log scale: positive values
                    if pts:
                        marker, line = styles.get(e, ("o", "-"))
                        axes[row][j].plot(*zip(*pts), marker=marker, linestyle=line, label=SHORT.get(e, e))
            for row, ylabel in ((0, "Var = E‖g − E g‖²"), (1, "SNR = ‖E g‖² / Var")):
                ax = axes[row][j]
                ax.set_yscale("log")
                ax.set_xscale("log", base=2)
                ax.set_xticks(ns, [str(n) for n in ns])
                ax.set_xlabel("n (samples per prompt)")
                ax.set_ylabel(ylabel)
                ax.grid(True, which="both", alpha=0.3)
            key = next(iter(cells[ck].values()))["key"]
            title = CHECKPOINTS[ck].label if ck in CHECKPOINTS else ck
            axes[0][j].set_title(f"{title}\nK = {key['k']} batches × B = {key['batch']} prompts", fontsize=10)
        axes[0][0].legend(fontsize=8)


def report(out: Path, cells: dict[str, dict[int, dict]], estimators: Sequence[str], settings: Settings) -> str:
    rep = build_report(cells, estimators, settings.boot)
    text = table_markdown(cells, estimators, rep)
    (out / "table.md").write_text(text + "\n")
    slim = {
        ck: {str(n): {k: v for k, v in c.items() if k != "batches"} for n, c in by_n.items()}
        for ck, by_n in cells.items()
    }
    for by_n in slim.values():
        for c in by_n.values():
            c["estimators"] = {e: {k: v for k, v in s.items() if k != "gram"} for e, s in c["estimators"].items()}
    result = {"settings": dataclasses.asdict(settings), "estimators": list(estimators), "cells": slim, **rep}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    if cells:
        plot(cells, estimators, out / "grad_variance.png")
    return text


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", nargs="+", choices=list(CHECKPOINTS), default=None)
    p.add_argument("--ns", nargs="+", type=int, default=None, help="group sizes (default 4 8 16)")
    p.add_argument("--estimators", nargs="+", default=list(PAIRED))
    p.add_argument("--k", type=int, default=None, help="independent batches per cell (default 16)")
    p.add_argument("--batch", type=int, default=None, help="prompts per batch (default 4)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--mid-steps", type=int, default=None, help="training steps of chain_mid (default 8)")
    p.add_argument("--boot", type=int, default=2000, help="bootstrap resamples of the variance ratios")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every cell")
    p.add_argument("--quick", action="store_true", help="smoke run: K=2, n=2, B=2, arith warm start only")
    p.add_argument("--report-only", action="store_true", help="tables and plot from the finished cells")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_grad_variance"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)

    from otb_tir.advantage import get_estimator

    for name in args.estimators:
        get_estimator(VARIANTS.get(name, (name,))[0])  # unknown names fail now
    q = args.quick
    settings = Settings(
        k=args.k if args.k is not None else (2 if q else 16),
        batch=args.batch if args.batch is not None else (2 if q else 4),
        seed=args.seed,
        mid_steps=args.mid_steps if args.mid_steps is not None else (1 if q else 8),
        boot=args.boot if not q else 200,
        overrides=list(args.set),
    )
    if settings.k < 2:
        p.error("--k must be at least 2 (a variance needs two batches)")
    checkpoints = args.checkpoints or (["arith_warm"] if q else list(CHECKPOINTS))
    ns = args.ns or ([2] if q else [4, 8, 16])
    out = Path(args.out)
    (out / "cells").mkdir(parents=True, exist_ok=True)

    cells: dict[str, dict[int, dict]] = {}
    t0 = time.perf_counter()
    for name in checkpoints:
        ck = CHECKPOINTS[name]
        todo = []
        for n in ns:
            done = finished_cell(out, settings.key(ck, n), args.estimators)
            if done is not None:
                log.info("%s n=%d: done already, skipped", name, n)
                cells.setdefault(name, {})[n] = done
            elif not args.report_only:
                todo.append(n)
        if not todo:
            continue
        model_path = ensure_mid_checkpoint(out, settings, q) if ck.mid else None
        session = Session(ck, settings, out, model_path, q)
        try:
            for n in todo:
                log.info("%s n=%d: %d batches of %d prompts", name, n, settings.k, settings.batch)
                cell = run_cell(session, ck, n, settings, args.estimators, out)
                log.info("%s n=%d: %.0f s (%.1f s per batch)", name, n, cell["wall_s"], cell["batch_s"])
                cells.setdefault(name, {})[n] = cell
        finally:
            session.close()
    cells = {ck: dict(sorted(cells[ck].items())) for ck in checkpoints if ck in cells}
    text = report(out, cells, args.estimators, settings)
    print(text)
    print(f"\nwritten: {out / 'results.json'}, {out / 'table.md'}, {out / 'grad_variance.png'}")
    log.info("wall time %.0f s", time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
