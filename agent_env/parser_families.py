"""The tool-call formats of the model families users bring: ``llama3_json``, ``mistral`` and
``qwen3_coder`` (see :mod:`agent_env.parsers` for the contract and the format of each; the registry
:data:`agent_env.parsers.FORMATS` names them). gpt-oss's ``harmony`` is in
:mod:`agent_env.parser_harmony`. The helpers the formats share (``_malformed``, ``_call_from_object``,
``_tagged_calls``) are in :mod:`agent_env.parsers`."""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any, Iterable, Sequence

from agent_env.parsers import ParsedCall, _call_from_object, _malformed, _tagged_calls

__all__ = ["Llama3JsonParser", "MistralParser", "Qwen3CoderParser"]


_DECODER = json.JSONDecoder()


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


# ----------------------------------------------------------------------------- Llama 3.x JSON


class Llama3JsonParser:
    """Llama 3.1/3.2/3.3 JSON tool calls: ``[<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]``."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    shape = '{"name": ..., "parameters": {...}}'

    def parse(self, text: str) -> list[ParsedCall]:
        i = text.find(self.python_tag)
        if i >= 0:
            body, pos = text, i + len(self.python_tag)
        else:
            body, pos = text, _skip_ws(text, 0)
            if not text.startswith("{", pos):
                return []  # prose: without <|python_tag|> a call is the whole turn
        calls: list[ParsedCall] = []
        while True:
            pos = _skip_ws(body, pos)
            if pos >= len(body):
                if not calls:
                    calls.append(_malformed(None, body[i:] if i >= 0 else body, "<|python_tag|> without a tool call"))
                break
            try:
                obj, end = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError as e:
                calls.append(_malformed(None, body[pos:], f"tool call is not valid JSON: {e}"))
                break
            calls.append(_call_from_object(obj, body[pos:end], args_keys=("parameters", "arguments"), shape=self.shape))
            pos = _skip_ws(body, end)
            if pos >= len(body):
                break
            if body[pos] != ";":
                calls.append(_malformed(None, body[pos:], "text after a tool call; separate several calls with ';'"))
                break
            pos += 1
        return calls

    def format_observation(self, text: str) -> str:
        return text


# ----------------------------------------------------------------------------- Mistral

_ALNUM = string.ascii_letters + string.digits
_ID_RNG = random.Random()


def _is_mistral_id(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 9 and all(c in _ALNUM for c in value)


class MistralParser:
    """Mistral ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3) and
    ``[TOOL_CALLS]name[ARGS]{...}`` (newer tokenizers), several calls per turn."""

    name = "mistral"
    token = "[TOOL_CALLS]"
    args_token = "[ARGS]"
    call_id_token = "[CALL_ID]"
    shape = '{"name": ..., "arguments": {...}}'

    def parse(self, text: str) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        starts = [m.start() for m in re.finditer(re.escape(self.token), text)]
        for k, start in enumerate(starts):
            end = starts[k + 1] if k + 1 < len(starts) else len(text)
            seg = text[start + len(self.token) : end]
            raw = text[start:end]
            pos = _skip_ws(seg, 0)
            if seg.startswith(("[", "{"), pos) and not seg.startswith((self.args_token, self.call_id_token), pos):
                calls.extend(self._parse_json_style(seg, pos, raw))
            else:
                calls.append(self._parse_args_style(seg, raw))
        return calls

    def _parse_json_style(self, seg: str, pos: int, raw: str) -> list[ParsedCall]:
        try:
            obj, end = _DECODER.raw_decode(seg, pos)
        except json.JSONDecodeError as e:
            return [_malformed(None, raw, f"[TOOL_CALLS] is not followed by valid JSON: {e}")]
        items = obj if isinstance(obj, list) else [obj]
        if not items:
            return [_malformed(None, raw, "[TOOL_CALLS] with an empty list of calls")]
        calls = [
            _call_from_object(item, json.dumps(item, ensure_ascii=False), args_keys=("arguments",), shape=self.shape)
            for item in items
        ]
        if seg[end:].strip():
            calls.append(_malformed(None, seg[end:], "text after the [TOOL_CALLS] JSON list"))
        return calls

    def _parse_args_style(self, seg: str, raw: str) -> ParsedCall:
        i = seg.find(self.args_token)
        if i < 0:
            return _malformed(None, raw, f"expected [TOOL_CALLS][{self.shape}, ...] or [TOOL_CALLS]name[ARGS]{{...}}")
        head, rest = seg[:i], seg[i + len(self.args_token) :]
        call_id = None
        if self.call_id_token in head:
            head, call_id = head.split(self.call_id_token, 1)
            call_id = call_id.strip()
        name = head.strip()
        if not name or any(c.isspace() for c in name):
            return _malformed(None, raw, "[TOOL_CALLS] must be followed by the tool's name, then [ARGS]")
        pos = _skip_ws(rest, 0)
        try:
            args, end = _DECODER.raw_decode(rest, pos)
        except json.JSONDecodeError as e:
            return _malformed(name, raw, f"the [ARGS] of {name!r} are not valid JSON: {e}")
        if not isinstance(args, dict):
            return _malformed(name, raw, f"the [ARGS] of {name!r} must be a JSON object")
        if rest[end:].strip():
            return _malformed(name, raw, f"text after the [ARGS] JSON of {name!r}")
        return ParsedCall(name, arguments=args, raw=raw, id=call_id or None)

    def format_observation(self, text: str) -> str:
        """The JSON value of ``"content"`` in ``[TOOL_RESULTS] {"content": ..., "call_id": ...}``, as
        mistral-common writes it: the result's JSON when it is JSON, else the text as a JSON string."""
        try:
            return json.dumps(json.loads(text), ensure_ascii=False)
        except ValueError:
            return json.dumps(text, ensure_ascii=False)

    @staticmethod
    def new_call_id() -> str:
        """A fresh tool-call id: 9 alphanumeric characters, as Mistral's templates require."""
        return "".join(_ID_RNG.choice(_ALNUM) for _ in range(9))

    def tool_messages(self, records: Sequence[Any], calls: Sequence[ParsedCall]) -> list[dict[str, Any]]:
        """One ``tool`` message per call with its ``tool_call_id`` (the id the model wrote when it is
        a valid Mistral id, else a fresh one) and ``name``."""
        out = []
        for rec, call in zip(records, calls):
            msg: dict[str, Any] = {"role": "tool", "content": self.format_observation(rec.text)}
            msg["tool_call_id"] = call.id if _is_mistral_id(call.id) else self.new_call_id()
            if rec.name:
                msg["name"] = rec.name
            out.append(msg)
        return out


