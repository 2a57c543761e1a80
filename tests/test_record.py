"""benchmarks/record.py, the one writer of docs/results.md sections and of the outputs in docs/results-log.md,
run as a user runs it."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from record import heading_anchors

RECORD = Path(__file__).resolve().parents[1] / "benchmarks" / "record.py"


def _record(results: Path, *args: str) -> subprocess.CompletedProcess:
    log = results.with_name("results-log.md")  # never the project's own log
    return subprocess.run(
        [sys.executable, str(RECORD), *args[:2], "--results", str(results), "--log", str(log), *args[2:]],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_run_writes_its_section_with_date_machine_and_command_and_a_rerun_replaces_it(tmp_path):
    page = tmp_path / "results.md"
    page.write_text("# Measured results\n\nhand-written intro\n\n## Other section\n\nkept\n")
    cmd = [sys.executable, "-c", "print('ratio 1.25')"]
    first = _record(page, "demo", "Demo bench", "--", *cmd)
    assert first.returncode == 0, first.stderr
    assert "ratio 1.25" in first.stdout  # the benchmark's output is still shown
    text = page.read_text()
    assert "hand-written intro" in text and "## Other section\n\nkept" in text
    assert "<!-- results:demo -->\n## Demo bench (" in text and "ratio 1.25" in text
    assert "Machine: " in text and f"Command: `{shlex.join(cmd)}`" in text
    assert re.search(r"Speed reference: \d+ GFLOP/s \(measured by record.py after the run\)", text)
    code = "print('ratio 2.50, speed reference 7 GFLOP/s')"  # printed: not measured again
    second = _record(page, "demo", "Demo bench", "--", sys.executable, "-c", code)
    assert second.returncode == 0, second.stderr
    text = page.read_text()
    assert "ratio 2.50" in text and "ratio 1.25" not in text  # replaced, not appended
    assert text.count("<!-- results:demo -->") == 1 and "hand-written intro" in text


def test_a_rerun_leaves_one_section_in_the_page_and_moves_the_previous_one_to_the_log(tmp_path):
    page = tmp_path / "results.md"
    log = tmp_path / "results-log.md"
    page.write_text("# Measured results\n")

    def run(ratio: str) -> None:
        code = f"print('ratio {ratio}'); print('speed reference 99 GFLOP/s')"
        assert _record(page, "demo", "Demo", "--", sys.executable, "-c", code).returncode == 0

    run("1.25")
    assert "<!-- results:demo -->" not in log.read_text()  # a first run replaces nothing
    assert "Speed reference: 99 GFLOP/s" in page.read_text()  # the one the output printed
    run("2.50")
    text, history = page.read_text(), log.read_text()
    assert text.count("<!-- results:demo -->") == 1 and "ratio 2.50" in text and "ratio 1.25" not in text
    assert history.count("<!-- results:demo -->") == 1 and "Moved from results.md on " in history
    # the log has both outputs and the replaced section, oldest first
    assert history.index("ratio 1.25") < history.index("<!-- results:demo -->") < history.index("ratio 2.50")
    run("3.75")
    history = log.read_text()  # appended to, never rewritten
    assert history.count("<!-- results:demo -->") == 2 and history.index("ratio 1.25") < history.index("ratio 2.50")
    assert history.index("ratio 2.50") < history.rindex("ratio 3.75") and "ratio 3.75" in page.read_text()


def test_a_long_output_goes_whole_to_the_log_and_the_page_keeps_its_figures_and_a_link(tmp_path):
    page = tmp_path / "results.md"
    log = tmp_path / "results-log.md"
    code = "print('speed reference 42 GFLOP/s'); [print(f'row {i:03d}') for i in range(50)]"
    assert _record(page, "long", "Long bench", "--", sys.executable, "-c", code).returncode == 0
    text, history = page.read_text(), log.read_text()
    assert all(f"row {i:03d}" in history for i in range(50))  # every line, verbatim, in the log
    assert "row 037" not in text and all(f"row {i:03d}" in text for i in range(38, 50))  # the page: the last 12
    assert "last 12 of 51 lines" in text
    link = re.search(r"\]\(results-log\.md#([^)]+)\)", text).group(1)
    assert link in heading_anchors(history)  # the link names the log's heading of this run
    summary = tmp_path / "figures.md"
    summary.write_text("| figure | value |\n|---|---|\n| rows | 50 |\n")
    assert (
        _record(page, "long", "Long bench", "--summary", str(summary), "--", sys.executable, "-c", code).returncode == 0
    )
    text, history = page.read_text(), log.read_text()
    assert "| rows | 50 |" in text and "row 049" not in text and text.count("<!-- results:long -->") == 1
    link = re.search(r"\]\(results-log\.md#([^)]+)\)", text).group(1)
    assert link.endswith("-1") and link in heading_anchors(history)  # the second run's entry, same title
    assert history.count("row 049") == 3  # two outputs and the replaced section's last lines
    missing = _record(page, "long", "T", "--summary", str(tmp_path / "nope.md"), "--", sys.executable, "-c", code)
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_a_failing_benchmark_writes_nothing_and_passes_its_exit_code_on(tmp_path):
    page = tmp_path / "results.md"
    page.write_text("# Measured results\n")
    proc = _record(page, "demo", "Demo", "--", sys.executable, "-c", "import sys; print('half'); sys.exit(3)")
    assert proc.returncode == 3
    assert page.read_text() == "# Measured results\n"
    assert "not changed" in proc.stderr


def test_a_bad_name_or_no_command_is_refused(tmp_path):
    page = tmp_path / "results.md"
    assert _record(page, "bad name", "T", "--", sys.executable, "-c", "pass").returncode == 2
    assert _record(page, "ok", "T", "--").returncode == 2
    assert not page.exists()


def test_a_run_on_another_machine_is_recorded_from_what_it_printed_without_running_here(tmp_path):
    page = tmp_path / "results.md"
    printed = tmp_path / "log.txt"
    printed.write_text("engine 1.23x\n")
    marker = tmp_path / "ran"
    cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]  # would leave a file if run here
    proc = _record(page, "gpu", "On a GPU", "--printed", str(printed), "--machine", "1x NVIDIA H200", "--", *cmd)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
    text = page.read_text()
    assert "Machine: 1x NVIDIA H200." in text and "engine 1.23x" in text and f"Command: `{shlex.join(cmd)}`" in text
    assert "Speed reference: not printed." in text  # not measured here: this is not that machine
    # one without the other is refused
    assert _record(page, "gpu", "T", "--printed", str(printed), "--", *cmd).returncode == 2
