"""The configuration reference, rendered from the config schemas (the dataclasses are the source
of truth: each key's default and the comment written beside it). ``otb-tir-train --reference``
prints it from an installed package; in a checkout it is also docs/configuration.md:

    python scripts/gen_config_reference.py            # rewrite docs/configuration.md
    python scripts/gen_config_reference.py --check    # exit 1 if it is out of date (a test runs this)
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"  # in a checkout

HEADER = """# Configuration reference

Generated from the config dataclasses by `python scripts/gen_config_reference.py`; do not edit by hand.

Every key is set in a YAML file (`--config FILE`, or a shipped one by name: `tir_math_cpu`, `eval_tool_use`,
`tir_math_qwen3_8b_gpu` — the seed's Qwen3-8B run on 8 GPUs with verl, docs/verl.md)
or on the command line as a dotted override (`rollout.n=4`, `actor.optim.lr=1e-4`,
`multi_turn.tools=[python,lookup]`, `multi_turn.tool_config.python.timeout=5`). An unknown key, a
value of the wrong type or outside its choices stops the run at start with the key's name and the
valid choices. `--print-config` prints every key with the value a run would use.
"""


def _comments(cls: type) -> dict[str, str]:
    """field name → the comment on its line (``name: type = default  # comment``); a field a
    subclass redefines without a comment keeps its base class's comment."""
    out: dict[str, str] = {}
    for base in reversed([c for c in cls.__mro__ if is_dataclass(c)]):
        out.update({k: v for k, v in _own_comments(base).items() if v or k not in out})
    return out


def _own_comments(cls: type) -> dict[str, str]:
    src = inspect.getsource(cls)
    lines = src.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(src).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            before = [ln.strip()[1:].strip() for ln in reversed(lines[: node.lineno - 1])]
            lead = []
            for ln, raw in zip(before, reversed(lines[: node.lineno - 1])):
                if not raw.strip().startswith("#"):
                    break
                lead.insert(0, ln)
            tail = text.split("#", 1)[1].strip() if "#" in text.splitlines()[-1] else ""
            out[node.target.id] = " ".join([*lead, tail]).strip()
    return out


def _default(f) -> str:
    if f.default is not MISSING:
        value = f.default
    elif f.default_factory is not MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return ""
    return json.dumps(value)


def _section(schema: type, prefix: str, choices: dict) -> list[str]:
    rows: list[str] = []
    notes = _comments(schema)
    for f in fields(schema):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not MISSING else None  # type: ignore[misc]
        if is_dataclass(default):
            rows += _section(type(default), key + ".", choices)
            continue
        note = notes.get(f.name, "")
        if key in choices:
            listed = " | ".join(map(str, choices[key]))
            note = note.replace(listed, "").lstrip(" ;:")  # the comment's own list of choices, shown below
            note = (note + " " if note else "") + "Choices: " + ", ".join(f"`{c}`" for c in choices[key]) + "."
        note = note.replace("|", "\\|")
        rows.append(f"| `{key}` | `{_default(f)}` | {note} |")
    return rows


def render() -> str:
    from otb_tir.evaluation.config import EVAL_CHOICES, EvalConfig
    from otb_tir.trainer.config import CHOICES, Config

    parts = [HEADER]
    for title, schema, choices in [
        ("Training (`otb-tir-train`, `recipes/train_tir_math.py`)", Config, CHOICES),
        ("Evaluation (`otb-tir-eval`, `recipes/eval_tool_use.py`)", EvalConfig, EVAL_CHOICES),
    ]:
        parts.append(f"\n## {title}\n")
        for f in fields(schema):
            sub = f.default_factory()  # type: ignore[misc]
            parts.append(f"\n### `{f.name}`\n")
            doc = (type(sub).__doc__ or "").strip()
            if doc and not doc.startswith(type(sub).__name__ + "("):
                parts.append(" ".join(doc.split("\n\n")[0].split()) + "\n")  # its first paragraph
            parts.append("\n| key | default | meaning |\n|---|---|---|")
            parts += _section(type(sub), f"{f.name}.", choices)
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="gen_config_reference.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python scripts/gen_config_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0
