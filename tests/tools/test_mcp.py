"""MCP servers as tools (``multi_turn.mcp_servers``), with real servers written with the ``mcp``
SDK (``MCPServer``, FastMCP's name in mcp 2.x) into a temporary folder outside the project. Each
server appends every call it serves to its own JSON-lines log (with a token per server process),
and every assertion is on what the server recorded or what the tool answered."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.optional import need
from tests.support.user_runs import TRAIN, read_log

need("mcp", "multi_turn.mcp_servers needs the MCP SDK: pip install -e '.[mcp]'")

from agent_env import EpisodeConfig  # noqa: E402
from tools import ErrorKind, ToolError, build_tool_set  # noqa: E402
from tools.mcp import build_mcp_tools  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

SERVER = '''
import asyncio, json, os, sys, uuid
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ImageContent

LOG = os.environ["CALL_LOG"]
PROC = uuid.uuid4().hex  # one per server process (the pid is 2 in every bubblewrap pid namespace)
if os.environ.get("FAIL_START"):
    print("cannot open the index: /nonexistent/index.db", file=sys.stderr, flush=True)
    sys.exit(3)
for _module in filter(None, os.environ.get("EXTRA_MODULES", "").split(",")):  # the server's own imports
    __import__(_module)
if os.environ.get("START_DELAY"):  # a server that takes a while to start (a big index to load)
    import time
    time.sleep(float(os.environ["START_DELAY"]))
app = MCPServer("test-server")


def log(tool, args):
    with open(LOG, "a") as f:
        f.write(json.dumps({"tool": tool, "args": args, "proc": PROC, "pid": os.getpid()}) + "\\n")


@app.tool()
def lookup(query: str) -> str:
    """Look up a query and return a short note."""
    log("lookup", {"query": query})
    return f"note about {query}"


@app.tool()
async def hang(seconds: float = 600) -> str:
    """Sleep for a long time."""
    log("hang", {"seconds": seconds})
    await asyncio.sleep(seconds)
    return "woke up"


@app.tool()
def refuse(reason: str) -> str:
    """Always fails (isError)."""
    log("refuse", {"reason": reason})
    raise ToolError(f"refused: {reason}")


@app.tool()
def crash() -> str:
    """The server process exits mid-call."""
    log("crash", {})
    os._exit(9)


MEMORY = []  # a stateful server: what this process was told


@app.tool()
def remember(value: str) -> str:
    """Remember a value; returns everything remembered so far."""
    log("remember", {"value": value})
    MEMORY.append(value)
    return ",".join(MEMORY)


@app.tool(structured_output=False)
def picture() -> list:
    """Returns an image only."""
    log("picture", {})
    return [ImageContent(type="image", data="aGk=", mime_type="image/png")]


@app.tool()
def probe() -> str:
    """What the server may reach: the network, the host's files."""
    log("probe", {})
    import socket
    out = {}
    try:
        socket.create_connection(("1.1.1.1", 53), timeout=2).close()
        out["net"] = "open"
    except OSError as e:
        out["net"] = f"blocked: {e}"
    try:
        open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "written_by_server"), "w").close()
        out["write_own_folder"] = "open"
    except OSError as e:
        out["write_own_folder"] = f"blocked: {e.strerror}"
    return json.dumps(out)


if os.environ.get("EXTRA_TOOL"):
    app.tool(name=os.environ["EXTRA_TOOL"], description="a tool whose name clashes")(lambda: "x")

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
    if os.environ.get("LINGER"):  # a server that does not exit when its stdin closes
        import time
        time.sleep(600)
