"""Tool-call parsers, chosen by name: ``hermes``, ``code_block``, ``llama3_json``, ``mistral``,
``qwen3_coder`` and ``harmony``.

A parser reads the text of one assistant turn and returns the tool calls it contains, in order.
A call the model got wrong (bad JSON, no name, arguments not an object, unterminated tag) is
returned as a :class:`ParsedCall` with ``error`` set: the episode turns it into an error
observation the model reads, and counts it. Parsers never raise on model text.

- ``hermes`` (Qwen2.5 / Qwen3 / Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn. ``arguments`` may also be a JSON-encoded string (some models do that).
- ``code_block`` (ToRL / SimpleTIR style): every fenced ````` ```python ````` block is a call to
  the ``python`` tool with ``{"code": <block>}``. Its result goes back as a ``tool`` message whose
  content is a fenced ````` ```output ````` block (see :func:`format_observation`), so both parsers
  share the chat-template machinery of the episode.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the turn is ``{"name": ..., "parameters": {...}}``
  (``"arguments"`` also accepted), optionally after ``<|python_tag|>``; several calls are separated by
  ``;``. Text before ``<|python_tag|>`` is prose; without the tag a call must be the whole turn (it
  starts with ``{``). Results go back as ``tool`` messages, which Llama's template renders as
  ``<|start_header_id|>ipython<|end_header_id|>`` turns (the turn with ``<|python_tag|>`` ends with
  ``<|eom_id|>``, the others with ``<|eot_id|>``: both belong in ``stop_token_ids``).
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3), also the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` (optionally ``name[CALL_ID]id[ARGS]{...}``), one or more per turn.
  Each result is a ``tool`` message with a ``tool_call_id`` (the call's own ``"id"`` when it is 9
  alphanumeric characters, else a fresh one) whose content is the JSON value Mistral's
  ``[TOOL_RESULTS] {"content": ..., "call_id": ...}[/TOOL_RESULTS]`` expects (see :meth:`MistralParser.tool_messages`).
- ``qwen3_coder`` (Qwen3-Coder XML): ``<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>
  ...</function>\n</tool_call>``, several per turn. Values are strings; a parameter whose schema type
  (from :meth:`Qwen3CoderParser.bind_tools`) is not ``string`` is ``json.loads``-ed when it parses.
- ``harmony`` (gpt-oss): ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``
  (or ``to=`` in the header's role part, as openai-harmony renders it), ended by ``<|call|>``; analysis
  and final messages are not calls. Results go back as ``tool`` messages with the tool's ``name``,
  which the template renders as ``<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>...<|end|>``.
  Needs the ``harmony`` extra (``openai-harmony``) for its message types; see
  :class:`agent_env.parser_harmony.HarmonyParser`.

A parser may define ``tool_messages(records, calls) -> list[dict]``: the messages the episode appends
after a turn, one per call, from the episode's ``ToolCallRecord`` s (``.name``, ``.text`` after
truncation) and the turn's :class:`ParsedCall` s. Without it (the hook is optional: a user's parser
needs only ``name``, ``parse`` and ``format_observation``) each result is
``{"role": "tool", "content": format_observation(text)}``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from agent_env.errors import EnvError
from tools.plugins import Registry

__all__ = [
    "ParsedCall",
    "ToolCallParser",
    "HermesParser",
    "CodeBlockParser",
    "get_parser",
    "PARSERS",
    "FORMATS",
]


@dataclass
class ParsedCall:
    """One tool call found in a turn. ``error`` (an ``ErrorKind`` value) is set for a malformed
    call, with ``error_message`` saying what was wrong; ``raw`` is the text of the call."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None
    error_message: str = ""
    id: str | None = None  # the call id the model wrote (Mistral's "id"), if any

    @property
    def ok(self) -> bool:
        return self.error is None


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


def _is_json(s: str) -> bool:
    try:
        json.loads(s)
    except ValueError:
        return False
    return True


def _tagged_calls(
    text: str,
    open_tag: str,
    close_tag: str,
    parse_body: Callable[[str, str], ParsedCall],
    *,
    body_ok: Callable[[str], bool] | None = None,
    tries: int = 8,
) -> list[ParsedCall]:
    """The calls of the ``open_tag … close_tag`` blocks of ``text``, in order (hermes and qwen3_coder's
    ``<tool_call>`` blocks): ``parse_body(body, raw)`` for each block, a malformed call for a block
    that is not closed (the rest of the text) and for an opening inside another block (from the outer
    opening to the inner one, whose block goes on). ``body_ok``: where it rejects the body the first
    closing tag leaves, the first of the next ``tries`` closing tags whose body it accepts closes the
    block instead (else the first one)."""
    calls: list[ParsedCall] = []
    pos = 0
    while (i := text.find(open_tag, pos)) >= 0:
        start = i + len(open_tag)
        j = text.find(close_tag, start)
        if j < 0:
            calls.append(_malformed(None, text[i:], f"unterminated {open_tag} (no {close_tag})"))
            break
        k = j
        for _ in range(tries if body_ok is not None else 0):
            if body_ok(text[start:k]):
                j = k
                break
            k = text.find(close_tag, k + len(close_tag))
            if k < 0:
                break
        pos = j + len(close_tag)
        nested = text.rfind(open_tag, start, j)
        if nested >= 0:
            calls.append(_malformed(None, text[i:nested], f"{open_tag} opened inside another {open_tag}"))
            i, start = nested, nested + len(open_tag)
        calls.append(parse_body(text[start:j], text[i:pos]))
    return calls


