"""A run of the real local trainer, for tests/otb_tir/trainer/test_fsdp.py; launched as one process or under
``python -m torch.distributed.run --nproc_per_node N`` (FSDP2 on gloo).

    python fsdp_worker.py [--kill-after-save STEP] key=value ...

The reward is shaped (see ``parity_reward``) so that even the random tiny policy gets non-zero
advantages and every step really moves the weights. ``--kill-after-save STEP``: every rank
SIGKILLs itself right after the checkpoint of STEP is complete (a crash at a known point): its
trainer's data cursor (a part, swapped by assignment) dies when asked for the batch of step STEP + 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from otb_tir.trainer.data import DataCursor


class DyingCursor(DataCursor):
    """``cursor``'s copy that SIGKILLs this process when asked for its batch number ``die_at`` (1-based)."""

    def __init__(self, cursor: DataCursor, die_at: int):
        super().__init__(**vars(cursor))
        self.die_at, self.calls = die_at, 0

    def next_batch(self):
        self.calls += 1
        if self.calls == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().next_batch()


def parity_reward(text, ground_truth, traj):
    """100 × the share of odd token ids among the policy's tokens: varies between the samples of a
    random policy at every step; large, so that gradients sit far above Adam's eps (1e-8)."""
    toks = [t for t, m in zip(traj.response_ids, traj.response_mask) if m]
    return 100.0 * sum(t % 2 for t in toks) / max(len(toks), 1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kill-after-save", type=int, default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from otb_tir.trainer.config import load_config
    from otb_tir.trainer.run import run

    def setup(trainer):
        if args.kill_after_save is not None:  # step N's checkpoint is written before batch N + 1 is drawn
            trainer.cursor = DyingCursor(trainer.cursor, die_at=args.kill_after_save + 1)

    cfg = load_config(None, args.overrides)
    run(cfg, reward_fn=parity_reward, setup=setup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
