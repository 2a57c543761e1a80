"""Where a training step's time goes: verl's trainer (``trainer=verl``) and the local trainer on the
same settings, side by side.

Runs ``recipes/train_tir_math.py`` twice as subprocesses with the same overrides — once with the
verl environment's python and ``trainer=verl``, once with this python and the local trainer — and
prints, for each step, the time of each phase and verl / local. Phases: generation (the whole
multi-turn rollout, tools included), old log-prob (Σπ² is computed in the same forward by both),
advantage, update, weight sync, the whole step; and per episode: generation, tool calls, reward.

    python benchmarks/bench_verl_phases.py                       # default CPU settings, 3 steps
    python benchmarks/bench_verl_phases.py --steps 3 -- rollout.n=4 data.train_batch_size=4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (label, local trainer key, verl key): both write the local trainer's names (otb_tir.verl.hooks)
PHASES = [
    ("generation (rollout, tools incl.)", "timing/rollout_s", "timing/gen_s"),
    ("old log-prob + sum_pi_squared", "timing/old_log_prob_s", "timing/old_log_prob_s"),
    ("reward (batch)", None, "timing/reward_s"),
    ("advantage", "timing/advantage_s", "timing/adv_s"),
    ("update", "timing/update_s", "timing/update_actor_s"),
    ("weight sync", "timing/weight_sync_s", "timing/update_weights_s"),
    ("step", "timing/step_s", "timing/step_s"),
    ("per episode: generation", "timing/episode_generate_s", "timing/episode_generate_s"),
    ("per episode: tool calls", "timing/episode_tools_s", "timing/episode_tools_s"),
    ("per episode: reward", "timing/episode_reward_s", "timing/episode_reward_s"),
]


def _steps(out: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows if "timing/step_s" in r}


def _run(python: str, out: Path, args: list[str]) -> float:
    t0 = time.time()
    proc = subprocess.run(
        [python, str(REPO / "recipes" / "train_tir_math.py"), f"trainer.output_dir={out}", *args],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args[:2])} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return time.time() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--verl-python", default=str(REPO / ".venv-verl" / "bin" / "python"))
    p.add_argument("overrides", nargs="*", help="recipe overrides applied to both runs")
    a = p.parse_args()
    common = [
        f"trainer.total_steps={a.steps}",
        "eval.before=false",
        "eval.after=false",
        "trainer.save_every=0",
        *a.overrides,
    ]
    with tempfile.TemporaryDirectory() as tmp:
        wall = {
            "verl": _run(a.verl_python, Path(tmp) / "verl", ["trainer=verl", *common]),
            "local": _run(sys.executable, Path(tmp) / "local", common),
        }
        steps = {"verl": _steps(Path(tmp) / "verl"), "local": _steps(Path(tmp) / "local")}
    print(f"# {time.strftime('%Y-%m-%d')}, {a.steps} steps, overrides: {' '.join(common)}")
    print(f"# launch to exit: verl {wall['verl']:.0f} s, local {wall['local']:.0f} s")
    for step in sorted(set(steps["verl"]) & set(steps["local"])):
        v, l_ = steps["verl"][step], steps["local"][step]
        print(f"\nstep {step}\n| phase | local s | verl s | verl / local |\n|---|---|---|---|")
        for label, lk, vk in PHASES:
            lv = l_.get(lk) if lk else None
            vv = v.get(vk)
            ratio = f"{vv / lv:.2f}" if lv and vv is not None else "–"
            fmt = lambda x: "–" if x is None else f"{x:.3f}"
            print(f"| {label} | {fmt(lv)} | {fmt(vv)} | {ratio} |")


if __name__ == "__main__":
    main()
