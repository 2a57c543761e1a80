"""Evaluation of tool use: ``python recipes/eval_tool_use.py`` (see docs/evaluation.md).

- :func:`load_eval_config` (config schema + YAML + dotted overrides), :func:`prepare` (every input
  checked at start), :func:`evaluate` (episodes with tools, then with tools disabled; report written);
- :func:`pass_at_k`, :func:`classify_call`, :func:`figures` (metric definitions);
- :func:`summary_text`, :func:`load_report`, :func:`compare_text`, :func:`plot_compare`.
"""

from otb_tir.evaluation.config import EvalConfig, load_eval_config
from otb_tir.evaluation.metrics import ERROR_KINDS, classify_call, episode_record, figures, pass_at_k
from otb_tir.evaluation.report import compare_text, load_report, plot_compare, summary_text
from otb_tir.evaluation.run import evaluate, prepare

__all__ = [
    "EvalConfig",
    "load_eval_config",
    "ERROR_KINDS",
    "classify_call",
    "episode_record",
    "figures",
    "pass_at_k",
    "compare_text",
    "load_report",
    "plot_compare",
    "summary_text",
    "evaluate",
    "prepare",
]
