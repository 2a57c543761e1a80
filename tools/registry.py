"""Find and build tools by name: built-ins, ``register_tool``/``@tool``, the ``otb_tir.tools``
entry-point group, and verl-style YAML tool configs.

* ``get_tool(name, **config)`` → a ready :class:`~tools.base.Tool`. Unknown names and unknown
  config keys raise :class:`ToolError` naming the valid choices.
* ``list_tools()`` → every name ``get_tool`` accepts.
* ``register_tool(obj, name=None)``: a Tool subclass, a Tool instance, a factory returning a
  Tool, or a ``"package.module:Attr"`` import path (imported only when first used).
* ``load_tools(path)``: a YAML file in verl's tool-config shape::

      tools:
        - class_name: my_pkg.tools.Search        # ours (a Tool subclass) or verl's (a BaseTool)
          config: {top_k: 3}
          tool_schema:                            # optional for our tools, required for verl's
            type: function
            function: {name: search, description: ..., parameters: {...}}
        - name: calculator                        # or a registered name
          config: {timeout: 2}

  Classes subclassing our Tool are built with ``Class(**config)`` (verl's ``type: native`` key is
  accepted and dropped); a ``tool_schema`` overrides their name/description/parameters.
  verl-style classes (async ``create``/``execute``/``release``) are built as
  ``Class(config=..., tool_schema=...)`` and wrapped in :class:`VerlToolAdapter`.

Third-party packages register in ``pyproject.toml``::

    [project.entry-points."otb_tir.tools"]
    search = "my_pkg.tools:Search"
"""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
import os
import threading
from collections.abc import Callable
from importlib import metadata
from typing import Any

from tools.base import Tool, ToolError, ToolResult, check_schema, close_quietly

