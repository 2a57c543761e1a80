"""Benchmark: otb_tir's OTB / TIR-OTB estimators vs verl 0.9.1's, and the memory-bound floor.

    python benchmarks/bench_advantage.py            # [B=1024, R=8192], 3 tool segments per row, groups of 8
    python benchmarks/bench_advantage.py --small    # [B=64, R=1024], a few seconds

Prints, for both variants, the time of ours (the fused CPU kernel, ``otb_tir/fused_otb.c``), of
our plain PyTorch path (``OTB_TIR_FUSED=0``: the reference, and the path GPUs take) and of verl's,
the time to merely copy the inputs (clone of rewards, mask, old log-probs and Σπ²: the
memory-bound floor), and the ratios, all measured in this one run. It also checks that both of
our paths equal verl's (max abs diff ≤ 1e-6; 0 means bit-identical) and exits non-zero if not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch


def make_batch(batch: int, resp: int, group_size: int, tool_segments: int, seed: int = 0) -> dict:
    """Right-padded multi-turn rows: policy tokens with ``tool_segments`` tool spans (mask 0) inside."""
    gen = torch.Generator().manual_seed(seed)
    col = torch.arange(resp).unsqueeze(0)
    lengths = torch.randint(resp // 2, resp + 1, (batch, 1), generator=gen)
    mask = col < lengths
    seg_len = max(1, resp // 40)
    for _ in range(tool_segments):
        # A tool span somewhere strictly inside the row, ending before its last token.
        start = (torch.rand(batch, 1, generator=gen) * (lengths - seg_len - 1).clamp_min(1)).long()
        width = torch.randint(1, seg_len + 1, (batch, 1), generator=gen)
        mask &= ~((col >= start) & (col < start + width))
    rewards = torch.zeros(batch, resp)
    rewards.scatter_(1, lengths - 1, (torch.rand(batch, 1, generator=gen) < 0.5).float())
    return {
        "token_level_rewards": rewards,
        "response_mask": mask.float(),
        "index": np.array([f"prompt-{i // group_size}" for i in range(batch)], dtype=object),
        "old_log_probs": -torch.rand(batch, resp, generator=gen) * 2.0,
        "sum_pi_squared": torch.rand(batch, resp, generator=gen) * 0.9 + 0.05,
    }


def timeit(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median wall time and median process CPU time of ``reps`` calls (after one warm-up), seconds.

    CPU time is printed too because it is far less sensitive than wall time to other processes
    competing for the cores (it still includes page faults, which dominate fresh allocations).
    """
    fn()
    walls, cpus = [], []
    for _ in range(max(1, reps)):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="B=64, R=1024: a quick run")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--resp", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tool-segments", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions of ours and of the copy (median)")
    parser.add_argument("--verl-reps", type=int, default=1, help="timed repetitions of verl's (median)")
    args = parser.parse_args()
    batch = args.batch or (64 if args.small else 1024)
    resp = args.resp or (1024 if args.small else 8192)

    from otb_tir import fused
    from otb_tir.advantage import optimal_token_baseline, tir_optimal_token_baseline

    try:
        from verl.trainer.ppo import core_algos
    except ImportError:
        print("verl is not installed: pip install -e '.[verl]' (verl==0.9.1 is the reference)", file=sys.stderr)
        return 2

    data = make_batch(batch, resp, args.group_size, args.tool_segments)
    policy_frac = data["response_mask"].mean().item()
    print(
        f"[B={batch}, R={resp}] groups of {args.group_size}, {args.tool_segments} tool segments per row, "
        f"{policy_frac:.0%} policy tokens, torch threads={torch.get_num_threads()}"
    )
    if not fused.fused_available():
        print("the fused kernel is not available (see the warning above): 'ours' is the PyTorch path")
    tensors = [data[k] for k in ("token_level_rewards", "response_mask", "old_log_probs", "sum_pi_squared")]
    t_copy, c_copy = timeit(lambda: [t.clone() for t in tensors], args.reps)
    print(f"copy the inputs (floor): wall {t_copy * 1e3:8.1f} ms  cpu {c_copy * 1e3:8.1f} ms")

    ok = True
    for name, ours, ref in (
        ("TIR-OTB", tir_optimal_token_baseline, core_algos.compute_multi_turn_optimal_token_baseline_advantage),
        ("dense OTB", optimal_token_baseline, core_algos.compute_optimal_token_baseline_advantage),
    ):
        t_ours, c_ours = timeit(lambda ours=ours: ours(**data), args.reps)
        os.environ["OTB_TIR_FUSED"] = "0"
        t_pt, c_pt = timeit(lambda ours=ours: ours(**data), args.reps)
        pt_adv, pt_ret = ours(**data)
        del os.environ["OTB_TIR_FUSED"]
        w0, c0 = time.perf_counter(), time.process_time()
        ref_adv, ref_ret = ref(**data)
        t_ref, c_ref = time.perf_counter() - w0, time.process_time() - c0
        if args.verl_reps > 1:
            more = [timeit(lambda ref=ref: ref(**data), 1) for _ in range(args.verl_reps - 1)]
            t_ref = statistics.median([t_ref] + [m[0] for m in more])
            c_ref = statistics.median([c_ref] + [m[1] for m in more])
        # The floor again, right after ours, so both see the same machine load.
        t_copy2, c_copy2 = timeit(lambda: [t.clone() for t in tensors], args.reps)
        t_floor, c_floor = min(t_copy, t_copy2), min(c_copy, c_copy2)
        adv, ret = ours(**data)
        diff = max((adv - ref_adv).abs().max().item(), (ret - ref_ret).abs().max().item())
        diff_pt = max((pt_adv - ref_adv).abs().max().item(), (pt_ret - ref_ret).abs().max().item())
        ok &= diff <= 1e-6 and diff_pt <= 1e-6
        print(
            f"{name:9s}: ours wall {t_ours * 1e3:7.1f} ms (cpu {c_ours * 1e3:7.1f}) | "
            f"PyTorch path {t_pt * 1e3:7.1f} ms (cpu {c_pt * 1e3:7.1f}) | "
            f"verl wall {t_ref * 1e3:8.1f} ms (cpu {c_ref * 1e3:8.1f}) | "
            f"ours / copy floor {t_ours / t_floor:5.2f}x (cpu {c_ours / c_floor:5.2f}x), "
            f"PyTorch path {t_pt / t_floor:5.2f}x | "
            f"speed-up vs verl {t_ref / t_ours:5.1f}x | "
            f"max |ours - verl| = {diff:.2e}, PyTorch path {diff_pt:.2e}"
        )
    if not ok:
        print("MISMATCH: our outputs differ from verl's by more than 1e-6", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
