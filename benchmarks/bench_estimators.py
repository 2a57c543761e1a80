"""Benchmark: TIR-OTB vs GRPO vs RLOO (vs dense OTB) on the built-in task, with identical seeds.

    python benchmarks/bench_estimators.py                     # 3 estimators × the default run, seed 0
    python benchmarks/bench_estimators.py --seeds 0 1 2 --estimators tir_optimal_token_baseline grpo rloo
    python benchmarks/bench_estimators.py --quick             # a ~2-minute smoke run of the whole script
    python benchmarks/bench_estimators.py --steps 10 rollout.n=4   # trailing key=value: recipe overrides

For each seed and each trained estimator it runs the recipe's local trainer end to end
(:func:`otb_tir.trainer.run.run`, the same warm start, data, config and seed for every estimator)
and reports held-out accuracy before and after. Every ``--measure-every`` steps it also takes that
step's rollout batch — after the trainer's actor forward (old log-probs, Σπ²) and before its PPO
update — and computes *every* estimator's advantages on it, with the verl-defined variance-proxy
metrics of each (:func:`otb_tir.metrics.variance_proxy_metrics`); the signal term ‖ḡ‖² of each is
the squared norm of the policy gradient that estimator's advantages give on that batch, computed by
the trainer's own ``ppo_update`` at the current weights (no optimizer step). So the gradient-noise
comparison is *paired*: the same trajectories, the same Σπ², only the advantages differ.

It prints one table (estimator, accuracy before/after, proxies as mean ± sd over the measured
batches, the paired ratio to GRPO, wall time) and writes everything to
``runs/bench_estimators/results.json`` (per-run summaries, the per-step metrics, every paired
measurement). Wall times on a shared machine are noisy; the proxies and accuracies are not.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from otb_tir.advantage import get_estimator
from otb_tir.configs import CONFIG_DIR
from otb_tir.metrics import variance_proxy_metrics

ROOT = Path(__file__).resolve().parents[1]  # the checkout: runs/ go here

log = logging.getLogger("bench_estimators")

TRAINED = ("tir_optimal_token_baseline", "grpo", "rloo")
PAIRED = ("tir_optimal_token_baseline", "optimal_token_baseline", "grpo", "grpo_no_std", "rloo")
SHORT = {
    "tir_optimal_token_baseline": "TIR-OTB",
    "optimal_token_baseline": "OTB (dense)",
    "grpo": "GRPO",
    "grpo_no_std": "GRPO (no std)",
    "rloo": "RLOO",
}
#: Measured-only variants: (registered estimator, keyword arguments that replace the trainer's).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"grpo_no_std": ("grpo", {"norm_adv_by_std_in_grpo": False})}


def estimator_advantages(name: str, inputs: dict[str, Any]) -> torch.Tensor:
    """``name``'s advantages for the trainer's estimator ``inputs`` (a registered name or a VARIANTS entry)."""
    base, kw = VARIANTS.get(name, (name, {}))
    return get_estimator(base)(**{**inputs, **kw})[0]


PROXIES = ("proxy3_pure_noise", "proxy2_total_power", "proxy1_signal_strength", "expected_a_squared")
QUICK = [
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=4",
    "eval.size=4",
    "rollout.response_length=64",
    "rollout.max_tokens_per_turn=32",
    "trainer.save_every=0",
    "trainer.loggers=[jsonl]",
]


# --------------------------------------------------------------------------- the paired measurement


def paired_proxies(
    inputs: dict[str, Any],
    estimators: Sequence[str],
    *,
    loss_mask: torch.Tensor | None = None,
    grad_norm_fn: Callable[[torch.Tensor, torch.Tensor], float] | None = None,
) -> dict[str, dict[str, float]]:
    """Every estimator's advantages on one batch and their variance-proxy metrics.

    ``inputs``: the keyword arguments the trainer passes to its estimator (``token_level_rewards``,
    ``response_mask``, ``index``, ``old_log_probs``, ``sum_pi_squared``, ``rollout_is_weights``, ...).
    ``loss_mask``: the trainer's mask after its trajectory filters (default: ``response_mask``); the
    advantages are multiplied by it, as the trainer does before its update and its own metrics.
    ``grad_norm_fn(advantages, loss_mask)``: the norm of the policy gradient those advantages give
    (the signal term); without it ``proxy1`` and ``proxy3`` are 0, as verl reports them.
    Returns ``{estimator: {"variance_proxy/...": value, ..., "grad_norm": g}}``.
    """
    mask = inputs["response_mask"].float() if loss_mask is None else loss_mask.float()
    out: dict[str, dict[str, float]] = {}
    for name in estimators:
        adv = estimator_advantages(name, inputs).float() * mask
        gnorm = None
        if grad_norm_fn is not None:  # (zero advantages give a zero gradient: no backward pass needed)
            gnorm = grad_norm_fn(adv, mask) if bool(adv.ne(0).any()) else 0.0
        m = variance_proxy_metrics(
            adv,
            mask,
            inputs["old_log_probs"],
            inputs["sum_pi_squared"],
            rollout_is_weights=inputs.get("rollout_is_weights"),
            gradient_norm=gnorm,
        )
        m["grad_norm"] = float("nan") if gnorm is None else float(gnorm)
        out[name] = m
    return out


class _NoStep:
    """An optimizer stand-in for ``ppo_update``: gradients are computed, never applied
    (``on_step(model)``, if given, sees them where the optimizer would step)."""

    def __init__(self, model: torch.nn.Module, on_step: Callable[[torch.nn.Module], None] | None = None):
        self.model, self.on_step = model, on_step

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        if self.on_step is not None:
            self.on_step(self.model)


def _policy_gradient_pass(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    settings,
    on_step: Callable[[torch.nn.Module], None] | None = None,
) -> dict[str, float]:
    """The trainer's ``ppo_update`` on the whole batch as one mini-batch (KL and entropy terms off,
    no clipping), with no optimizer step; ``on_step`` sees the gradients. Returns its metrics; the
    weights are not changed and the gradients are cleared."""
    from otb_tir.token_stats import TokenStats
    from otb_tir.trainer.actor import ppo_update
    from otb_tir.trainer.ppo import Advantages

    old = TokenStats(tensors["old_log_probs"], None, None)  # the loss reads the old log-probs only
    s = dataclasses.replace(settings, kl_loss_coef=0.0, entropy_coeff=0.0, grad_clip=math.inf)
    was_training = model.training
    try:
        rows = torch.arange(tensors["responses"].shape[0])
        return ppo_update(model, _NoStep(model, on_step), tensors, old, Advantages(advantages, loss_mask), [rows], s)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)


def policy_gradient_norm(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    settings,
) -> float:
    """‖ḡ‖: the norm of the token-mean PPO policy gradient over the whole batch at the current weights
    (ratio 1, so exactly the policy gradient), computed by the trainer's own ``ppo_update`` as one
    mini-batch (KL and entropy terms off); the weights are not changed and the gradients are cleared."""
    return _policy_gradient_pass(model, tensors, advantages, loss_mask, settings)["actor/grad_norm"]


def policy_gradient(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    settings,
) -> torch.Tensor:
    """ḡ itself: the gradient :func:`policy_gradient_norm` measures, flattened into one float32 CPU
    vector in ``model.parameters()`` order (a parameter without a gradient contributes zeros; all NaN
    when the gradient is not finite, where the trainer would skip its step)."""
    params = list(model.parameters())
    got: list[torch.Tensor] = []

    def keep(m: torch.nn.Module) -> None:
        flat = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in params]
        got.append(torch.cat(flat).float().cpu())

    _policy_gradient_pass(model, tensors, advantages, loss_mask, settings, on_step=keep)
    if not got:
        return torch.full((sum(p.numel() for p in params),), math.nan)
    return got[0]


class PairedRecorder:
    """Stands in for the trainer's estimator: returns the trained estimator's result unchanged and,
    on measured steps, records every estimator's proxies on the same batch."""

    def __init__(self, trainer, trained: str, estimators: Sequence[str], measure_every: int):
        self.trainer, self.trained, self.estimators = trainer, trained, list(estimators)
        self.primary = get_estimator(trained)
        self.measure_every = max(1, measure_every)
        self.records: list[dict[str, Any]] = []
        self.calls = 0

    def __call__(self, **inputs):
        result = self.primary(**inputs)
        step = self.trainer.step
        self.calls += 1
        if step % self.measure_every == 0:
            self.records.append(self.measure(inputs, step, result[0]))
        return result

    def measure(self, inputs: dict[str, Any], step: int, trained_adv: torch.Tensor) -> dict[str, Any]:
        from otb_tir.trainer.step import filter_loss_mask

        t0 = time.perf_counter()
        tr = self.trainer
        batch = tr.batch  # the rollout of the step in progress
        tensors = dict(batch.tensors)
        tensors["old_log_probs"] = inputs["old_log_probs"]
        loss_mask, _ = filter_loss_mask(batch, tr.settings.filters)

        def gnorm(adv: torch.Tensor, mask: torch.Tensor) -> float:
            return policy_gradient_norm(tr.model, tensors, adv, mask, tr.settings.actor)

        proxies = paired_proxies(inputs, self.estimators, loss_mask=loss_mask, grad_norm_fn=gnorm)
        same = self.trained not in proxies or torch.equal(
            trained_adv.float() * loss_mask, get_estimator(self.trained)(**inputs)[0].float() * loss_mask
        )
        return {
            "step": step,
            "trained": self.trained,
            "rows": int(loss_mask.shape[0]),
            "reward_mean": float(inputs["token_level_rewards"].sum(-1).mean()),
            "proxies": proxies,
            "trained_adv_reproduced": bool(same),
            "measure_s": time.perf_counter() - t0,
        }


