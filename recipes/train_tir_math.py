#!/usr/bin/env python
"""Train a policy to solve math with a sandboxed Python interpreter and a calculator, with TIR-OTB.

A thin wrapper of ``otb-tir-train`` (``otb_tir/train.py``) for a checkout; same arguments:

    python recipes/train_tir_math.py                               # built-in CPU default
    python recipes/train_tir_math.py rollout.n=4 trainer.total_steps=10
    python recipes/train_tir_math.py --help                        # config sections, every option
"""

import sys

from otb_tir.train import main

if __name__ == "__main__":
    sys.exit(main())
