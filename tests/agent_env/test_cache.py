"""agent_env.cache.publish, the one publisher of built artifacts: concurrent builders (processes and
threads) build once, a failed or killed build publishes nothing and is cleaned up by the next
builder, an unmarked folder is rebuilt (never read), and the folder names are the layout existing
caches have (``<name>-<12 hex of the key's SHA-256>``). The tiny policy and the warm start publish
through it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from agent_env import cache
from agent_env.cache import artifact_dir, is_published, publish

MARKER = "otb_tir_test.json"

# A builder process: publishes <root>/thing-<digest> with a build that notes its pid in
# <root>/builds.log, then waits for <root>/go (so every builder is started before any finishes),
# or, with "crash", kills itself mid-build.
_BUILDER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from agent_env.cache import artifact_dir, publish

    root, mode = Path(sys.argv[1]), sys.argv[2]

    def build(tmp):
        with open(root / "builds.log", "a") as f:
            f.write(f"{os.getpid()}\\n")
        (tmp / "half.bin").write_bytes(b"x" * 1000)
        if mode == "crash":
            os.kill(os.getpid(), 9)
        for _ in range(600):
            if (root / "go").exists():
                break
            time.sleep(0.05)
        (tmp / "data.txt").write_text("done")
        return {"builder": os.getpid()}

    (root / f"started-{os.getpid()}").touch()
    print(publish(artifact_dir(root, "thing", {"k": 1}), "otb_tir_test.json", build, {"key": {"k": 1}}))
    """
)


def _builder(root: Path, mode: str = "ok") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen(
        [sys.executable, "-c", _BUILDER, str(root), mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(predicate, timeout: float = 120.0) -> None:
    import time

    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out")
        time.sleep(0.05)


@pytest.mark.slow
def test_concurrent_processes_build_once(tmp_path):
    procs = [_builder(tmp_path) for _ in range(3)]
    _wait_for(lambda: len(list(tmp_path.glob("started-*"))) == 3 and (tmp_path / "builds.log").exists())
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    paths = {o.strip() for o, _ in outs}
    final = artifact_dir(tmp_path, "thing", {"k": 1})
    assert paths == {str(final)}
    builders = (tmp_path / "builds.log").read_text().split()
    assert len(builders) == 1  # one build; the others waited and found it published
    record = json.loads((final / MARKER).read_text())
    assert record == {"key": {"k": 1}, "builder": int(builders[0])}
    assert (final / "data.txt").read_text() == "done"
    left = {p.name for p in tmp_path.iterdir()} - {"go", "builds.log"} - {p.name for p in tmp_path.glob("started-*")}
    assert left == {final.name}  # no temporary folder, no lock file


def test_concurrent_threads_build_once(tmp_path):
    builds = []
    release = threading.Event()

    def build(tmp):
        builds.append(threading.get_ident())
        release.wait(30)
        (tmp / "f").write_text("x")

    final = artifact_dir(tmp_path, "thing", {"k": 2})
    results = []
    threads = [threading.Thread(target=lambda: results.append(publish(final, MARKER, build))) for _ in range(4)]
    for t in threads:
        t.start()
    _wait_for(lambda: builds)
    release.set()
    for t in threads:
        t.join(60)
    assert len(builds) == 1 and results == [final] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]


def test_failed_build_publishes_nothing(tmp_path):
    final = artifact_dir(tmp_path, "thing", {"k": 3})

    def bad(tmp):
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        publish(final, MARKER, bad, {"key": 3})
    assert not final.exists() and list(tmp_path.iterdir()) == []  # no folder, temporary or lock left
    calls = []
    assert publish(final, MARKER, lambda tmp: calls.append(tmp)) == final and len(calls) == 1
    assert is_published(final, MARKER)
    assert publish(final, MARKER, lambda tmp: pytest.fail("rebuilt a published folder")) == final


@pytest.mark.slow
def test_killed_build_publishes_nothing_and_is_cleaned_up(tmp_path):
    p = _builder(tmp_path, "crash")
    p.communicate(timeout=300)
    assert p.returncode == -9
    final = artifact_dir(tmp_path, "thing", {"k": 1})
    assert not final.exists() and not is_published(final, MARKER)
    leftovers = [x for x in tmp_path.iterdir() if x.name.startswith(f".{final.name}-")]
    assert len(leftovers) == 1 and (leftovers[0] / "half.bin").exists()  # the dead builder's temporary folder
    (tmp_path / "go").touch()
    q = _builder(tmp_path)
    out, err = q.communicate(timeout=300)
    assert q.returncode == 0, err
    assert out.strip() == str(final) and (final / "data.txt").read_text() == "done"
    assert len((tmp_path / "builds.log").read_text().split()) == 2
    assert not any(x.name.startswith(".") for x in tmp_path.iterdir())  # the leftover was removed


def test_unmarked_folder_is_rebuilt_not_read(tmp_path):
    """A folder without its marker (an older, interrupted copy) is never returned as built."""
    final = artifact_dir(tmp_path, "thing", {"k": 4})
    final.mkdir()
    (final / "config.json").write_text("{}")
    calls = []

    def build(tmp):
        calls.append(1)
        (tmp / "config.json").write_text('{"fresh": true}')

    assert publish(final, MARKER, build) == final and calls == [1]
    assert json.loads((final / "config.json").read_text()) == {"fresh": True} and is_published(final, MARKER)


def test_folder_names_keep_the_existing_layout(tmp_path, monkeypatch):
    key = {"b": [1, 2], "a": "x"}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    assert artifact_dir(tmp_path, "warm", key) == tmp_path / f"warm-{digest}"
    monkeypatch.setenv("OTB_TIR_CACHE", str(tmp_path / "env"))
    assert artifact_dir(None, "tiny-qwen3", key) == tmp_path / "env" / f"tiny-qwen3-{digest}"
    monkeypatch.delenv("OTB_TIR_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.default_cache_root() == tmp_path / "xdg" / "otb_tir"


_SMALL = dict(hidden_size=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate_size=64)


def test_tiny_policy_publishes_through_the_cache(tmp_path, monkeypatch):
    """tiny_policy_dir: concurrent callers build once; a folder in the old layout (same name, same
    marker) is found without a rebuild; a failed build leaves nothing."""
    import otb_tir.defaults.tiny as tiny

    real = tiny.build_tiny_tokenizer
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(tiny, "build_tiny_tokenizer", counted)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(tiny.tiny_policy_dir(tmp_path, **_SMALL))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 2
    path = results[0]
    assert path.name.startswith("tiny-qwen3-") and is_published(path, "otb_tir_tiny.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    # the marker records the key, and the folder name is its digest (the layout of existing caches)
    key = json.loads((path / "otb_tir_tiny.json").read_text())
    assert path.name == "tiny-qwen3-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    monkeypatch.setattr(tiny, "build_tiny_tokenizer", lambda *a, **k: pytest.fail("rebuilt a cached policy"))
    assert tiny.tiny_policy_dir(tmp_path, **_SMALL) == path

    def broken(*a, **k):
        raise RuntimeError("tokenizer training failed")

    monkeypatch.setattr(tiny, "build_tiny_tokenizer", broken)
    with pytest.raises(RuntimeError, match="tokenizer training failed"):
        tiny.tiny_policy_dir(tmp_path, seed=7, **_SMALL)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
