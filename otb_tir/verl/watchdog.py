"""Run verl's trainer as a child process that cannot hang silently.

verl can wait forever after one of its workers failed (a failed weight sync left ``main_ppo``
waiting ~13 minutes before it was killed by hand). :func:`run_watched` starts the child in its own
process group, copies its output to a log file and to this console, and reads the phase the
trainer is in from ``progress.json`` (written by :mod:`otb_tir.verl.hooks`). It stops the whole
process group, and raises :class:`VerlRunError` naming the phase and quoting
the last traceback, when

* a phase runs longer than ``phase_timeout_s``, or
* a traceback appeared in the output, and since then the phase it appeared in has not finished
  and the child has printed nothing for ``error_grace_s`` (``<= 0`` turns this rule off),

and also when the child exits non-zero. Whatever stopped the run, the error names the phase the
last traceback appeared in (a sync that fails in one phase can leave the next one hanging). The
exit after verl's last step is given
``teardown_timeout_s``; a child still alive then is stopped and the run counts as finished. If the
launcher itself is killed, the child is signalled too (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["run_watched"]

_TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class VerlRunError(RuntimeError):
    """verl's trainer failed, hung in a phase, or exited without finishing (the message says which)."""


def _read_progress(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the child's process group, then SIGKILL to whatever of it is left (Ray's raylet and
    workers are in the group too)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    time.sleep(0.5)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The child gets SIGTERM when the launcher dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``);
    Ray's processes share the child's fate, so a killed launcher leaves no Ray cluster behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _last_traceback(lines: Sequence[str]) -> str:
    text = [_ANSI.sub("", x) for x in lines]
    starts = [i for i, x in enumerate(text) if "Traceback (most recent call last)" in x]
    if not starts:
        return "\n".join(text[-40:])
    return "\n".join(text[starts[-1] : starts[-1] + 80])


def run_watched(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    progress_path: Path,
    phase_timeout_s: float,
    error_grace_s: float,
    teardown_timeout_s: float = 90.0,
    poll_s: float = 1.0,
    echo: bool = True,
) -> None:
    """Run ``argv`` under the watchdog (see the module docstring); returns when it finished."""

    log_path.parent.mkdir(parents=True, exist_ok=True)
    progress_path.unlink(missing_ok=True)
    tail: deque[str] = deque(maxlen=400)
    error_seen: list[tuple[float, str]] = []  # (when, phase it appeared in), until that phase finishes
    last_error: list[tuple[str, int]] = []  # (phase, step) of the latest traceback, for the message
    state: dict = {"phase": "launch", "last_output": time.time()}
    started = time.time()
    log = open(log_path, "w", buffering=1)
    proc = subprocess.Popen(
        list(argv),
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if echo:
                sys.stdout.write(line)
            tail.append(line.rstrip("\n"))
            state["last_output"] = time.time()
            if _TRACEBACK.search(line):
                prog = _read_progress(progress_path)
                phase = prog["phase"] if prog else "launch"
                if phase != "finished":
                    last_error[:] = [(phase, int(prog["step"]) if prog else 0)]
                    if not error_seen:
                        error_seen.append((time.time(), phase))

    reader = threading.Thread(target=pump, name="verl-output", daemon=True)
    reader.start()
    failure: str | None = None
    try:
        while proc.poll() is None:
            time.sleep(poll_s)
            now = time.time()
            prog = _read_progress(progress_path)
            phase = prog["phase"] if prog else "launch"
            since = float(prog["since"]) if prog else started
            if phase != state["phase"]:
                state["phase"] = phase
                if error_seen and phase != error_seen[0][1]:
                    error_seen.clear()  # the phase finished after all: that traceback was not fatal
            if phase == "finished":
                if now - since > teardown_timeout_s:
                    _kill_group(proc)
                    break
                continue
            if now - since > phase_timeout_s:
                failure = (
                    f"verl's phase '{phase}' (step {prog['step'] if prog else 0}) ran {now - since:.0f} s, "
                    f"over verl.phase_timeout_s={phase_timeout_s:g}"
                )
            elif (
                error_seen
                and error_grace_s > 0
                and now - error_seen[0][0] > error_grace_s
                and now - state["last_output"] > error_grace_s
            ):
                failure = (
                    f"an error was raised during verl's phase '{phase}', which then neither finished nor "
                    f"printed anything for verl.error_grace_s={error_grace_s:g} s"
                )
            if failure:
                _kill_group(proc)
                break
    except KeyboardInterrupt:
        _kill_group(proc)
        raise
    finally:
        if proc.poll() is None and failure is None and state["phase"] != "finished":
            _kill_group(proc)
        reader.join(timeout=10)
        log.close()
    if failure:
        where, step = last_error[0] if last_error else (None, 0)
        if where is not None and f"phase '{where}'" not in failure:
            failure += f"; the last traceback appeared earlier, during verl's phase '{where}' (step {step})"
        raise VerlRunError(
            f"{failure}; the run was stopped. Last traceback (full log: {log_path}):\n{_last_traceback(list(tail))}"
        )
    prog = _read_progress(progress_path)
    if proc.returncode not in (0, None) and not (prog and prog.get("phase") == "finished"):
        where = prog.get("failed") or prog["phase"] if prog else "launch"
        raise VerlRunError(
            f"verl exited with code {proc.returncode} in phase '{where}' (step {prog['step'] if prog else 0}) "
            f"(full log: {log_path}):\n{_last_traceback(list(tail))}"
        )
