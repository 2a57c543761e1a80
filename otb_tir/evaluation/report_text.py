"""Rendering the evaluation report as text: the plain-text summary printed at the end of a run
(:func:`summary_text`), the Markdown report (:func:`markdown_report`: tables per data source and
problem kind, errors, turns, finish reasons, plots, example episodes, definitions) and the
side-by-side table of two reports (:func:`compare_text`), with :func:`format_figure` writing each
figure as counts, rates or '—'. The figures come from :mod:`otb_tir.evaluation.report_build`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from otb_tir.evaluation.metrics import ERROR_KINDS
from otb_tir.evaluation.report_build import DEFINITIONS, compare_reports, headline_keys

__all__ = ["compare_text", "format_figure", "markdown_report", "summary_text"]

_COUNTS = ("errors/", "tools/calls", "tools/by_name/", "problems", "episodes", "turns/max", "response/length_")


def format_figure(v: Any, key: str = "") -> str:
    """A figure as text: counts and lengths as integers, rates with 3 decimals, missing as '—'."""
    if v is None:
        return "—"
    if isinstance(v, float):
        count = key.startswith(_COUNTS) and not key.endswith(("_per_call", "_per_episode"))
        if v.is_integer() and (count or abs(v) >= 10):
            return f"{int(v)}"
        return f"{v:.1f}" if count else f"{v:.3f}"
    return str(v)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in header]] + [[format_figure(c) if not isinstance(c, str) else c for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _main_table(report: Mapping[str, Any], src: str | None = None) -> str:
    def get(section: str) -> Mapping[str, Any]:
        sec = report.get(section) or {}
        return (sec.get("overall") if src is None else (sec.get("by_source") or {}).get(src)) or {}

    w, o = get("with_tools"), get("without_tools")
    has_o = bool(o)
    header = ["figure", "with tools"] + (["tools disabled", "gain"] if has_o else [])
    rows = []
    for k in headline_keys(w):
        row: list[Any] = [k, format_figure(w.get(k), k)]
        if has_o:
            ov = o.get(k)
            gain = (w[k] - ov) if k.startswith("accuracy/") and w.get(k) is not None and ov is not None else None
            row += [format_figure(ov, k), f"{gain:+.3f}" if gain is not None else ""]
        rows.append(row)
    return _table(header, rows)


def _kv_line(fig: Mapping[str, Any], prefix: str, keys: Sequence[str] | None = None) -> str:
    keys = keys or sorted(k[len(prefix) :] for k in fig if k.startswith(prefix) and not k.endswith("_per_call"))
    parts = [f"{k} {format_figure(fig.get(prefix + k), prefix + k)}" for k in keys if fig.get(prefix + k) is not None]
    return ", ".join(parts) or "none"


def summary_text(report: Mapping[str, Any]) -> str:
    """The summary printed at the end of a run (plain-text tables)."""
    m = report["meta"]
    w = report["with_tools"]["overall"]
    lines = [
        f"eval_tool_use — {m['model']}",
        f"engine {m['engine']} · {m['problems']} problems × n={m['n']} · temperature {m['temperature']} · "
        f"tools {', '.join(m['tools'])} · up to {m['max_assistant_turns']} turns, R={m['response_length']}",
        "",
        _main_table(report),
        "",
        "errors by kind (with tools): " + _kv_line(w, "errors/", [k for k in ERROR_KINDS if f"errors/{k}" in w]),
        "turns (share of episodes): " + _kv_line(w, "turns/hist/"),
        "finish reasons (with tools): " + _kv_line(w, "finish/"),
    ]
    if report.get("without_tools"):
        o = report["without_tools"]["overall"]
        lines.append("finish reasons (tools disabled): " + _kv_line(o, "finish/"))
    srcs = sorted((report["with_tools"].get("by_source") or {}))
    if len(srcs) > 1:
        lines += [
            "",
            "accuracy by data source (mean@n): "
            + ", ".join(
                f"{s} {format_figure(report['with_tools']['by_source'][s].get('accuracy/mean@n'))}"
                + (
                    f" / {format_figure(report['without_tools']['by_source'][s].get('accuracy/mean@n'))} without tools"
                    if report.get("without_tools")
                    else ""
                )
                for s in srcs
            ),
        ]
    lines.append(f"wall time {m['wall_s']:.1f} s")
    return "\n".join(lines)


def markdown_report(report: Mapping[str, Any], plots: Mapping[str, str]) -> str:
    m = report["meta"]
    w = report["with_tools"]
    out = [
        f"# Tool-use evaluation: `{m['model']}`",
        "",
        f"- engine `{m['engine']}`, data: {m['data']}, {m['problems']} problems × n={m['n']} samples, "
        f"temperature {m['temperature']}, seed {m['seed']}",
        f"- tools: {', '.join(m['tools'])}; format `{m['format']}`, up to {m['max_assistant_turns']} assistant "
        f"turns, response budget R={m['response_length']} tokens",
        f"- created {m['created']}, wall time {m['wall_s']:.1f} s",
        "",
        "## Overall",
        "",
        _main_table(report),
        "",
    ]
    if report.get("without_tools"):
        out += [f"*Tools disabled*: {DEFINITIONS['without_tools']}.", ""]
    sources = sorted(w.get("by_source") or {})
    if len(sources) == 1:
        out += [
            f"One data source, `{sources[0]}`: its figures are the overall ones (also in the JSON's `by_source`).",
            "",
        ]
    else:
        for src in sources:
            out += [f"## Data source `{src}`", "", _main_table(report, src), ""]
    if w.get("by_kind"):
        rows = [
            [
                k,
                f.get("accuracy/mean@n"),
                (report.get("without_tools") or {}).get("by_kind", {}).get(k, {}).get("accuracy/mean@n", ""),
                f.get("tools/call_rate"),
            ]
            for k, f in w["by_kind"].items()
        ]
        out += [
            "## By problem kind",
            "",
            _table(["kind", "mean@n with tools", "tools disabled", "tool-call rate"], rows),
            "",
        ]
    ov = w["overall"]
    rows = [
        [k, format_figure(ov.get(f"errors/{k}", 0.0), "errors/"), format_figure(ov.get(f"errors/{k}_per_call"))]
        for k in ERROR_KINDS
        if f"errors/{k}" in ov
    ]
    out += ["## Tool-call errors by kind (with tools)", "", _table(["kind", "calls", "per call"], rows), ""]
    hist_keys = sorted(
        {
            k
            for sec in ("with_tools", "without_tools")
            if report.get(sec)
            for k in report[sec]["overall"]
            if k.startswith("turns/hist/")
        },
        key=lambda s: int(s.rsplit("/", 1)[1]),
    )
    rows = [
        [k.rsplit("/", 1)[1], ov.get(k, 0.0)]
        + ([report["without_tools"]["overall"].get(k, 0.0)] if report.get("without_tools") else [])
        for k in hist_keys
    ]
    out += [
        "## Assistant turns per episode",
        "",
        _table(["turns", "with tools"] + (["tools disabled"] if report.get("without_tools") else []), rows),
        "",
    ]
    fin = sorted(
        {
            k
            for sec in ("with_tools", "without_tools")
            if report.get(sec)
            for k in report[sec]["overall"]
            if k.startswith("finish/")
        }
    )
    rows = [
        [k.split("/", 1)[1], ov.get(k, 0.0)]
        + ([report["without_tools"]["overall"].get(k, 0.0)] if report.get("without_tools") else [])
        for k in fin
    ]
    out += [
        "## Finish reasons",
        "",
        _table(["reason", "with tools"] + (["tools disabled"] if report.get("without_tools") else []), rows),
        "",
    ]
    if plots:
        out += ["## Plots", ""] + [f"![{name}]({Path(p).name})" for name, p in plots.items()] + [""]
    recs = (report.get("records") or {}).get("with_tools") or []
    examples = [r for r in recs if r["correct"] and any(tr["tool_calls"] for tr in r["turns"])][:1]
    examples += [r for r in recs if not r["correct"]][:1]
    if examples:
        out += ["## Example episodes (with tools)", ""]
        for r in examples:
            out += [
                f"**problem {r['problem_index']} sample {r['sample_index']}** — correct: {r['correct']}, "
                f"answer {r['answer']!r} (truth {r['ground_truth']!r}), finish `{r['finish_reason']}`",
                "",
                "```text",
                "USER: " + r["prompt"],
            ]
            for tr in r["turns"]:
                out.append("ASSISTANT: " + tr["text"].strip())
                out += [
                    f"TOOL ({c['name']}, {c['error_kind'] or 'ok'}): {c['result'].strip()}" for c in tr["tool_calls"]
                ]
            out += ["```", ""]
    out += ["## Definitions", ""] + [f"- `{k}`: {v}" for k, v in DEFINITIONS.items()] + [""]
    return "\n".join(out)


def compare_text(path_a: str | Path, a: Mapping[str, Any], path_b: str | Path, b: Mapping[str, Any]) -> str:
    rows = [
        [
            k,
            format_figure(va, k.split(" ")[-1]),
            format_figure(vb, k.split(" ")[-1]),
            format_figure(vb - va, k.split(" ")[-1])
            if isinstance(va, (int, float)) and isinstance(vb, (int, float))
            else "",
        ]
        for k, va, vb in compare_reports(a, b)
    ]
    head = [
        f"A = {path_a}: {a['meta']['model']} ({a['meta']['problems']} problems × n={a['meta']['n']})",
        f"B = {path_b}: {b['meta']['model']} ({b['meta']['problems']} problems × n={b['meta']['n']})",
    ]
    if (a["meta"]["problems"], a["meta"]["n"], a["meta"].get("data")) != (
        b["meta"]["problems"],
        b["meta"]["n"],
        b["meta"].get("data"),
    ):
        head.append("warning: A and B were run on different problems or sample counts")
    return "\n".join(head + ["", _table(["figure", "A", "B", "B - A"], rows)])
