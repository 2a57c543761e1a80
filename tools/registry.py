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
import inspect
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from tools.base import Tool, ToolError, close_quietly
from tools.plugins import Registry, import_path, is_path_name
from tools.verl_tools import VerlToolAdapter, check_tool_schema, is_verl_style

__all__ = [
    "ENTRY_POINT_GROUP",
    "TOOLS",
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
        function = check_tool_schema(schema, where)
    class_name, name = entry.get("class_name"), entry.get("name")
    if bool(class_name) == bool(name):
        raise ToolError(f"{where}: give exactly one of class_name (an import path) or name (a registered tool)")
    if name:
        target = _resolve(name)
        label = name
    else:
        target = _import_object(class_name, what=where)
        label = class_name
    if inspect.isclass(target) and not issubclass(target, Tool) and is_verl_style(target):
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
