"""The one publisher of built artifacts into the cache (the tiny policy, the warm start, the test
tool-caller policy): :func:`publish`.

An artifact is a folder ``<root>/<name>-<digest of its key>`` (``root``: ``$OTB_TIR_CACHE``, else
``$XDG_CACHE_HOME/otb_tir`` or ``~/.cache/otb_tir``) holding the built files and a marker file,
written last. A folder counts as published only when its marker is there. The build

* runs under an exclusive lock per folder (``fcntl.flock`` on ``.<folder>.lock`` in the root,
  removed when the build ends), so concurrent builders of one artifact build it once: the others
  wait and then find it published;
* writes into a temporary sibling (``.<folder>-<random>``) that is renamed into place after the
  marker is written, so nothing ever sees a half-written folder;
* leaves nothing published when it fails: an exception removes the temporary folder, a killed
  process leaves it behind unpublished, and the next builder (holding the lock) removes it, and
  also any unmarked folder in the way, before it builds.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

logger = logging.getLogger(__name__)

__all__ = ["default_cache_root", "key_digest", "artifact_dir", "is_published", "publish", "code_fingerprint"]

#: What a build function returns: figures to add to the marker's record (or ``None``).
BuildFn = Callable[[Path], "Mapping[str, Any] | None"]


def default_cache_root() -> Path:
    """``$OTB_TIR_CACHE`` if set, else ``$XDG_CACHE_HOME/otb_tir`` or ``~/.cache/otb_tir``."""
    env = os.environ.get("OTB_TIR_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "otb_tir"


def key_digest(key: Mapping[str, Any]) -> str:
    """12 hex digits of the SHA-256 of ``key`` as sorted JSON (the folder names' suffix)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def code_fingerprint(modules: "list[str] | tuple[str, ...]") -> str:
    """SHA-256 of the code of ``modules`` (dotted names, found without importing them): each one's
    syntax tree without docstrings, comments or layout, so that a key holding it changes when the
    code that builds an artifact changes and not when its prose or formatting does."""
    import importlib.util

    h = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise ValueError(f"code_fingerprint: no Python source for module {name!r}")
        h.update(name.encode() + b"\0" + _source_digest(spec.origin).encode() + b"\0")
    return h.hexdigest()


_FINGERPRINT_LOCK = threading.Lock()
_FINGERPRINTS: dict[str, str] = {}  # source text's SHA-256 → its syntax tree's


def _source_digest(path: str) -> str:
    """SHA-256 of one source file's syntax tree without docstrings, cached per file content.
    Under a lock: CPython 3.11's ``ast.parse`` is not thread-safe (two threads parsing at once
    raised ``SystemError: AST constructor recursion depth mismatch`` in CI)."""
    import ast

    text = Path(path).read_text()
    key = hashlib.sha256(text.encode()).hexdigest()
    with _FINGERPRINT_LOCK:
        if key in _FINGERPRINTS:
            return _FINGERPRINTS[key]
        tree = ast.parse(text)
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (
                isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
        digest = hashlib.sha256(ast.dump(tree, include_attributes=False).encode()).hexdigest()
        _FINGERPRINTS[key] = digest
        return digest


def artifact_dir(root: str | os.PathLike | None, name: str, key: Mapping[str, Any]) -> Path:
    """``<root>/<name>-<key_digest(key)>``; ``root=None`` is :func:`default_cache_root`."""
    base = Path(root).expanduser() if root is not None else default_cache_root()
    return base / f"{name}-{key_digest(key)}"


def is_published(final: Path, marker: str) -> bool:
    return (Path(final) / marker).is_file()


@contextmanager
def _locked(final: Path) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``.<final.name>.lock`` next to ``final`` (yields True); the
    file is removed on release (a waiter that locked the removed file notices and locks the new one)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock (yields False), the rename alone keeps the folder whole
        yield False
        return
    path = final.parent / f".{final.name}.lock"
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)  # the holder before us removed the file we locked: lock the current one
    try:
        yield True
    finally:
        try:
            os.unlink(path)
        finally:
            os.close(fd)


def _remove_leftovers(final: Path, marker: str) -> None:
    """Under the lock: temporary folders of builders that died, and an unmarked folder at ``final``."""
    for tmp in final.parent.glob(f".{final.name}-*"):
        if tmp.is_dir():
            logger.info("removing %s, left by a build that did not finish", tmp)
            shutil.rmtree(tmp, ignore_errors=True)
    if final.exists() and not is_published(final, marker):
        logger.warning("removing %s: it has no %s (not a finished build)", final, marker)
        if final.is_dir() and not final.is_symlink():
            shutil.rmtree(final)
        else:
            final.unlink()


def publish(final: str | os.PathLike, marker: str, build: BuildFn, record: Mapping[str, Any] | None = None) -> Path:
    """Build the cached folder ``final`` once and return it (see the module docstring).

    ``build(tmp)`` writes the folder's files into ``tmp`` (an empty folder) and may return a mapping
    that is added to ``record``; the result is written, as JSON, to ``tmp/marker`` last, then ``tmp``
    is renamed to ``final``. If ``final`` is published already (also after waiting for another
    builder), ``build`` is not called.
    """
    final = Path(final)
    if is_published(final, marker):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final) as locked:
        if is_published(final, marker):  # another builder published it while we waited
            return final
        if locked:
            _remove_leftovers(final, marker)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            extra = build(tmp)
            full = {**(record or {}), **(extra or {})}
            (tmp / marker).write_text(json.dumps(full, indent=1, sort_keys=True, default=str))
            try:
                os.rename(tmp, final)
            except OSError as e:  # only without a lock: another builder published it meanwhile,
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):  # or an unmarked folder is in the way
                    raise
                if not is_published(final, marker):
                    shutil.rmtree(final, ignore_errors=True)
                    os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final
