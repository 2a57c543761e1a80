"""A real pretrained model learns to use its tools: SmolLM2-135M-Instruct, cold start then RL, evaluated
before, after the cold start and after RL, with and without tools; TIR-OTB beside GRPO over seeds.

    python benchmarks/bench_smollm2.py --out runs/bench_smollm2                       # OTB and GRPO × seeds 0 1 2
    python benchmarks/bench_smollm2.py --out runs/bench_smollm2 --estimators tir_optimal_token_baseline --seeds 0
    python benchmarks/bench_smollm2.py --out runs/bench_smollm2 -- trainer.total_steps=30   # recipe overrides

What runs, each timed and each resumable (a finished piece in ``--out`` is read, not run again):

1. the conversion of the GGUF file into an HF folder (``otb_tir.defaults.smollm2``, once per cache);
2. per seed and estimator, README's command ``recipes/train_tir_math.py --config tir_math_smollm2
   trainer.seed=S algorithm.adv_estimator=E`` as a subprocess: the cold start (the first run builds it,
   the others find it cached: its own build time is in its folder's record), RL, the run's held-out
   figures before and after (with tools);
3. ``recipes/eval_tool_use.py`` (the tool-use evaluation, with and without tools) on the base model, on the
   cold start's folder (``summary.json``'s ``start_model``) and on each run's final model, on the run's
   held-out problems and episode settings (greedy, one sample each).

Prints per run and per estimator (mean [min, max] over seeds): held-out accuracy with and without tools
before (base) / after the cold start / after RL, the tool-call rate and success, the mean response length,
and the wall time of the whole path one user walks (conversion + cold start + RL + three evaluations).
Writes ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_verl_learns import run_one  # the script's folder is on sys.path

from otb_tir.machine import describe, native_bf16, speed_reference

REPO = Path(__file__).resolve().parents[1]
CONFIG = "tir_math_smollm2"
ESTIMATORS = ("tir_optimal_token_baseline", "grpo")


def episode_overrides(cfg) -> list[str]:
    """The evaluation's settings from the training config: its held-out problems and episodes, greedy."""
    return [
        f"data.task={cfg.data.task}",
        f"data.size={cfg.eval.size}",
        "rollout.n=1",
        f"rollout.temperature={cfg.eval.temperature}",
        "eval.pass_k=[1]",
        f"rollout.response_length={cfg.rollout.response_length}",
        f"rollout.max_tokens_per_turn={cfg.rollout.max_tokens_per_turn}",
        f"multi_turn.format={cfg.multi_turn.format}",
        f"multi_turn.max_assistant_turns={cfg.multi_turn.max_assistant_turns}",
        f"multi_turn.max_tool_response_length={cfg.multi_turn.max_tool_response_length}",
        f"multi_turn.tools=[{','.join(cfg.multi_turn.tools)}]",
        "rollout.dtype=bfloat16" if native_bf16() else "rollout.dtype=float32",
        "output.plots=false",
    ]


def evaluate(model: Path, out: Path, name: str, overrides: list[str], timeout: float) -> dict[str, Any]:
    """The tool-use evaluation of ``model`` (with and without tools): its figures and wall seconds."""
    report = out / f"{name}.json"
    if not report.is_file():
        t0 = time.time()
        cmd = [
            sys.executable,
            str(REPO / "recipes" / "eval_tool_use.py"),
            "--model",
            str(model),
            f"output.dir={out}",
            f"output.name={name}",
            *overrides,
        ]
        proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"eval of {model} failed: " + proc.stderr[-1500:])
        (out / f"{name}.wall_s").write_text(f"{time.time() - t0:.1f}")
    r = json.loads(report.read_text())
    w, o = r["with_tools"]["overall"], (r.get("without_tools") or {}).get("overall", {})
    return {
        "accuracy_tools": w["accuracy/mean@n"],
        "accuracy_no_tools": o.get("accuracy/mean@n"),
        "tool_call_rate": w.get("tools/call_rate"),
        "tool_success_rate": w.get("tools/success_rate"),
        "response_length": w.get("response/length_mean"),
        "wall_s": float((out / f"{name}.wall_s").read_text()),
    }


