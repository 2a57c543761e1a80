#!/usr/bin/env python
"""The cost curve: the same RL step in our local trainer and TRL's GRPOTrainer from the tiny policy's
shape to Qwen3-0.6B's, on this machine, time and memory per phase.

    python benchmarks/bench_scale.py                          # tiny, 30m, 150m, qwen3-0.6b; 3 steps each
    python benchmarks/bench_scale.py --shapes tiny,30m        # the small shapes only (a few minutes)
    python benchmarks/bench_scale.py --shape ~/Qwen2.5-0.5B/config.json   # and any transformers config
    python benchmarks/bench_scale.py --quick                  # smoke: tiny, 2 steps, 2 prompts × n=2, 16 tokens

**Shapes** (``otb_tir/defaults/shapes.py``; parameters as ``sum(p.numel())`` counts them, tied
embeddings once): ``tiny`` (the built-in policy's shape, 1.3M, vocabulary 2,125), ``30m`` (29.9M) and
``150m`` (151.0M), Qwen3 layers over a 49,152-token vocabulary (SmolLM2's: models of that size use
~50k; Qwen3's 151,936 alone would be 58M parameters at the 30M shape's width), ``qwen3-0.6b`` (596M,
vocabulary 151,936), and
``--shape config.json``. Each gets random weights (seed 0, float32) and a tokenizer of exactly its
vocabulary size: the tiny policy's, its chat template (which renders tool calls) and special tokens
unchanged, padded with filler tokens (:func:`otb_tir.defaults.shapes.save_shape`; nothing downloads).
The folders are kept under ``<out>/models`` and reused.

**Same work** (``benchmarks/bench_peers.py``'s rules; its functions run both trainers): the same
prompts per step (our data cursor's order for seed 0, given to TRL unshuffled and checked), group
size, lr 2e-4 constant, AdamW β (0.9, 0.99), grad clip 1, clip 0.2 / 0.28, no KL, one optimizer step
per batch, token-mean loss, one process each, the same micro-batch (trajectories per forward/backward:
ours ``actor.ppo_micro_batch_size``, TRL ``per_device_train_batch_size`` with gradient accumulation over
the batch). Precision: ``trl`` trains and generates in float32 (``bf16=False``); ``trl_bf16`` is TRL at
its own default (``bf16=True``: accelerate's bfloat16 autocast over float32 weights). ``ours`` is the
recipe's default: ``rollout.dtype=auto`` (a bfloat16 copy of the weights in the engine on a CPU with
native bfloat16 for a policy of >= 20M parameters) and ``model.dtype=auto`` (the actor's forward and
backward under bfloat16 autocast over float32 master weights there from 100M parameters), so float32
everywhere on an AVX2-only VM and at the tiny shape; ``ours_fp32`` (``model.dtype=float32
rollout.dtype=float32``) is ours in float32 throughout, as ``trl``; ``ours_ckpt`` adds gradient
checkpointing to ``ours``. The table gives each of ours' rows against ``trl`` and, where run,
``trl_bf16``.

**Equal work with random weights**, which would otherwise stop at random points and call no tool:

- *Every sample is exactly the budget long.* Ours: no token ends a turn (the episode's
  ``stop_token_ids=[]``, set in this script's worker through ``EpisodeConfig.from_sections``, the one
  translation of the config; the engine already runs with ``stop_at_eos=False``): each turn ends on
  ``max_tokens``. TRL: ``generation_kwargs={"min_new_tokens": R}`` (transformers masks the eos ids until
  R tokens are out; ``max_completion_length=R``). Checked per step from each run's own output: policy
  tokens = samples × R for both, and TRL's logged completion min = max = R.
- *No tool runs, one assistant turn.* Both prompts list the same one tool, ``calculator`` (in-process
  sympy: no sandbox process), so both render the same prompt; ours runs one assistant turn
  (``multi_turn.max_assistant_turns=1``: calls on the last turn are not executed), TRL
  ``max_tool_calling_iterations=0``.
- *Both run the full update.* The reward is ``benchmarks/scale_reward.py``'s seeded U(0, 1) per sample
  (a hash of seed, ground truth and text): no group has equal rewards, no batch zero advantages.

**Measured** per shape × trainer, steps 2..N (the first carries start-up): samples/s, policy tokens/s,
seconds per phase — generation (ours ``timing/gen_s``, TRL its ``generate`` calls), old log-probs + Σπ²
(ours ``timing/old_log_prob_s``; TRL computes none on-policy), update (ours ``timing/update_s``;
TRL the step less generation, rewards and advantages: loss forward + backward + optimizer) — peak RSS
of the trainer's process (``wait4``), and each phase's growth with the parameter count (the slope of
log seconds against log parameters). ``ours`` is the recipe's default (TIR-OTB); ``--trainers`` also
takes bench_peers' other rows of ours (``ours_grpo``: GRPO, TRL's estimator; ``ours_torch_threads`` ...).

**Batch**: the same at every shape, so the curve is one step's work against the model's size: 4 prompts
× n=4, R=128 tokens, micro-batch 8 — what fits Qwen3-0.6B in 24 GB for both trainers: parameters,
gradients and AdamW's two moments in float32 are ~16 B/parameter (9.5 GB), TRL's [8, 128, 151,936]
float32 logits ~0.6 GB a copy (a few copies live through its loss), activations of 8 rows of ~180 tokens
over 28 layers a few GB. Measured 2026-12-07 (2-core AVX-512-BF16 VM): at 0.6B ours ~76 s a step,
TRL ~155 s, ~5-6 min per trainer with start-up (150m: ~1.5 min). Disk: 2.4 GB for the 0.6B folder.

Writes ``<out>/results.json`` (default ``runs/bench_scale/``; resumable: a shape × trainer already there
is not rerun unless ``--force``), prints the table and writes ``<out>/scale.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import bench_peers as bp
from scale_reward import SEED_ENV

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
REWARD = f"{SCRIPT.with_name('scale_reward.py')}:random_reward"
SHAPE_NAMES = ("tiny", "30m", "150m", "qwen3-0.6b")
TRAINERS = tuple(t for t in bp.LABELS if t != "trl_cb")  # continuous batching preallocates a paged cache
GIB = 1024.0  # MB per GiB (peak RSS is in MB)


@dataclass(frozen=True)
class Batch:
    """One step's work, the same for both trainers."""

    prompts: int = 4
    n: int = 4
    response_length: int = 128  # R: every sample is exactly this long
    micro: int = 8  # trajectories per forward/backward

    @property
    def samples(self) -> int:
        return self.prompts * self.n

    def label(self) -> str:
        return f"{self.prompts}×{self.n}, R={self.response_length}, micro {self.micro}"


