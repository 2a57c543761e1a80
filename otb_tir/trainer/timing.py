"""A training step's phases and their timer: the disjoint phases of one iteration (the
``timing/*_s`` metrics), the one context-manager timer that measures them, and the run's summary of
where the training loop's time went (``summary.json``'s ``timing``, ``benchmarks/profile_step.py``)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
import time
from typing import Any, Callable, Iterator, Mapping

# The disjoint phases of one training iteration, in order. The first five split timing/rollout_s:
# generating (some generate call in flight), waiting on tools (no generate, some tool call in
# flight), reward scoring (neither, the reward function runs), the rest of the episodes' host work
# (parsing, chat templates, tokenizing, scheduling) and padding the batch (collate). Then the
# old log-prob pass (log-prob, entropy and Σπ² together), the reference model, the advantage
# (reward placement, IS weights, estimator, filters), the PPO update, the weight sync, the step's
# metrics, its dump (trainer.rollout_data_dir), what lies between those timers (timing/step_other_s),
# the held-out evaluation, and after the row is complete, writing it and the checkpoint.
STEP_PHASES = (
    "timing/gen_s",
    "timing/tool_wait_s",
    "timing/reward_s",
    "timing/rollout_other_s",
    "timing/collate_s",
    "timing/old_log_prob_s",
    "timing/ref_s",
    "timing/advantage_s",
    "timing/update_s",
    "timing/weight_sync_s",
    "timing/metrics_s",
    "timing/dump_s",
    "timing/step_other_s",
    "timing/eval_s",
)
AFTER_ROW_PHASES = ("timing/log_s", "timing/checkpoint_s")


def rollout_phases(stats: Mapping[str, float], rollout_s: float) -> dict[str, float]:
    """Split a rollout's wall time into the first five of :data:`STEP_PHASES` (they sum to it)."""
    parts = {
        "timing/gen_s": float(stats.get("generating_s", 0.0)),
        "timing/tool_wait_s": float(stats.get("waiting_on_tools_s", 0.0)),
        "timing/reward_s": float(stats.get("scoring_s", 0.0)),
        "timing/collate_s": float(stats.get("collate_s", 0.0)),
    }
    parts["timing/rollout_other_s"] = max(rollout_s - sum(parts.values()), 0.0)
    return parts


def phase_name(key: str) -> str:
    """``timing/update_s`` → ``update``: a phase's name in summaries and tables."""
    return key.removeprefix("timing/").removesuffix("_s")


def step_time_summary(totals: Mapping[str, float], fit_s: float) -> dict[str, Any]:
    """Seconds and share of the training loop per phase; ``unattributed_s`` is what no timer saw."""
    phases = {phase_name(k): float(totals.get(k, 0.0)) for k in STEP_PHASES + AFTER_ROW_PHASES}
    attributed = sum(phases.values())
    return {
        "fit_s": fit_s,
        "phases_s": phases,
        "shares": {k: v / fit_s if fit_s > 0 else 0.0 for k, v in phases.items()},
        "unattributed_s": fit_s - attributed,
    }


def format_step_time(summary: Mapping[str, Any]) -> str:
    """:func:`step_time_summary` as an aligned text table, largest phase first."""
    rows = sorted(summary["phases_s"].items(), key=lambda kv: -kv[1])
    fit = summary["fit_s"]
    lines = [f"  {name:<14} {sec:9.2f} s {100 * sec / fit if fit > 0 else 0.0:6.1f} %" for name, sec in rows if sec > 0]
    lines.append(f"  {'(unattributed)':<14} {summary['unattributed_s']:9.2f} s")
    lines.append(f"  {'training loop':<14} {fit:9.2f} s")
    return "\n".join(lines)


def memory_kb() -> dict[str, int]:
    """This process's resident set now (``VmRSS``) and its peak so far (``VmHWM``), in kB, from
    ``/proc/self/status`` (~20 µs); ``{}`` where there is none (not Linux). The peak is never reset
    here: a parent's ``wait4`` reads the same high-water mark."""
    if not sys.platform.startswith("linux"):
        return {}
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line[:5]] = int(line.split()[1])
    except OSError:
        return {}
    return out


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_free_memory() -> bool:
    """Give the C allocator's free memory back to the system: glibc's ``malloc_trim(0)`` (µs to a few
    ms); ``False`` where there is none. glibc keeps freed chunks below its mmap threshold (which rises to
    32 MiB as large blocks are freed, so most of a model's activations) in its arenas, one per thread
    that allocated; a phase's freed tensors (the rollout's KV cache, the forward's activations) then stay
    resident and the next phase, allocating other sizes from other threads, adds to them. Measured at
    Qwen3-0.6B's shape (``bench_scale.py --shapes qwen3-0.6b --trainers ours_ckpt --steps 3``, 2026-12-07):
    the resident set after an update 8.5 GiB with this after every phase against 11.5 GiB without; with it
    also after each micro-batch's backward (the actor) the run's peak 12.47 against 14.05 GiB."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


class PhaseTimer:
    """Wall seconds per phase: ``with timer("update"):`` adds the block's seconds to
    ``seconds["timing/update_s"]``; :meth:`elapsed` is the time since the timer was made.

    Memory too: after each phase the process's peak resident set so far goes to
    ``memory["memory/peak_rss_gib/<phase>"]`` (the high-water mark is monotone: the phase after which
    it jumped is the one that set it) and its resident set then to ``memory["memory/rss_gib/<phase>"]``."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.memory: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{phase}_s"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t
            release_free_memory()
            mem = memory_kb()
            if mem:
                self.memory[f"memory/peak_rss_gib/{phase}"] = mem["VmHWM"] / 2**20
                self.memory[f"memory/rss_gib/{phase}"] = mem["VmRSS"] / 2**20

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
