"""tools: the Tool protocol, registry, the sandboxed Python executor and the sympy calculator.

Make a tool by subclassing :class:`Tool`, by decorating a typed function with :func:`tool`, or
by listing classes in a verl-style YAML file (:func:`load_tools`); build one by name with
:func:`get_tool`; a run assembles its whole tool set with :func:`build_tool_set`. Episodes call
``await tool.invoke(args)``, which never raises.
"""

from tools.assembly import DEFAULT_TOOLS, ToolSet, build_tool_set
from tools.base import ErrorKind, Tool, ToolError, ToolResult
from tools.decorator import FunctionTool, tool
from tools.registry import get_tool, list_tools, load_tools, register_tool, unregister_tool

__all__ = [
    "DEFAULT_TOOLS",
    "ToolSet",
    "build_tool_set",
    "ErrorKind",
    "FunctionTool",
    "Tool",
    "ToolError",
    "ToolResult",
    "get_tool",
    "list_tools",
    "load_tools",
    "register_tool",
    "tool",
    "unregister_tool",
]