'''


def write_server(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "server.py"
    path.write_text(textwrap.dedent(SERVER))
    return path


def stdio_config(folder: Path, name: str = "notes", **entry) -> tuple[Path, Path]:
    """An mcpServers JSON with one stdio server; the server's log (writable in its sandbox)."""
    server = write_server(folder)
    log = folder / f"{name}-calls.jsonl"
    log.touch()
    spec = {
        "command": sys.executable,
        "args": [str(server)],
        "env": {"CALL_LOG": str(log), **entry.pop("env", {})},
        "writable_paths": [str(log)],
        **entry,
    }
    cfg = folder / f"{name}-servers.json"
    cfg.write_text(json.dumps({"mcpServers": {name: spec}}))
    return cfg, log


def run(coro):
    return asyncio.run(coro)


def calls(log: Path, tool: str | None = None) -> list[dict]:
    return [r for r in read_log(log) if tool is None or r["tool"] == tool]


@pytest.fixture(scope="module")
def notes(tmp_path_factory):
    """One sandboxed stdio server (the default isolation) shared by the call tests."""
    folder = tmp_path_factory.mktemp("user") / "servers"
    cfg, log = stdio_config(folder)
    ts = build_tool_set(None, None, None, str(cfg))
    yield ts, log, folder
    run(ts.close())


def test_stdio_discovery_call_and_isolation(notes):
    ts, log, folder = notes
    assert sorted(ts) == ["crash", "hang", "lookup", "picture", "probe", "refuse", "remember"]  # all: none named
    lookup = ts["lookup"]
    assert lookup.description == "Look up a query and return a short note."
    assert lookup.parameters["properties"]["query"]["type"] == "string" and lookup.parameters["required"] == ["query"]
    res = run(lookup.invoke({"query": "otb"}, timeout=10))
    assert res.ok and res.text == "note about otb"
    assert calls(log, "lookup")[-1]["args"] == {"query": "otb"}
    assert calls(log, "lookup")[-1]["pid"] != os.getpid()
    # bad arguments are caught by the schema before the server sees them
    bad = run(lookup.invoke({"query": 3}, timeout=10))
    assert not bad.ok and bad.error == ErrorKind.BAD_ARGUMENTS and len(calls(log, "lookup")) == 1
    rec = {r["name"]: r for r in ts.describe()}["lookup"]
    assert rec["server"] == "notes" and rec["transport"] == "stdio" and rec["cls"] == "tools.mcp.MCPTool"
    assert "MCP server 'notes' (stdio)" in rec["source"] and rec["isolation"].startswith("bubblewrap")
    # isolated by default: no network, its own folder read-only (only the log is writable)
    probe = json.loads(run(ts["probe"].invoke({}, timeout=10)).text)
    assert probe["net"].startswith("blocked") and probe["write_own_folder"].startswith("blocked")
    assert not (folder / "written_by_server").exists()


def test_is_error_and_non_text_content(notes):
    ts, log, _ = notes
    res = run(ts["refuse"].invoke({"reason": "no index"}, timeout=10))
    assert not res.ok and res.error == ErrorKind.RUNTIME and "refused: no index" in res.text
    pic = run(ts["picture"].invoke({}, timeout=10))
    assert not pic.ok and pic.error == ErrorKind.RUNTIME and "non-text content (image)" in pic.text
    assert [c["tool"] for c in calls(log)][-2:] == ["refuse", "picture"]


def test_hanging_call_times_out_and_the_next_call_works(notes):
    ts, log, _ = notes
    res = run(ts["hang"].invoke({}, timeout=1.0))
    assert not res.ok and res.error == ErrorKind.TIMEOUT and res.metrics["latency_ms"] < 5000
    # the request had reached the server (it logged it): the model is told it may have taken effect
    assert "may still have taken effect" in res.text
    after = run(ts["lookup"].invoke({"query": "after"}, timeout=10))
    assert after.ok and after.text == "note about after"
    assert calls(log, "hang") and calls(log, "lookup")[-1]["args"] == {"query": "after"}
    assert len({c["proc"] for c in calls(log)}) == 1  # no restart was needed


def test_crashed_server_is_restarted(tmp_path):
    cfg, log = stdio_config(tmp_path / "servers", "flaky")
    ts = build_tool_set(["crash", "lookup"], None, None, str(cfg))
    try:
        first = run(ts["lookup"].invoke({"query": "a"}, timeout=10))
        lost = run(ts["crash"].invoke({}, timeout=10))
        assert first.ok and not lost.ok and lost.error == ErrorKind.SANDBOX and "'flaky'" in lost.text
        assert lost.metrics["server_lost"] == 1.0
        again = run(ts["lookup"].invoke({"query": "b"}, timeout=60))  # waits for the restart if still running
        assert again.ok and again.text == "note about b"
        client = ts["lookup"].client
        assert client.lost == 1 and client.restarts == 1
        procs = [c["proc"] for c in calls(log)]
        assert len(set(procs)) == 2 and procs[0] == procs[1] != procs[2]  # a, crash | b
    finally:
        run(ts.close())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_server(tmp_path):
    folder = tmp_path / "servers"
    server = write_server(folder)
    log = folder / "http-calls.jsonl"
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(server), "http", str(port)],
        env=dict(os.environ, CALL_LOG=str(log)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the HTTP server did not listen within 60 s"
                time.sleep(0.2)
        cfg = folder / "http.yaml"
        cfg.write_text(f"mcpServers:\n  web:\n    url: http://127.0.0.1:{port}/mcp\n    headers: {{X-Test: yes}}\n")
        ts = build_tool_set(["lookup"], None, None, str(cfg))
        try:
            res = run(ts["lookup"].invoke({"query": "http"}, timeout=10))
            assert res.ok and res.text == "note about http"
            (rec,) = ts.describe()
            assert rec["server"] == "web" and rec["transport"] == "http" and rec["isolation"].startswith("remote")
            assert calls(log, "lookup") == [
                {"tool": "lookup", "args": {"query": "http"}, "proc": calls(log)[0]["proc"], "pid": proc.pid}
            ]
        finally:
            run(ts.close())
    finally:
        proc.kill()
        proc.wait()


def test_server_that_cannot_start_stops_the_run_at_build(tmp_path):
    from otb_tir import ConfigError
    from otb_tir.builders import build_tools
    from otb_tir.configs import resolve_config
    from otb_tir.trainer.config import load_config

    cfg_file, _ = stdio_config(tmp_path / "servers", "broken", env={"FAIL_START": "1"}, start_timeout=60)
    cfg = load_config(resolve_config("tir_math_cpu"), [f"multi_turn.mcp_servers={cfg_file}"])
    with pytest.raises(ConfigError) as err:
        build_tools(cfg)
    msg = str(err.value)
    assert "MCP server 'broken'" in msg and "cannot open the index: /nonexistent/index.db" in msg


def test_stdio_server_is_refused_without_isolation_or_opt_out(tmp_path, monkeypatch):
    import tools.sandbox.backends as backends

    monkeypatch.setattr(backends, "find_bwrap", lambda: (None, ["no bwrap here"]))
    cfg, log = stdio_config(tmp_path / "servers")
    with pytest.raises(ToolError, match='"unsandboxed": true') as err:
        build_mcp_tools(cfg)
    assert "no bwrap here" in str(err.value) and read_log(log) == []  # refused before it started


def test_name_clash_is_an_error_naming_both(tmp_path):
    cfg, _ = stdio_config(tmp_path / "servers", "clashing", env={"EXTRA_TOOL": "calculator"})
    with pytest.raises(ToolError) as err:
        build_tool_set(["calculator", "lookup"], None, None, str(cfg))
    msg = str(err.value)
    assert "'calculator'" in msg and "built-in" in msg and "MCP server 'clashing'" in msg


KILLED = """
import json, os, sys, time
from tools import build_tool_set
ts = build_tool_set(["lookup"], None, None, sys.argv[1])
pids = []
for d in os.listdir("/proc"):
    if d.isdigit():
        try:
            stat = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        pids.append((int(d), ppid))
mine, grew = {os.getpid()}, True
while grew:
    kids = {p for p, pp in pids if pp in mine} - mine
    grew, mine = bool(kids), mine | kids
print(json.dumps(sorted(mine - {os.getpid()})), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("unsandboxed", [False, True], ids=["bubblewrap", "unsandboxed"])
def test_no_orphan_server_after_kill_9(tmp_path, unsandboxed):
    cfg, _ = stdio_config(tmp_path / "servers", unsandboxed=unsandboxed, env={"LINGER": "1"})
    builder = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(cfg)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = builder.stdout.readline()
        assert line, builder.stderr.read()[-2000:]
        servers = json.loads(line)
        assert servers and all(_alive(p) for p in servers)
    finally:
        builder.send_signal(signal.SIGKILL)
        builder.wait()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in servers if _alive(p)], "server processes outlived the kill -9 of the run"


def test_list_shows_mcp_tools_with_their_server(tmp_path):
    cfg, _ = stdio_config(tmp_path / "servers", "notes")
    out = subprocess.run(
        [sys.executable, "-m", "otb_tir.train", "--list", f"multi_turn.mcp_servers={cfg}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.strip().startswith("lookup"))
    assert "MCP server 'notes' (stdio)" in line and "Look up a query" in line


@pytest.mark.slow
def test_training_and_eval_call_the_mcp_server(tmp_path):
    """The user path: `python recipes/train_tir_math.py` from a folder outside the project with an
    MCP server there; the policy (tests/support/tool_caller.py) calls `lookup` on every turn."""
    from tests.support.tool_caller import tool_caller_policy

    policy = tool_caller_policy()
    user = tmp_path / "user"
    cfg, log = stdio_config(user / "servers", "notes")
    out = user / "run"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes" / "train_tir_math.py"),
            "--model",
            str(policy),
            *TRAIN,
            f"trainer.output_dir={out}",
            f"multi_turn.mcp_servers={cfg}",
            "multi_turn.tools=[lookup,calculator]",
        ],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    served = calls(log, "lookup")
    # training rollouts (2 prompts × 2 samples, 2 executed calls each) and the held-out eval after
    # training (eval.size=2 prompts, 2 executed calls each) all reached the server
    assert row["tools/ok"] == 4 * 2 and row["tools/failed"] == 0
    assert len(served) == row["tools/ok"] + 2 * 2
    assert all(c["args"] == {"query": "otb"} for c in served)
    summary = json.loads((out / "summary.json").read_text())
    rec = {r["name"]: r for r in summary["tools"]}
    assert set(rec) == {"lookup", "calculator"}
    assert rec["lookup"]["server"] == "notes" and rec["lookup"]["transport"] == "stdio"
    assert str(cfg) in rec["lookup"]["source"] and rec["lookup"]["isolation"].startswith("bubblewrap")


@pytest.mark.parametrize("session", ["per_trajectory", "shared"])
def test_per_trajectory_sessions_keep_each_trajectorys_state_and_end_with_it(tmp_path, session):
    """``"session": "per_trajectory"``: each trajectory (session id) gets a server process of its own,
    so a stateful server's memory is the trajectory's; releasing the trajectory stops that process,
    and the next trajectory with that id starts afresh. The default (shared) is the control: one
    process, one memory for everyone."""
    cfg, log = stdio_config(tmp_path / "servers", "memo", session=session)
    ts = build_tool_set(["remember"], None, None, str(cfg))
    tool = ts["remember"]

    async def go() -> list[str]:
        out = []
        for sid, value in (("t1", "a"), ("t2", "b"), ("t1", "c")):
            res = await tool.invoke({"value": value}, session_id=sid, timeout=30)
            assert res.ok, res.text
            out.append(res.text)
        await tool.release("t1")
        await tool.release("t1")  # every tool of the server releases it: idempotent
        res = await tool.invoke({"value": "d"}, session_id="t1", timeout=30)
        out.append(res.text)
        await tool.release("t1")
        await tool.release("t2")
        return out

    try:
        texts = run(go())
        procs = [c["proc"] for c in calls(log, "remember")]
        if session == "per_trajectory":
            assert texts == ["a", "b", "a,c", "d"]
            assert procs[0] == procs[2] and len({procs[0], procs[1], procs[3]}) == 3  # t1, t2, the new t1
            assert tool.client.sessions_opened == 3 and not tool.client._sessions  # all released
        else:
            assert texts == ["a", "a,b", "a,b,c", "a,b,c,d"] and len(set(procs)) == 1
    finally:
        run(ts.close())


def test_per_trajectory_servers_start_outside_the_calls_timeout(tmp_path):
    """Six trajectories make their first call together at the episode's default tool_timeout (5 s),
    each to a per-trajectory server that takes 6 s to start: the start is bounded by start_timeout,
    not by the call's timeout, so every call the model made correctly is answered (on the old code
    all six read "timed out")."""
    cfg, log = stdio_config(tmp_path / "servers", "slow", session="per_trajectory", env={"START_DELAY": "6"})
    ts = build_tool_set(["remember"], None, None, str(cfg))
    tool = ts["remember"]
    timeout = EpisodeConfig().tool_timeout
    assert timeout == 5.0

    async def go() -> list:
        res = await asyncio.gather(
            *(tool.invoke({"value": f"v{i}"}, session_id=f"t{i}", timeout=timeout) for i in range(6))
        )
        for i in range(6):
            await tool.release(f"t{i}")
        return res

    try:
        res = run(go())
        assert [(r.ok, r.text) for r in res] == [(True, f"v{i}") for i in range(6)], [r.text for r in res]
        assert len({c["proc"] for c in calls(log, "remember")}) == 6  # one server per trajectory
    finally:
        run(ts.close())


def test_a_lost_per_trajectory_server_tells_the_model_its_state_is_gone(tmp_path):
    """A trajectory's own server dies: the call that finds it so says the trajectory's state is gone
    (``session_lost``, as the python tool says of a lost session), and the next call of the
    trajectory runs on a fresh server that remembers nothing of before."""
    cfg, log = stdio_config(tmp_path / "servers", "memo", session="per_trajectory")
    ts = build_tool_set(["remember", "crash"], None, None, str(cfg))

    async def go() -> list:
        out = [await ts["remember"].invoke({"value": "a"}, session_id="t1", timeout=30)]
        out.append(await ts["crash"].invoke({}, session_id="t1", timeout=30))
        out.append(await ts["remember"].invoke({"value": "b"}, session_id="t1", timeout=60))
        await ts["remember"].release("t1")
        return out

    try:
        first, lost, again = run(go())
        assert first.ok and first.text == "a"
        assert not lost.ok and lost.error == ErrorKind.SESSION_LOST and lost.metrics["server_lost"] == 1.0
        assert "state from this trajectory's earlier calls is gone" in lost.text and "'memo'" in lost.text
        assert again.ok and again.text == "b"  # a fresh server: "a" is not remembered
        procs = [c["proc"] for c in calls(log)]
        assert procs[0] == procs[1] != procs[2]
    finally:
        run(ts.close())


def test_stdio_server_with_a_venv_under_tmp(tmp_path):
    """A checkout and venv under /tmp (a CI clone): the sandbox's private /tmp must not hide the
    venv's interpreter (bin/python, pyvenv.cfg, site-packages), the folders its .pth files add (an
    editable install, a venv stacked on another: CI's own venv is under /tmp too), the server's
    PYTHONPATH entries, nor the server's script and cwd."""
    assert str(tmp_path).startswith("/tmp/")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    # the test's own venv stands in for the system site-packages (it has the mcp SDK)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "outer.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    # an editable install of a checkout under /tmp (a .pth line) and a PYTHONPATH entry under /tmp
    for folder, module in (("checkout", "tmp_editable_pkg"), ("pythonpath", "tmp_pythonpath_pkg")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{module}.py").write_text("VALUE = 1\n")
    (site / "editable.pth").write_text(str(tmp_path / "checkout") + "\n")
    env = {"EXTRA_MODULES": "tmp_editable_pkg,tmp_pythonpath_pkg", "PYTHONPATH": str(tmp_path / "pythonpath")}
    cfg, log = stdio_config(tmp_path / "servers", "tmpvenv", command=str(venv / "bin" / "python"), env=env)
    spec = json.loads(cfg.read_text())
    spec["mcpServers"]["tmpvenv"]["cwd"] = str(tmp_path / "servers")
    cfg.write_text(json.dumps(spec))
    ts = build_tool_set(["lookup"], None, None, str(cfg))
    try:
        res = run(ts["lookup"].invoke({"query": "tmp"}, timeout=30))
        assert res.ok and res.text == "note about tmp"
        assert calls(log, "lookup")[-1]["args"] == {"query": "tmp"}
    finally:
        run(ts.close())