BATCH = Batch()  # every shape: the curve is the same work against the model's size
QUICK = Batch(prompts=2, n=2, response_length=16, micro=4)


def settings(b: Batch, steps: int, timeout_s: float) -> bp.Settings:
    """bench_peers' settings for ``b``: one assistant turn of the whole budget."""
    if b.samples % b.micro or b.micro % b.n:
        raise SystemExit(f"the micro-batch ({b.micro}) must divide the batch ({b.samples}) and hold whole groups")
    return bp.Settings(
        prompts=b.prompts,
        n=b.n,
        steps=steps,
        seeds=(0,),
        response_length=b.response_length,
        max_tokens_per_turn=b.response_length,
        max_assistant_turns=1,
        train_size=max(64, b.prompts * steps),
        timeout_s=timeout_s,
    )


def ours_overrides(b: Batch) -> list[str]:
    return [f"actor.ppo_micro_batch_size={b.micro}", "multi_turn.tools=[calculator]", f"reward.name={REWARD}"]


def trl_spec(b: Batch, s: bp.Settings) -> dict[str, Any]:
    """bench_peers.trl_worker's spec beyond the settings: TRL's side of the equal work."""
    return {
        "tools": ["calculator"],
        "reward": REWARD,
        "save_model": False,
        "grpo_args": {
            "per_device_train_batch_size": b.micro,
            "gradient_accumulation_steps": s.samples_per_step // b.micro,
            "generation_kwargs": {"min_new_tokens": s.response_length},
            "max_tool_calling_iterations": 0,
        },
    }


def no_stop_tokens() -> None:
    """From now on in this process no token ends an assistant turn: the episode's ``stop_token_ids=[]``
    (every turn ends on its token budget), added where a config becomes an episode config
    (``EpisodeConfig.from_sections``, the one translation)."""
    from agent_env.episode_config import EpisodeConfig

    inner = EpisodeConfig.from_sections.__func__

    def from_sections(cls, rollout, multi_turn, reward=None, **kw):
        return inner(cls, rollout, multi_turn, reward, **{"stop_token_ids": [], **kw})

    EpisodeConfig.from_sections = classmethod(from_sections)


def ours_worker(stats_path: Path, overrides: list[str]) -> int:
    """bench_peers' worker of ours, with :func:`no_stop_tokens`."""
    no_stop_tokens()
    return bp.ours_worker(stats_path, overrides)


