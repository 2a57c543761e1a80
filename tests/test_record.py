"""benchmarks/record.py, the one writer of docs/results.md sections, run as a user runs it."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

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
    second = _record(page, "demo", "Demo bench", "--", sys.executable, "-c", "print('ratio 2.50')")
    assert second.returncode == 0, second.stderr
    text = page.read_text()
    assert "ratio 2.50" in text and "ratio 1.25" not in text  # replaced, not appended
    assert text.count("<!-- results:demo -->") == 1 and "hand-written intro" in text


def test_a_rerun_leaves_one_section_in_the_page_and_moves_the_previous_one_to_the_log(tmp_path):
    page = tmp_path / "results.md"
    log = tmp_path / "results-log.md"
    page.write_text("# Measured results\n")
    assert _record(page, "demo", "Demo", "--", sys.executable, "-c", "print('ratio 1.25')").returncode == 0
    assert not log.exists()  # a first run replaces nothing
    assert _record(page, "demo", "Demo", "--", sys.executable, "-c", "print('ratio 2.50')").returncode == 0
    text, history = page.read_text(), log.read_text()
    assert text.count("<!-- results:demo -->") == 1 and "ratio 2.50" in text and "ratio 1.25" not in text
    assert history.count("<!-- results:demo -->") == 1 and "ratio 1.25" in history and "ratio 2.50" not in history
    assert "Moved from results.md on " in history
    assert _record(page, "demo", "Demo", "--", sys.executable, "-c", "print('ratio 3.75')").returncode == 0
    history = log.read_text()  # appended to, never rewritten: oldest first
    assert history.count("<!-- results:demo -->") == 2 and history.index("ratio 1.25") < history.index("ratio 2.50")
    assert "ratio 3.75" in page.read_text() and "ratio 3.75" not in history


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
    # one without the other is refused
    assert _record(page, "gpu", "T", "--printed", str(printed), "--", *cmd).returncode == 2
