"""The built-in warm start, shipped with the package: every machine starts RL from the same weights.

A warm start trained here is the same bit for bit on every rebuild on one machine, but not across
machines: CPUs differ in their float kernels, so a build on an Intel VM and one on an AMD VM
differed (0.29 and 0.26 held-out accuracy before RL). The default one (arith task, default
settings, the built-in base) is therefore built once and shipped in ``otb_tir/defaults/data/``
(4 MB of weights, its tokenizer and chat template, ``shipped.json``: the key's
:func:`portable_digest`, the key, where, when and with which libraries it was built).
:func:`otb_tir.defaults.warm_start.warm_start_policy` copies it into the cache when its key is the
shipped one; ``model.warm_start_shipped=false`` builds it here.

    python -m otb_tir.defaults.reship            # rebuild the default warm start and ship it (~6 min)
    python -m otb_tir.defaults.reship --check    # rebuild it and compare with the shipped files byte for byte
    python -m otb_tir.defaults.reship --status   # is the shipped copy the current code's? (no build)

When the code that builds it changes (the key holds its fingerprint), the shipped copy no longer
matches, the default run builds it on the user's machine, and the test suite says to reship.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

SHIPPED = Path(__file__).resolve().parent / "data" / "warm-arith"
RECORD = "shipped.json"
#: the files of an HF folder that a run loads (the build's own marker is not shipped)
FILES = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)

__all__ = ["SHIPPED", "FILES", "shipped_record", "shipped_digest", "copy_shipped", "portable_digest"]


def shipped_record(folder: Path = SHIPPED) -> dict[str, Any] | None:
    path = folder / RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def shipped_digest(folder: Path = SHIPPED) -> str | None:
    """The shipped warm start's key digest (``None``: nothing shipped, or a file missing)."""
    record = shipped_record(folder)
    if record is None or not all((folder / f).is_file() for f in FILES):
        return None
    return record["digest"]


def copy_shipped(dest: Path, folder: Path = SHIPPED) -> dict[str, Any]:
    """Copy the shipped files into ``dest``; returns what the cache marker records about them."""
    for name in FILES:
        shutil.copyfile(folder / name, dest / name)
    record = shipped_record(folder) or {}
    return {"source": "shipped", "shipped": {k: v for k, v in record.items() if k != "key"}}


def portable_digest(key: dict[str, Any]) -> str:
    """The digest the shipped copy is matched by: the warm start's key without the library versions
    (recorded in ``shipped.json``: like a CPU's float kernels, they change the build's last bits,
    not which policy it is) and without the local build's ``source``."""
    from agent_env.cache import key_digest

    return key_digest({k: v for k, v in key.items() if k not in ("libraries", "source")})
