"""``@tool``: turn a typed Python function (sync or async) into a :class:`~tools.base.Tool`.

The JSON schema comes from the signature (type hints; parameters without a default are
required) and the docstring (summary = description; a Google- or NumPy-style ``Args`` /
``Parameters`` section gives per-argument descriptions)::

    @tool
    def add(a: int, b: int = 0) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first number.
            b: the second number.
        \"\"\"
        return a + b

The decorated name is a :class:`FunctionTool`: still callable as ``add(1, 2)``, awaited as
``await add.invoke({"a": 1})`` in an episode, and registered so ``get_tool("add")`` finds it.
The return value becomes the result text (a returned :class:`ToolResult` passes through).
A parameter named ``session_id`` receives the episode's session id and is not in the schema.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import inspect
import json
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tools.base import Tool, ToolError, ToolResult, as_result, check_schema

__all__ = ["FunctionTool", "tool", "function_schema"]

_SCALARS: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}


class FunctionTool(Tool):
    """A :class:`Tool` wrapping a plain function; made by :func:`tool`."""

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None) -> None:
        if not callable(fn):
            raise ToolError(f"@tool expects a function, got {fn!r}")
        self.fn = fn
        self.name = name or fn.__name__
        auto_description, self.parameters = function_schema(fn, tool_name=self.name)
        self.description = description if description is not None else auto_description
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004 (an async __call__)
        self._takes_session = "session_id" in inspect.signature(fn).parameters
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the original function directly (the decorator keeps functions usable)."""
        return self.fn(*args, **kwargs)

    async def call(self, args: dict[str, Any], *, session_id: str | None = None) -> ToolResult:
        kwargs = dict(args)
        if self._takes_session:
            kwargs["session_id"] = session_id
        if self._is_async:
            value = await self.fn(**kwargs)
        else:
            value = await asyncio.to_thread(self.fn, **kwargs)
            if inspect.isawaitable(value):  # a sync function returning a coroutine
                value = await value
        return as_result(value)

    def __repr__(self) -> str:
        return f"FunctionTool(name={self.name!r}, fn={getattr(self.fn, '__qualname__', self.fn)!r})"


@typing.overload
def tool(fn: Callable[..., Any], /) -> FunctionTool: ...
@typing.overload
def tool(
    *, name: str | None = None, description: str | None = None, register: bool = True, replace: bool = False
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    register: bool = True,
    replace: bool = False,
) -> Any:
    """Decorator: ``@tool`` or ``@tool(name="...", description="...", register=True)``.

    ``register=True`` adds the tool to the registry under its name (so ``get_tool(name)`` and
    YAML configs can use it); a different function already registered under that name raises
    :class:`ToolError` unless ``replace=True``.
    """

    def wrap(f: Callable[..., Any]) -> FunctionTool:
        made = FunctionTool(f, name=name, description=description)
        if register:
            from tools.registry import register_tool

            register_tool(made, replace=replace)
        return made

    if fn is not None:
        return wrap(fn)
    return wrap


def function_schema(fn: Callable[..., Any], *, tool_name: str | None = None) -> tuple[str, dict[str, Any]]:
    """``(description, parameters)`` for ``fn``: a JSON schema (type object) built from the type
    hints, the defaults and the docstring. Raises :class:`ToolError` for what cannot be expressed
    (missing type hints, ``*args``/``**kwargs``, positional-only parameters, unsupported types)."""
    label = tool_name or getattr(fn, "__qualname__", repr(fn))
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn, include_extras=True)
    except (TypeError, ValueError, NameError) as exc:
        raise ToolError(f"@tool {label!r}: cannot read the signature/type hints: {exc}") from exc

    description, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in signature.parameters.items():
        if pname == "session_id":
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolError(
                f"@tool {label!r}: *args/**kwargs ({pname!r}) cannot be described by a JSON schema; "
                "declare each argument by name"
            )
        if param.kind is param.POSITIONAL_ONLY:
            raise ToolError(f"@tool {label!r}: positional-only parameter {pname!r} cannot be passed by name")
        if pname not in hints:
            raise ToolError(
                f"@tool {label!r}: parameter {pname!r} has no type hint; @tool builds the schema from "
                "type hints (use typing.Any to accept anything)"
            )
        try:
            spec = _type_schema(hints[pname])
        except ToolError as exc:
            raise ToolError(f"@tool {label!r}: parameter {pname!r}: {exc}") from None
        if pname in arg_docs:
            spec["description"] = arg_docs[pname]
        if param.default is param.empty:
            required.append(pname)
        else:
            default = param.default.value if isinstance(param.default, enum.Enum) else param.default
            try:
                json.dumps(default)
                spec["default"] = default
            except (TypeError, ValueError):
                pass
        properties[pname] = spec
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    check_schema(parameters, tool_name=label)
    return description, parameters


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    if not doc.strip():
        return "", {}
    import docstring_parser

    parsed = docstring_parser.parse(doc)
    parts = [p for p in (parsed.short_description, parsed.long_description) if p]
    description = "\n\n".join(parts).strip()
    args = {
        p.arg_name: " ".join((p.description or "").split())
        for p in parsed.params
        if p.args and p.args[0] in ("param", "parameter", "arg", "argument", "key", "keyword")
    }
    return description, {k: v for k, v in args.items() if v}


def _type_schema(hint: Any) -> dict[str, Any]:
    """JSON schema of one type hint."""
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        base, *extra = typing.get_args(hint)
        spec = _type_schema(base)
        for item in extra:  # Annotated[int, "a description"]
            if isinstance(item, str):
                spec["description"] = item
        return spec
    if hint is typing.Any or hint is object:
        return {}
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if origin is typing.Literal:
        values = [v.value if isinstance(v, enum.Enum) else v for v in typing.get_args(hint)]
        types_ = sorted({_SCALARS[type(v)] for v in values if type(v) in _SCALARS})
        spec: dict[str, Any] = {"enum": values}
        if types_:
            spec["type"] = types_[0] if len(types_) == 1 else types_
        return spec
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _type_schema(typing.Literal[tuple(m.value for m in hint)])  # type: ignore[misc]
    if origin in (typing.Union, types.UnionType):
        members = [_type_schema(a) for a in typing.get_args(hint)]
        simple = [m for m in members if set(m) == {"type"} and isinstance(m["type"], str)]
        if len(simple) == len(members):
            names = list(dict.fromkeys(m["type"] for m in members))
            return {"type": names[0] if len(names) == 1 else names}
        return {"anyOf": members}
    if hint in (list, tuple, set, frozenset) or origin in (list, set, frozenset, Sequence, typing.Sequence):
        args = typing.get_args(hint)
        spec = {"type": "array"}
        if args:
            spec["items"] = _type_schema(args[0])
        return spec
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type_schema(args[0])}
        return {
            "type": "array",
            "prefixItems": [_type_schema(a) for a in args],
            "minItems": len(args),
            "maxItems": len(args),
        }
    if hint is dict or origin in (dict, Mapping, typing.Mapping):
        args = typing.get_args(hint)
        spec = {"type": "object"}
        if len(args) == 2 and args[1] is not typing.Any:
            spec["additionalProperties"] = _type_schema(args[1])
        return spec
    raise ToolError(
        f"type {hint!r} has no JSON-schema equivalent (use int, float, str, bool, list[...], dict[str, ...], "
        "Optional[...], Literal[...], an Enum or typing.Any)"
    )
