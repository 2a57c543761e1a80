"""Run a benchmark and write what it printed into docs/results.md, with the date, the machine and
the exact command: the one way measured figures reach the results page.

    python benchmarks/record.py NAME "Title" -- python benchmarks/bench_advantage.py --reps 5

The section is the text between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``; a new
run replaces it (the rest of the page is kept as it is), a first run appends it. The page keeps
only each claim's latest figure: the section a rerun replaces is first appended, verbatim, to the
log docs/results-log.md (``--log``), which is only ever appended to. A command that exits
non-zero writes nothing and its exit code is this script's.

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


def machine() -> str:
    """CPU model and count, memory and accelerator, in one line: :func:`otb_tir.machine.describe`."""
    from otb_tir.machine import describe

    return describe()


def section(name: str, title: str, command: list[str], output: str, *, when: str, where: str) -> str:
    return (
        f"<!-- results:{name} -->\n## {title} ({when})\n\n"
        f"Machine: {where}. Command: `{shlex.join(command)}`\n\n```text\n{output.rstrip()}\n```\n"
        f"<!-- /results:{name} -->\n"
    )


def write_section(path: Path, name: str, text: str, *, log: Path | None = None) -> None:
    """Replace section ``name`` of ``path`` with ``text`` (or append it), keeping the rest; the
    replaced section is first appended verbatim to ``log`` (when given), with the date it moved."""
    page = path.read_text() if path.exists() else "# Measured results\n"
    pattern = re.compile(rf"<!-- results:{re.escape(name)} -->\n.*?<!-- /results:{re.escape(name)} -->\n", re.S)
    old = pattern.search(page)
    if old:
        if log is not None:
            history = log.read_text() if log.exists() else "# Results log\n"
            moved = f"_Moved from results.md on {_dt.date.today().isoformat()} (replaced by a rerun)._\n\n"
            history = history.rstrip("\n") + "\n\n" + moved + old.group(0)
            tmp = log.with_suffix(".tmp")
            tmp.write_text(history)
            os.replace(tmp, log)
        page = pattern.sub(lambda _: text, page, count=1)
    else:
        page = page.rstrip("\n") + "\n\n" + text
    tmp = path.with_suffix(".tmp")
    tmp.write_text(page)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(description="run a benchmark, record its output in docs/results.md")
    p.add_argument("name", help="section name (letters, digits, - and _)")
    p.add_argument("title", help="the section's heading")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--log", type=Path, default=LOG, help="where a replaced section goes (appended)")
    p.add_argument("--printed", type=Path, help="what the command printed on another machine (not run here)")
    p.add_argument("--machine", help="that machine's description (with --printed)")
    args = p.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.name) or not command:
        p.error("a NAME of letters, digits, - and _, and a command after --")
    if (args.printed is None) != (args.machine is None):
        p.error("--printed and --machine go together")
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
    when = _dt.date.today().isoformat()
    text = section(args.name, args.title, command, output, when=when, where=where)
    write_section(args.results, args.name, text, log=args.log)
    print(f"record: section '{args.name}' of {args.results} written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