__all__ = [
    "ENTRY_POINT_GROUP",
    "Registry",
    "TOOLS",
    "VerlToolAdapter",
    "absolute_path_name",
    "import_path",
    "is_path_name",
    "get_tool",
    "list_tools",
    "load_tool_entries",
    "load_tools",
    "register_tool",
    "tool_source",
    "unregister_tool",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "otb_tir.tools"

# ----------------------------------------------------------------------------------- the mechanism


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


def _check_tool(obj: Any, name: str) -> None:
    _check_tool_like(obj)


_LOCK = threading.Lock()
TOOLS = Registry(
    "tool",
    ENTRY_POINT_GROUP,
    {"python": "tools.sandbox:PythonTool", "calculator": "tools.calculator:CalculatorTool"},
    check=_check_tool,
)


# ----------------------------------------------------------------------------------- registration


def register_tool(obj: Any, name: str | None = None, *, replace: bool = False) -> Any:
    """Make ``obj`` available to :func:`get_tool` under ``name`` (default: its ``name`` attribute).

    ``obj`` is a :class:`Tool` subclass (built with ``**config`` on each ``get_tool``), a Tool
    instance (returned as is), a callable returning a Tool, or an import path
    ``"package.module:Attr"`` resolved on first use. Returns ``obj`` (usable as a class decorator).
    Registering a different object under a taken name raises :class:`ToolError` unless
    ``replace=True``; re-registering the same function/class (e.g. a module reload) is allowed.
    """
    if isinstance(obj, str):
        if ":" not in obj and "." not in obj:
            raise ToolError(f"register_tool: {obj!r} is not an import path like 'package.module:Attr'")
        if name is None:
            raise ToolError("register_tool: a name is required when registering by import path")
    else:
        _check_tool_like(obj)
        name = name or getattr(obj, "name", "") or ""
    if not isinstance(name, str) or not name:
        raise ToolError(f"register_tool: {obj!r} has no name; set a `name` class attribute or pass name=...")
    return TOOLS.register(obj, name, replace=replace)


def unregister_tool(name: str) -> None:
    """Remove a tool registered with :func:`register_tool` / ``@tool`` (built-ins stay)."""
    TOOLS.unregister(name)


def _same_origin(a: Any, b: Any) -> bool:
    if a is b:
        return True
    key = lambda o: (
        getattr(getattr(o, "fn", o), "__module__", None),
        getattr(getattr(o, "fn", o), "__qualname__", None),
    )  # noqa: E731
    return type(a) is type(b) and key(a) == key(b) and key(a)[1] is not None


def _check_tool_like(obj: Any) -> None:
    if isinstance(obj, Tool) or (inspect.isclass(obj) and issubclass(obj, Tool)):
        return
    if callable(obj):
        return  # a factory; checked when called
    raise ToolError(
        f"cannot register {obj!r}: expected a Tool subclass, a Tool instance, a factory "
        "returning a Tool, or an import path 'package.module:Attr'"
    )


# ----------------------------------------------------------------------------------- lookup


def list_tools() -> list[str]:
    """Every name :func:`get_tool` accepts: built-ins, registered tools, entry points (sorted)."""
    return TOOLS.names()


def _resolve(name: str) -> Any:
    return TOOLS.resolve(name)


def _import_object(path: str, *, what: str) -> Any:
    """``"pkg.mod:Attr"``, ``"pkg.mod.Attr"`` or ``"file.py:Attr"`` → the object."""
    return import_path(path, what=what)


def get_tool(name: str, **config: Any) -> Tool:
    """Build the tool registered as ``name`` with keyword ``config`` (e.g.
    ``get_tool("python", timeout=5, stateful=False)``). Raises :class:`ToolError` for an unknown
    name (listing the available ones) or config keys the tool does not take (listing valid keys)."""
    if not isinstance(name, str):
        raise ToolError(f"tool name must be a string, got {name!r}")
    target = _resolve(name)
    made = _construct(target, config, label=name)
    if made.name != name and not is_path_name(name):  # the registered name is the one the model is told
        made = copy.copy(made) if made is target else made
        made.name = name
    return made


def _config_keys(factory: Callable[..., Any]) -> tuple[list[str], bool]:
    """(keyword names the factory accepts, whether it also takes **kwargs)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return [], True
    keys = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    return keys, var_kw


def _construct(target: Any, config: dict[str, Any], *, label: str) -> Tool:
    if isinstance(target, Tool):
        if config:
            raise ToolError(f"tool {label!r} takes no configuration; got keys {sorted(config)} (valid keys: none)")
        return target
    keys, var_kw = _config_keys(target)
    unknown = sorted(k for k in config if k not in keys)
    if unknown and not var_kw:
        raise ToolError(
            f"tool {label!r} got unknown config key(s) {unknown}; valid keys: {', '.join(keys) if keys else 'none'}"
        )
    try:
        made = target(**config)
    except ToolError:
        raise
    except (TypeError, ValueError) as exc:
        raise ToolError(
            f"tool {label!r}: bad configuration {config!r}: {exc} (valid keys: {', '.join(keys) if keys else 'none'})"
        ) from exc
    if not isinstance(made, Tool):
        raise ToolError(f"tool {label!r}: {target!r} returned {type(made).__name__}, not a tools.Tool")
    return made


# ----------------------------------------------------------------------------------- YAML (verl shape)


def tool_source(name: str) -> str:
    """Where :func:`get_tool` finds ``name``: ``registered``, ``built-in (...)`` or ``entry point ...``."""
    return TOOLS.source(name)


def load_tools(path: str | os.PathLike[str]) -> list[Tool]:
    """Build the tools listed in a YAML file in verl's tool-config shape (see the module doc).
    Raises :class:`ToolError` naming the entry and the problem."""
    return [made for made, _, _ in load_tool_entries(path)]


def load_tool_entries(path: str | os.PathLike[str]) -> list[tuple[Tool, str, dict[str, Any]]]:
    """:func:`load_tools` with, for each tool, where it is defined (``"<path>: tools[i] (class)"``)
    and its config. A failure closes the tools built before it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ToolError(f"tool config file not found: {path!r}")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OmegaConfBaseException, OSError, ValueError) as exc:
        raise ToolError(f"cannot read tool config {path!r}: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("tools"), list):
        raise ToolError(f"{path}: expected a top-level 'tools:' list (verl tool-config shape)")
    built: list[tuple[Tool, str, dict[str, Any]]] = []
    try:
        for i, entry in enumerate(raw["tools"]):
            where = f"{path}: tools[{i}]"
            if not isinstance(entry, dict):
                raise ToolError(f"{where}: expected a mapping with class_name (or name), config, tool_schema")
            unknown = sorted(set(entry) - {"class_name", "name", "config", "tool_schema"})
            if unknown:
                raise ToolError(f"{where}: unknown key(s) {unknown}; valid keys: class_name, name, config, tool_schema")
            label = entry.get("class_name") or f"name: {entry.get('name')}"
            try:
                made = _tool_from_entry(entry, where)
            except ToolError:
                raise
            except Exception as exc:  # a plugin's own constructor or import
                raise ToolError(f"{where} ({label}) failed to load: {type(exc).__name__}: {exc}") from exc
            built.append((made, f"{where} ({label})", dict(entry.get("config") or {})))
        names = [t.name for t, _, _ in built]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ToolError(f"{path}: tool name(s) {duplicates} appear more than once; each tool needs a unique name")
    except BaseException:
        close_quietly([t for t, _, _ in built])  # tools built before the failure must not leak workers
        raise
    return built


def _tool_from_entry(entry: dict[str, Any], where: str) -> Tool:
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolError(f"{where}: config must be a mapping, got {config!r}")
    schema = entry.get("tool_schema")
    function = None
    if schema is not None:
        function = _check_tool_schema(schema, where)
    class_name, name = entry.get("class_name"), entry.get("name")
    if bool(class_name) == bool(name):
        raise ToolError(f"{where}: give exactly one of class_name (an import path) or name (a registered tool)")
    if name:
        target = _resolve(name)
        label = name
    else:
        target = _import_object(class_name, what=where)
        label = class_name
    if inspect.isclass(target) and not issubclass(target, Tool) and _is_verl_style(target):
        if schema is None:
            schema = getattr(target, "tool_schema", None)
        if schema is None:
            raise ToolError(f"{where}: verl-style tool {class_name!r} needs a tool_schema")
        return VerlToolAdapter.build(target, config=config, tool_schema=schema, where=where)
    ours = {k: v for k, v in config.items() if not (k == "type" and v == "native")}
    made = _construct(target, ours, label=f"{where} ({label})")
    if function is not None:
        if made is target:  # a shared instance (e.g. from @tool): rename a copy, not the original
            made = copy.copy(made)
        made.name = function["name"]
        if "description" in function:
            made.description = function["description"]
        if "parameters" in function:
            made.parameters = function["parameters"]
    return made


def _check_tool_schema(schema: Any, where: str) -> dict[str, Any]:
    if (
        not isinstance(schema, dict)
        or schema.get("type", "function") != "function"
        or not isinstance(schema.get("function"), dict)
    ):
        raise ToolError(
            f"{where}: tool_schema must look like {{type: function, function: {{name, description, "
            f"parameters}}}}, got {schema!r}"
        )
    function = schema["function"]
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolError(f"{where}: tool_schema.function.name is missing")
    if "parameters" in function:
        check_schema(function["parameters"], tool_name=function["name"])
    return function


def _is_verl_style(cls: type) -> bool:
    return all(inspect.iscoroutinefunction(getattr(cls, m, None)) for m in ("create", "execute", "release"))


class VerlToolAdapter(Tool):
    """Wrap a verl-style tool object (``create``/``execute``/``release``; ``execute`` returns
    ``(response, reward, metrics)`` with ``response`` a str or an object with ``.text``).

    Without a ``session_id`` every call gets a fresh instance (created, executed, released).
    With one, the instance lives across the calls of that session until :meth:`release`.
    The step reward is reported as ``metrics["tool_reward"]``; numeric verl metrics are kept.
    """

    def __init__(self, inner: Any, *, name: str, description: str, parameters: dict[str, Any]) -> None:
        self.inner = inner
        self.name = name
        self.description = description
        self.parameters = parameters
        self._instances: dict[str, str] = {}

    @classmethod
    def build(cls, tool_cls: type, *, config: dict[str, Any], tool_schema: Any, where: str = "") -> "VerlToolAdapter":
        schema_dict = tool_schema if isinstance(tool_schema, dict) else _dump(tool_schema)
        function = _check_tool_schema(schema_dict, where or tool_cls.__name__)
        try:
            inner = tool_cls(config=config, tool_schema=_verl_schema_object(schema_dict, tool_cls))
        except Exception as exc:  # noqa: BLE001 - third-party constructor, report which one
            raise ToolError(
                f"{where}: constructing {tool_cls.__qualname__}(config=..., tool_schema=...) failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        parameters = function.get("parameters") or {"type": "object", "properties": {}, "required": []}
        return cls(
            inner,
            name=getattr(inner, "name", None) or function["name"],
            description=function.get("description", ""),
            parameters=parameters,
        )

    async def _create(self, instance_id: str | None) -> str:
        created = await self.inner.create(instance_id)
        if isinstance(created, tuple):  # verl >= 0.5: (instance_id, ToolResponse)
            created = created[0]
        return str(created)

    async def call(self, args: dict[str, Any], *, session_id: str | None = None) -> ToolResult:
        if session_id is None:
            instance = await self._create(None)
            try:
                out = await self.inner.execute(instance, args)
            finally:
                await self.inner.release(instance)
        else:
            instance = self._instances.get(session_id)
            if instance is None:
                instance = self._instances[session_id] = await self._create(session_id)
            out = await self.inner.execute(instance, args)
        return _verl_result(out)

    async def release(self, session_id: str) -> None:
        instance = self._instances.pop(session_id, None)
        if instance is not None:
            await self.inner.release(instance)

    async def close(self) -> None:
        for session_id in list(self._instances):
            await self.release(session_id)


def _verl_result(out: Any) -> ToolResult:
    reward: Any = None
    extra: Any = None
    response = out
    if isinstance(out, tuple):
        response = out[0] if out else ""
        reward = out[1] if len(out) > 1 else None
        extra = out[2] if len(out) > 2 else None
    text = response if isinstance(response, str) else getattr(response, "text", None)
    if text is None:
        text = "" if response is None else str(response)
    result = ToolResult(text=text)
    if isinstance(reward, (int, float)) and not isinstance(reward, bool):
        result.metrics["tool_reward"] = float(reward)
    if isinstance(extra, dict):
        for key, value in extra.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                result.metrics[str(key)] = float(value)
    return result


def _dump(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(exclude_none=True)
    if isinstance(obj, dict):
        return obj
    raise ToolError(f"tool_schema must be a mapping, got {obj!r}")


def _verl_schema_object(schema: dict[str, Any], tool_cls: type) -> Any:
    """verl's own pydantic schema object for classes built on verl's BaseTool, else an attribute
    view of the dict (``schema.function.name`` works either way; verl is never imported for
    classes that do not come from it)."""
    if any((getattr(c, "__module__", "") or "").startswith("verl.") for c in tool_cls.__mro__):
        from verl.tools.schemas import OpenAIFunctionToolSchema

        return OpenAIFunctionToolSchema.model_validate(schema)
    return _AttrView(schema)


class _AttrView(dict):
    """A dict readable as attributes (``schema.function.name``), for verl-style tools without verl."""

    def __getattr__(self, key: str) -> Any:
        try:
            value = self[key]
        except KeyError:
            raise AttributeError(key) from None
        return _AttrView(value) if isinstance(value, dict) else value

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return dict(self)
