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

from tools.base import Tool, ToolError, ToolResult, check_schema

__all__ = [
    "ENTRY_POINT_GROUP",
    "VerlToolAdapter",
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

# Built-ins by import path: `import tools` stays light, and works before a backend's package exists.
_BUILTINS: dict[str, str] = {
    "python": "tools.sandbox:PythonTool",
    "calculator": "tools.calculator:CalculatorTool",
}

_REGISTRY: dict[str, Any] = {}  # name -> Tool subclass | Tool instance | factory | "module:attr"
_LOCK = threading.Lock()


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
    with _LOCK:
        existing = _REGISTRY.get(name)
        if existing is not None and not replace and not _same_origin(existing, obj):
            raise ToolError(
                f"a tool named {name!r} is already registered ({existing!r}); pick another name or pass replace=True"
            )
        _REGISTRY[name] = obj
    return obj


def unregister_tool(name: str) -> None:
    """Remove a tool registered with :func:`register_tool` / ``@tool`` (built-ins stay)."""
    with _LOCK:
        if name not in _REGISTRY:
            raise ToolError(f"no registered tool named {name!r}; registered: {sorted(_REGISTRY)}")
        del _REGISTRY[name]


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


def _entry_points() -> dict[str, metadata.EntryPoint]:
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)
    return found


def list_tools() -> list[str]:
    """Every name :func:`get_tool` accepts: built-ins, registered tools, entry points (sorted)."""
    with _LOCK:
        names = set(_BUILTINS) | set(_REGISTRY)
    names |= set(_entry_points())
    return sorted(names)


def _resolve(name: str) -> Any:
    with _LOCK:
        if name in _REGISTRY:
            target = _REGISTRY[name]
        elif name in _BUILTINS:
            target = _BUILTINS[name]
        else:
            target = None
    if target is None:
        ep = _entry_points().get(name)
        if ep is None:
            raise ToolError(f"unknown tool {name!r}; available tools: {', '.join(list_tools())}")
        try:
            target = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin must say which one
            raise ToolError(
                f"tool {name!r} from entry point {ep.value!r} (group {ENTRY_POINT_GROUP!r}) "
                f"failed to load: {type(exc).__name__}: {exc}"
            ) from exc
        _check_tool_like(target)
        return target
    if isinstance(target, str):
        resolved = _import_object(target, what=f"tool {name!r}")
        _check_tool_like(resolved)
        with _LOCK:
            if _REGISTRY.get(name) == target:
                _REGISTRY[name] = resolved
        return resolved
    return target


def _import_object(path: str, *, what: str) -> Any:
    """``"pkg.mod:Attr"`` or ``"pkg.mod.Attr"`` → the object."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ToolError(f"{what}: {path!r} is not an import path like 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ToolError(f"{what}: cannot import module {module_name!r} ({exc}); is the package installed?") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ToolError(f"{what}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def get_tool(name: str, **config: Any) -> Tool:
    """Build the tool registered as ``name`` with keyword ``config`` (e.g.
    ``get_tool("python", timeout=5, stateful=False)``). Raises :class:`ToolError` for an unknown
    name (listing the available ones) or config keys the tool does not take (listing valid keys)."""
    if not isinstance(name, str):
        raise ToolError(f"tool name must be a string, got {name!r}")
    target = _resolve(name)
    made = _construct(target, config, label=name)
    if made.name != name:  # the registered name is the one the model is told
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
    with _LOCK:
        if name in _REGISTRY:
            target = _REGISTRY[name]
            return f"registered ({target})" if isinstance(target, str) else "registered"
        if name in _BUILTINS:
            return f"built-in ({_BUILTINS[name]})"
    ep = _entry_points().get(name)
    if ep is None:
        return "unknown"
    dist = getattr(getattr(ep, "dist", None), "name", None)
    return f"entry point {ENTRY_POINT_GROUP}:{name} = {ep.value}" + (f" (distribution {dist})" if dist else "")


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
        _close_later([t for t, _, _ in built])  # tools built before the failure must not leak workers
        raise
    return built


def _close_later(built: list[Tool]) -> None:
    from tools.assembly import _close_quietly

    _close_quietly(built)


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
