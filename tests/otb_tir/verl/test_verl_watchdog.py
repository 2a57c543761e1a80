"""The launcher's watchdog (otb_tir.verl.watchdog) on real child processes that hang, fail or finish:
a hung phase or a traceback followed by silence stops the whole process group with the phase and
the traceback in the error; a non-zero exit is an error; a run whose trainer finished is not."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from otb_tir.verl.launch import VerlRunError
from otb_tir.verl.watchdog import run_watched


def _child(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent('''
        import json, os, subprocess, sys, time
        progress = sys.argv[1]
        def phase(name, step=0):
            with open(progress + ".tmp", "w") as f:
                json.dump({"phase": name, "since": time.time(), "step": step, "pid": os.getpid()}, f)
            os.replace(progress + ".tmp", progress)
        ''')
        + textwrap.dedent(body)
    )
    return [sys.executable, str(script), str(tmp_path / "progress.json")]


def _watch(tmp_path: Path, argv: list[str], **kw) -> None:
    args = dict(
        env=dict(os.environ),
        log_path=tmp_path / "verl.log",
        progress_path=tmp_path / "progress.json",
        phase_timeout_s=600,
        error_grace_s=600,
        teardown_timeout_s=600,
        poll_s=0.2,
        echo=False,
    )
    args.update(kw)
    run_watched(argv, **args)


def _gone(pid: int) -> bool:
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return True
        time.sleep(0.1)
    return False


def test_a_phase_over_its_limit_stops_the_whole_process_group(tmp_path):
    argv = _child(
        tmp_path,
        '''
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(progress + ".grandchild", "w").write(str(grandchild.pid))
        phase("update_weights", step=3)
        time.sleep(600)
        ''',
    )
    with pytest.raises(VerlRunError, match=r"phase 'update_weights' \(step 3\) ran \d+ s, over verl.phase_timeout_s=1"):
        _watch(tmp_path, argv, phase_timeout_s=1)
    grandchild = int((tmp_path / "progress.json.grandchild").read_text())
    assert _gone(grandchild)  # Ray's processes live in the child's group: none is left behind


def test_a_traceback_then_silence_fails_fast_with_the_traceback(tmp_path):
    argv = _child(
        tmp_path,
        '''
        phase("gen", step=1)
        print("Traceback (most recent call last):", flush=True)
        print('  File "vllm_rollout/utils.py", line 405, in _update_weights', flush=True)
        print("AttributeError: 'Parameter' object has no attribute 'weight_loader'", flush=True)
        time.sleep(600)
        ''',
    )
    with pytest.raises(VerlRunError) as err:
        _watch(tmp_path, argv, error_grace_s=1)
    msg = str(err.value)
    assert "phase 'gen'" in msg and "verl.error_grace_s=1" in msg
    assert "'Parameter' object has no attribute 'weight_loader'" in msg
    assert "weight_loader" in (tmp_path / "verl.log").read_text()


@pytest.mark.slow
def test_a_traceback_in_a_phase_that_then_finishes_is_not_fatal(tmp_path):
    argv = _child(
        tmp_path,
        '''
        phase("gen", step=1)
        print("Traceback (most recent call last):\\nValueError: handled and logged by a worker", flush=True)
        time.sleep(0.3)
        phase("update_actor", step=1)  # the phase finished: the traceback was not fatal
        time.sleep(3)  # silent for longer than the grace
        phase("finished", step=2)
        ''',
    )
    _watch(tmp_path, argv, error_grace_s=2)


@pytest.mark.slow
def test_a_phase_that_hangs_after_an_earlier_error_names_where_the_error_appeared(tmp_path):
    """A weight sync whose receiver died may return on the trainer's side and leave the next phase
    waiting on a dead engine: the phase limit stops it, and the error points back at the sync."""
    argv = _child(
        tmp_path,
        '''
        phase("update_weights", step=1)
        print("Traceback (most recent call last):\\nRuntimeError: injected fault: the weight sync failed", flush=True)
        time.sleep(0.5)
        phase("gen", step=2)
        time.sleep(600)
        ''',
    )
    with pytest.raises(VerlRunError) as err:
        _watch(tmp_path, argv, phase_timeout_s=2, error_grace_s=600)
    msg = str(err.value)
    assert "phase 'gen' (step 2) ran" in msg
    assert "during verl's phase 'update_weights' (step 1)" in msg
    assert "injected fault: the weight sync failed" in msg


def test_a_non_zero_exit_names_the_failed_phase_and_quotes_the_traceback(tmp_path):
    argv = _child(
        tmp_path,
        '''
        with open(progress, "w") as f:
            json.dump({"phase": "between_phases", "failed": "old_log_prob", "since": time.time(), "step": 2,
                       "pid": os.getpid()}, f)
        raise RuntimeError("micro-batch does not divide the batch")
        ''',
    )
    with pytest.raises(VerlRunError, match=r"exited with code 1 in phase 'old_log_prob' \(step 2\)") as err:
        _watch(tmp_path, argv)
    assert "RuntimeError: micro-batch does not divide the batch" in str(err.value)


def test_a_finished_trainer_whose_exit_hangs_counts_as_finished(tmp_path):
    argv = _child(
        tmp_path,
        '''
        phase("finished", step=2)
        time.sleep(600)
        ''',
    )
    _watch(tmp_path, argv, teardown_timeout_s=1)


def test_a_killed_launcher_takes_verl_down_with_it(tmp_path):
    """kill -9 of the process running the watchdog: the child (verl's driver, which Ray's
    processes follow) is signalled and exits instead of training on, orphaned."""
    import signal
    import subprocess

    argv = _child(
        tmp_path,
        '''
        open(progress + ".pid", "w").write(str(os.getpid()))
        phase("gen", step=1)
        time.sleep(600)
        ''',
    )
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, os; from pathlib import Path; from otb_tir.verl.watchdog import run_watched; "
                f"run_watched({argv!r}, env=dict(os.environ), log_path=Path({str(tmp_path / 'verl.log')!r}), "
                f"progress_path=Path({str(tmp_path / 'progress.json')!r}), phase_timeout_s=600, error_grace_s=600, "
                "echo=False)"
            ),
        ]
    )
    pid_file = tmp_path / "progress.json.pid"
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    child = int(pid_file.read_text())
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=30)
    assert _gone(child)
