"""tools: the Tool protocol, registry, the sandboxed Python executor and the sympy calculator."""

from tools.base import ErrorKind, Tool, ToolError, ToolResult

__all__ = ["ErrorKind", "Tool", "ToolError", "ToolResult"]