def stats(xs: list[float | None], fmt: str = ".2f") -> str:
    """Mean [min, max] of the values given (one value: itself); "–" where there is none (a tool success
    rate of a model that never calls)."""
    xs = [x for x in xs if x is not None and x == x]
    if not xs:
        return "–"
    mean = f"{sum(xs) / len(xs):{fmt}}"
    return mean if len(xs) == 1 else f"{mean} [{min(xs):{fmt}}, {max(xs):{fmt}}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--estimators", default=",".join(ESTIMATORS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench_smollm2")
    p.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    p.add_argument("overrides", nargs="*", help="recipe overrides applied to every run")
    a = p.parse_args(argv)
    from otb_tir.configs import resolve_config
    from otb_tir.trainer.config import load_config

    root = a.out.resolve()
    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config(resolve_config(CONFIG), a.overrides)
    ev = episode_overrides(cfg)
    results: dict[str, Any] = {"machine": describe(), "speed_reference": speed_reference(), "runs": {}}

    t0 = time.time()
    from otb_tir.defaults.smollm2 import smollm2_dir

    base = smollm2_dir()  # converted once into the cache (its marker records the conversion's seconds)
    convert = json.loads((base / "otb_tir_smollm2.json").read_text()).get("seconds", time.time() - t0)
    results["conversion_s"] = convert
    results["base"] = evaluate(base, root, "eval_base", ev, a.timeout)
    print(f"base {base}: {results['base']}", flush=True)
    cold_record: dict[str, Any] | None = None
    for seed in a.seeds:  # seed-major: an interrupted benchmark has every estimator's first seeds
        for est in [e for e in a.estimators.split(",") if e]:
            name = f"{est}-seed{seed}"
            args = ["--config", CONFIG, f"trainer.seed={seed}", f"algorithm.adv_estimator={est}", *a.overrides]
            summary, wall, err = run_one(sys.executable, root / name, args, a.timeout)
            if err:
                print(f"{name}: failed: {err}", flush=True)
                results["runs"][name] = {"error": err}
                continue
            start = Path(summary["start_model"])
            cold_record = cold_record or json.loads((start / "otb_tir_cold_start.json").read_text())
            if "cold" not in results:
                results["cold"] = evaluate(start, root, "eval_cold_start", ev, a.timeout)
                print(f"after the cold start {start}: {results['cold']}", flush=True)
            after = evaluate(root / name / "final", root / name, "eval_after", ev, a.timeout)
            results["runs"][name] = {
                "estimator": est,
                "seed": seed,
                "wall_s": wall,
                "summary_before": summary["before"],
                "summary_after": summary["after"],
                "after": after,
            }
            print(f"{name}: {after} (run {wall:.0f} s)", flush=True)
    if cold_record is not None:
        results["cold_start_s"] = cold_record["train_seconds"] + cold_record["trace_seconds"]
    (root / "results.json").write_text(json.dumps(results, indent=2))

    print(
        "\n| stage | estimator | accuracy with tools | without tools | tool-call rate | tool success "
        "| response length |"
    )
    print("|---|---|---|---|---|---|---|")
    for stage, r in (("base", results["base"]), ("after the cold start", results.get("cold"))):
        if r:
            print(
                f"| {stage} | – | {stats([r['accuracy_tools']])} | {stats([r['accuracy_no_tools']])} "
                f"| {stats([r['tool_call_rate']])} | {stats([r['tool_success_rate']])} "
                f"| {stats([r['response_length']], '.0f')} |"
            )
    for est in [e for e in a.estimators.split(",") if e]:
        rs = [r for r in results["runs"].values() if r.get("estimator") == est]
        if not rs:
            continue
        col = {
            k: stats([r["after"][k] for r in rs], ".0f" if k == "response_length" else ".2f")
            for k in ("accuracy_tools", "accuracy_no_tools", "tool_call_rate", "tool_success_rate", "response_length")
        }
        print(
            f"| after RL ({len(rs)} seeds) | {est} | {col['accuracy_tools']} | {col['accuracy_no_tools']} "
            f"| {col['tool_call_rate']} | {col['tool_success_rate']} | {col['response_length']} |"
        )
    gains = {
        e: [
            r["after"]["accuracy_tools"] - results["cold"]["accuracy_tools"]
            for r in results["runs"].values()
            if r.get("estimator") == e
        ]
        for e in a.estimators.split(",")
        if results.get("cold")
    }
    for est, g in gains.items():
        if g:
            print(
                f"- {est}: after RL − after the cold start, with tools, per seed: {', '.join(f'{x:+.2f}' for x in g)}"
            )
    runs = [r for r in results["runs"].values() if "wall_s" in r]
    if runs and results.get("cold"):
        path = [
            results["conversion_s"]
            + results.get("cold_start_s", 0)
            + r["wall_s"]
            + results["base"]["wall_s"]
            + results["cold"]["wall_s"]
            + r["after"]["wall_s"]
            for r in runs
        ]
        print(
            f"- the whole path (conversion + cold start + RL with its held-out passes + three evaluations): "
            f"{stats(path, '.0f')} s"
        )
    ref = results["speed_reference"]["matmul_gflops"]
    print(
        f"\nmachine: {describe()}; speed reference {ref:.0f} GFLOP/s; bfloat16 {native_bf16() or 'emulated'}; "
        f"runs in {root}"
    )
    return 1 if any("error" in r for r in results["runs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
