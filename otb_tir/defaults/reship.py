"""Rebuild the shipped default warm start (:mod:`otb_tir.defaults.ship`) and check it.

python -m otb_tir.defaults.reship            # rebuild the default warm start and ship it (~6 min)
python -m otb_tir.defaults.reship --check    # rebuild it and compare with the shipped files byte for byte
python -m otb_tir.defaults.reship --status   # is the shipped copy the current code's? (no build)
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

from otb_tir.defaults.ship import FILES, RECORD, SHIPPED, portable_digest, shipped_digest, shipped_record

__all__ = ["default_key", "main"]


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
            "command": "python -m otb_tir.defaults.reship",
            "build_seconds": round(seconds, 1),
            "final_loss": sum(build_record["losses"][-10:]) / 10,
        }
        (SHIPPED / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(f"shipped into {SHIPPED} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
