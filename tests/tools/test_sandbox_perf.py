"""The sandbox's performance switches (raw fork, huge pages, adaptive prefault) change nothing a
snippet can observe or do; the prefault really takes page faults off the snippet's run.

Real worker processes throughout (bubblewrap where it works, else the unisolated backend). No
wall-clock assertion: the prefault test counts page faults, which the kernel reports exactly.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.tools.test_sandbox import HAVE_BWRAP, LIGHT, call
from tools.base import ErrorKind, ToolError
from tools.sandbox import PythonTool
from tools.sandbox.backends import UnisolatedBackend, make_backend
from tools.sandbox.host_worker import _minimal_env

BACKEND = "bwrap" if HAVE_BWRAP else "unisolated"
_HDR = struct.Struct(">I")

# what a snippet can observe of the process it runs in; every variant must answer alike
BATTERY = [
    ("print(sum(range(1000)))", "499500\n"),
    (
        "import threading\nout = []\n"
        "ts = [threading.Thread(target=lambda v=v: out.append(v * v)) for v in range(5)]\n"
        "for t in ts:\n    t.start()\nfor t in ts:\n    t.join()\n"
        "print(sorted(out), threading.current_thread() is threading.main_thread(), "
        "threading.active_count())",
        "[0, 1, 4, 9, 16] True 1\n",
    ),
    (
        "import os\npid = os.fork()\nif pid == 0:\n    print('in child', flush=True)\n    os._exit(3)\n"
        "_, st = os.waitpid(pid, 0)\nprint('child exit', os.waitstatus_to_exitcode(st))",
        "in child\nchild exit 3\n",
    ),
    ("def f(n):\n    return 1 / n\nf(0)", None),  # traceback checked below
    (
        "import socket\ntry:\n    socket.socket()\nexcept OSError as e:\n    print('blocked', e.errno)",
        "blocked 1\n",
    ),  # seccomp: EPERM
    ("import os\nprint(os.getuid() != 0, os.getpgid(0) == os.getpid())", "True True\n"),
]


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def test_worker_options_are_validated() -> None:
    for bad in ({"bogus": True}, {"thp": "yes"}, {"raw_fork": 1}):
        with pytest.raises(ToolError, match="worker_options"):
            PythonTool(backend="unisolated", worker_options=bad)


@pytest.mark.parametrize("options", [{}, {"raw_fork": False, "thp": False}], ids=["default", "switches-off"])
def test_switches_do_not_change_what_snippets_see(loop, options) -> None:
    t = PythonTool(backend=BACKEND, workers=1, cache=False, preload=LIGHT, timeout=10.0, worker_options=options)
    try:
        loop.run_until_complete(t.start())
        info = t.pool.workers[0].info
        # the worker is single-threaded, so the raw fork is used unless switched off
        assert info["raw_fork"] is options.get("raw_fork", True)
        assert info["thp_mb"] >= 0 and (options.get("thp", True) or info["thp_mb"] == 0)
        for code, expected in BATTERY:
            r = call(loop, t, code)
            if expected is None:
                assert r.error == ErrorKind.RUNTIME and "ZeroDivisionError" in r.text
                assert 'File "<snippet>", line 3' in r.text and not re.search(r"worker\w*\.py", r.text)
            else:
                assert (r.ok, r.text) == (True, expected), code
        # children are reseeded even though CPython's at-fork hook (random's reseed) is skipped
        draws = {call(loop, t, "import random\nrandom.random()").text for _ in range(3)}
        assert len(draws) == 3
    finally:
        loop.run_until_complete(t.close())


# ----------------------------------------------------------------------------- worker level
def _read(proc: subprocess.Popen) -> dict:
    assert proc.stdout is not None
    (n,) = _HDR.unpack(proc.stdout.read(_HDR.size))
    return json.loads(proc.stdout.read(n))


def _write(proc: subprocess.Popen, obj: dict) -> None:
    assert proc.stdin is not None
    body = json.dumps(obj).encode()
    proc.stdin.write(_HDR.pack(len(body)) + body)
    proc.stdin.flush()


@pytest.mark.slow
def test_prefault_learns_hot_pages_and_spares_them_faults() -> None:
    """A worker with ``prefault``: calibration finds the pages sympy code writes; once recent
    snippets used sympy, idle spares copy them in advance, so the snippet's own run takes far
    fewer page faults; a plain snippet is unaffected and every answer is unchanged."""
    backend = make_backend(BACKEND)
    cfg = backend.worker_config(
        {
            "memory_mb": 1024,
            "fsize_mb": 16,
            "nofile": 64,
            "nproc": 32,
            "preload": ["math", "numpy", "sympy"],
            "seccomp": True,
            "stateful": False,
            "prefault": True,
            "profile": True,
        }
    )
    proc = subprocess.Popen(backend.command(cfg), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_minimal_env())
    code = "import sympy as sp\nx = sp.Symbol('x')\nprint(sp.factor(x**6 - 1))"
    try:
        ready = _read(proc)
        assert ready["op"] == "ready"
        if not ready["hot_pages"]:
            pytest.skip("madvise(MADV_POPULATE_WRITE) unavailable (Linux < 5.14)")
        assert ready["hot_pages"]["sympy"] > 100 and ready["hot_pages"]["numpy"] > 10
        runs = []
        for i in range(8):
            _write(proc, {"op": "run", "id": i, "code": code, "timeout": 30, "max_output": 4096})
            reply = _read(proc)
            assert _read(proc)["op"] == "idle"
            assert reply["status"] == "ok"
            assert reply["output"] == "(x - 1)*(x + 1)*(x**2 - x + 1)*(x**2 + x + 1)\n"
            stamps = [s[0] for s in reply["prof"]["stamps"]]
            runs.append((reply["prof"]["child_run_flt"], "prefault" in stamps))
            time.sleep(0.3)  # idle time: the spare completes its prefault
        assert not runs[0][1]  # no sympy seen yet: the first spare was not prefaulted
        prefaulted = [f for f, pre in runs if pre]
        assert len(prefaulted) >= 3, runs
        assert max(prefaulted) < 0.8 * runs[0][0], runs
        # a snippet that uses neither library still works from a prefaulted spare
        _write(proc, {"op": "run", "id": 99, "code": "print(2 ** 10)", "timeout": 10, "max_output": 100})
        reply = _read(proc)
        assert (reply["status"], reply["output"]) == ("ok", "1024\n")
        assert _read(proc)["op"] == "idle"
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if isinstance(backend, UnisolatedBackend):
            shutil.rmtree(cfg["scratch"], ignore_errors=True)
