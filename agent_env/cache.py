"""One way to publish a built folder into the cache (tiny policy, warm start, test policies):
write it into a temporary sibling, mark it complete, rename it into place. Concurrent builders
never see a half-written folder; the loser of a race keeps the winner's copy."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = ["is_published", "publishing"]


def is_published(final: Path, marker: str) -> bool:
    return (final / marker).is_file()


@contextmanager
def publishing(final: Path, marker: str, record: dict[str, Any]) -> Iterator[Path]:
    """``with publishing(final, marker, record) as tmp:`` write the folder's files into ``tmp``;
    on a clean exit ``record`` is written to ``tmp/marker`` and ``tmp`` becomes ``final``.
    ``record`` may be filled in inside the block (e.g. losses, timings)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        yield tmp
        (tmp / marker).write_text(json.dumps(record, indent=1, sort_keys=True, default=str))
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first, or a stale unmarked folder is in the way
            if not is_published(final, marker):
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
