"""The GPU check's legs and its table (``benchmarks/gpu_check.py``, ``scripts/gpu_check.sh``).

The same work (the Qwen3-0.6B shape with random weights, ``--prompts`` x ``--n`` one-turn episodes of
up to ``--response-length`` tokens, calculator listed, TIR-OTB) through four paths, each in a process
of its own with its own timeout (a leg that hangs is killed with its process group; the others still
run), within one budget (``GPU_CHECK_TIMEOUT`` seconds, default 600, less 30 s to print and write):

* ``local``: the local trainer's step with the HF engine and an FSDP2 actor (``gpu_check.py --leg local``);
* ``verl_sync``: ``otb-tir-train trainer=verl`` with verl's V1 trainer in ``sync`` mode and vLLM, one GPU;
* ``verl_separate_async``: the same in ``separate_async`` (the rollout on a pool of its own, weights
  moved by verl's ``nccl`` checkpoint engine): one GPU for the trainer, one for the rollout;
* ``sglang``: the local trainer with ``rollout.name=sglang`` (CUDA graphs off).

The verl and sglang legs load a saved random-weight model folder (``otb_tir.defaults.shapes.save_shape``:
the tiny policy's tokenizer padded to the model's vocabulary). A leg whose packages are not installed,
or that needs more GPUs than are visible, is a ``skipped: ...`` row, never a failure and never a
stand-in. ``--cpu-smoke`` runs the local leg for real on a tiny shape and composes the others exactly
as on a GPU, without running them (verl: ``trainer.device=cuda verl.dry_run=true``; sglang:
``--print-config``), and checks their wiring (``gpu_check_commands``: the commands and the checks).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from gpu_check_commands import (
    check_sglang_wiring,
    check_verl_wiring,
    local_argv,
    sglang_argv,
    verl_argv,
)

ROOT = Path(__file__).resolve().parents[1]
VERL_PACKAGES = ("verl", "ray", "vllm", "hydra", "omegaconf")


@dataclasses.dataclass(frozen=True)
class Leg:
    name: str
    title: str
    needs: tuple[str, ...]  # importable packages for the GPU run
    smoke_needs: tuple[str, ...]  # for --cpu-smoke's composition
    gpus: int
    timeout_s: float


LEGS: dict[str, Leg] = {
    leg.name: leg
    for leg in (
        Leg("local", "HF engine, FSDP2 actor", (), (), 1, 240),
        Leg("verl_sync", "verl V1 sync, vLLM", VERL_PACKAGES, ("verl", "ray", "hydra", "omegaconf"), 1, 330),
        Leg(
            "verl_separate_async",
            "verl, vLLM, nccl weight sync",
            VERL_PACKAGES,
            ("verl", "ray", "hydra", "omegaconf"),
            2,
            330,
        ),
        Leg("sglang", "local trainer, sglang", ("sglang",), (), 1, 240),
    )
}


@dataclasses.dataclass
class Row:
    leg: str
    status: str
    wall_s: float | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None  # the step's prompt + response tokens (no padding) / step s
    peak_gpu_gib: float | None = None  # device memory in use at the peak (nvidia-smi, all processes)
    weight_sync_s: float | None = None
    argv: list[str] = dataclasses.field(default_factory=list)
    log: str | None = None

    @property
    def failed(self) -> bool:
        return self.status.startswith(("failed", "timed out"))


def missing(packages: Sequence[str]) -> list[str]:
    return [p for p in packages if importlib.util.find_spec(p) is None]


def skip_reason(leg: Leg, *, smoke: bool, gpus: int) -> str | None:
    """Why ``leg`` cannot run here (None: it can): too few GPUs (a GPU run only), packages not installed."""
    why = []
    if not smoke and gpus < leg.gpus:
        why.append(f"needs {leg.gpus} GPU{'s' if leg.gpus > 1 else ''} ({gpus} visible)")
    absent = missing(leg.smoke_needs if smoke else leg.needs)
    if absent:
        why.append(f"{', '.join(absent)} not installed")
    return "; ".join(why) or None


# ----------------------------------------------------------------------------- running a leg


class GPUMemory:
    """The peak device memory in use (nvidia-smi, every process, summed over the GPUs) while a leg
    runs, above what was in use when it started; None without nvidia-smi."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.cmd = shutil.which("nvidia-smi")
        self.interval_s = interval_s
        self.base: float | None = None
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _used_mib(self) -> float | None:
        try:
            out = subprocess.run(
                [self.cmd, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            return float(sum(float(x) for x in out.split()))
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            used = self._used_mib()
            if used is not None:
                self.peak = max(self.peak or 0.0, used)

    def __enter__(self) -> GPUMemory:
        if self.cmd:
            self.base = self.peak = self._used_mib()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def gib(self) -> float | None:
        if self.base is None or self.peak is None:
            return None
        return (self.peak - self.base) / 1024


def _stop_group(p: subprocess.Popen) -> None:
    """SIGTERM to the leg's process group (it was started in a session of its own), SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_leg(argv: Sequence[str], timeout_s: float, log_path: Path, stdout: Path | None = None) -> dict[str, Any]:
    """Run ``argv`` (its output to ``log_path``; its stdout alone to ``stdout`` if given) in a process
    group of its own, killed at ``timeout_s``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)  # also Ray's workers
    log_path.parent.mkdir(parents=True, exist_ok=True)
    timed_out = False
    with GPUMemory() as mem, log_path.open("w") as log, stdout.open("w") if stdout else log as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(list(argv), stdout=out, stderr=log, cwd=ROOT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_group(p)
            rc = p.returncode
        except BaseException:  # Ctrl-C, the script's own timeout: the leg's processes go too
            _stop_group(p)
            raise
        wall = time.perf_counter() - t0
    return {"rc": rc, "timed_out": timed_out, "wall_s": wall, "peak_gpu_gib": mem.gib}


def _tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(text[-lines:])


# ----------------------------------------------------------------------------- the legs


def _failed(res: dict[str, Any], log: Path, timeout_s: float) -> str | None:
    if res["timed_out"]:
        return f"timed out after {timeout_s:.0f} s"
    if res["rc"] != 0:
        return f"failed: exit {res['rc']} (see {log})"
    return None


def leg_local(work: Path, args: Any, timeout_s: float) -> tuple[Row, dict[str, Any] | None]:
    out_json, log = work / "local.json", work / "local.log"
    argv = local_argv(out_json, args)
    res = run_leg(argv, timeout_s, log)
    row = Row("local", "", wall_s=res["wall_s"], peak_gpu_gib=res["peak_gpu_gib"], argv=argv, log=str(log))
    bad = _failed(res, log, timeout_s)
    if bad:
        row.status = bad
        return row, None
    info = json.loads(out_json.read_text())
    st = info["step"]
    row.status = "ok" + (" (cpu)" if args.cpu_smoke else "")
    row.step_s, row.tokens_per_s, row.weight_sync_s = st["wall_s"], st["step_tokens_per_s"], st["timing/weight_sync_s"]
    return row, info


def leg_verl(mode: str, work: Path, model: Path, args: Any, timeout_s: float) -> Row:
    from omegaconf import OmegaConf

    name = f"verl_{mode}"
    out, log = work / name, work / f"{name}.log"
    shutil.rmtree(out, ignore_errors=True)  # a run folder of an earlier check would be resumed from
    argv = verl_argv(mode, model, out, args, timeout_s)
    res = run_leg(argv, timeout_s, log)
    row = Row(name, "", wall_s=res["wall_s"], peak_gpu_gib=res["peak_gpu_gib"], argv=argv, log=str(log))
    config = out / "verl_config.yaml"
    bad = _failed(res, log, timeout_s)
    if bad and not config.is_file():
        row.status = bad
        return row
    run = json.loads((out / "verl_run.json").read_text())
    problems = check_verl_wiring(mode, OmegaConf.load(config), run, model, args)
    if problems:
        row.status = "failed: wiring: " + "; ".join(problems)
        return row
    if bad:
        row.status = bad
        return row
    if args.cpu_smoke:
        row.status = "wired (dry run)"
        return row
    last = json.loads((out / "summary.json").read_text())["last_step"]
    row.status = "ok"
    row.step_s = last.get("timing_s/step")
    if row.step_s and last.get("perf/total_num_tokens") is not None:
        row.tokens_per_s = last["perf/total_num_tokens"] / row.step_s
    row.weight_sync_s = last.get("timing_s/update_weights")
    return row


def leg_sglang(work: Path, model: Path, args: Any, timeout_s: float) -> Row:
    from omegaconf import OmegaConf

    out, log = work / "sglang", work / "sglang.log"
    shutil.rmtree(out, ignore_errors=True)
    argv = sglang_argv(model, out, args)
    printed = work / "sglang_config.yaml"  # --cpu-smoke: the config --print-config printed
    res = run_leg(argv, timeout_s, log, stdout=printed if args.cpu_smoke else None)
    row = Row("sglang", "", wall_s=res["wall_s"], peak_gpu_gib=res["peak_gpu_gib"], argv=argv, log=str(log))
    bad = _failed(res, log, timeout_s)
    if bad:
        row.status = bad
        return row
    cfg = OmegaConf.load(printed if args.cpu_smoke else out / "config.yaml")
    problems = check_sglang_wiring(cfg, model, args)
    if problems:
        row.status = "failed: wiring: " + "; ".join(problems)
        return row
    if args.cpu_smoke:
        row.status = "wired (dry run)"
        return row
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last = [r for r in rows if "timing/step_s" in r][-1]
    row.status = "ok"
    row.step_s, row.weight_sync_s = last["timing/step_s"], last.get("timing/weight_sync_s")
    # the step's prompt + response tokens, as the update counted them (perf/update_tokens_per_s x its seconds)
    tokens = last["perf/update_tokens_per_s"] * last["timing/update_s"]
    row.tokens_per_s = tokens / row.step_s
    return row


def save_model(work: Path, smoke_shape: dict[str, Any] | None) -> Path:
    """The random-weight model folder the verl and sglang legs load: Qwen3-0.6B's shape, or on
    ``--cpu-smoke`` ``smoke_shape`` (through a config.json), with the padded tiny tokenizer."""
    from otb_tir.defaults.shapes import save_shape

    if smoke_shape is None:
        return save_shape("qwen3-0.6b", work / "model_qwen3_0_6b")
    config = work / "smoke_config.json"
    config.write_text(json.dumps({"model_type": "qwen3", **smoke_shape}))
    return save_shape(str(config), work / "model_smoke")


# ----------------------------------------------------------------------------- all of them, one table


def _fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def table(rows: Sequence[Row]) -> str:
    head = ["leg", "status", "wall s", "step s", "tokens/s", "peak GPU GiB", "weight sync s"]
    body = [
        [
            f"{r.leg} ({LEGS[r.leg].title})",
            r.status,
            _fmt(r.wall_s),
            _fmt(r.step_s, 2),
            _fmt(r.tokens_per_s, 0),
            _fmt(r.peak_gpu_gib, 2),
            _fmt(r.weight_sync_s, 2),
        ]
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


def run_legs(
    args: Any, names: Sequence[str], work: Path, budget_s: float, smoke_shape: dict[str, Any]
) -> dict[str, Any]:
    """Each leg in ``names`` in turn, each within what is left of ``budget_s``; the rows, the local leg's
    own figures and the table. ``smoke_shape``: the model shape of ``--cpu-smoke``."""
    import torch

    t0 = time.perf_counter()
    smoke = args.cpu_smoke
    gpus = 0 if smoke else torch.cuda.device_count()
    work.mkdir(parents=True, exist_ok=True)
    reasons = {name: skip_reason(LEGS[name], smoke=smoke, gpus=gpus) for name in names}
    model = None
    rows: list[Row] = []
    local_info = None
    for name in names:
        if reasons[name]:
            rows.append(Row(name, f"skipped: {reasons[name]}"))
            continue
        if name != "local" and model is None:  # the saved model (~20 s for Qwen3-0.6B), inside the budget
            model = save_model(work, smoke_shape if smoke else None)
        left = budget_s - (time.perf_counter() - t0)
        if left < 60:
            rows.append(Row(name, f"skipped: {left:.0f} s left of the {budget_s:.0f} s budget"))
            continue
        timeout_s = min(args.leg_timeout or LEGS[name].timeout_s, left - 5)
        print(f"gpu_check: leg {name} (timeout {timeout_s:.0f} s) ...", flush=True)
        if name == "local":
            row, local_info = leg_local(work, args, timeout_s)
        elif name == "sglang":
            row = leg_sglang(work, model, args, timeout_s)
        else:
            row = leg_verl(name[len("verl_") :], work, model, args, timeout_s)
        if row.failed and row.log:
            print(f"gpu_check: leg {name} {row.status}; the end of {row.log}:\n{_tail(Path(row.log))}", flush=True)
        rows.append(row)
    return {
        "gpus": gpus,
        "budget_s": budget_s,
        "wall_s": time.perf_counter() - t0,
        "work": str(work),
        "legs": [dataclasses.asdict(r) for r in rows],
        "local": local_info,
        "table": table(rows),
        "failed": [r.leg for r in rows if r.failed],
    }
