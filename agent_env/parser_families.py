"""The tool-call formats of the model families users bring: ``llama3_json``, ``mistral``,
``qwen3_coder`` and ``harmony`` (see :mod:`agent_env.parsers` for the contract and the format of
each; the registry :data:`agent_env.parsers.FORMATS` names them)."""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from agent_env import EnvError
from agent_env.parsers import _MALFORMED, ParsedCall

__all__ = ["HarmonyParser", "Llama3JsonParser", "MistralParser", "Qwen3CoderParser"]


_DECODER = json.JSONDecoder()


def _malformed(name: str | None, raw: str, message: str) -> ParsedCall:
    return ParsedCall(name, raw=raw, error=_MALFORMED, error_message=message)


def _call_from_object(obj: Any, raw: str, *, args_keys: Sequence[str], shape: str) -> ParsedCall:
    """A call from a decoded JSON object ``{"name": ..., <args key>: {...}}``: the checks every
    JSON-based format shares (an object, a non-empty ``name`` string, arguments an object or a
    JSON string of one)."""
    if not isinstance(obj, dict):
        return _malformed(None, raw, f"tool call must be a JSON object {shape}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _malformed(None, raw, 'tool call has no "name" string')
    key = next((k for k in args_keys if k in obj), args_keys[0])
    args = obj.get(key, {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return _malformed(name, raw, f'"{key}" is a string that is not valid JSON: {e}')
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return _malformed(name, raw, f'"{key}" must be a JSON object')
    call_id = obj.get("id")
    return ParsedCall(name, arguments=args, raw=raw, id=call_id if isinstance(call_id, str) else None)


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
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            i = text.find(self.open_tag, pos)
            if i < 0:
                break
            j = text.find(self.close_tag, i + len(self.open_tag))
            if j < 0:
                calls.append(_malformed(None, text[i:], "unterminated <tool_call> (no </tool_call>)"))
                break
            nested = text.rfind(self.open_tag, i + len(self.open_tag), j)
            if nested >= 0:
                calls.append(_malformed(None, text[i:nested], "<tool_call> opened inside another <tool_call>"))
                i = nested
            pos = j + len(self.close_tag)
            calls.append(self._parse_body(text[i + len(self.open_tag) : j], text[i:pos]))
        return calls

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


# ----------------------------------------------------------------------------- harmony (gpt-oss)

HARMONY_INSTALL = "pip install 'otb-tir[harmony]'"


def _import_harmony() -> Any:
    try:
        import openai_harmony
    except ImportError as e:
        raise EnvError(
            f"the harmony tool-call format needs the openai-harmony package: {HARMONY_INSTALL} ({e})"
        ) from None
    return openai_harmony


_H_START, _H_CHANNEL, _H_MESSAGE, _H_CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
_H_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_H_RECIPIENT = re.compile(r"(?:^|\s)to=(\S*)")


@dataclass
class _HarmonySegment:
    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    body: str | None  # None: the header has no <|message|>
    end: str | None  # the token that ended the body; None: the end of the text (the stop token)
    raw: str


class HarmonyParser:
    """gpt-oss harmony tool calls: messages to ``functions.NAME`` (``to=`` after the channel, as the
    model writes it, or in the role part, as openai-harmony renders it) with a JSON body, ended by
    ``<|call|>`` (the stop token the episode strips). Several such messages in one turn are several
    calls (gpt-oss itself stops at the first ``<|call|>``); analysis/final messages are not calls.

    openai-harmony's own parser (``HarmonyEncoding.parse_messages_from_completion_tokens``) needs the
    o200k tokenizer's vocabulary file, which it downloads unless ``TIKTOKEN_ENCODINGS_BASE`` names a
    folder holding ``o200k_base.tiktoken``; it works on o200k token ids (not the policy's text) and
    raises on malformed input. So the text is split into messages here, and :meth:`messages` returns
    them as openai-harmony ``Message`` objects (role, channel, recipient, content type).
    """

    name = "harmony"
    namespace = "functions."

    def __init__(self) -> None:
        self._oh = _import_harmony()

    # -- splitting the text into harmony messages

    @staticmethod
    def _segments(text: str) -> list[_HarmonySegment]:
        segs: list[_HarmonySegment] = []
        pos, first = 0, True
        while pos < len(text):
            if first:
                head_start, role_default = pos, "assistant"  # the prompt ends with <|start|>assistant
            else:
                s = text.find(_H_START, pos)
                if s < 0:
                    break
                head_start, role_default = s + len(_H_START), None
            first = False
            m = text.find(_H_MESSAGE, head_start)
            nxt = text.find(_H_START, head_start)
            if m < 0 or (0 <= nxt < m):  # a header without <|message|>
                stop = nxt if nxt >= 0 else len(text)
                segs.append(
                    HarmonyParser._header(text[head_start:stop], role_default, None, None, text[head_start:stop])
                )
                pos = stop
                continue
            body_start = m + len(_H_MESSAGE)
            ends = [(text.find(t, body_start), t) for t in (*_H_ENDS, _H_START)]
            ends = [(k, t) for k, t in ends if k >= 0]
            if ends:
                k, tok = min(ends)
                end = None if tok == _H_START else tok
                stop = k + (len(tok) if end else 0)
            else:
                k, end, stop = len(text), None, len(text)
            segs.append(
                HarmonyParser._header(text[head_start:m], role_default, text[body_start:k], end, text[head_start:stop])
            )
            pos = stop
        return segs

    @staticmethod
    def _header(header: str, role_default: str | None, body: str | None, end: str | None, raw: str) -> _HarmonySegment:
        role_part, _, channel_part = header.partition(_H_CHANNEL)
        recipient = None
        r = _H_RECIPIENT.search(header.replace(_H_CHANNEL, " ").replace(_H_CONSTRAIN, " "))
        if r is not None:
            recipient = r.group(1)
        role_words = [w for w in role_part.split() if not w.startswith("to=")]
        role = role_words[0] if role_words else (role_default or "")
        channel = content_type = None
        if _H_CHANNEL in header:
            words = [
                w for w in channel_part.replace(_H_CONSTRAIN, " " + _H_CONSTRAIN).split() if not w.startswith("to=")
            ]
            if words and not words[0].startswith(_H_CONSTRAIN):
                channel = words.pop(0)
            if words:
                content_type = " ".join(words)
        return _HarmonySegment(role, channel, recipient, content_type, body, end, raw)

    def messages(self, text: str) -> list[Any]:
        """The turn's messages as ``openai_harmony.Message`` objects (those with a body)."""
        oh = self._oh
        out = []
        for seg in self._segments(text):
            if seg.body is None:
                continue
            try:
                role = oh.Role(seg.role)
            except ValueError:
                role = oh.Role.ASSISTANT
            msg = oh.Message.from_role_and_content(role, seg.body)
            if seg.channel:
                msg = msg.with_channel(seg.channel)
            if seg.recipient:
                msg = msg.with_recipient(seg.recipient)
            if seg.content_type:
                msg = msg.with_content_type(seg.content_type)
            out.append(msg)
        return out

    # -- the parser contract

    def parse(self, text: str) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        for seg in self._segments(text):
            if seg.recipient is None:
                continue
            if seg.role not in ("assistant", ""):
                continue  # e.g. the model writing a tool's answer itself: not a call
            if not seg.recipient.startswith(self.namespace):
                calls.append(
                    _malformed(
                        None, seg.raw, f"unknown recipient {seg.recipient!r}: call a function as to=functions.NAME"
                    )
                )
                continue
            name = seg.recipient[len(self.namespace) :]
            if not name:
                calls.append(_malformed(None, seg.raw, "to=functions. without a function name"))
                continue
            if seg.body is None:
                calls.append(_malformed(name, seg.raw, f"call to functions.{name} has no <|message|>"))
                continue
            if seg.end in ("<|end|>", "<|return|>"):
                calls.append(_malformed(name, seg.raw, f"call to functions.{name} must end with <|call|>"))
                continue
            try:
                args = json.loads(seg.body) if seg.body.strip() else None
            except json.JSONDecodeError as e:
                calls.append(_malformed(name, seg.raw, f"the arguments of functions.{name} are not valid JSON: {e}"))
                continue
            if not isinstance(args, dict):
                calls.append(_malformed(name, seg.raw, f"the arguments of functions.{name} must be a JSON object"))
                continue
            calls.append(ParsedCall(name, arguments=args, raw=seg.raw))
        return calls

    def format_observation(self, text: str) -> str:
        return text

    def tool_messages(self, records: Sequence[Any], calls: Sequence[ParsedCall]) -> list[dict[str, Any]]:
        """One ``tool`` message per call, named after the function it answers (harmony's author
        ``functions.NAME``; ``unknown`` for a call without a name)."""
        return [
            {"role": "tool", "name": rec.name or "unknown", "content": self.format_observation(rec.text)}
            for rec in records
        ]
