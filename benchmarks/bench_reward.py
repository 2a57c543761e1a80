#!/usr/bin/env python
"""Batch reward scoring in ms/sample on ordinary answers: today's bounded scorer
(:func:`agent_env.math_task.reward.math_reward`: plain numbers exactly, math-verify in a killable helper
process) against the reference, the scorer before it (math-verify in the calling thread, every
answer), measured in the same process on the same responses.

    python benchmarks/bench_reward.py                 # 2,000 responses, 3 repeats
    python benchmarks/bench_reward.py --n 500 --repeats 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from agent_env.math_task.reward import _normalize_str, _plain_number, extract_answer, extract_boxed, math_reward

# the kinds of answers a math policy writes: integers (the built-in task), fractions, decimals,
# LaTeX forms, units, expressions; right and wrong
ORDINARY = [
    ("42", "42"),
    ("41", "42"),
    ("-7", "-7"),
    ("1,000", "1000"),
    ("3.0", "3"),
    ("0.5", "1/2"),
    ("\\frac{3}{4}", "0.75"),
    ("\\dfrac{1}{3}", "0.25"),
    ("x=3", "3"),
    ("10\\text{ cm}", "10"),
    ("\\sqrt{2}", "2^{1/2}"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\frac{\\pi}{2}", "\\pi/2"),
    ("(x+1)^2", "x^2+2x+1"),
    ("12", "13"),
    ("7/8", "0.875"),
]


def before_answers_match(pred: str, gold: str, timeout_seconds: int = 5) -> bool:
    """The reference: the comparison as it was before (math-verify first, in the calling thread)."""
    from math_verify import parse, verify

    try:
        g = parse("\\boxed{" + gold + "}", parsing_timeout=timeout_seconds)
        p = parse("\\boxed{" + pred + "}", parsing_timeout=timeout_seconds)
        if g and p:
            return bool(verify(g, p, timeout_seconds=timeout_seconds))
    except Exception:  # noqa: BLE001
        pass
    fp, fg = _plain_number(pred), _plain_number(gold)
    if fp is not None and fg is not None:
        return fp == fg
    return _normalize_str(pred) == _normalize_str(gold)


def before_math_reward(response: str, gold: str) -> float:
    answer, _ = extract_answer(response)
    if answer is None:
        return 0.0
    boxed = extract_boxed(gold)
    return float(before_answers_match(answer, boxed if boxed is not None else gold))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    batch = []
    for _ in range(args.n):
        pred, gold = rng.choice(ORDINARY)
        batch.append((f"Let me compute it with the tool.\nThe answer is \\boxed{{{pred}}}.", gold))
    # warm both (imports, the helper process) outside the timed region
    before_math_reward(*batch[0])
    math_reward(*batch[0])
    rows = {"before (math-verify in thread)": [], "now (bounded)": []}
    agree = 0
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        ref = [before_math_reward(r, g) for r, g in batch]
        rows["before (math-verify in thread)"].append((time.perf_counter() - t0) / len(batch) * 1000)
        t0 = time.perf_counter()
        now = [math_reward(r, g).reward for r, g in batch]
        rows["now (bounded)"].append((time.perf_counter() - t0) / len(batch) * 1000)
        agree = sum(a == b for a, b in zip(ref, now))
    print(f"reward scoring, {args.n} ordinary responses ({len(ORDINARY)} answer kinds), {args.repeats} repeats")
    for name, ms in rows.items():
        print(f"  {name:32s} {statistics.median(ms):7.3f} ms/sample (min {min(ms):.3f}, max {max(ms):.3f})")
    ratio = statistics.median(rows["now (bounded)"]) / statistics.median(rows["before (math-verify in thread)"])
    print(f"  now / before: {ratio:.2f}x   same reward on {agree}/{len(batch)} responses")
    return 0


if __name__ == "__main__":
    sys.exit(main())
