"""The docker backend: the container command/spec it builds, the protocol and recycling with the
very same worker run as a local process, and real containers of the locally built image
(``python -m tools.sandbox.docker_image``; ``scripts/install_test_env.sh`` starts dockerd and
builds it). Real-container tests skip, saying why, only where no daemon can run (never in CI)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from tools.base import ErrorKind
from tools.sandbox import DockerBackend, PythonTool
from tools.sandbox.backends import SANDBOX_WORKER_PATH, WORKER_PATH


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_container_spec() -> None:
    t = PythonTool(backend="docker", image="otb/sandbox:py311", memory_mb=512)
    b = t.backend
    assert isinstance(b, DockerBackend) and t.recycle_after == 500
    cfg = b.worker_config(dict(t.worker_cfg, stateful=False))
    # the worker is the container's root with six capabilities; each snippet drops to its own uid
    assert cfg["uid"] >= 100_000 and cfg["nproc"] == t.worker_cfg["nproc"] and cfg["scratch"] == "/tmp/scratch"
    cmd = b.command(cfg)
    assert cmd[:4] == ["docker", "run", "-i", "--rm"]
    assert _flag(cmd, "--network") == "none"
    assert "--read-only" in cmd
    assert _flag(cmd, "--cap-drop") == "ALL" and _flag(cmd, "--ipc") == "none"
    added = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--cap-add"]
    assert sorted(added) == sorted(
        ["CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_CHOWN"]
    )
    assert _flag(cmd, "--security-opt") == "no-new-privileges"
    assert _flag(cmd, "--user") == "0:0"
    assert _flag(cmd, "--memory") == _flag(cmd, "--memory-swap") == "2048m"
    assert int(_flag(cmd, "--pids-limit")) <= 128 and float(_flag(cmd, "--cpus")) > 0
    tmpfs = _flag(cmd, "--tmpfs")
    assert tmpfs.startswith("/tmp:") and "size=64m" in tmpfs and "nosuid" in tmpfs
    assert _flag(cmd, "-v") == f"{WORKER_PATH}:{SANDBOX_WORKER_PATH}:ro"
    i = cmd.index("otb/sandbox:py311")
    assert cmd[i - 2 : i] == ["--entrypoint", "python"]
    assert cmd[i + 1 : i + 3] == ["-I", SANDBOX_WORKER_PATH]
    assert json.loads(cmd[i + 3])["memory_mb"] == 512
    # everything before the image is a docker option, nothing after it is
    assert all(not a.startswith("--") or a == "--entrypoint" for a in cmd[i + 1 : i + 3])


@dataclass
class LocalDockerBackend(DockerBackend):
    """The docker backend with `docker run ...` replaced by running the worker locally."""

    scratch: str = ""

    def command(self, cfg: dict[str, Any]) -> list[str]:
        return [sys.executable, "-I", WORKER_PATH, json.dumps(cfg)]

    def worker_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        cfg = super().worker_config(cfg)
        cfg["scratch"] = self.scratch
        return cfg


@pytest.mark.slow
def test_protocol_and_recycling_with_a_local_worker(tmp_path) -> None:
    backend = LocalDockerBackend(scratch=str(tmp_path / "scratch"))
    t = PythonTool(
        backend=backend, workers=1, recycle_after=3, cache=False, timeout=2.0, preload=("math",), max_output_chars=300
    )

    async def scenario():
        await t.start()
        pids = []
        outs = []
        for i in range(7):
            r = await t.call({"code": f"import os\nprint({i})\nos.getppid()"})
            outs.append(r)
            await asyncio.sleep(0)  # let the pool swap a recycled worker in
            await asyncio.sleep(0.05)
            pids.append(int(r.text.split()[1]))
        respawned = t.pool.respawned
        timeout = await t.call({"code": "while True: pass"})
        cut = await t.call({"code": "print('z' * 1000)"})
        err = await t.call({"code": "1/0"})
        await t.close()
        return pids, outs, respawned, timeout, cut, err

    pids, outs, respawned, timeout, cut, err = asyncio.run(scenario())
    assert [r.text.split()[0] for r in outs] == [str(i) for i in range(7)]
    # the worker (the snippet's parent) changes every 3 snippets
    assert pids[0] == pids[1] == pids[2] != pids[3]
    assert pids[3] == pids[4] == pids[5] != pids[6]
    assert respawned == 2
    assert timeout.error == ErrorKind.TIMEOUT
    assert cut.error == ErrorKind.OUTPUT_CUT and "output truncated" in cut.text
    assert err.error == ErrorKind.RUNTIME and "ZeroDivisionError" in err.text


def docker_problem() -> str | None:
    """Why the docker backend cannot run here (None: it can): no CLI, no daemon, no local image."""
    from tools.sandbox.docker_image import DEFAULT_IMAGE, image_exists

    if shutil.which("docker") is None:
        return "no docker CLI on PATH (apt-get install docker.io)"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`docker info` failed: {e}"
    if info.returncode != 0:
        return f"no Docker daemon answers (start dockerd as root): {info.stderr.strip()[-200:]}"
    if not image_exists(DEFAULT_IMAGE):
        return f"the local image {DEFAULT_IMAGE} is missing: python -m tools.sandbox.docker_image"
    return None


@pytest.mark.docker
def test_real_container_is_isolated_and_limited() -> None:
    """The docker backend for real: the locally built image, a running daemon (.ci/run starts one).
    The security probes of test_sandbox_security.py run against this backend too."""
    from tests.tools.test_sandbox_security import require_docker

    require_docker()
    t = PythonTool(backend="docker", workers=1, timeout=2.0)

    async def scenario():
        try:
            return [
                await t.call({"code": c})
                for c in (
                    "import os, numpy, sympy\nprint(os.getuid() != 0, int(numpy.arange(4).sum()), sympy.Integer(7))",
                    "import socket\nsocket.create_connection(('1.1.1.1', 53), 2)",
                    "while True: pass",
                    "open('/etc/escape', 'w')",
                )
            ], t.pool.workers[0].info
        finally:
            await t.close()

    (a, b, c, d), info = asyncio.run(scenario())
    assert a.text == "True 6 7\n" and info["seccomp"] is True and "numpy" in info["preloaded"]
    assert not b.ok and c.error == ErrorKind.TIMEOUT and not d.ok
