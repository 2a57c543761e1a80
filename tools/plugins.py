"""The one plugin mechanism: names → objects for every extension point (tools, rewards, advantage
estimators, tool-call formats, tasks).

A :class:`Registry` resolves a name to an object registered in the process, a built-in (an import
path, imported on first use), an entry point of an installed distribution, or a path written in
the name (``package.module:attr`` / ``path/to/file.py:attr``). The tool registry
(:data:`tools.registry.TOOLS`), ``agent_env.rewards.REWARDS``, ``agent_env.parsers.FORMATS``,
``agent_env.tasks.TASKS`` and ``otb_tir.advantage.ESTIMATORS`` are instances.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from importlib import metadata
from typing import Any

from tools.base import ToolError

__all__ = ["Registry", "absolute_path_name", "import_path", "is_path_name"]

_LOCK = threading.Lock()


class Registry:
    """Names → objects for one extension point (tools, rewards, estimators, tool-call formats,
    tasks): the one mechanism every extension point uses.

    A name resolves, in this order, to an object registered in this process
    (:meth:`register`), a built-in (an import path, imported on first use), an installed entry
    point of ``group``, or a path written in the name itself: ``"package.module:attr"`` or
    ``"path/to/file.py:attr"`` (a file outside any package, imported once under a private module
    name). A name that does not resolve, or whose import fails, raises ``error`` naming the
    name, where it was looked for and the import error. :meth:`source` says where a name came from
    (recorded by each run); :meth:`describe` lists every known name with its source (``--list``).
    ``check(obj, name)`` validates a resolved object (raising ``error``).
    """

    def __init__(
        self,
        kind: str,
        group: str,
        builtins: dict[str, str] | None = None,
        *,
        error: type[Exception] = ToolError,
        check: Callable[[Any, str], None] | None = None,
    ) -> None:
        self.kind = kind
        self.group = group
        self.builtins = dict(builtins or {})
        self.error = error
        self.check = check
        self._registered: dict[str, Any] = {}
        self._lock = threading.Lock()

    # -- registration
    def register(self, obj: Any, name: str, *, replace: bool = False) -> Any:
        """Make ``obj`` (or an import path ``"pkg.mod:attr"``, resolved on first use) available as
        ``name``. A different object under a taken name raises unless ``replace=True``;
        re-registering the same function or class (a module reload) is allowed."""
        if not isinstance(name, str) or not name:
            raise self.error(f"register: a {self.kind} needs a non-empty name, got {name!r}")
        if not isinstance(obj, str) and self.check is not None:
            self.check(obj, name)
        with self._lock:
            existing = self._registered.get(name)
            if existing is not None and not replace and not _same_origin(existing, obj):
                raise self.error(
                    f"a {self.kind} named {name!r} is already registered ({existing!r}); "
                    "pick another name or pass replace=True"
                )
            self._registered[name] = obj
        return obj

    def unregister(self, name: str) -> None:
        with self._lock:
            if name not in self._registered:
                raise self.error(f"no registered {self.kind} named {name!r}; registered: {sorted(self._registered)}")
            del self._registered[name]

    def registered(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._registered)

    # -- lookup
    def entry_points(self) -> dict[str, metadata.EntryPoint]:
        found: dict[str, metadata.EntryPoint] = {}
        for ep in metadata.entry_points(group=self.group):
            found.setdefault(ep.name, ep)
        return found

    def names(self) -> list[str]:
        """Every name known without a path: registered, built-in and entry points (sorted)."""
        with self._lock:
            names = set(self.builtins) | set(self._registered)
        return sorted(names | set(self.entry_points()))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.names() or is_path_name(name))

    def resolve(self, name: str) -> Any:
        """The object ``name`` stands for (see the class doc)."""
        if not isinstance(name, str) or not name:
            raise self.error(f"a {self.kind} name must be a non-empty string, got {name!r}")
        with self._lock:
            target = self._registered.get(name, self.builtins.get(name))
            registered = name in self._registered
        if target is None:
            ep = self.entry_points().get(name)
            if ep is not None:
                try:
                    target = ep.load()
                except Exception as exc:  # noqa: BLE001 - a broken plugin must say which one
                    raise self.error(
                        f"{self.kind} {name!r} from entry point {ep.value!r} (group {self.group!r}) "
                        f"failed to load: {type(exc).__name__}: {exc}"
                    ) from exc
            elif is_path_name(name):
                target = import_path(name, what=f"{self.kind} {name!r}", error=self.error)
            else:
                raise self.error(
                    f"unknown {self.kind} {name!r}; available {self.kind}s: {', '.join(self.names()) or 'none'} "
                    f"(or an import path 'package.module:attr' / 'path/to/file.py:attr', or an "
                    f"entry point in group {self.group!r})"
                )
        elif isinstance(target, str):
            resolved = import_path(target, what=f"{self.kind} {name!r}", error=self.error)
            if registered:
                with self._lock:
                    if self._registered.get(name) == target:
                        self._registered[name] = resolved
            target = resolved
        if self.check is not None:
            self.check(target, name)
        return target

    def source(self, name: str) -> str:
        """Where :meth:`resolve` finds ``name``: ``registered``, ``built-in (...)``,
        ``entry point ...``, ``path ...`` or ``unknown``."""
        with self._lock:
            if name in self._registered:
                target = self._registered[name]
                return f"registered ({target})" if isinstance(target, str) else "registered"
            if name in self.builtins:
                return f"built-in ({self.builtins[name]})"
        ep = self.entry_points().get(name)
        if ep is not None:
            dist = getattr(getattr(ep, "dist", None), "name", None)
            return f"entry point {self.group}:{name} = {ep.value}" + (f" (distribution {dist})" if dist else "")
        if is_path_name(name):
            module, _, _ = name.rpartition(":")
            if module.endswith(".py"):
                return f"file {os.path.abspath(os.path.expanduser(module))}"
            return f"import path {name}"
        return "unknown"

    def describe(self) -> list[tuple[str, str]]:
        """``(name, source)`` for every name in :meth:`names`."""
        return [(n, self.source(n)) for n in self.names()]


def is_path_name(name: str) -> bool:
    """Whether ``name`` is written as a path: ``"package.module:attr"`` or ``"file.py:attr"``."""
    module, sep, attr = name.rpartition(":")
    return bool(sep and module and attr and attr.replace(".", "_").isidentifier())


def absolute_path_name(name: str) -> str:
    """``name`` with a ``file.py`` part made absolute (for another process in another folder)."""
    module, sep, attr = name.rpartition(":")
    if sep and module.endswith(".py"):
        return f"{os.path.abspath(os.path.expanduser(module))}:{attr}"
    return name


_FILE_MODULES: dict[str, Any] = {}


def import_path(path: str, *, what: str, error: type[Exception] = ToolError) -> Any:
    """``"pkg.mod:Attr"``, ``"pkg.mod.Attr"`` or ``"path/to/file.py:Attr"`` → the object. A file is
    imported once per process (its directory is not added to ``sys.path``)."""
    module_name, sep, attr = path.rpartition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise error(f"{what}: {path!r} is not an import path like 'package.module:attr' or 'file.py:attr'")
    if module_name.endswith(".py"):
        module = _import_file(module_name, what=what, error=error)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise error(f"{what}: cannot import module {module_name!r} ({exc}); is the package installed?") from exc
        except Exception as exc:  # noqa: BLE001 - the plugin's own import-time failure
            raise error(f"{what}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise error(f"{what}: {module_name!r} has no attribute {attr!r}") from None
    return obj


def _import_file(file: str, *, what: str, error: type[Exception]) -> Any:
    import hashlib
    import importlib.util
    import sys

    full = os.path.abspath(os.path.expanduser(file))
    with _LOCK:
        if full in _FILE_MODULES:
            return _FILE_MODULES[full]
        if not os.path.isfile(full):
            raise error(f"{what}: file not found: {full}")
        name = "otb_tir_plugin_" + os.path.basename(full)[:-3].replace("-", "_") + "_"
        name += hashlib.sha1(full.encode()).hexdigest()[:8]
        spec = importlib.util.spec_from_file_location(name, full)
        if spec is None or spec.loader is None:  # pragma: no cover - a .py file always has a loader
            raise error(f"{what}: cannot import {full}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses / pickling look the module up by name
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - the file's own failure, named
            sys.modules.pop(name, None)
            raise error(f"{what}: importing {full} failed: {type(exc).__name__}: {exc}") from exc
        _FILE_MODULES[full] = module
        return module


def _same_origin(a: Any, b: Any) -> bool:
    if a is b:
        return True
    key = lambda o: (
        getattr(getattr(o, "fn", o), "__module__", None),
        getattr(getattr(o, "fn", o), "__qualname__", None),
    )  # noqa: E731
    return type(a) is type(b) and key(a) == key(b) and key(a)[1] is not None
