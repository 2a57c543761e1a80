"""The built-in warm start, shipped with the package: every machine starts RL from the same weights.

A warm start trained here is the same bit for bit on every rebuild on one machine, but not across
machines: CPUs differ in their float kernels, so a build on an Intel VM and one on an AMD VM
differed (0.29 and 0.26 held-out accuracy before RL). The default one (arith task, default
settings, the built-in base) is therefore built once and shipped in ``otb_tir/defaults/data/``
(4 MB of weights, its tokenizer and chat template, ``shipped.json``: the key's
:func:`portable_digest`, the key, where, when and with which libraries it was built).
:func:`otb_tir.defaults.warm_start.warm_start_policy` copies it into the cache when its key is the
shipped one; ``model.warm_start_shipped=false`` builds it here.

    python -m otb_tir.defaults.ship            # rebuild the default warm start and ship it (~6 min)
    python -m otb_tir.defaults.ship --check    # rebuild it and compare with the shipped files byte for byte
    python -m otb_tir.defaults.ship --status   # is the shipped copy the current code's? (no build)

When the code that builds it changes (the key holds its fingerprint), the shipped copy no longer
matches, the default run builds it on the user's machine, and the test suite says to reship.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shutil
import sys
import tempfile
import time
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

__all__ = ["SHIPPED", "shipped_record", "shipped_digest", "copy_shipped", "portable_digest", "default_key", "main"]


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


def default_key() -> dict[str, Any]:
    """The key of the built-in default warm start (what ``trainer.py`` with no overrides uses)."""
    from otb_tir.defaults.warm_start import WarmStartSettings, warm_start_key

    return warm_start_key(WarmStartSettings())


def _build(cache: Path) -> tuple[Path, float]:
    from otb_tir.defaults.warm_start import warm_start_policy

    t0 = time.perf_counter()
    path = warm_start_policy(cache, shipped=False, progress=True)
    return path, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    from otb_tir.machine import describe, speed_reference

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="rebuild and compare with the shipped files")
    mode.add_argument("--status", action="store_true", help="does the shipped copy match the current key?")
    args = ap.parse_args(argv)
    digest = portable_digest(default_key())
    shipped = shipped_record()
    current = shipped is not None and shipped_digest() == digest
    print(
        f"current key {digest}; shipped {shipped['digest'] if shipped else 'none'}: {'matches' if current else 'stale'}"
    )
    if args.status:
        return 0 if current else 1
    with tempfile.TemporaryDirectory(prefix="otb_ship_") as tmp:
        built, seconds = _build(Path(tmp))
        if args.check:
            same = {name: (built / name).read_bytes() == (SHIPPED / name).read_bytes() for name in FILES}
            for name, ok in same.items():
                print(f"{name}: {'identical' if ok else 'DIFFERS'}")
            print(f"rebuilt in {seconds:.0f} s on {describe()}; shipped one built on {shipped and shipped['built_on']}")
            return 0 if all(same.values()) and current else 1
        SHIPPED.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copyfile(built / name, SHIPPED / name)
        build_record = json.loads((built / "otb_tir_warm_start.json").read_text())
        record = {
            "digest": digest,
            "key": default_key(),
            "built_on": describe(),
            "speed_reference": speed_reference(),
            "date": _dt.date.today().isoformat(),
            "command": "python -m otb_tir.defaults.ship",
            "build_seconds": round(seconds, 1),
            "final_loss": sum(build_record["losses"][-10:]) / 10,
        }
        (SHIPPED / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(f"shipped into {SHIPPED} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
