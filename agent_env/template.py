"""The chat template, token-in-token-out: what the environment inserts between sampled turns.

Token bookkeeping (what the trainer relies on):

- The ids the engine sampled are kept exactly as they are (``response_mask`` 1, with the engine's
  log-probs). The sampled turn ends with the stop token the model sampled (``<|im_end|>``);
  nothing is appended to it.
- Everything the environment inserts (the tool-response messages *and* the next assistant
  header) is the *delta* of the chat template (:meth:`ChatTemplate.delta`): render the
  conversation with the new messages (``add_generation_prompt=True``) and take what follows the
  text of the tokens so far. So the newline the template writes after ``<|im_end|>`` is an
  inserted (mask 0) token, as it must be.
- The template must be prefix-preserving (rendering more messages never changes the rendering
  of the earlier ones): otherwise :class:`~agent_env.EnvError` names the template.
- The template's rendering of the conversation *as the model produced it* is compared with the
  decoded token stream at every turn and at the end (:meth:`ChatTemplate.final_mismatch`). A
  template that rewrites history (strips reasoning, re-renders tool calls) gives a mismatch note
  that the episode records in ``Trajectory.template_mismatch`` (or raises), never silently trains
  on: the trajectory's tokens stay those the model saw.
- Every text the environment encodes must round-trip (``decode(encode(text)) == text``,
  :meth:`ChatTemplate.encode_exact`), else token-in-token-out cannot be guaranteed.
"""

from __future__ import annotations

import collections
import json
from typing import Any, Literal, Mapping, Sequence

from agent_env.errors import EnvError

__all__ = ["ChatTemplate", "describe_mismatch"]

_PROMPTS_KEPT = 256  # conversations whose prompt tokens ChatTemplate.prompt_ids remembers