# --------------------------------------------------------------------------- runs and the report


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    vals = [v for v in values if v == v]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def aggregate(runs: list[dict[str, Any]], estimators: Sequence[str], reference: str = "grpo") -> dict[str, Any]:
    """Proxies pooled over every measured batch of every run, and paired ratios to ``reference``."""
    records = [r for run in runs for r in run["paired"]]
    out: dict[str, Any] = {"n_batches": len(records), "estimators": {}}
    for name in estimators:
        row: dict[str, Any] = {}
        for p in PROXIES:
            vals = [r["proxies"][name][f"variance_proxy/{p}"] for r in records if name in r["proxies"]]
            row[p] = _mean_sd(vals)
        row["grad_norm"] = _mean_sd([r["proxies"][name]["grad_norm"] for r in records if name in r["proxies"]])
        if reference in estimators and name != reference:
            for p in ("proxy3_pure_noise", "proxy2_total_power"):
                pairs = [
                    (r["proxies"][name][f"variance_proxy/{p}"], r["proxies"][reference][f"variance_proxy/{p}"])
                    for r in records
                    if name in r["proxies"] and reference in r["proxies"]
                ]
                ratios = [a / b for a, b in pairs if b > 0 and a > 0]
                row[f"{p}_ratio_to_{reference}"] = {
                    "geo_mean": math.exp(statistics.fmean(math.log(x) for x in ratios)) if ratios else float("nan"),
                    "lower_in": sum(a < b for a, b in pairs),
                    "equal_in": sum(a == b for a, b in pairs),
                    "of": len(pairs),
                }
        out["estimators"][name] = row
    return out


