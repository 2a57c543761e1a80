"""A user's own tools, as a user writes them outside the project (tests copy this file to a
temporary folder and reach it only through PYTHONPATH, a tools YAML or an installed entry point).

Each tool appends one JSON line per event to ``log_path`` (its own record of what it received:
process, class, session id, arguments), so a test can tell that the run called *this* code.

- ``Lookup``: a plain ``tools.Tool`` subclass (stateless).
- ``SessionLookup``: a verl-style tool (async ``create`` / ``execute`` / ``release``, built as
  ``SessionLookup(config=..., tool_schema=...)``) that keeps a counter per instance, i.e. per
  trajectory: the n-th call of a trajectory answers ``call n``.
"""

import json
import os

from tools import Tool, ToolResult

SCHEMA = {
    "type": "object",
    "properties": {"query": {"type": "string", "description": "what to look up"}},
    "required": ["query"],
}


def _log(path, **record):
    with open(path, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), **record}) + "\n")


class Lookup(Tool):
    name = "lookup"
    description = "Look up a query and return a short note."
    parameters = SCHEMA

    def __init__(self, log_path: str, prefix: str = "note"):
        self.log_path = log_path
        self.prefix = prefix
        self.calls = 0

    async def call(self, args, *, session_id=None):
        self.calls += 1
        _log(self.log_path, event="call", cls="Lookup", session_id=session_id, args=args)
        return ToolResult(text=f"{self.prefix} {self.calls}")


class SessionLookup:
    """verl's BaseTool shape, without importing verl."""

    def __init__(self, config, tool_schema):
        self.log_path = config["log_path"]
        self.name = tool_schema.function.name
        self.state = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id = instance_id or f"anon-{len(self.state)}"
        self.state[instance_id] = 0
        _log(self.log_path, event="create", cls="SessionLookup", session_id=instance_id)
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        self.state[instance_id] += 1
        _log(
            self.log_path,
            event="call",
            cls="SessionLookup",
            session_id=instance_id,
            args=parameters,
            n=self.state[instance_id],
        )
        return f"call {self.state[instance_id]}", 0.0, {}

    async def release(self, instance_id, **kwargs):
        self.state.pop(instance_id, None)
        _log(self.log_path, event="release", cls="SessionLookup", session_id=instance_id)
