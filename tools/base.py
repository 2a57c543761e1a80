"""The tool contract every tool in otb-tir follows.

A tool has a ``name``, a ``description`` and a JSON-schema of ``parameters`` (OpenAI
function-calling form), and is awaited as ``await tool.call(args)`` → :class:`ToolResult`.

Inside an episode a tool never raises for bad model input: it returns ``ToolResult(ok=False,
error=<kind>)`` with a message the model can read. :class:`ToolError` is for configuration-time
mistakes (unknown tool name, bad config key), raised to the user.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

logger = logging.getLogger(__name__)

_IN_FLIGHT = 0  # tool calls of this process under way (Tool.invoke), read by calls_in_flight()


def calls_in_flight() -> int:
    """How many tool calls this process has under way (every :meth:`Tool.invoke` from its start to
    its result): a rollout engine on the CPU leaves cores to them while there are any."""
    return _IN_FLIGHT


class ToolError(Exception):
    """Bad tool configuration or registration (raised at configuration time, never mid-episode)."""


class ErrorKind:
    """Error kinds a :class:`ToolResult` may carry in ``error`` (eval reports count them by kind)."""

    SYNTAX = "syntax_error"
    RUNTIME = "runtime_error"
    TIMEOUT = "timeout"
    MEMORY = "memory"
    OUTPUT_CUT = "output_cut"
    MALFORMED_CALL = "malformed_call"
    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"
    SANDBOX = "sandbox_error"
    SESSION_LOST = "session_lost"  # a stateful session's process died from an outside cause
    BLOCKED = "blocked"

    ALL = (
        SYNTAX,
        RUNTIME,
        TIMEOUT,
        MEMORY,
        OUTPUT_CUT,
        MALFORMED_CALL,
        UNKNOWN_TOOL,
        BAD_ARGUMENTS,
        SANDBOX,
        SESSION_LOST,
        BLOCKED,
    )


@dataclass
class ToolResult:
    """What a tool call returns: the text the model reads, and how the call went.

    ``ok`` is False when the call failed; ``error`` then names an :class:`ErrorKind`.
    A call can be ``ok`` and still carry ``error=ErrorKind.OUTPUT_CUT`` (output was truncated).
    ``metrics`` holds numbers such as ``latency_ms`` or ``cache_hit``.
    """

    text: str
    ok: bool = True
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Tool(abc.ABC):
    """Base class for tools. Subclasses set ``name``, ``description``, ``parameters``
    and implement :meth:`call`.

    Episodes call :meth:`invoke` (not :meth:`call` directly): it validates the arguments against
    the schema, applies a timeout, turns every failure into an error :class:`ToolResult` and
    records ``latency_ms``, so each tool only implements the happy path in :meth:`call`.

    ``session_id`` lets a tool keep state across the turns of one trajectory (the python tool's
    stateful mode); tools without state ignore it. The episode calls :meth:`release` with the
    same id when the trajectory ends.
    """

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
    #: True for a tool that may wait for capacity before it works (the python tool: a free sandbox
    #: worker) and bounds its own work by the ``timeout`` :meth:`invoke` hands to
    #: :meth:`call_bounded`: the wait is not counted as the call's time (64 episodes calling at once
    #: on 4 workers would otherwise read "timed out" for snippets that never ran). :meth:`invoke`
    #: still bounds the whole call, by ``timeout`` plus :attr:`capacity_wait_s`.
    bounds_itself: bool = False
    capacity_wait_s: float = 300.0

    @abc.abstractmethod
    async def call(self, args: dict[str, Any], *, session_id: str | None = None) -> ToolResult: ...

    async def call_bounded(
        self, args: dict[str, Any], *, session_id: str | None = None, timeout: float | None = None
    ) -> ToolResult:
        """:meth:`call` with the tool's own work bounded by ``timeout`` (``bounds_itself`` tools
        override it; the default ignores ``timeout``, which :meth:`invoke` then applies)."""
        return await self.call(args, session_id=session_id)

    async def release(self, session_id: str) -> None:
        """Free whatever the tool holds for ``session_id`` (no-op for stateless tools)."""

    async def close(self) -> None:
        """Free the tool's resources (worker pools, containers)."""

    async def invoke(
        self,
        args: Any,
        *,
        session_id: str | None = None,
        timeout: float | None = None,
    ) -> ToolResult:
        """Call the tool the way an episode does: never raises, always returns a :class:`ToolResult`.

        ``args`` (a dict, or a JSON string of one) is validated against :attr:`parameters`; a
        mismatch returns ``ToolResult(ok=False, error=ErrorKind.BAD_ARGUMENTS)`` with a message
        the model can read. An exception escaping :meth:`call` becomes ``ErrorKind.RUNTIME``
        (``ErrorKind.SANDBOX`` for OS/IPC failures), ``timeout`` seconds elapsed become
        ``ErrorKind.TIMEOUT``. ``metrics["latency_ms"]`` is always set.
        """
        global _IN_FLIGHT
        _IN_FLIGHT += 1
        try:
            return await self._invoke_timed(args, session_id, timeout)
        finally:
            _IN_FLIGHT -= 1

    async def _invoke_timed(self, args: Any, session_id: str | None, timeout: float | None) -> ToolResult:
        start = time.perf_counter()
        try:
            result = await self._invoke_checked(args, session_id, timeout)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - inside an episode nothing may escape
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            kind = ErrorKind.SANDBOX if isinstance(exc, (OSError, EOFError)) else ErrorKind.RUNTIME
            logger.debug("tool %r raised during call", self.name, exc_info=True)
            result = ToolResult(
                text=f"Error: tool '{self.name}' failed: {type(exc).__name__}: {exc}", ok=False, error=kind
            )
        # a copy: a tool may hand out a cached/shared result object
        result = dataclasses.replace(
            result, metrics={**result.metrics, "latency_ms": (time.perf_counter() - start) * 1000.0}
        )
        return result

    async def _invoke_checked(self, args: Any, session_id: str | None, timeout: float | None) -> ToolResult:
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                return ToolResult(
                    text=f"Error: the arguments of tool '{self.name}' are not valid JSON ({exc}). "
                    f"Expected arguments: {describe_parameters(self.parameters)}.",
                    ok=False,
                    error=ErrorKind.BAD_ARGUMENTS,
                )
        if args is None:
            args = {}
        problem = self.check_arguments(args)
        if problem is not None:
            return ToolResult(text=problem, ok=False, error=ErrorKind.BAD_ARGUMENTS)
        if self.bounds_itself:
            work = self.call_bounded(args, session_id=session_id, timeout=timeout)
            limit = None if timeout is None else timeout + self.capacity_wait_s
        else:
            work, limit = self.call(args, session_id=session_id), timeout
        if limit is None:
            return as_result(await work)
        task = asyncio.ensure_future(work)
        try:
            done, _ = await asyncio.wait({task}, timeout=limit)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            if self.bounds_itself:  # its own bound held no longer: capacity never came, not the model's code
                return ToolResult(
                    text=f"Error: tool '{self.name}' gave no result within {limit:g} s: it waited more than "
                    f"{self.capacity_wait_s:g} s for capacity (the machine is overloaded).",
                    ok=False,
                    error=ErrorKind.SANDBOX,
                )
            return ToolResult(
                text=f"Error: tool '{self.name}' timed out after {timeout:g} s.", ok=False, error=ErrorKind.TIMEOUT
            )
        return as_result(task.result())

    def check_arguments(self, args: Any) -> str | None:
        """Validate ``args`` against :attr:`parameters` (JSON schema); ``None`` if valid, else
        a short message for the model naming what was wrong and what was expected."""
        if not isinstance(args, dict):
            return (
                f"Error: the arguments of tool '{self.name}' must be a JSON object, got "
                f"{type(args).__name__}. Expected arguments: {describe_parameters(self.parameters)}."
            )
        errors = _validator_for(self.parameters).iter_errors(args)
        problems = sorted({_explain(e) for e in errors})
        if not problems:
            return None
        return (
            f"Error: bad arguments for tool '{self.name}': {'; '.join(problems[:5])}. "
            f"Expected arguments: {describe_parameters(self.parameters)}."
        )

    def schema(self) -> dict[str, Any]:
        """OpenAI function-calling schema, as chat templates' ``tools=`` argument expects."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def as_result(value: Any) -> ToolResult:
    """Turn what a tool returned into a :class:`ToolResult` (a ToolResult passes through; a
    string is the text; ``None`` is empty; dicts/lists are JSON; anything else is ``str()``)."""
    if isinstance(value, ToolResult):
        return value
    if value is None:
        return ToolResult(text="")
    if isinstance(value, str):
        return ToolResult(text=value)
    if isinstance(value, (dict, list)):
        try:
            return ToolResult(text=json.dumps(value, ensure_ascii=False, default=str))
        except (TypeError, ValueError):
            pass
    return ToolResult(text=str(value))


def describe_parameters(parameters: dict[str, Any]) -> str:
    """``"expression (string, required), digits (integer)"``: a one-line summary for error messages."""
    props = parameters.get("properties") or {}
    if not props:
        return "none"
    required = set(parameters.get("required") or [])
    parts = []
    for name, spec in props.items():
        kind = _type_name(spec)
        flags = [kind] if kind else []
        if name in required:
            flags.append("required")
        parts.append(f"{name} ({', '.join(flags)})" if flags else name)
    return ", ".join(parts)


def _type_name(spec: Any) -> str:
    if not isinstance(spec, dict):
        return ""
    if "enum" in spec:
        return "one of " + "/".join(json.dumps(v) for v in spec["enum"])
    t = spec.get("type")
    if isinstance(t, list):
        return " or ".join(map(str, t))
    if t == "array" and isinstance(spec.get("items"), dict) and spec["items"].get("type"):
        return f"array of {spec['items']['type']}"
    if t:
        return str(t)
    if "anyOf" in spec:
        return " or ".join(filter(None, (_type_name(s) for s in spec["anyOf"])))
    return ""


_VALIDATORS: dict[str, Any] = {}


def check_schema(parameters: Any, *, tool_name: str = "?") -> None:
    """Raise :class:`ToolError` if ``parameters`` is not a valid JSON schema of an object."""
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ToolError(f"tool {tool_name!r}: parameters must be a JSON schema with type 'object', got {parameters!r}")
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as exc:
        raise ToolError(f"tool {tool_name!r}: invalid parameters schema: {exc.message}") from exc


def _validator_for(parameters: dict[str, Any]) -> Any:
    key = json.dumps(parameters, sort_keys=True, default=str)
    validator = _VALIDATORS.get(key)
    if validator is None:
        from jsonschema import Draft202012Validator

        validator = Draft202012Validator(parameters)
        if len(_VALIDATORS) > 1024:
            _VALIDATORS.clear()
        _VALIDATORS[key] = validator
    return validator


def _explain(error: Any) -> str:
    """One readable line for a jsonschema ValidationError."""
    where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
    validator = error.validator
    if validator == "required":
        missing = [name for name in error.validator_value if name not in (error.instance or {})]
        return "missing required argument " + ", ".join(repr(m) for m in missing)
    if validator == "additionalProperties":
        allowed = set((error.schema.get("properties") or {}))
        extra = sorted(k for k in (error.instance or {}) if k not in allowed)
        return "unexpected argument " + ", ".join(repr(k) for k in extra)
    if validator == "type":
        expected = error.validator_value
        expected = " or ".join(expected) if isinstance(expected, list) else expected
        got = _json_type(error.instance)
        return f"argument {where!r} must be {expected}, got {got} {_short(error.instance)}"
    if validator == "enum":
        return f"argument {where!r} must be one of {json.dumps(error.validator_value)}, got {_short(error.instance)}"
    prefix = f"argument {where!r}: " if where else ""
    return prefix + error.message


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def close_quietly(built: Sequence[Tool]) -> None:
    """Close tools built before a later one failed (their worker pools must not leak); a failure
    to close one is logged and the others are still closed."""

    async def close_all() -> None:
        for t in built:
            try:
                await t.close()
            except Exception:  # noqa: BLE001 - closing must go on for the others
                logging.getLogger(__name__).warning("closing tool %r failed", t, exc_info=True)

    if not built:
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(close_all())
        return
    # inside a running loop (e.g. verl's agent loop): schedule it, the caller raises now
    asyncio.ensure_future(close_all())