# ----------------------------------------------------------------------------- Qwen3-Coder XML

_QC_FUNCTION = re.compile(r"<function=([^>\n]*)>")
_QC_PARAM_OPEN = re.compile(r"<parameter=([^>\n]*)>")


class Qwen3CoderParser:
    """Qwen3-Coder XML tool calls: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>
    ...</function>\\n</tool_call>``, several per turn.

    Parameter values are strings. When the tools' schemas are known (``Qwen3CoderParser(tools)`` or
    :meth:`bind_tools`, with OpenAI-style schemas as ``Tool.schema()`` returns them), a value whose
    schema type is not ``string`` is ``json.loads``-ed when it parses (``True``/``False`` too for
    booleans, as the template writes Python booleans); otherwise it stays a string and the tool's
    argument check reports it.
    """

    name = "qwen3_coder"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self, tools: Iterable[dict[str, Any]] | None = None) -> None:
        self._types: dict[str, dict[str, Any]] = {}
        if tools:
            self.bind_tools(tools)

    def bind_tools(self, tools: Iterable[dict[str, Any]] | None) -> None:
        """Learn each tool's parameter types from its OpenAI-style schema (``{"type": "function",
        "function": {"name", "parameters"}}`` or the inner function dict)."""
        self._types = {}
        for schema in tools or ():
            fn = schema.get("function", schema) if isinstance(schema, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                continue
            props = (fn.get("parameters") or {}).get("properties") or {}
            self._types[fn["name"]] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}

    def parse(self, text: str) -> list[ParsedCall]:
        return _tagged_calls(text, self.open_tag, self.close_tag, self._parse_body)

    def _parse_body(self, body: str, raw: str) -> ParsedCall:
        m = _QC_FUNCTION.search(body)
        if m is None:
            return _malformed(None, raw, "<tool_call> without <function=NAME>")
        name = m.group(1).strip()
        if not name:
            return _malformed(None, raw, "<function=> has an empty name")
        end = body.find("</function>", m.end())
        if end < 0:
            return _malformed(name, raw, f"unterminated <function={name}> (no </function>)")
        fbody = body[m.end() : end]
        args: dict[str, Any] = {}
        pos = 0
        while True:
            p = _QC_PARAM_OPEN.search(fbody, pos)
            if p is None:
                break
            key = p.group(1).strip()
            close = fbody.find("</parameter>", p.end())
            if close < 0:
                return _malformed(name, raw, f"unterminated <parameter={key}> (no </parameter>)")
            if not key:
                return _malformed(name, raw, "<parameter=> has an empty name")
            if key in args:
                return _malformed(name, raw, f"parameter {key!r} given twice")
            value = fbody[p.end() : close]
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            args[key] = self._convert(name, key, value)
            pos = close + len("</parameter>")
        return ParsedCall(name, arguments=args, raw=raw)

    def _convert(self, tool: str, key: str, value: str) -> Any:
        kind = self._types.get(tool, {}).get(key)
        kinds = set(kind) if isinstance(kind, list) else {kind}
        if kind is None or "string" in kinds:
            return value
        if "boolean" in kinds and value.strip() in ("True", "False"):
            return value.strip() == "True"
        try:
            return json.loads(value)
        except ValueError:
            return value

    def format_observation(self, text: str) -> str:
        return text
