"""Rendering the evaluation report as PNG plots with matplotlib (imported only when a plot is
drawn, on the Agg backend): :func:`plot_report` draws accuracy with and without tools per data
source, the turns histogram and the tool-call errors by kind; :func:`plot_compare` draws the
headline figures of two reports side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from otb_tir.evaluation.metrics import ERROR_KINDS, ISSUE_ERROR_KINDS
from otb_tir.evaluation.report_build import headline_keys
from otb_tir.evaluation.report_text import format_figure

__all__ = ["plot_compare", "plot_report"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_report(report: Mapping[str, Any], out_dir: Path, stem: str) -> dict[str, str]:
    """Three PNGs: accuracy with/without tools per data source, turns histogram, error kinds."""
    plt = _plt()
    import numpy as np

    paths: dict[str, str] = {}
    w, o = report["with_tools"], report.get("without_tools")
    groups = ["overall"] + sorted(w["by_source"]) if len(w["by_source"]) > 1 else ["overall"] + list(w["by_source"])
    pk = [k for k in w["overall"] if k.startswith("accuracy/pass@")]
    best = max(pk, key=lambda s: int(s.split("@")[1])) if pk else None

    def fig_of(sec: Mapping[str, Any], g: str) -> Mapping[str, Any]:
        return sec["overall"] if g == "overall" else sec["by_source"].get(g, {})

    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(groups) + 2), 3.6))
    x = np.arange(len(groups))
    series = [("with tools", w, "tab:blue")] + ([("tools disabled", o, "tab:gray")] if o else [])
    width = 0.8 / len(series)
    for i, (label, sec, color) in enumerate(series):
        vals = [fig_of(sec, g).get("accuracy/mean@n") or 0.0 for g in groups]
        ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=f"{label} mean@n", color=color)
        if best:
            pv = [fig_of(sec, g).get(best) or 0.0 for g in groups]
            ax.scatter(
                x + (i - (len(series) - 1) / 2) * width,
                pv,
                marker="_",
                s=400,
                color="black",
                label=f"{best.split('/')[1]}" if i == 0 else None,
                zorder=3,
            )
    ax.set_xticks(x, groups, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy")
    ax.set_title(f"accuracy with and without tools (n={report['meta']['n']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["accuracy"] = str(out_dir / f"{stem}_accuracy.png")
    fig.savefig(paths["accuracy"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.4))
    keys = sorted(
        {int(k.rsplit("/", 1)[1]) for sec in (w, o) if sec for k in sec["overall"] if k.startswith("turns/hist/")}
    )
    x = np.arange(len(keys))
    for i, (label, sec, color) in enumerate(series):
        vals = [sec["overall"].get(f"turns/hist/{t}", 0.0) for t in keys]
        ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=label, color=color)
    ax.set_xticks(x, [str(t) for t in keys])
    ax.set_xlabel("assistant turns per episode")
    ax.set_ylabel("share of episodes")
    ax.set_title("turns distribution")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["turns"] = str(out_dir / f"{stem}_turns.png")
    fig.savefig(paths["turns"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    kinds = [k for k in ERROR_KINDS if f"errors/{k}" in w["overall"] or k in ISSUE_ERROR_KINDS]
    y = np.arange(len(kinds))
    for i, (label, sec, color) in enumerate(series):
        vals = [sec["overall"].get(f"errors/{k}", 0.0) or 0.0 for k in kinds]
        ax.barh(y + (i - (len(series) - 1) / 2) * width, vals, width, label=label, color=color)
    ax.set_yticks(y, kinds, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tool calls")
    ax.set_title(f"tool-call errors by kind ({format_figure(w['overall'].get('tools/calls'))} calls with tools)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["errors"] = str(out_dir / f"{stem}_errors.png")
    fig.savefig(paths["errors"], dpi=110)
    plt.close(fig)
    return paths


def _label(path: str | Path, report: Mapping[str, Any]) -> str:
    return f"{Path(path).stem} ({Path(report['meta']['model']).name})"


def plot_compare(
    path_a: str | Path, a: Mapping[str, Any], path_b: str | Path, b: Mapping[str, Any], out: str | Path
) -> str:
    plt = _plt()
    import numpy as np

    keys = [
        k
        for k in headline_keys(a["with_tools"]["overall"])
        if k.startswith(("accuracy/", "tools/call_rate", "tools/success_rate", "episode/", "response/tool_token"))
    ]
    oa, ob = (a.get("without_tools") or {}).get("overall", {}), (b.get("without_tools") or {}).get("overall", {})
    labels = keys + (["no tools mean@n"] if oa or ob else [])
    va = [a["with_tools"]["overall"].get(k) or 0.0 for k in keys] + (
        [oa.get("accuracy/mean@n") or 0.0] if oa or ob else []
    )
    vb = [b["with_tools"]["overall"].get(k) or 0.0 for k in keys] + (
        [ob.get("accuracy/mean@n") or 0.0] if oa or ob else []
    )
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels) + 2), 3.8))
    x = np.arange(len(labels))
    ax.bar(x - 0.2, va, 0.4, label="A " + _label(path_a, a), color="tab:gray")
    ax.bar(x + 0.2, vb, 0.4, label="B " + _label(path_b, b), color="tab:blue")
    ax.set_xticks(x, [lbl.split("/", 1)[-1] for lbl in labels], rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_title("A vs B (with tools unless noted)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out)
