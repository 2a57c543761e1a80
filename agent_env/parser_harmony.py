"""gpt-oss's harmony tool-call format (``multi_turn.format=harmony``; see :mod:`agent_env.parsers`
for the contract): the turn's text is split into harmony messages here, and calls are the messages to
``functions.NAME``. The messages are given as openai-harmony ``Message`` objects, so the format needs
``openai-harmony``, an optional dependency (the ``harmony`` extra), imported only when a parser is made."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from agent_env.errors import EnvError, install_hint
from agent_env.parsers import ParsedCall, _malformed

__all__ = ["HarmonyParser"]


HARMONY_INSTALL = install_hint("harmony")


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