# --------------------------------------------------------------------------- one run


def shape_label(shape: str) -> str:
    """A name for the shape: its own, or a config file's folder (``.../Qwen2.5-0.5B/config.json``) or stem."""
    if shape in SHAPE_NAMES or "/" not in shape and not shape.endswith(".json"):
        return shape
    p = Path(shape)
    return p.parent.name if p.name == "config.json" and p.parent.name else p.stem


def model_folder(shape: str, out: Path, timeout_s: float) -> tuple[Path, int]:
    """The shape's model folder under ``out/models`` (built in a subprocess, reused when there) and its
    parameter count."""
    folder = out / "models" / shape_label(shape)
    cmd = [sys.executable, str(SCRIPT), "--save-shape", shape, str(folder)]
    r = bp.run_child(cmd, out / "models" / f"{shape_label(shape)}.log", timeout_s)
    if r["rc"] != 0:
        raise SystemExit(f"building shape {shape} failed: {bp._tail(r['log'])}")
    return folder, int(json.loads((folder / "otb_tir_shape.json").read_text())["parameters"])


def equal_work(run: dict[str, Any], b: Batch) -> str:
    """'' when every step of ``run`` sampled exactly samples × R policy tokens (and, TRL, logged its
    completions min = max = R and no group of equal rewards), else what differed."""
    want = b.samples * b.response_length
    bad = []
    for i, x in enumerate(run.get("steps") or [], 1):
        got = x.get("policy_tokens")
        lengths = [x.get(f"log/completions/{k}_length") for k in ("min", "max")]
        if got != want or any(v is not None and v != b.response_length for v in lengths):
            bad.append(f"step {i}: {got} policy tokens (want {want}), completion min/max {lengths}")
        if x.get("log/frac_reward_zero_std", 0.0) != 0.0:
            bad.append(f"step {i}: a share {x['log/frac_reward_zero_std']} of groups had equal rewards")
    return "; ".join(bad)


def run_one(shape: str, trainer: str, folder: Path, out: Path, b: Batch, s: bp.Settings) -> dict[str, Any]:
    """One trainer at one shape: the run (bench_peers.run_ours / run_trl) and its figures."""
    where = out / "runs" / shape_label(shape) / trainer
    if trainer.startswith("trl"):
        run = bp.run_trl(s, 0, where, folder, trainer, spec_extra=trl_spec(b, s))
    else:
        extra = [*ours_overrides(b), *bp.OURS_EXTRA.get(trainer, ())]
        run = bp.run_ours(s, 0, where, folder, bp.ESTIMATORS[trainer], extra, script=SCRIPT)
        shutil.rmtree(where / "final", ignore_errors=True)  # 2.4 GB at 0.6B; nothing evaluates it here
    fig = bp.per_run_figures(run, b.samples) if not run.get("error") else {}
    return {"run": run, "figures": fig, "phases": phases(run, fig), "equal_work": equal_work(run, b)}


def phases(run: dict[str, Any], fig: dict[str, Any]) -> dict[str, float]:
    """Seconds per step of generation, old log-probs + Σπ², update, and the rest, alike for both."""
    if not fig:
        return {}
    p = {k[len("phase/") :]: v for k, v in fig.items() if k.startswith("phase/")}
    step = fig["step_s"]
    if "prepare_s" in p:  # TRL: generation, rewards and advantages, then loss forward + backward + optimizer
        out = {"generation": p.get("generate_s", math.nan), "old_log_prob": 0.0, "update": step - p["prepare_s"]}
    else:
        out = {k: p.get(f"{v}_s", math.nan) for k, v in (("generation", "generate"), ("old_log_prob", "old_log_prob"))}
        out["update"] = p.get("update_s", math.nan)
    out["other"] = step - sum(out.values())
    return out


# --------------------------------------------------------------------------- report


def _gib(mb: Any) -> str:
    return bp._f(mb / GIB if isinstance(mb, (int, float)) else None)


