#!/usr/bin/env python
"""Train a policy to solve math with a sandboxed Python interpreter and a calculator, with TIR-OTB.

    python recipes/train_tir_math.py                               # built-in CPU default
    python recipes/train_tir_math.py rollout.n=4 trainer.total_steps=10
    python recipes/train_tir_math.py --model /path/to/hf_model data.train_files=[train.parquet]
    python recipes/train_tir_math.py trainer=verl rollout.name=vllm ...   # multi-GPU on verl

Arguments are dotted overrides of recipes/configs/tir_math_cpu.yaml (or --config FILE).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "recipes/configs/tir_math_cpu.yaml"))
    p.add_argument("--model", default=None, help="local HF causal LM folder (default: built-in tiny policy)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n=4")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from otb_tir import ConfigError
    from otb_tir.trainer.config import load_config

    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model.path={args.model}")
    if args.resume:
        overrides.append("trainer.resume=true")
    try:
        cfg = load_config(args.config, overrides)
        if cfg.trainer.name == "verl":
            from otb_tir.verl.launch import run_verl

            run_verl(cfg)
            return 0
        from otb_tir.trainer.run import run

        summary = run(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports
        return 0
    print(json.dumps({k: summary.get(k) for k in ("before", "after", "wall_time_s")}, indent=2))
    print(f"run folder: {cfg.trainer.output_dir} (summary.json, metrics.jsonl, curves.png, tensorboard/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
