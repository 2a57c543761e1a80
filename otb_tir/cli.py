"""What ``otb-tir-train`` and ``otb-tir-eval`` share: the ``--help`` listing of config sections."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

REFERENCE = "docs/configuration.md; --print-config prints every key with the value this run would use"


def sections_help(schema: type) -> str:
    """One line per config section with its keys, for an argparse epilog."""
    lines = ["config sections (override any key as section.key=value; nested: actor.optim.lr=1e-4):"]
    for f in fields(schema):
        default: Any = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if not is_dataclass(default):
            continue
        keys = []
        for g in fields(default):
            sub = getattr(default, g.name)
            keys.append(f"{g.name}.*" if is_dataclass(sub) else g.name)
        lines.append(f"  {f.name}: {', '.join(keys)}")
    lines.append(f"every key, its default and meaning: {REFERENCE}")
    return "\n".join(lines)
