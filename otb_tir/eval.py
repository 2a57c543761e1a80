"""``otb-tir-eval`` / ``python -m otb_tir.eval``: evaluate how well a model reasons with tools:
accuracy (mean@n, pass@k) with and without tools, tool-call rate and success, errors by kind,
turns, void turns, tool-token share, lengths, finish reasons, overall and per data source. Writes
<output.dir>/<output.name>.json (every figure, the tool set in use, per-episode records), .md and PNG plots.

    otb-tir-eval                                          # built-in tiny policy, 100 problems × 4
    otb-tir-eval --model runs/tir_math/final output.name=after
    otb-tir-eval --model M data.files=[test.parquet] rollout.n=8 eval.pass_k=[1,4,8]
    otb-tir-eval --compare runs/eval_tool_use/before.json runs/eval_tool_use/after.json

Arguments are dotted overrides of the shipped config ``eval_tool_use`` (or --config FILE).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from otb_tir.cli import parse, parser, refuse_shadowed

    refuse_shadowed()  # a user's own `tools` / `agent_env` package first on sys.path: say so, both paths
    from otb_tir.evaluation.config import EvalConfig

    p = parser(
        "otb-tir-eval", __doc__, EvalConfig, "eval_tool_use", "local HF model folder (default: built-in tiny policy)"
    )
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="compare two reports side by side")
    p.add_argument("--out", default=None, help="--compare: PNG to write (default: next to B, compare.png)")
    args = parse(p, argv, "rollout.n=8")

    from otb_tir import ConfigError

    try:
        if args.compare:
            from otb_tir.evaluation.report import compare_text, load_report, plot_compare

            if args.overrides or args.model:
                raise ConfigError("--compare takes two report files and no overrides or --model")
            a, b = (load_report(f) for f in args.compare)
            print(compare_text(args.compare[0], a, args.compare[1], b))
            out = args.out or str(Path(args.compare[1]).with_name("compare.png"))
            print(f"plot: {plot_compare(args.compare[0], a, args.compare[1], b, out)}")
            return 0
        from omegaconf import OmegaConf

        from otb_tir.configs import resolve_config
        from otb_tir.evaluation import evaluate, load_eval_config, summary_text

        overrides = list(args.overrides) + ([f"model.path={args.model}"] if args.model else [])
        cfg = load_eval_config(resolve_config(args.config), overrides)
        if args.print_config:
            print(OmegaConf.to_yaml(cfg), end="")
            return 0
        from otb_tir.defaults.policy import resolve_policy

        resolve_policy(cfg)  # model.path, or the built-in tiny policy after its (cached) warm start
        report = evaluate(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(summary_text(report))
    print("report: " + ", ".join(report["files"].values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
