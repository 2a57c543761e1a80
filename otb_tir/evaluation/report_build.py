"""Computing the evaluation report: the report dict of :func:`build_report` (run metadata, the
resolved config, every figure of :mod:`otb_tir.evaluation.metrics` overall, per data source and per
problem kind for each pass, the tool gain, the per-episode records), JSON-safe; the
:data:`DEFINITIONS` of its figures; the headline figures a reader sees first
(:func:`headline_keys`); and the figure-by-figure comparison of two reports
(:func:`compare_reports`). Rendering is in :mod:`otb_tir.evaluation.report_text` and
:mod:`otb_tir.evaluation.report_plots`; :mod:`otb_tir.evaluation.report` writes and loads the files.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

from otb_tir import __version__
from otb_tir.builders import resolved_plugins
from otb_tir.evaluation.metrics import ERROR_KINDS, episode_record, figures, group_figures

__all__ = ["DEFINITIONS", "build_report", "compare_reports", "headline_keys"]


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


def headline_keys(fig: Mapping[str, Any]) -> list[str]:
    keys = []
    for k in _HEADLINE:
        if k == "@pass":
            keys += sorted((x for x in fig if x.startswith("accuracy/pass@")), key=lambda s: int(s.split("@")[1]))
        elif k in fig:
            keys.append(k)
    return keys


def compare_reports(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(figure, A, B)`` rows: the headline figures with tools, then accuracy with tools disabled."""
    rows: list[tuple[str, Any, Any]] = []
    fa, fb = a["with_tools"]["overall"], b["with_tools"]["overall"]
    keys = headline_keys(fa)
    keys += [k for k in headline_keys(fb) if k not in keys]
    rows += [(k, fa.get(k), fb.get(k)) for k in keys]
    for kind in ERROR_KINDS:
        k = f"errors/{kind}"
        if k in fa or k in fb:
            rows.append((k, fa.get(k), fb.get(k)))
    oa, ob = (a.get("without_tools") or {}).get("overall", {}), (b.get("without_tools") or {}).get("overall", {})
    for k in sorted({x for x in list(oa) + list(ob) if x.startswith("accuracy/")}):
        rows.append(("tools disabled " + k, oa.get(k), ob.get(k)))
    return rows