def _fmt(ms: tuple[float, float], scale: float = 1.0) -> str:
    m, sd = ms
    return "n/a" if m != m else f"{m * scale:.3g} ± {sd * scale:.2g}"


def print_report(
    runs: list[dict[str, Any]], agg: dict[str, Any], paired: Sequence[str], reference: str = "grpo"
) -> str:
    lines = []
    trained = list(dict.fromkeys(r["estimator"] for r in runs))
    lines.append(
        "held-out accuracy (greedy), per trained estimator, over seeds "
        + ", ".join(str(s) for s in sorted({r["seed"] for r in runs}))
    )
    lines.append(
        f"{'estimator':<14} {'acc before':>11} {'acc after':>11} {'gain (pts)':>11} {'tool calls after':>17} "
        f"{'train s':>8}"
    )
    for name in trained:
        rs = [r for r in runs if r["estimator"] == name]
        before = _mean_sd([r["before"]["accuracy"] for r in rs if r.get("before")])
        after = _mean_sd([r["after"]["accuracy"] for r in rs if r.get("after")])
        gain = _mean_sd(
            [100 * (r["after"]["accuracy"] - r["before"]["accuracy"]) for r in rs if r.get("after") and r.get("before")]
        )
        calls = _mean_sd([r["after"]["tool_call_rate"] for r in rs if r.get("after")])
        wall = _mean_sd([r["train_s"] for r in rs])
        lines.append(
            f"{SHORT.get(name, name):<14} {_fmt(before):>11} {_fmt(after):>11} {_fmt(gain):>11} "
            f"{_fmt(calls):>17} {wall[0]:>8.0f}"
        )
    lines.append("")
    lines.append(
        f"variance proxies on the same {agg['n_batches']} rollout batches (paired; every estimator's "
        "advantages on each batch), mean ± sd over batches"
    )
    hdr = (
        f"{'estimator':<14} {'pure noise (proxy3)':>22} {'total power (proxy2)':>22} {'‖ḡ‖² (proxy1)':>18} "
        f"{'E[Ā²]':>16} {'noise / ' + SHORT.get(reference, reference):>14} "
        f"{'power / ' + SHORT.get(reference, reference):>14}"
    )
    lines.append(hdr)
    for name in paired:
        row = agg["estimators"][name]

        def ratio(p: str, row: dict = row, name: str = name) -> str:
            r = row.get(f"{p}_ratio_to_{reference}")
            if not r:
                return "1 (ref)" if name == reference else "n/a"
            g = r["geo_mean"]
            return f"{g:.3f} ({r['lower_in']}/{r['of']}<)" if g == g else f"n/a (0/{r['of']})"

        lines.append(
            f"{SHORT.get(name, name):<14} {_fmt(row['proxy3_pure_noise']):>22} "
            f"{_fmt(row['proxy2_total_power']):>22} {_fmt(row['proxy1_signal_strength']):>18} "
            f"{_fmt(row['expected_a_squared']):>16} {ratio('proxy3_pure_noise'):>14} "
            f"{ratio('proxy2_total_power'):>14}"
        )
    lines.append(
        "ratios: geometric mean over batches of estimator / reference on the same batch "
        "(k/N<: lower on k of N batches; batches where either is 0 are left out of the mean)"
    )
    lines.append("train s: the training steps' wall time without the paired measurement (noisy on a shared machine)")
    text = "\n".join(lines)
    print(text)
    return text


