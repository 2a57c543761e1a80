"""Where a training step's time goes, per trainer: the local trainer and verl's trainer in each
``verl.trainer_mode`` (legacy, V1 sync, V1 colocate_async, V1 separate_async), on the same settings.

Runs ``recipes/train_tir_math.py`` once per trainer as a subprocess with the same overrides (the
local trainer with this python, verl with the verl environment's) and prints, per trainer, the mean
over the steps after the first (the first carries start-up and first-request warm-up) of:

* each phase: generation (the trainer waiting for samples), reward, old log-prob (Σπ² in the same
  forward), advantage, update, weight sync, the whole step;
* samples/s and sampled (policy) tokens/s over the step;
* staleness: mean and max weight-version lag of the samples trained on;
* the peak resident set of each process of the run (the trainer's, Ray's workers: sampled every
  second with psutil);
* trainer idle (waiting on rollouts) and rollout idle (the rollout servers waiting on the trainer),
  and the overlap they imply (rollout busy while the trainer computes).

    python benchmarks/bench_verl_phases.py                                   # all CPU modes, 4 steps
    python benchmarks/bench_verl_phases.py --modes local,legacy,sync -- rollout.n=4
    python benchmarks/bench_verl_phases.py --modes sync,colocate_async,separate_async --gpu  # a GPU machine

On a 2-core CPU the asynchronous modes share the cores between rollout and training, so they are
not expected to be faster here; what they show is which phases overlap. separate_async runs its
rollout on a pool of its own (a second logical GPU of the CPU profile) and moves weights with our
``gloo`` checkpoint engine (otb_tir/verl/gloo_engine.py); on a GPU machine verl's nccl engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINERS = ("local", "legacy", "sync", "colocate_async", "separate_async")
# (label, local trainer key, verl key): both write the local trainer's names (otb_tir.verl.hooks / v1)
PHASES = [
    ("generation (trainer waits for samples)", "timing/rollout_s", "timing/gen_s"),
    ("reward (batch)", None, "timing/reward_s"),
    ("old log-prob + Σπ²", "timing/old_log_prob_s", "timing/old_log_prob_s"),
    ("advantage", "timing/advantage_s", "timing/adv_s"),
    ("update", "timing/update_s", "timing/update_actor_s"),
    ("weight sync", "timing/weight_sync_s", "timing/update_weights_s"),
    ("step", "timing/step_s", "timing/step_s"),
]


def _steps(out: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows if "timing/step_s" in r}


def _process_name(proc) -> str:
    """A process's role: Ray's title (``ray::WorkerDict.…``, ``ray::AgentLoopWorker…``), else its
    program and first argument (``python …/train_tir_math.py``, ``raylet``, ``gcs_server``)."""
    try:
        cmd = proc.cmdline()
    except Exception:  # noqa: BLE001 - gone meanwhile
        return "?"
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split()[0]
    names = [Path(c).name for c in cmd[:3] if c and not c.startswith("-")]
    return " ".join(names[:2]) or proc.name()


class PeakRSS:
    """Every second, the resident set of a process and all its descendants (Ray's head, raylet and
    workers are the driver's), keeping each process's peak; :meth:`by_role` sums nothing: per pid,
    named by :func:`_process_name`."""

    def __init__(self, pid: int, every_s: float = 1.0) -> None:
        import threading

        self.pid, self.every_s = pid, every_s
        self.peak: dict[int, tuple[str, float]] = {}  # pid -> (role, peak GiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for proc in procs:
                try:
                    gib = proc.memory_info().rss / 2**30
                except psutil.Error:
                    continue
                role, best = self.peak.get(proc.pid, (None, 0.0))
                # a Ray worker sets its title after it starts, an idle one's (ray::IDLE) when it takes an actor
                if role is None or not role.startswith("ray::") or role == "ray::IDLE":
                    role = _process_name(proc)
                self.peak[proc.pid] = (role, max(gib, best))
            self._stop.wait(self.every_s)

    def stop(self) -> list[tuple[str, float]]:
        """The processes' (role, peak GiB), largest first (those above 50 MiB)."""
        self._stop.set()
        self._thread.join(timeout=5)
        return sorted(((r, g) for r, g in self.peak.values() if g > 0.05), key=lambda x: -x[1])


def _run(python: str, out: Path, args: list[str], timeout: float) -> tuple[float, str | None, list]:
    t0 = time.time()
    cmd = [python, str(REPO / "recipes" / "train_tir_math.py"), f"trainer.output_dir={out}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rss = PeakRSS(proc.pid)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return time.time() - t0, f"did not finish in {timeout:.0f} s", rss.stop()
    peaks = rss.stop()
    if proc.returncode != 0:
        tail = [line for line in stderr.splitlines() if line.strip()][-6:]
        return time.time() - t0, f"rc={proc.returncode}: " + " / ".join(tail)[-800:], peaks
    return time.time() - t0, None, peaks


def _mean(rows: list[dict], key: str | None) -> float | None:
    vals = [r[key] for r in rows if key and r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def _batch_rows(trainer: str, out: Path) -> float:
    """Samples per step: prompts per step x samples per prompt, from the config the run wrote."""
    from omegaconf import OmegaConf

    if trainer == "local":
        cfg = OmegaConf.load(out / "config.yaml")
        return float(cfg.data.train_batch_size * cfg.rollout.n)
    v = OmegaConf.load(out / "verl_config.yaml")
    return float(v.data.train_batch_size * v.actor_rollout_ref.rollout.n)


def figures(trainer: str, out: Path) -> dict[str, float | None]:
    """Means over the steps after the first (all steps if there is only one)."""
    steps = _steps(out)
    rows = [steps[s] for s in sorted(steps)][1:] or list(steps.values())
    local = trainer == "local"
    result: dict[str, float | None] = {label: _mean(rows, lk if local else vk) for label, lk, vk in PHASES}
    step = result["step"] or float("nan")
    samples = _batch_rows(trainer, out)
    tokens = _mean(rows, "rollout/sampled_tokens") if local else None
    if tokens is None:
        per_row = _mean(rows, "response/policy_tokens_mean")
        tokens = per_row * samples if per_row is not None else None
    result["samples/s"] = samples / step
    result["sampled tokens/s"] = tokens / step if tokens else None
    result["staleness mean"] = 0.0 if local else _mean(rows, "staleness/mean")
    result["staleness max"] = 0.0 if local else _mean(rows, "staleness/max")
    synchronous = local or trainer == "legacy"  # the rollout runs only while the trainer waits for it
    result["trainer idle s"] = result[PHASES[0][0]] if synchronous else _mean(rows, "timing/trainer_idle_s")
    if synchronous:
        result["rollout idle s"] = step - (result["trainer idle s"] or 0.0)
    else:
        result["rollout idle s"] = _mean(rows, "timing/rollout_idle_s")
    busy = step - (result["rollout idle s"] or 0.0)  # the rollout servers busy
    result["overlap s"] = max(0.0, busy - (result["trainer idle s"] or 0.0))  # ... while the trainer computes
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--modes", default=",".join(TRAINERS), help=f"comma-separated, of {TRAINERS}")
    p.add_argument("--verl-python", default=str(REPO / ".venv-verl" / "bin" / "python"))
    p.add_argument("--gpu", action="store_true", help="trainer.device=cuda (a GPU machine)")
    p.add_argument("--timeout", type=float, default=1500.0, help="per run, seconds")
    p.add_argument("--keep", type=Path, default=None, help="keep the run folders here")
    p.add_argument("overrides", nargs="*", help="recipe overrides applied to every run")
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in TRAINERS]
    if bad:
        p.error(f"unknown --modes {bad}; choose from {TRAINERS}")
    common = [
        f"trainer.total_steps={a.steps}",
        "eval.before=false",
        "eval.after=false",
        "trainer.save_every=0",
        *(["trainer.device=cuda"] if a.gpu else []),
        *a.overrides,
    ]
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}
    wall: dict[str, float] = {}
    peaks: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = a.keep or Path(tmp)
        for mode in modes:
            out = root / mode
            if mode == "local":
                wall[mode], err, peaks[mode] = _run(sys.executable, out, common, a.timeout)
            else:
                wall[mode], err, peaks[mode] = _run(
                    a.verl_python, out, ["trainer=verl", f"verl.trainer_mode={mode}", *common], a.timeout
                )
            if err:
                errors[mode] = err
                continue
            results[mode] = figures(mode, out)
    print(
        f"# {time.strftime('%Y-%m-%d')}, {a.steps} steps each (means over steps 2..{a.steps}), "
        f"overrides: {' '.join(common)}"
    )
    print("# launch to exit: " + ", ".join(f"{m} {wall[m]:.0f} s" for m in modes if m in wall))
    shown = [m for m in modes if m in results]
    labels = [label for label, _, _ in PHASES] + [
        "samples/s",
        "sampled tokens/s",
        "staleness mean",
        "staleness max",
        "trainer idle s",
        "rollout idle s",
        "overlap s",
    ]
    fmt = lambda x: "–" if x is None else f"{x:.3f}" if abs(x) < 100 else f"{x:.0f}"  # noqa: E731
    print("\n| per step | " + " | ".join(shown) + " |\n|---|" + "---|" * len(shown))
    for label in labels:
        print(f"| {label} | " + " | ".join(fmt(results[m].get(label)) for m in shown) + " |")
    print("\nPeak resident set per process (GiB, sampled every second; the run's process and its descendants):")
    for mode in modes:
        if peaks.get(mode):
            top = ", ".join(f"{role} {gib:.2f}" for role, gib in peaks[mode][:8])
            print(f"- {mode}: {top}; all processes' peaks summed {sum(g for _, g in peaks[mode]):.2f}")
    for mode, err in errors.items():
        print(f"\n{mode}: did not run: {err}")
    return 1 if errors and not results else 0


if __name__ == "__main__":
    raise SystemExit(main())
