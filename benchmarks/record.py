"""Run a benchmark and record it: what it printed goes, whole, to the log docs/results-log.md; the
claim's section of docs/results.md gets its figures in a few lines, with the date, the machine, the
speed reference and the exact command: the one way measured figures reach the results pages.

    python benchmarks/record.py NAME "Title" --summary figures.md -- python benchmarks/bench_advantage.py --reps 5

The section is the text between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``; a new
run replaces it (the rest of the page is kept as it is), a first run appends it. Its figures are
``--summary FILE`` (a compact table of the run's figures, written by hand from the output) or,
without it, the output itself when it is at most SUMMARY_LINES lines, else its last SUMMARY_LINES
lines. Every run appends its whole output, verbatim, to the log (``--log``, only ever appended to),
under a heading the section links to; the section a rerun replaces is appended there first, with
the date it moved. The speed reference is the one the output prints ("speed reference ... N
GFLOP/s"), else measured here after the run (:func:`otb_tir.machine.speed_reference`). A command
that exits non-zero writes nothing and its exit code is this script's.

A run on another machine (a lent GPU) is recorded from what it printed there, with that machine's
description, without running the command here:

    python benchmarks/record.py NAME "Title" --printed log.txt --machine "1x NVIDIA H200, ..." -- CMD
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results.md"
LOG = RESULTS.with_name("results-log.md")
SUMMARY_LINES = 12  # an output longer than this is summarized on the page (its last lines, or --summary)
SPEED = re.compile(r"speed reference\b[^\n\d]*?(\d+(?:\.\d+)?) GFLOP/s")


def machine() -> str:
    """CPU model and count, memory and accelerator, in one line: :func:`otb_tir.machine.describe`."""
    from otb_tir.machine import describe

    return describe()


def measured_speed() -> str:
    from otb_tir.machine import speed_reference

    return f"{speed_reference()['matmul_gflops']:.0f} GFLOP/s (measured by record.py after the run)"


def heading_anchors(text: str) -> list[str]:
    """The anchors GitHub gives a page's headings, in order: lowercase, punctuation dropped, spaces
    to '-', a repeat gets -1, -2, ...; lines inside ``` fences are not headings."""
    seen: dict[str, int] = {}
    out: list[str] = []
    fence = False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"#{1,6} (.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.append(slug if n == 0 else f"{slug}-{n}")
    return out


def figures(output: str, summary: str | None) -> str:
    """What the page shows of a run: the hand-written summary, the whole output when it is short,
    else its last SUMMARY_LINES lines."""
    if summary is not None:
        return summary.strip() + "\n"
    lines = output.rstrip().splitlines()
    if len(lines) <= SUMMARY_LINES:
        return "```text\n" + "\n".join(lines) + "\n```\n"
    tail = "\n".join(lines[-SUMMARY_LINES:])
    return f"Its last {SUMMARY_LINES} of {len(lines)} lines:\n\n```text\n{tail}\n```\n"


def record(
    results: Path,
    log: Path,
    name: str,
    title: str,
    command: list[str],
    output: str,
    *,
    when: str,
    where: str,
    speed: str,
    summary: str | None = None,
) -> None:
    """Append the whole output to ``log`` (after the section it replaces, if any), then write
    section ``name`` of ``results``: its figures and a link to that log entry."""
    page = results.read_text() if results.exists() else "# Measured results\n"
    pattern = re.compile(rf"<!-- results:{re.escape(name)} -->\n.*?<!-- /results:{re.escape(name)} -->\n", re.S)
    old = pattern.search(page)
    history = log.read_text() if log.exists() else "# Results log\n"
    if old:
        moved = f"_Moved from results.md on {_dt.date.today().isoformat()} (replaced by a rerun)._\n\n"
        history = history.rstrip("\n") + "\n\n" + moved + old.group(0)
    history = history.rstrip("\n") + "\n\n" + f"## {name}: {title} ({when}), as printed\n"
    anchor = heading_anchors(history)[-1]
    history += (
        f"\nMachine: {where}. Speed reference: {speed}. Command: `{shlex.join(command)}`\n\n"
        f"```text\n{output.rstrip()}\n```\n"
    )
    link = Path(os.path.relpath(log, results.parent)).as_posix()
    text = (
        f"<!-- results:{name} -->\n## {title} ({when})\n\n"
        f"Machine: {where}. Speed reference: {speed}. Command: `{shlex.join(command)}`. "
        f"All it printed: [{log.name}]({link}#{anchor}).\n\n{figures(output, summary)}"
        f"<!-- /results:{name} -->\n"
    )
    page = pattern.sub(lambda _: text, page, count=1) if old else page.rstrip("\n") + "\n\n" + text
    for path, body in ((log, history), (results, page)):
        tmp = path.with_suffix(".tmp")
        tmp.write_text(body)
        os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(description="run a benchmark, record its figures in docs/results.md")
    p.add_argument("name", help="section name (letters, digits, - and _)")
    p.add_argument("title", help="the section's heading")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--log", type=Path, default=LOG, help="where every output and a replaced section go (appended)")
    p.add_argument("--summary", type=Path, help="the section's figures (markdown) instead of the output's last lines")
    p.add_argument("--printed", type=Path, help="what the command printed on another machine (not run here)")
    p.add_argument("--machine", help="that machine's description (with --printed)")
    args = p.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.name) or not command:
        p.error("a NAME of letters, digits, - and _, and a command after --")
    if (args.printed is None) != (args.machine is None):
        p.error("--printed and --machine go together")
    summary = None
    if args.summary is not None:
        if not args.summary.is_file():
            p.error(f"--summary {args.summary}: no such file (write the run's figures there, markdown)")
        summary = args.summary.read_text()
    if args.printed is not None:
        output, where = args.printed.read_text(), args.machine
    else:
        proc = subprocess.run(command, capture_output=True, text=True)
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        if proc.returncode != 0:
            print(f"record: the command exited {proc.returncode}; {args.results} not changed", file=sys.stderr)
            return proc.returncode
        output, where = proc.stdout, machine()
    found = SPEED.search(output)
    if found:
        speed = f"{found.group(1)} GFLOP/s"
    else:
        speed = "not printed" if args.printed is not None else measured_speed()
    when = _dt.date.today().isoformat()
    record(
        args.results,
        args.log,
        args.name,
        args.title,
        command,
        output,
        when=when,
        where=where,
        speed=speed,
        summary=summary,
    )
    print(
        f"record: section '{args.name}' of {args.results} written, the output appended to {args.log}", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
