"""Every link into docs/results.md or docs/results-log.md by anchor (from README.md, docs/*.md and
those two pages themselves) names a heading that page has, by GitHub's anchor rules. A same-page
link in the log may name a heading of results.md: its sections were written there, verbatim."""

from __future__ import annotations

import re
from pathlib import Path

from record import heading_anchors

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("results.md", "results-log.md")
LINK = re.compile(r"\]\(((?:[\w./-]*/)?(results(?:-log)?\.md))?#([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors (record.py's rule, the one the sections it writes link by)."""
    return set(heading_anchors(text))


def broken_links(root: Path = ROOT) -> list[str]:
    known = {name: anchors((root / "docs" / name).read_text()) for name in PAGES if (root / "docs" / name).is_file()}
    broken = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for target, name, anchor in LINK.findall(doc.read_text()):
            if not target:  # a same-page link: checked only on the two results pages
                if doc.name not in PAGES:
                    continue
                name = doc.name
            ok = anchor in known.get(name, set())
            if not target and doc.name == "results-log.md":  # verbatim sections written on results.md
                ok = ok or anchor in known.get("results.md", set())
            if not ok:
                broken.append(f"{doc.relative_to(root)}: {name}#{anchor}")
    return broken


def test_every_anchor_into_the_results_pages_resolves():
    assert broken_links() == []


def test_a_broken_anchor_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results.md").write_text("# Measured results\n\n## Side by side with TRL (2026-12-06)\n")
    (tmp_path / "docs" / "results-log.md").write_text("# Results log\n\n## Old run\n\n## Old run\n")
    (tmp_path / "README.md").write_text(
        "[a](docs/results.md#side-by-side-with-trl-2026-12-06) [b](docs/results-log.md#old-run-1)"
        " [c](docs/results.md#gone)\n"
    )
    assert broken_links(tmp_path) == ["README.md: results.md#gone"]
