"""A user's own tool-call parser, outside the project (named by path:
``multi_turn.format=code/logging_parser.py:LoggingHermes``).

Hermes-style ``<tool_call>{...}</tool_call>`` calls, read by the user's own code: every parse
appends one JSON line to ``$PARSER_LOG`` (pid, how many calls it found).
"""

import json
import os
import re

from agent_env.parsers import ParsedCall

_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class LoggingHermes:
    name = "logging_hermes"

    def parse(self, text):
        calls = []
        for m in _CALL.finditer(text):
            try:
                obj = json.loads(m.group(1))
                calls.append(ParsedCall(obj["name"], arguments=dict(obj.get("arguments") or {}), raw=m.group(0)))
            except (ValueError, KeyError, TypeError) as e:
                calls.append(ParsedCall(None, raw=m.group(0), error="malformed_call", error_message=str(e)))
        path = os.environ.get("PARSER_LOG")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "calls": len(calls)}) + "\n")
        return calls

    def format_observation(self, text):
        return text
