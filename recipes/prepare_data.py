#!/usr/bin/env python
"""Turn local math datasets into verl-format parquet files: a thin wrapper of
``otb-tir-prepare-data`` (``otb_tir/prepare_data.py``) for a checkout; same arguments:

    python recipes/prepare_data.py --gsm8k gsm8k.jsonl --test-frac 0.1 --out data/
    python recipes/prepare_data.py --help
"""

import sys

from otb_tir.prepare_data import cli

if __name__ == "__main__":
    sys.exit(cli())
