"""verl-style tools (async ``create`` / ``execute`` / ``release``, built as
``Class(config=..., tool_schema=...)``) behind our :class:`~tools.base.Tool` interface."""

from __future__ import annotations

import inspect
from typing import Any

from tools.base import Tool, ToolError, ToolResult, check_schema

__all__ = ["VerlToolAdapter", "check_tool_schema", "is_verl_style"]


def check_tool_schema(schema: Any, where: str) -> dict[str, Any]:
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


def is_verl_style(cls: type) -> bool:
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
        function = check_tool_schema(schema_dict, where or tool_cls.__name__)
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