class ChatTemplate:
    """A tokenizer's chat template with the tools' schemas: render, encode, decode, and the delta.

    ``stop_token_ids`` are the tokens that end an assistant turn (None: the tokenizer's eos).
    """

    def __init__(
        self,
        tokenizer: Any,
        tool_schemas: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tool_schemas = tool_schemas or None
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.name = f"the chat template of tokenizer {getattr(tokenizer, 'name_or_path', '?')!r}"
        if not getattr(tokenizer, "chat_template", None):
            raise EnvError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
                "set tokenizer.chat_template to a Jinja template with tool support"
            )
        if stop_token_ids is not None:
            self.stop_ids = list(stop_token_ids)
        else:
            eos = tokenizer.eos_token_id
            if eos is None:
                raise EnvError(
                    "the tokenizer has no eos token; set EpisodeConfig.stop_token_ids to the "
                    "token that ends an assistant turn (e.g. <|im_end|>)"
                )
            self.stop_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        self.closing = self._assistant_closing()
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._prompts: collections.OrderedDict[str, list[int]] = collections.OrderedDict()

    # ------------------------------------------------------------------ text <-> tokens

    @staticmethod
    def initial_messages(
        prompt: str | Sequence[Mapping[str, Any]], system_prompt: str | None = None
    ) -> list[dict[str, Any]]:
        """The conversation a prompt starts (a user message, or the messages given), with
        ``system_prompt`` first unless the prompt has a system message."""
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            messages = [dict(m) for m in prompt]
        else:
            raise EnvError(f"a prompt must be a string or a non-empty list of chat messages, got {prompt!r:.200}")
        if system_prompt and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        return messages

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=self.tool_schemas,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **self.chat_template_kwargs,
            )
        except Exception as e:  # jinja TemplateError and friends
            raise EnvError(f"{self.name} failed to render the conversation: {e}") from e
        if not isinstance(text, str):
            raise EnvError(f"{self.name} did not render to a string (got {type(text).__name__})")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode_exact(self, text: str, what: str = "text") -> list[int]:
        """``encode(text)``, checked to decode back to ``text``; ``what`` names the text in the error."""
        ids = self.encode(text)
        if self.decode(ids) != text:
            if what == "prompt":
                raise EnvError(
                    f"the tokenizer does not round-trip the prompt rendered by {self.name}: "
                    "decode(encode(text)) != text, so token-in-token-out cannot be guaranteed"
                )
            raise EnvError(f"the tokenizer does not round-trip {what} rendered by {self.name}")
        return ids

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The tokens of the conversation so far followed by the assistant header (round-trip checked).
        Remembered for the last few conversations: a group's ``n`` samples start from the same prompt
        (the render and encode ran once per sample before, ~0.4 ms each on the built-in template)."""
        try:
            # key order kept: the template's tojson renders dicts in their order, so two conversations
            # differing only in key order are two prompts
            key = json.dumps(messages, ensure_ascii=False)
        except (TypeError, ValueError):  # not plain JSON data: rendered each time
            return self.encode_exact(self.render(messages, add_generation_prompt=True), "prompt")
        ids = self._prompts.get(key)
        if ids is None:
            ids = self.encode_exact(self.render(messages, add_generation_prompt=True), "prompt")
            self._prompts[key] = ids
            if len(self._prompts) > _PROMPTS_KEPT:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(key)
        return list(ids)

    def is_end_token(self, token_id: int) -> bool:
        """A stop token or a special token: not part of what the model *wrote* in a turn."""
        return token_id in self.stop_ids or token_id in self.special_ids

    def content_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` without a final stop / special token."""
        ids = list(ids)
        return ids[:-1] if ids and self.is_end_token(ids[-1]) else ids

    def truncate(
        self, text: str, max_tokens: int, side: Literal["head", "tail", "middle"], marker: str
    ) -> tuple[str, bool, int]:
        """``(text, truncated, n_tokens)``: cut ``text`` to ``max_tokens`` tokens (``marker``
        included), keeping the ``head``, the ``tail`` or both ends (``middle``)."""
        ids = self.encode(text)
        n = len(ids)
        if n <= max_tokens:
            return text, False, n
        keep = max(max_tokens - len(self.encode(marker)), 0)

        def build(keep: int) -> str:
            if side == "head":
                return self.decode(ids[:keep]) + marker
            if side == "tail":
                return marker + self.decode(ids[n - keep :] if keep else [])
            head = (keep + 1) // 2
            tail = keep - head
            return self.decode(ids[:head]) + marker + self.decode(ids[n - tail :] if tail else [])

        out = build(keep)
        # Re-tokenizing at the cut (or a split multi-byte character) can cost a token or two:
        # shrink until the text really fits.
        while keep > 0 and len(self.encode(out)) > max_tokens:
            keep -= 1
            out = build(keep)
        return out, True, n

    # ------------------------------------------------------------------ token-in-token-out

    def delta(
        self, stream_ids: list[int], messages: list[dict[str, Any]], obs: list[dict[str, Any]]
    ) -> tuple[str, str | None]:
        """The text to insert after ``stream_ids`` (the prompt and response tokens so far, whose
        conversation is ``messages``) for the new messages ``obs`` and the next assistant header,
        and a mismatch note (the template renders the conversation otherwise than the tokens) or None."""
        text_a = self.render(messages, add_generation_prompt=False)
        text_b = self.render(messages + obs, add_generation_prompt=True)
        if not text_b.startswith(text_a):
            raise EnvError(
                f"{self.name} is not prefix-preserving: adding tool messages changed the "
                f"rendering of the earlier conversation ({describe_mismatch(text_a, text_b)}); "
                "token-in-token-out needs a template that only appends"
            )
        stream = self.decode(stream_ids)
        if text_a.startswith(stream):
            return text_b[len(stream) :], None
        # The template renders the assistant turn differently from what was sampled: insert the
        # template's closing of the turn (minus the stop token the model sampled) + the new messages.
        eos_text = self.decode(stream_ids[-1:])
        rest = self.closing[len(eos_text) :] if self.closing.startswith(eos_text) else self.closing
        return rest + text_b[len(text_a) :], describe_mismatch(stream, text_a)

    def final_mismatch(self, stream_ids: list[int], messages: list[dict[str, Any]]) -> str | None:
        """A note when the rendering of the whole conversation does not continue the token stream."""
        final_text = self.render(messages, add_generation_prompt=False)
        stream = self.decode(stream_ids)
        return None if final_text.startswith(stream) else describe_mismatch(stream, final_text)

    def _assistant_closing(self) -> str:
        """What the template writes after an assistant message's content (``<|im_end|>\\n``)."""
        sentinel = "OTBTIRSENTINEL"
        text = self.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": sentinel}], False)
        i = text.rfind(sentinel)
        if i < 0:
            raise EnvError(f"{self.name} does not render assistant message content")
        return text[i + len(sentinel) :]


def describe_mismatch(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return f"first difference at character {n}: {a[n : n + 40]!r} vs {b[n : n + 40]!r}"
