"""``otb-tir-train`` / ``python -m otb_tir.train``: train a policy to solve math with a sandboxed
Python interpreter and a calculator, with TIR-OTB.

    otb-tir-train                                          # built-in CPU default (tiny policy, built-in task)
    otb-tir-train rollout.n=4 trainer.total_steps=10
    otb-tir-train --model /path/to/hf_model data.train_files=[train.parquet]
    otb-tir-train multi_turn.tool_config_path=my_tools.yaml  # your own tools (verl-style tools YAML)
    otb-tir-train trainer=verl rollout.name=vllm ...       # multi-GPU on verl

Arguments are dotted overrides of the shipped config ``tir_math_cpu`` (or --config FILE).
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from otb_tir.cli import parse, parser, refuse_shadowed

    refuse_shadowed()  # a user's own `tools` / `agent_env` package first on sys.path: say so, both paths
    from otb_tir.trainer.config import Config

    p = parser(
        "otb-tir-train", __doc__, Config, "tir_math_cpu", "local HF causal LM folder (default: built-in tiny policy)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    args = parse(p, argv, "rollout.n=4")

    from omegaconf import OmegaConf

    from otb_tir import ConfigError
    from otb_tir.configs import resolve_config
    from otb_tir.trainer.config import load_config

    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model.path={args.model}")
    if args.resume:
        overrides.append("trainer.resume=true")
    try:
        cfg = load_config(resolve_config(args.config), overrides)
        if args.print_config:
            print(OmegaConf.to_yaml(cfg), end="")
            return 0
        from otb_tir.builders import check_inputs

        check_inputs(cfg)  # the user's data and model, before anything is loaded or written
        from otb_tir.defaults.policy import resolve_policy

        resolve_policy(cfg)  # model.path, or the built-in tiny policy after its (cached) warm start
        if cfg.trainer.name == "verl":
            from otb_tir.verl.launch import VerlRunError, run_verl

            try:
                summary = run_verl(cfg)
            except VerlRunError as e:
                print(f"verl run failed: {e}", file=sys.stderr)
                return 1
            if summary is not None:
                print(json.dumps({k: summary.get(k) for k in ("before", "after", "wall_time_s")}, indent=2))
                print(
                    f"run folder: {cfg.trainer.output_dir} (summary.json, metrics.jsonl, curves.png, tensorboard/, "
                    "verl_config.yaml, verl.log)"
                )
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