class ToolCallParser(Protocol):
    name: str

    def parse(self, text: str) -> list[ParsedCall]: ...

    def format_observation(self, text: str) -> str:
        """The content of the ``tool`` message that returns ``text`` to the model."""
        ...


_MALFORMED = "malformed_call"  # == tools.ErrorKind.MALFORMED_CALL (kept literal: parsers need no tools import)


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks, several per turn."""

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> list[ParsedCall]:
        # A "</tool_call>" may sit inside a JSON string: the first closing tag that makes the body
        # valid JSON (of a few) closes the block, else the first one.
        return _tagged_calls(text, self.open_tag, self.close_tag, self._parse_body, body_ok=_is_json)

    @staticmethod
    def _parse_body(body: str, raw: str) -> ParsedCall:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            return _malformed(None, raw, f"tool call is not valid JSON: {e}")
        return _call_from_object(
            obj, raw, args_keys=("arguments", "parameters"), shape='{"name": ..., "arguments": {...}}'
        )

    def format_observation(self, text: str) -> str:
        return text


_FENCE = re.compile(r"```[ \t]*(?:python|py)[ \t]*\n(?P<code>.*?)(?P<close>```|\Z)", re.DOTALL | re.IGNORECASE)


class CodeBlockParser:
    """Fenced ```python blocks, each a call to the ``python`` tool (ToRL / SimpleTIR style)."""

    name = "code_block"
    tool_name = "python"

    def parse(self, text: str) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        for m in _FENCE.finditer(text):
            code = m.group("code")
            if m.group("close") != "```":
                calls.append(
                    ParsedCall(
                        self.tool_name,
                        raw=m.group(0),
                        error=_MALFORMED,
                        error_message="unterminated ```python block (no closing ```)",
                    )
                )
                continue
            if not code.strip():
                calls.append(
                    ParsedCall(self.tool_name, raw=m.group(0), error=_MALFORMED, error_message="empty ```python block")
                )
                continue
            calls.append(ParsedCall(self.tool_name, arguments={"code": code}, raw=m.group(0)))
        return calls

    def format_observation(self, text: str) -> str:
        return "```output\n" + text.rstrip("\n") + "\n```"


# ----------------------------------------------------------------------------- shared helpers


#: The built-in formats by import path (a family's module is imported when one of its formats is used).
PARSERS: dict[str, str] = {
    "hermes": f"{__name__}:HermesParser",
    "code_block": f"{__name__}:CodeBlockParser",
    "llama3_json": "agent_env.parser_families:Llama3JsonParser",
    "mistral": "agent_env.parser_families:MistralParser",
    "qwen3_coder": "agent_env.parser_families:Qwen3CoderParser",
    "harmony": "agent_env.parser_harmony:HarmonyParser",
}


def _check_parser(obj: Any, name: str) -> None:
    if not (callable(obj) or hasattr(obj, "parse")):
        raise EnvError(f"tool-call format {name!r} resolved to {obj!r}: expected a parser class or instance")


#: Every tool-call format (``multi_turn.format``): the built-ins of :data:`PARSERS`, parsers
#: registered with ``FORMATS.register(cls, name)``, entry points of group ``otb_tir.parsers`` and
#: paths (``pkg.mod:Parser`` / ``file.py:Parser``), by the one plugin mechanism
#: (:class:`tools.plugins.Registry`). A parser is a class (built with no arguments) or an
#: instance with ``parse(text) -> list[ParsedCall]`` and ``format_observation(text) -> str``.
FORMATS = Registry(
    "tool-call format",
    "otb_tir.parsers",
    PARSERS,
    error=EnvError,
    check=_check_parser,
)


def get_parser(name: str) -> ToolCallParser:
    """The parser called ``name`` (``multi_turn.format``; see :data:`FORMATS`)."""
    target = FORMATS.resolve(name)
    try:
        parser = target() if isinstance(target, type) else target
    except Exception as exc:  # noqa: BLE001 - a user's parser class, named
        raise EnvError(f"tool-call format {name!r}: building {target!r}() failed: {type(exc).__name__}: {exc}") from exc
    missing = [m for m in ("parse", "format_observation") if not callable(getattr(parser, m, None))]
    if missing:
        raise EnvError(f"tool-call format {name!r}: {type(parser).__name__} has no {', '.join(missing)} method")
    return parser
