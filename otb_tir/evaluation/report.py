"""The evaluation report's files and public API: :func:`write_report` writes ``<name>.json``
(every figure + per-episode records), ``<name>.md`` and the PNG plots, :func:`load_report` reads a
JSON report back for a comparison. The report is computed in
:mod:`otb_tir.evaluation.report_build` (:func:`build_report`, :func:`compare_reports`), rendered as
text in :mod:`otb_tir.evaluation.report_text` (:func:`summary_text`, :func:`markdown_report`,
:func:`compare_text`) and as plots in :mod:`otb_tir.evaluation.report_plots` (:func:`plot_report`,
:func:`plot_compare`); those names are importable from here too.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from otb_tir import ConfigError
from otb_tir.evaluation.report_build import DEFINITIONS, build_report, compare_reports
from otb_tir.evaluation.report_plots import plot_compare, plot_report
from otb_tir.evaluation.report_text import compare_text, markdown_report, summary_text

log = logging.getLogger(__name__)

__all__ = [
    "build_report",
    "write_report",
    "summary_text",
    "markdown_report",
    "plot_report",
    "load_report",
    "compare_reports",
    "compare_text",
    "plot_compare",
    "DEFINITIONS",
]


def write_report(report: dict[str, Any], cfg: DictConfig) -> dict[str, str]:
    """Write ``<dir>/<name>.json``, ``.md`` and the PNGs; returns their paths (also in ``report["files"]``)."""
    out_dir = Path(cfg.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = cfg.output.name
    plots = plot_report(report, out_dir, stem) if cfg.output.plots else {}
    files = {"json": str(out_dir / f"{stem}.json"), "markdown": str(out_dir / f"{stem}.md"), **plots}
    report["files"] = files
    Path(files["markdown"]).write_text(markdown_report(report, plots))
    Path(files["json"]).write_text(json.dumps(report, indent=1, allow_nan=False))
    return files


def load_report(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"report not found: {p}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not a JSON report: {e}") from None
    if not isinstance(data, dict) or "with_tools" not in data or "meta" not in data:
        raise ConfigError(f"{p} is not an eval_tool_use report (no 'meta' / 'with_tools')")
    return data
