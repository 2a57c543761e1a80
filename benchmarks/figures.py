"""The benchmarks' figures: a grid of matplotlib axes (the Agg backend, imported only when a figure is
drawn) saved as one PNG. Imported by its sibling scripts (``from figures import figure``: a script's own
folder is on ``sys.path``, and ``benchmarks/`` is on pytest's ``pythonpath``)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def figure(path: str | Path, rows: int, cols: int, figsize: tuple[float, float]) -> Iterator[Any]:
    """``axes[row][col]``, a ``rows`` × ``cols`` grid, for the block to draw on; when it ends the figure is
    laid out and saved to ``path`` (its folder made) at 110 dpi, and closed (also when the block fails)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=figsize, squeeze=False)
    try:
        yield axes
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