def run_one(cfg, trained: str, paired: Sequence[str], measure_every: int) -> dict[str, Any]:
    from otb_tir.trainer.run import run

    t0 = time.perf_counter()
    recorders: list[PairedRecorder] = []

    def setup(trainer) -> None:  # the trainer's estimator part, swapped for the recording one
        trainer.estimator = PairedRecorder(trainer, trained, paired, measure_every)
        recorders.append(trainer.estimator)

    summary = run(cfg, setup=setup)
    if len(recorders) != 1 or recorders[0].calls != cfg.trainer.total_steps:
        raise RuntimeError(
            f"the paired-proxy recorder did not see the run's steps (trainers built: {len(recorders)}, "
            f"estimator calls: {recorders[0].calls if recorders else 0}, steps: {cfg.trainer.total_steps})"
        )
    history = []
    metrics_file = Path(cfg.trainer.output_dir) / "metrics.jsonl"
    if metrics_file.is_file():
        history = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    return {
        "estimator": trained,
        "seed": int(cfg.trainer.seed),
        "steps": int(cfg.trainer.total_steps),
        "before": summary.get("before"),
        "after": summary.get("after"),
        "wall_time_s": time.perf_counter() - t0,
        "paired": recorders[0].records,
        "history": history,
        "measure_s": sum(r["measure_s"] for r in recorders[0].records),
        # the training steps' own time: the trainer's step times less the paired measurement inside them
        "train_s": sum(h.get("timing/step_s", 0.0) for h in history)
        - sum(r["measure_s"] for r in recorders[0].records),
        "output_dir": str(cfg.trainer.output_dir),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(CONFIG_DIR / "tir_math_cpu.yaml"))
    p.add_argument("--estimators", nargs="+", default=list(TRAINED), help="estimators to train with")
    p.add_argument("--paired", nargs="+", default=list(PAIRED), help="estimators measured on every measured batch")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's trainer.total_steps)")
    p.add_argument("--measure-every", type=int, default=1, help="paired measurement every k steps")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a ~2-minute smoke run: 2 steps, tiny batches and responses, 4 eval problems, "
        "the built-in base tiny model (no warm start) unless model.path= is given",
    )
    p.add_argument("--out", default=str(ROOT / "runs/bench_estimators"))
    p.add_argument("overrides", nargs="*", help="recipe overrides (key=value), applied to every run")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)

    from otb_tir import ConfigError
    from otb_tir.defaults.policy import resolve_policy
    from otb_tir.trainer.config import load_config

    for name in args.estimators:
        get_estimator(name)  # unknown names fail now
    for name in args.paired:
        get_estimator(VARIANTS.get(name, (name,))[0])
    overrides = [*(QUICK if args.quick else []), *args.overrides]
    if args.quick and not any(o.startswith("model.path=") for o in overrides):
        # the smoke run checks the script, not learning: the built-in base tiny model, no SFT warm start
        from otb_tir.defaults.tiny import tiny_policy_dir

        overrides.append(f"model.path={tiny_policy_dir()}")
    steps = args.steps if args.steps is not None else (2 if args.quick else None)
    if steps is not None:
        overrides.append(f"trainer.total_steps={steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    try:
        for seed in args.seeds:
            before = None
            for name in args.estimators:
                run_dir = out / f"seed{seed}" / name
                extra = [
                    f"trainer.seed={seed}",
                    f"algorithm.adv_estimator={name}",
                    f"trainer.output_dir={run_dir}",
                    "trainer.resume=false",
                ]
                if before is not None:  # same warm start, same held-out set: evaluate "before" once per seed
                    extra.append("eval.before=false")
                cfg = load_config(args.config, [*overrides, *extra])
                resolve_policy(cfg)  # model.path, or the built-in warm-started tiny policy
                log.info("seed %d: training with %s for %d steps -> %s", seed, name, cfg.trainer.total_steps, run_dir)
                res = run_one(cfg, name, args.paired, args.measure_every)
                if before is None:
                    before = res["before"]
                else:
                    res["before"], res["before_shared"] = copy.deepcopy(before), True
                runs.append(res)
                log.info(
                    "%s seed %d: before %s after %s (%.0f s)",
                    name,
                    seed,
                    before and before.get("accuracy"),
                    res["after"] and res["after"].get("accuracy"),
                    res["wall_time_s"],
                )
                (out / "results.json").write_text(json.dumps({"runs": runs, "partial": True}, indent=1))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    agg = aggregate(runs, args.paired)
    text = print_report(runs, agg, args.paired)
    result = {
        "argv": sys.argv[1:] if argv is None else argv,
        "overrides": overrides,
        "seeds": args.seeds,
        "estimators": args.estimators,
        "paired": args.paired,
        "measure_every": args.measure_every,
        "aggregate": agg,
        "runs": runs,
        "report": text,
        "wall_time_s": time.perf_counter() - t_start,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"\nwritten: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