def render_table(results: dict[str, Any]) -> str:
    """The markdown table of ``results["runs"]`` (shape × trainer), in parameter order, ours/TRL on ours' rows."""
    rows = sorted(results["runs"].values(), key=lambda r: (r["parameters"], r["trainer"].startswith("trl")))
    head = (
        "| shape | params | vocab | batch | trainer | step s | samples/s | policy tokens/s | generation s "
        "| old log-probs + Σπ² s | update s | peak RSS GiB | ours/TRL samples/s | ours/TRL peak RSS "
        "| ours/TRL-bf16 samples/s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    out = [head]
    for r in rows:
        f, p = r.get("figures") or {}, r.get("phases") or {}
        trl = results["runs"].get(f"{r['shape']}/trl")
        trl16 = results["runs"].get(f"{r['shape']}/trl_bf16")
        ratio = rss = ratio16 = "–"
        if not r["trainer"].startswith("trl") and trl and trl.get("figures") and f:
            ratio = f"{f['samples_per_s'] / trl['figures']['samples_per_s']:.2f}×"
            rss = f"{f['peak_rss_mb'] / trl['figures']['peak_rss_mb']:.2f}×"
        if not r["trainer"].startswith("trl") and trl16 and trl16.get("figures") and f:
            ratio16 = f"{f['samples_per_s'] / trl16['figures']['samples_per_s']:.2f}×"
        name = r["trainer"] + (" ⚠ unequal work" if r.get("equal_work") else "") + (" ✗ failed" if not f else "")
        out.append(
            f"| {r['shape']} | {r['parameters'] / 1e6:.1f}M | {r['vocab_size']:,} | {r['batch']} | {name} "
            f"| {bp._f(f.get('step_s'))} | {bp._f(f.get('samples_per_s'))} "
            f"| {bp._f(f.get('sampled_tokens_per_s'), '.0f')} "
            f"| {bp._f(p.get('generation'))} | {bp._f(p.get('old_log_prob'))} | {bp._f(p.get('update'))} "
            f"| {_gib(f.get('peak_rss_mb'))} | {ratio} | {rss} | {ratio16} |"
        )
    return "\n".join(out)


def growth(results: dict[str, Any]) -> list[str]:
    """Per trainer, each phase's slope of log seconds against log parameters (least squares over the
    shapes measured): which phase grows fastest with the model."""
    lines = []
    for trainer in sorted({r["trainer"] for r in results["runs"].values()}):
        rs = [r for r in results["runs"].values() if r["trainer"] == trainer and r.get("phases")]
        if len({r["parameters"] for r in rs}) < 2:
            continue
        slopes = {}
        for key in ("generation", "old_log_prob", "update"):
            pts = [(math.log(r["parameters"]), math.log(r["phases"][key])) for r in rs if r["phases"].get(key, 0) > 0]
            if len(pts) >= 2:
                mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
                den = sum((x - mx) ** 2 for x, _ in pts)
                slopes[key] = sum((x - mx) * (y - my) for x, y in pts) / den if den else math.nan
        if slopes:
            fastest = max(slopes, key=lambda k: slopes[k])
            text = ", ".join(f"{k} {v:.2f}" for k, v in slopes.items())
            lines.append(f"{trainer}: seconds ∝ params^slope — {text}; fastest: {fastest}")
    return lines


def plot(results: dict[str, Any], path: Path) -> None:
    """Step seconds and peak RSS against parameters (log-log), one line per trainer, and the phases'
    seconds of ours and TRL."""
    from figures import figure
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    trainers = sorted({r["trainer"] for r in results["runs"].values() if r.get("figures")})
    with figure(path, 1, 3, (16, 4.6)) as axes:
        for t in trainers:
            rs = sorted((r for r in results["runs"].values() if r["trainer"] == t and r.get("figures")),
                        key=lambda r: r["parameters"])  # fmt: skip
            x = [r["parameters"] / 1e6 for r in rs]
            style = "--" if t.startswith("trl") else "-"
            axes[0][0].plot(x, [r["figures"]["step_s"] for r in rs], style, marker="o", label=t)
            axes[0][1].plot(x, [r["figures"]["peak_rss_mb"] / GIB for r in rs], style, marker="o", label=t)
            for key, colour in (("generation", "C0"), ("old_log_prob", "C1"), ("update", "C2")):
                if t not in ("ours", "trl"):  # the phases of the default row and TRL's only
                    continue
                ys = [r["phases"].get(key, math.nan) for r in rs]
                if any(y > 0 for y in ys):
                    axes[0][2].plot(x, ys, style, color=colour, marker="o", label=f"{t} {key}")
        for ax, title in zip(axes[0], ("step seconds", "peak RSS GiB", "seconds per phase")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            for axis in (ax.xaxis, ax.yaxis):  # plain numbers, the minor ticks unlabelled
                axis.set_major_formatter(ScalarFormatter())
                axis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("parameters (M)")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--ours-worker"]:  # internal: one run of ours (key=value overrides follow)
        return ours_worker(Path(argv[1]), argv[2:])
    if argv[:1] == ["--save-shape"]:  # internal: one shape's model folder
        from otb_tir.defaults.shapes import save_shape

        save_shape(argv[1], argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help=f"comma-separated of {', '.join(SHAPE_NAMES)} (default all)")
    p.add_argument("--shape", action="append", default=[], help="a transformers config.json, added to --shapes")
    p.add_argument("--trainers", default="ours,trl", help=f"comma-separated of {', '.join(TRAINERS)}")
    p.add_argument(
        "--steps", type=int, default=None, help="steps per run (default 3, --quick 2); the first is left out"
    )
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_scale")
    p.add_argument("--force", action="store_true", help="rerun shape × trainer pairs already in results.json")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny only, 2 steps, 2 prompts × n=2, R=16")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per trainer run")
    a = p.parse_args(argv)
    shapes = [x for x in (a.shapes or ("tiny" if a.quick else ",".join(SHAPE_NAMES))).split(",") if x] + a.shape
    bad = [x for x in shapes if x not in SHAPE_NAMES and not x.endswith(".json")]
    if bad:
        p.error(f"unknown --shapes {bad}: choose from {list(SHAPE_NAMES)}, or give a config.json with --shape")
    trainers = [t for t in a.trainers.split(",") if t]
    if [t for t in trainers if t not in TRAINERS]:
        p.error(f"unknown --trainers {[t for t in trainers if t not in TRAINERS]}; choose from {list(TRAINERS)}")
    if any(t.startswith("trl") for t in trainers):
        try:
            import trl  # noqa: F401
        except ImportError as e:
            print(f"TRL is not installed ({e}): pip install 'otb-tir[peers]'; running without it", file=sys.stderr)
            trainers = [t for t in trainers if not t.startswith("trl")]
    b = QUICK if a.quick else BATCH
    s = settings(b, a.steps or (2 if a.quick else 3), a.timeout)
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(SEED_ENV, "0")  # the reward's seed, for both trainers' processes
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {"runs": {}}
    from otb_tir.machine import speed_reference

    print(f"# bench_scale {time.strftime('%Y-%m-%d %H:%M')}: shapes {shapes}, trainers {trainers}, {b.label()}, "
          f"{s.steps} steps", flush=True)  # fmt: skip
    for shape in shapes:
        folder, params = model_folder(shape, out, a.timeout)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        for t in trainers:
            key = f"{shape_label(shape)}/{t}"
            if key in results["runs"] and not a.force:
                print(f"# {key}: in results.json already (--force reruns it)", flush=True)
                continue
            gflops = speed_reference()["matmul_gflops"]
            r = run_one(shape, t, folder, out, b, s)
            f = r["figures"]
            results["runs"][key] = {
                "shape": shape_label(shape),
                "trainer": t,
                "parameters": params,
                "vocab_size": vocab,
                "batch": b.label(),
                "batch_settings": dataclasses.asdict(b),
                "steps": s.steps,
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "speed_reference_gflops": gflops,
                **r,
            }
            path.write_text(json.dumps(results, indent=1, default=str))
            print(
                f"# {key}: "
                + (f"error {r['run']['error']}" if r["run"].get("error") else
                   f"step {f['step_s']:.2f} s, {f['samples_per_s']:.2f} samples/s, peak RSS "
                   f"{f['peak_rss_mb'] / GIB:.2f} GiB, wall {r['run']['wall_s']:.0f} s, speed reference "
                   f"{gflops:.1f} GFLOP/s, 1-min load {r['run']['load_before']:.1f} → {r['run']['load_after']:.1f}"
                   + (f" — UNEQUAL WORK: {r['equal_work']}" if r["equal_work"] else "")),
                flush=True,
            )  # fmt: skip
    print()
    print(render_table(results))
    print("\nGrowth with the parameter count (slope of log seconds against log parameters, steps 2..N):")
    for line in growth(results) or ["(fewer than two shapes measured)"]:
        print(f"- {line}")
    same = {k: r["run"].get("same_prompts_as_ours") for k, r in results["runs"].items() if k.endswith("/trl")}
    if same:
        print("TRL drew our trainer's prompts step after step: " + ", ".join(f"{k} {v}" for k, v in same.items()))
    plot(results, out / "scale.png")
    print(f"\nresults: {path}, figure: {out / 'scale.png'}")
    failed = [k for k, r in results["runs"].items() if r["run"].get("error") or r.get("equal_work")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
