"""The evaluation report: JSON (every figure + per-episode records), Markdown, PNG plots, the
printed summary, and the side-by-side comparison of two reports."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

from otb_tir import ConfigError, __version__
from otb_tir.builders import resolved_plugins
from otb_tir.evaluation.metrics import ERROR_KINDS, ISSUE_ERROR_KINDS, episode_record, figures, group_figures

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

DEFINITIONS = {
    "accuracy/mean@n": "share of correct episodes (mean over problems of c/n)",
    "accuracy/pass@k": "mean over problems of 1 - C(n-c,k)/C(n,k) (unbiased, Chen et al. 2021)",
    "accuracy/any_correct": "share of problems with at least one correct sample (= pass@n)",
    "tools/call_rate": "share of episodes with at least one tool call (malformed ones included)",
    "tools/calls_per_episode": "parsed tool calls per episode",
    "tools/success_rate": "ok calls / (ok + failed) calls; calls on the last allowed turn are not executed and "
    "count as neither (tools/not_executed); output cut short counts as ok "
    "(agent_env.tool_metrics, the same definition as training's)",
    "tools/executed_success_rate": "calls that returned ok / calls that reached a tool",
    "errors/<kind>": "calls per error kind: " + ", ".join(ERROR_KINDS),
    "plugins": "what each extension point resolved to and from where: task, tool-call format, reward(s), tools",
    "tool_set": "the tools in use: name, class, where it came from (built-in, entry point, tools YAML), "
    "its config and the sandbox's isolation level",
    "turns/hist/<t>": "share of episodes with t assistant turns",
    "episode/void_turn_rate": "share of episodes with a void turn (neither a tool call nor an answer)",
    "response/tool_token_share": "response tokens inserted by tools (mask 0) / all response tokens",
    "finish/<reason>": "share of episodes per finish reason",
    "without_tools": (
        "same model and problems, prompts rendered without tool schemas and no tools available: "
        "a call the model still writes gets an unknown_tool error observation and is counted"
    ),
}

_HEADLINE = [
    "accuracy/mean@n",
    "@pass",
    "accuracy/any_correct",
    "tools/call_rate",
    "tools/calls_per_episode",
    "tools/success_rate",
    "errors/total",
    "turns/mean",
    "episode/void_turn_rate",
    "response/tool_token_share",
    "response/length_mean",
    "response/length_p90",
]


def _clean(x: Any) -> Any:
    """JSON-safe: NaN/inf → None, numpy scalars → Python."""
    if isinstance(x, Mapping):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _section(trajs: list, items: list[dict], pass_k: Sequence[int], stats: dict) -> dict[str, Any]:
    idx = [int(t.uid[1:]) for t in trajs]
    sources = [str(items[i].get("data_source", "unknown")) for i in idx]
    kinds = [str((items[i].get("extra_info") or {}).get("kind", "")) for i in idx]
    out = {"overall": figures(trajs, pass_k), "by_source": group_figures(trajs, sources, pass_k)}
    if any(kinds):
        out["by_kind"] = {
            k: {key: v for key, v in f.items() if key.startswith(("accuracy/", "tools/call_rate"))}
            for k, f in group_figures(trajs, kinds, pass_k).items()
        }
    out["rollout_stats"] = stats
    return out


def build_report(cfg: DictConfig, prep: Any, passes: dict[str, tuple[list, dict]], wall_s: float) -> dict[str, Any]:
    """The report dict from the trajectories of each pass (``with_tools`` and optionally ``without_tools``)."""
    pass_k = [int(k) for k in cfg.eval.pass_k]
    items = prep.items
    report: dict[str, Any] = {
        "meta": {
            "model": str(prep.model_path),
            "engine": cfg.rollout.name,
            "data": prep.data_desc,
            "problems": len(items),
            "n": cfg.rollout.n,
            "temperature": cfg.rollout.temperature,
            "seed": cfg.eval.seed,
            "tools": sorted(prep.tools),
            "pass_k": pass_k,
            "tool_set": prep.tools.describe(),
            "plugins": resolved_plugins(cfg, prep.tools),
            "max_assistant_turns": cfg.multi_turn.max_assistant_turns,
            "response_length": cfg.rollout.response_length,
            "format": cfg.multi_turn.format,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "wall_s": wall_s,
            "otb_tir_version": __version__,
        },
        "config": OmegaConf.to_container(cfg, resolve=True),
        "definitions": DEFINITIONS,
    }
    for name, (trajs, stats) in passes.items():
        report[name] = _section(trajs, items, pass_k, stats)
    if "without_tools" in passes:
        w, o = report["with_tools"], report["without_tools"]
        delta = {"overall": _delta(w["overall"], o["overall"])}
        delta["by_source"] = {s: _delta(w["by_source"][s], o["by_source"].get(s, {})) for s in w["by_source"]}
        report["tool_gain"] = delta
    if cfg.output.records:
        report["records"] = {
            name: [episode_record(t, items[int(t.uid[1:])], int(t.uid[1:])) for t in trajs]
            for name, (trajs, _) in passes.items()
        }
    return _clean(report)


def _delta(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    return {k: a[k] - b[k] for k in a if k.startswith("accuracy/") and k in b}


# ----------------------------------------------------------------------------- text

_COUNTS = ("errors/", "tools/calls", "tools/by_name/", "problems", "episodes", "turns/max", "response/length_")


def _fmt(v: Any, key: str = "") -> str:
    """A figure as text: counts and lengths as integers, rates with 3 decimals, missing as '—'."""
    if v is None:
        return "—"
    if isinstance(v, float):
        count = key.startswith(_COUNTS) and not key.endswith(("_per_call", "_per_episode"))
        if v.is_integer() and (count or abs(v) >= 10):
            return f"{int(v)}"
        return f"{v:.1f}" if count else f"{v:.3f}"
    return str(v)


def _headline_keys(fig: Mapping[str, Any]) -> list[str]:
    keys = []
    for k in _HEADLINE:
        if k == "@pass":
            keys += sorted((x for x in fig if x.startswith("accuracy/pass@")), key=lambda s: int(s.split("@")[1]))
        elif k in fig:
            keys.append(k)
    return keys


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in header]] + [[_fmt(c) if not isinstance(c, str) else c for c in r] for r in rows]
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
    for k in _headline_keys(w):
        row: list[Any] = [k, _fmt(w.get(k), k)]
        if has_o:
            ov = o.get(k)
            gain = (w[k] - ov) if k.startswith("accuracy/") and w.get(k) is not None and ov is not None else None
            row += [_fmt(ov, k), f"{gain:+.3f}" if gain is not None else ""]
        rows.append(row)
    return _table(header, rows)


def _kv_line(fig: Mapping[str, Any], prefix: str, keys: Sequence[str] | None = None) -> str:
    keys = keys or sorted(k[len(prefix) :] for k in fig if k.startswith(prefix) and not k.endswith("_per_call"))
    parts = [f"{k} {_fmt(fig.get(prefix + k), prefix + k)}" for k in keys if fig.get(prefix + k) is not None]
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
                f"{s} {_fmt(report['with_tools']['by_source'][s].get('accuracy/mean@n'))}"
                + (
                    f" / {_fmt(report['without_tools']['by_source'][s].get('accuracy/mean@n'))} without tools"
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
        [k, _fmt(ov.get(f"errors/{k}", 0.0), "errors/"), _fmt(ov.get(f"errors/{k}_per_call"))]
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


# ----------------------------------------------------------------------------- plots


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
    ax.set_title(f"tool-call errors by kind ({_fmt(w['overall'].get('tools/calls'))} calls with tools)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["errors"] = str(out_dir / f"{stem}_errors.png")
    fig.savefig(paths["errors"], dpi=110)
    plt.close(fig)
    return paths


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


# ----------------------------------------------------------------------------- compare


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


def _label(path: str | Path, report: Mapping[str, Any]) -> str:
    return f"{Path(path).stem} ({Path(report['meta']['model']).name})"


def compare_reports(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(figure, A, B)`` rows: the headline figures with tools, then accuracy with tools disabled."""
    rows: list[tuple[str, Any, Any]] = []
    fa, fb = a["with_tools"]["overall"], b["with_tools"]["overall"]
    keys = _headline_keys(fa)
    keys += [k for k in _headline_keys(fb) if k not in keys]
    rows += [(k, fa.get(k), fb.get(k)) for k in keys]
    for kind in ERROR_KINDS:
        k = f"errors/{kind}"
        if k in fa or k in fb:
            rows.append((k, fa.get(k), fb.get(k)))
    oa, ob = (a.get("without_tools") or {}).get("overall", {}), (b.get("without_tools") or {}).get("overall", {})
    for k in sorted({x for x in list(oa) + list(ob) if x.startswith("accuracy/")}):
        rows.append(("tools disabled " + k, oa.get(k), ob.get(k)))
    return rows


def compare_text(path_a: str | Path, a: Mapping[str, Any], path_b: str | Path, b: Mapping[str, Any]) -> str:
    rows = [
        [
            k,
            _fmt(va, k.split(" ")[-1]),
            _fmt(vb, k.split(" ")[-1]),
            _fmt(vb - va, k.split(" ")[-1]) if isinstance(va, (int, float)) and isinstance(vb, (int, float)) else "",
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


def plot_compare(
    path_a: str | Path, a: Mapping[str, Any], path_b: str | Path, b: Mapping[str, Any], out: str | Path
) -> str:
    plt = _plt()
    import numpy as np

    keys = [
        k
        for k in _headline_keys(a["with_tools"]["overall"])
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
