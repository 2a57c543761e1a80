"""The tool contract every tool in otb-tir follows.

A tool has a ``name``, a ``description`` and a JSON-schema of ``parameters`` (OpenAI
function-calling form), and is awaited as ``await tool.call(args)`` → :class:`ToolResult`.

Inside an episode a tool never raises for bad model input: it returns ``ToolResult(ok=False,
error=<kind>)`` with a message the model can read. :class:`ToolError` is for configuration-time
mistakes (unknown tool name, bad config key), raised to the user.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


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
    BLOCKED = "blocked"

    ALL = (SYNTAX, RUNTIME, TIMEOUT, MEMORY, OUTPUT_CUT, MALFORMED_CALL, UNKNOWN_TOOL,
           BAD_ARGUMENTS, SANDBOX, BLOCKED)


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

    ``session_id`` lets a tool keep state across the turns of one trajectory (the python tool's
    stateful mode); tools without state ignore it. The episode calls :meth:`release` with the
    same id when the trajectory ends.
    """

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}, "required": []}

    @abc.abstractmethod
    async def call(self, args: dict[str, Any], *, session_id: str | None = None) -> ToolResult:
        ...

    async def release(self, session_id: str) -> None:
        """Free whatever the tool holds for ``session_id`` (no-op for stateless tools)."""

    async def close(self) -> None:
        """Free the tool's resources (worker pools, containers)."""

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
