"""One multi-turn tool episode, token-in-token-out.

The policy writes an assistant turn; the parser finds its tool calls; the tools run (concurrently,
inside the episode's own python session); their results go back as ``tool`` messages; the policy
writes again; … until it answers, or a budget ends the episode.

Token bookkeeping (what the trainer relies on):

- The ids the engine sampled are kept exactly as they are (``response_mask`` 1, with the engine's
  log-probs). The sampled turn ends with the stop token the model sampled (``<|im_end|>``);
  nothing is appended to it.
- Everything the environment inserts (the tool-response messages *and* the next assistant
  header) is the *delta* of the chat template: render the conversation with the new messages
  (``add_generation_prompt=True``) and take what follows the text of the tokens so far. So the
  newline the template writes after ``<|im_end|>`` is an inserted (mask 0) token, as it must be.
- The template must be prefix-preserving (rendering more messages never changes the rendering
  of the earlier ones): otherwise :class:`~agent_env.EnvError` names the template.
- The template's rendering of the conversation *as the model produced it* is compared with the
  decoded token stream at every turn and at the end. A template that rewrites history (strips
  reasoning, re-renders tool calls) gives a mismatch that is recorded in
  :attr:`Trajectory.template_mismatch` (and raised with ``on_template_mismatch="error"``), never
  silently trained on: the trajectory's tokens stay those the model saw.

Finish reasons: ``answer`` (a turn without tool calls that writes a final answer), ``void_turn``
(a turn with neither a tool call nor a final answer), ``max_turns`` (the last allowed turn still
called tools), ``length`` (the total response budget R ran out while sampling), ``turn_length``
(the per-turn cap ran out before the stop token), ``tool_overflow`` (the tool responses would not
fit in R), ``abort`` (the engine aborted).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

from agent_env import EnvError
from agent_env.engines.base import Engine, SamplingParams
from agent_env.math_task.reward import RewardConfig, RewardResult, extract_answer
from agent_env.parsers import ParsedCall, get_parser
from agent_env.tool_metrics import MALFORMED_KINDS
from tools.assembly import plain

logger = logging.getLogger(__name__)

__all__ = ["EpisodeConfig", "ToolCallRecord", "TurnRecord", "Trajectory", "AgentEnv", "FINISH_REASONS"]

FINISH_REASONS = ("answer", "void_turn", "max_turns", "length", "turn_length", "tool_overflow", "abort")


@dataclass
class EpisodeConfig:
    """Episode settings, under the names of verl's ``rollout`` / ``rollout.multi_turn`` sections
    (the trainer's config sections use the same names and defaults; :meth:`from_sections` is the
    one place that builds an EpisodeConfig from them).

    ``response_length`` is R, the total budget of response tokens (sampled + inserted) over all
    turns, and the width of ``responses`` in the collated batch. ``max_tokens_per_turn`` caps one
    assistant turn (further capped by what remains of R). ``max_tool_response_length`` caps each
    tool result, measured in tokens of the policy's tokenizer; ``tool_response_truncate_side``
    says which part is *kept*: ``head`` (the beginning), ``tail`` (the end) or ``middle`` (the
    beginning and the end, the middle is cut), with ``truncation_marker`` where text was cut.
    """

    format: str = "hermes"  # a tool-call parser name (agent_env.parsers)
    # The tool set, for AgentEnv(tools=None): tools.build_tool_set(tools, tool_config, tool_config_path).
    # tools=None: [python, calculator] unless tool_config_path (a verl-style tools YAML) is set.
    tools: list[str] | None = None
    # keyword config per tool name for tools.get_tool, e.g. {"python": {"stateful": True}}
    tool_config: dict[str, dict[str, Any]] = field(default_factory=dict)
    tool_config_path: str | None = None
    max_assistant_turns: int = 3
    response_length: int = 192
    max_tokens_per_turn: int = 96
    max_tool_response_length: int = 48
    tool_response_truncate_side: Literal["head", "tail", "middle"] = "middle"
    truncation_marker: str = "\n...(truncated)...\n"
    max_parallel_calls: int = 4
    tool_timeout: float | None = 5.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    system_prompt: str | None = None
    stop_token_ids: list[int] | None = None  # None: the tokenizer's eos token
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    on_template_mismatch: Literal["record", "error"] = "record"
    reward: RewardConfig = field(default_factory=RewardConfig)
    # the task (agent_env.tasks.TASKS name or path): its reward is the default one, its answer
    # extraction (if it has one) decides when a turn is an answer; None = the math task's
    task: str | None = None

    def validate(self) -> None:
        def bad(msg: str) -> EnvError:
            return EnvError(f"invalid episode config: {msg}")

        get_parser(self.format)
        for name in (
            "max_assistant_turns",
            "response_length",
            "max_tokens_per_turn",
            "max_tool_response_length",
            "max_parallel_calls",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(f"{name} must be a positive integer, got {v!r}")
        if self.tool_response_truncate_side not in ("head", "tail", "middle"):
            raise bad(
                f"tool_response_truncate_side must be head, tail or middle, got {self.tool_response_truncate_side!r}"
            )
        if self.tool_timeout is not None and not self.tool_timeout > 0:
            raise bad(f"tool_timeout must be positive or None, got {self.tool_timeout!r}")
        if not self.temperature >= 0:
            raise bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.on_template_mismatch not in ("record", "error"):
            raise bad(f"on_template_mismatch must be 'record' or 'error', got {self.on_template_mismatch!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EpisodeConfig":
        """Build from a plain mapping of EpisodeConfig's own fields; unknown keys are an error."""
        d = dict(d)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise EnvError(f"unknown episode config keys {unknown}; known keys: {sorted(known)}")
        if isinstance(d.get("reward"), Mapping):
            try:
                d["reward"] = RewardConfig(**plain(d["reward"]))
            except TypeError as e:
                raise EnvError(f"bad reward config: {e}") from None
        for key in ("tools", "stop_token_ids", "tool_config", "chat_template_kwargs"):
            if d.get(key) is not None:
                d[key] = plain(d[key])
        cfg = cls(**d)
        cfg.validate()
        return cfg

    @classmethod
    def from_sections(cls, rollout: Any, multi_turn: Any, reward: Any = None, **overrides: Any) -> "EpisodeConfig":
        """The episode a config describes, from its sections under verl's names: ``rollout``
        (``response_length``, ``max_tokens_per_turn``, ``temperature``, ``top_p``, ``top_k``),
        ``multi_turn`` (``format``, ``max_assistant_turns``, ``max_tool_response_length``,
        ``tool_response_truncate_side``, ``max_parallel_calls``, and the tool set: ``tools``,
        ``tool_config``, ``tool_config_path``, ``tool_timeout``) and ``reward`` (RewardConfig's
        fields). Sections are mappings or attribute objects (OmegaConf, verl's config); a key a
        section lacks keeps EpisodeConfig's default; ``overrides`` (EpisodeConfig fields) win."""
        d: dict[str, Any] = {}
        for section, keys in ((rollout, _ROLLOUT_KEYS), (multi_turn, _MULTI_TURN_KEYS)):
            d.update({key: _section_get(section, key) for key in keys if _section_has(section, key)})
        if d.get("tool_config") is None:
            d.pop("tool_config", None)
        if reward is not None:
            d["reward"] = {k: plain(v) for k, v in _section_items(reward)}
        d.update(overrides)
        return cls.from_dict(d)


_ROLLOUT_KEYS = ("response_length", "max_tokens_per_turn", "temperature", "top_p", "top_k")
_MULTI_TURN_KEYS = (
    "format",
    "max_assistant_turns",
    "max_tool_response_length",
    "tool_response_truncate_side",
    "max_parallel_calls",
    "tools",
    "tool_config",
    "tool_config_path",
    "tool_timeout",
)


def _section_has(section: Any, key: str) -> bool:
    if isinstance(section, Mapping) or hasattr(section, "keys"):  # dicts, OmegaConf DictConfig
        return key in section
    return hasattr(section, key)


def _section_get(section: Any, key: str) -> Any:
    return section[key] if isinstance(section, Mapping) or hasattr(section, "keys") else getattr(section, key)


def _section_items(section: Any) -> list[tuple[str, Any]]:
    if hasattr(section, "items"):
        return [(str(k), v) for k, v in section.items()]
    return list(vars(section).items())


@dataclass
class ToolCallRecord:
    """One tool call of a turn and how it went. ``text`` is what the model read (after truncation);
    ``error`` is an ``ErrorKind`` value (``malformed_call``, ``unknown_tool``, ``bad_arguments``,
    ``timeout``, ``runtime_error`` …) or ``None``."""

    name: str | None
    arguments: dict[str, Any]
    raw: str
    text: str = ""
    ok: bool = False
    error: str | None = None
    latency_ms: float = 0.0
    executed: bool = False
    truncated: bool = False
    result_tokens: int = 0  # tokens of the tool's text before truncation
    infra_retries: int = 0  # times the tool re-ran the call after an infrastructure failure (a killed worker)


@dataclass
class TurnRecord:
    """One assistant turn. ``[start, end)`` is the span of its sampled tokens in ``response_ids``,
    ``[obs_start, obs_end)`` the span of the tokens inserted after it (empty if none)."""

    index: int
    start: int
    end: int
    obs_start: int
    obs_end: int
    text: str
    engine_finish_reason: str
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    has_answer: bool = False
    void: bool = False


@dataclass
class Trajectory:
    """One episode: the data contract of docs/architecture.md plus what happened in it."""

    uid: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    rollout_logprobs: list[float]
    turns: list[TurnRecord]
    messages: list[dict[str, Any]]
    reward: float
    reward_details: dict[str, Any]
    finish_reason: str
    num_turns: int
    void_turns: int
    malformed_calls: int
    num_tool_calls: int
    tool_errors: int
    template_mismatch: str | None
    timings: dict[str, float]
    ground_truth: Any = None
    data_source: str | None = None  # the data row's data_source (chooses the reward: reward.per_data_source)
    extra_info: dict[str, Any] = field(default_factory=dict)  # the data row's extra_info (passed to the reward)
    sample_index: int = 0

    @property
    def response_length(self) -> int:
        return len(self.response_ids)


class _Activity:
    """Counts in-flight generate calls and tool executions over time (see rollout's stats)."""

    def __init__(self) -> None:
        self.gen = 0
        self.tool = 0
        self.last = time.perf_counter()
        self.reward = 0
        self.waiting_on_tools = 0.0  # no generate in flight while some tool runs
        self.generating = 0.0
        self.scoring = 0.0  # the reward function runs, no generate or tool in flight
        self.idle = 0.0  # none of the above: parsing, templating, tokenizing, scheduling

    def _tick(self) -> None:
        now = time.perf_counter()
        dt = now - self.last
        self.last = now
        if self.gen > 0:
            self.generating += dt
        elif self.tool > 0:
            self.waiting_on_tools += dt
        elif self.reward > 0:
            self.scoring += dt
        else:
            self.idle += dt

    def enter(self, kind: str) -> None:
        self._tick()
        setattr(self, kind, getattr(self, kind) + 1)

    def leave(self, kind: str) -> None:
        self._tick()
        setattr(self, kind, getattr(self, kind) - 1)

    def summary(self) -> dict[str, float]:
        self._tick()
        total = self.generating + self.waiting_on_tools + self.scoring + self.idle
        return {
            "generating_s": self.generating,
            "waiting_on_tools_s": self.waiting_on_tools,
            "scoring_s": self.scoring,
            "idle_s": self.idle,
            "gen_waited_on_tools_frac": self.waiting_on_tools / total if total > 0 else 0.0,
        }


RewardFn = Callable[[str, Any, "Trajectory"], "RewardResult | float"]


class AgentEnv:
    """The environment: a tokenizer with a chat template, tools, a parser and budgets.

    ``tools`` is a mapping name → :class:`tools.Tool` or a sequence of tools; ``None`` builds the
    tool set of ``config`` with :func:`tools.build_tool_set` (and :meth:`close` closes them).
    ``reward_fn(response_text, ground_truth, trajectory)`` returns a :class:`RewardResult` or a
    float; the default is the reward section's (:class:`agent_env.rewards.RewardScorer`: the math
    reward unless the section or the task names another).
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: Mapping[str, Any] | Sequence[Any] | None = None,
        config: EpisodeConfig | None = None,
        reward_fn: RewardFn | None = None,
    ) -> None:
        self.config = config or EpisodeConfig()
        self.config.validate()
        self.tokenizer = tokenizer
        self.parser = get_parser(self.config.format)
        self._owns_tools = tools is None
        if tools is None:
            from tools import ToolError, build_tool_set

            try:
                tools = build_tool_set(self.config.tools, self.config.tool_config, self.config.tool_config_path)
            except ToolError as e:
                raise EnvError(f"tools: {e}") from None
        if isinstance(tools, dict):
            self.tools = tools  # kept as given: a tools.ToolSet keeps the record of where each tool came from
        elif isinstance(tools, Mapping):
            self.tools = dict(tools)
        else:
            self.tools = {t.name: t for t in tools}
        if self.config.format == "code_block" and "python" not in self.tools:
            raise EnvError(
                "the code_block parser runs code with the 'python' tool, which is not among "
                f"the episode's tools {sorted(self.tools)}"
            )
        self.reward_fn = reward_fn
        from agent_env.rewards import RewardScorer
        from agent_env.tasks import get_task

        self.task = get_task(self.config.task) if self.config.task else None
        self._extract = self.task.extract_answer if self.task is not None else None
        # the reward section's functions, resolved now: one that does not import stops the run here
        self.scorer = (
            RewardScorer(self.config.reward, default=self.task.reward if self.task else None, extract=self._extract)
            if reward_fn is None
            else None
        )
        self._tool_schemas = [t.schema() for t in self.tools.values()] or None
        bind = getattr(self.parser, "bind_tools", None)  # parsers that type arguments by the tools' schemas
        if callable(bind):
            bind(self._tool_schemas or [])
        self._template_name = f"the chat template of tokenizer {getattr(tokenizer, 'name_or_path', '?')!r}"
        if not getattr(tokenizer, "chat_template", None):
            raise EnvError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
                "set tokenizer.chat_template to a Jinja template with tool support"
            )
        if self.config.stop_token_ids is not None:
            self.stop_ids = list(self.config.stop_token_ids)
        else:
            eos = tokenizer.eos_token_id
            if eos is None:
                raise EnvError(
                    "the tokenizer has no eos token; set EpisodeConfig.stop_token_ids to the "
                    "token that ends an assistant turn (e.g. <|im_end|>)"
                )
            self.stop_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        self._closing = self._assistant_closing()
        self._special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])

    # ------------------------------------------------------------------ template helpers

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=self._tool_schemas,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **self.config.chat_template_kwargs,
            )
        except Exception as e:  # jinja TemplateError and friends
            raise EnvError(f"{self._template_name} failed to render the conversation: {e}") from e
        if not isinstance(text, str):
            raise EnvError(f"{self._template_name} did not render to a string (got {type(text).__name__})")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _assistant_closing(self) -> str:
        """What the template writes after an assistant message's content (``<|im_end|>\\n``)."""
        sentinel = "OTBTIRSENTINEL"
        text = self.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": sentinel}], False)
        i = text.rfind(sentinel)
        if i < 0:
            raise EnvError(f"{self._template_name} does not render assistant message content")
        return text[i + len(sentinel) :]

    def initial_messages(self, prompt: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            messages = [dict(m) for m in prompt]
        else:
            raise EnvError(f"a prompt must be a string or a non-empty list of chat messages, got {prompt!r:.200}")
        if self.config.system_prompt and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        return messages

    def truncate_tool_text(self, text: str) -> tuple[str, bool, int]:
        """``(text, truncated, n_tokens)``: cut ``text`` to ``max_tool_response_length`` tokens
        (marker included), keeping the configured side."""
        cfg = self.config
        ids = self.encode(text)
        n = len(ids)
        if n <= cfg.max_tool_response_length:
            return text, False, n
        marker = cfg.truncation_marker
        keep = max(cfg.max_tool_response_length - len(self.encode(marker)), 0)

        def build(keep: int) -> str:
            if cfg.tool_response_truncate_side == "head":
                return self.decode(ids[:keep]) + marker
            if cfg.tool_response_truncate_side == "tail":
                return marker + self.decode(ids[n - keep :] if keep else [])
            head = (keep + 1) // 2
            tail = keep - head
            return self.decode(ids[:head]) + marker + self.decode(ids[n - tail :] if tail else [])

        out = build(keep)
        # Re-tokenizing at the cut (or a split multi-byte character) can cost a token or two:
        # shrink until the text really fits.
        while keep > 0 and len(self.encode(out)) > cfg.max_tool_response_length:
            keep -= 1
            out = build(keep)
        return out, True, n

    # ------------------------------------------------------------------ tools

    async def _invoke(self, tool: Any, args: dict[str, Any], session_id: str) -> Any:
        invoke = getattr(tool, "invoke", None)
        if invoke is not None:
            return await invoke(args, session_id=session_id, timeout=self.config.tool_timeout)
        # Fallback for tools without Tool.invoke: same contract (never raises, timeout).
        from tools.base import ErrorKind, ToolResult

        t0 = time.perf_counter()
        try:
            res = await asyncio.wait_for(tool.call(args, session_id=session_id), self.config.tool_timeout)
        except asyncio.TimeoutError:
            res = ToolResult(
                f"Error: tool '{tool.name}' timed out after {self.config.tool_timeout:g} s.",
                ok=False,
                error=ErrorKind.TIMEOUT,
            )
        except Exception as e:  # noqa: BLE001 - a tool failure is an observation, never an exception
            res = ToolResult(
                f"Error: tool '{tool.name}' failed: {type(e).__name__}: {e}", ok=False, error=ErrorKind.RUNTIME
            )
        res.metrics.setdefault("latency_ms", (time.perf_counter() - t0) * 1000)
        return res

    async def _run_call(
        self, pc: ParsedCall, session_id: str, sem: asyncio.Semaphore, activity: _Activity | None
    ) -> ToolCallRecord:
        rec = ToolCallRecord(name=pc.name, arguments=pc.arguments, raw=pc.raw)
        if pc.error is not None:
            rec.error, text = pc.error, f"Error: {pc.error_message}"
        elif pc.name not in self.tools:
            rec.error = "unknown_tool"
            text = f"Error: unknown tool '{pc.name}'. Available tools: {', '.join(sorted(self.tools))}."
        else:
            async with sem:
                if activity:
                    activity.enter("tool")
                try:
                    res = await self._invoke(self.tools[pc.name], pc.arguments, session_id)
                finally:
                    if activity:
                        activity.leave("tool")
            rec.executed = True
            rec.ok, rec.error = bool(res.ok), res.error
            rec.latency_ms = float(res.metrics.get("latency_ms", 0.0))
            rec.infra_retries = int(res.metrics.get("infra_retries", 0))
            text = res.text if isinstance(res.text, str) else str(res.text)
        rec.text, rec.truncated, rec.result_tokens = self.truncate_tool_text(text)
        return rec

    # ------------------------------------------------------------------ the episode

    async def run(
        self,
        engine: Engine,
        prompt: str | Sequence[Mapping[str, Any]],
        *,
        uid: str | None = None,
        ground_truth: Any = None,
        seed: int | None = None,
        sample_index: int = 0,
        activity: _Activity | None = None,
        data_source: str | None = None,
        extra_info: Mapping[str, Any] | None = None,
    ) -> Trajectory:
        """Run one episode with ``engine`` and return its :class:`Trajectory`."""
        cfg = self.config
        t_start = time.perf_counter()
        timings = {"generate_s": 0.0, "tools_s": 0.0, "reward_s": 0.0}
        uid = uid if uid is not None else uuid.uuid4().hex
        session_id = f"{uid}:{sample_index}:{uuid.uuid4().hex[:8]}"
        messages = self.initial_messages(prompt)
        prompt_text = self.render(messages, add_generation_prompt=True)
        prompt_ids = self.encode(prompt_text)
        if self.decode(prompt_ids) != prompt_text:
            raise EnvError(
                f"the tokenizer does not round-trip the prompt rendered by {self._template_name}: "
                "decode(encode(text)) != text, so token-in-token-out cannot be guaranteed"
            )
        resp: list[int] = []
        mask: list[int] = []
        logps: list[float] = []
        turns: list[TurnRecord] = []
        mismatch: str | None = None
        finish = "max_turns"
        used_tools: set[str] = set()
        sem = asyncio.Semaphore(cfg.max_parallel_calls)
        R = cfg.response_length
        try:
            for t in range(cfg.max_assistant_turns):
                remaining = R - len(resp)
                if remaining <= 0:
                    finish = "length"
                    break
                params = SamplingParams(
                    max_tokens=min(cfg.max_tokens_per_turn, remaining),
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    top_k=cfg.top_k,
                    stop_token_ids=list(self.stop_ids),
                    seed=None if seed is None else seed * 1000 + t,
                )
                g0 = time.perf_counter()
                if activity:
                    activity.enter("gen")
                try:
                    out = await engine.generate(prompt_ids + resp, params)
                finally:
                    if activity:
                        activity.leave("gen")
                timings["generate_s"] += time.perf_counter() - g0
                ids = list(out.token_ids)
                if len(out.logprobs) != len(ids) or len(ids) > params.max_tokens:
                    raise EnvError(
                        f"engine {type(engine).__name__} broke the Engine contract: "
                        f"{len(ids)} tokens, {len(out.logprobs)} log-probs, max_tokens={params.max_tokens}"
                    )
                start = len(resp)
                resp += ids
                mask += [1] * len(ids)
                logps += [float(x) for x in out.logprobs]
                # The turn ends with the stop token the model sampled. An engine that stopped on
                # another token (e.g. an extra eos id of the model) also ends the turn; the
                # template's rendering then differs and the mismatch is detected below.
                ended = bool(ids) and (ids[-1] in self.stop_ids or out.finish_reason == "stop")
                text = self.decode(ids)
                strip_last = ended and (ids[-1] in self.stop_ids or ids[-1] in self._special_ids)
                content = self.decode(ids[:-1]) if strip_last else text
                calls = self.parser.parse(content)
                answer = self.extract_answer(content)
                turn = TurnRecord(
                    index=t,
                    start=start,
                    end=len(resp),
                    obs_start=len(resp),
                    obs_end=len(resp),
                    text=text,
                    engine_finish_reason=out.finish_reason,
                    has_answer=answer is not None,
                )
                turn.void = not calls and answer is None
                turns.append(turn)
                messages.append({"role": "assistant", "content": content})
                if out.finish_reason == "abort":
                    finish = "abort"
                    break
                if not ended:
                    finish = "length" if len(resp) >= R else "turn_length"
                    break
                if not calls:
                    finish = "answer" if answer is not None else "void_turn"
                    break
                if t == cfg.max_assistant_turns - 1:
                    turn.tool_calls = [
                        ToolCallRecord(name=c.name, arguments=c.arguments, raw=c.raw, error=c.error) for c in calls
                    ]
                    finish = "max_turns"
                    break
                # ---- run the calls (concurrently, capped), then insert their results
                k0 = time.perf_counter()
                # noted before the calls run, so sessions are released even if the episode is cancelled
                used_tools.update(c.name for c in calls if c.ok and c.name in self.tools)
                records = await asyncio.gather(*(self._run_call(c, session_id, sem, activity) for c in calls))
                timings["tools_s"] += time.perf_counter() - k0
                turn.tool_calls = list(records)
                # a parser may build the messages itself (tool roles, ids, names); the hook is optional
                tool_messages = getattr(self.parser, "tool_messages", None)
                if tool_messages is not None:
                    obs = list(tool_messages(records, calls))
                else:
                    obs = [{"role": "tool", "content": self.parser.format_observation(r.text)} for r in records]
                delta_text, mm = self._delta(prompt_ids + resp, messages, obs)
                if mm and mismatch is None:
                    mismatch = f"turn {t}: {mm}"
                    self._on_mismatch(mismatch)
                delta_ids = self.encode(delta_text)
                if self.decode(delta_ids) != delta_text:
                    raise EnvError(f"the tokenizer does not round-trip text rendered by {self._template_name}")
                if len(resp) + len(delta_ids) >= R:
                    finish = "tool_overflow"
                    break
                messages.extend(obs)
                resp += delta_ids
                mask += [0] * len(delta_ids)
                logps += [0.0] * len(delta_ids)
                turn.obs_end = len(resp)
            # ---- final check: the template's rendering of the conversation vs the token stream
            if mismatch is None:
                final_text = self.render(messages, add_generation_prompt=False)
                stream = self.decode(prompt_ids + resp)
                if not final_text.startswith(stream):
                    mismatch = "final: " + _describe_mismatch(stream, final_text)
                    self._on_mismatch(mismatch)
        finally:
            for name in used_tools:
                try:
                    await self.tools[name].release(session_id)
                except Exception:  # noqa: BLE001
                    logger.warning("releasing session %s of tool %r failed", session_id, name, exc_info=True)

        all_calls = [c for tr in turns for c in tr.tool_calls]
        traj = Trajectory(
            uid=uid,
            prompt_ids=prompt_ids,
            response_ids=resp,
            response_mask=mask,
            rollout_logprobs=logps,
            turns=turns,
            messages=messages,
            reward=0.0,
            reward_details={},
            finish_reason=finish,
            num_turns=len(turns),
            void_turns=sum(tr.void for tr in turns),
            malformed_calls=sum(c.error in MALFORMED_KINDS for c in all_calls),
            num_tool_calls=len(all_calls),
            tool_errors=sum(c.executed and not c.ok for c in all_calls),
            template_mismatch=mismatch,
            timings=timings,
            ground_truth=ground_truth,
            data_source=None if data_source is None else str(data_source),
            extra_info=dict(extra_info or {}),
            sample_index=sample_index,
        )
        r0 = time.perf_counter()
        if activity:
            activity.enter("reward")
        try:
            await self._score(traj)
        finally:
            if activity:
                activity.leave("reward")
        timings["reward_s"] = time.perf_counter() - r0
        timings["wall_s"] = time.perf_counter() - t_start
        return traj

    def _delta(
        self, stream_ids: list[int], messages: list[dict[str, Any]], obs: list[dict[str, Any]]
    ) -> tuple[str, str | None]:
        """The inserted text for ``obs`` (+ the next assistant header), and a mismatch note or None."""
        text_a = self.render(messages, add_generation_prompt=False)
        text_b = self.render(messages + obs, add_generation_prompt=True)
        if not text_b.startswith(text_a):
            raise EnvError(
                f"{self._template_name} is not prefix-preserving: adding tool messages changed the "
                f"rendering of the earlier conversation ({_describe_mismatch(text_a, text_b)}); "
                "token-in-token-out needs a template that only appends"
            )
        stream = self.decode(stream_ids)
        if text_a.startswith(stream):
            return text_b[len(stream) :], None
        # The template renders the assistant turn differently from what was sampled: insert the
        # template's closing of the turn (minus the stop token the model sampled) + the new messages.
        closing = self._closing
        eos_text = self.decode(stream_ids[-1:])
        rest = closing[len(eos_text) :] if closing.startswith(eos_text) else closing
        return rest + text_b[len(text_a) :], _describe_mismatch(stream, text_a)

    def _on_mismatch(self, note: str) -> None:
        msg = (
            f"{self._template_name} renders the conversation differently from the tokens the model "
            f"produced ({note}); the trajectory keeps the model's tokens and is flagged template_mismatch"
        )
        if self.config.on_template_mismatch == "error":
            raise EnvError(msg)
        logger.warning(msg)

    def extract_answer(self, text: str) -> str | None:
        """The final answer in ``text``: the task's extraction, else the math one (``\\boxed``, "answer:")."""
        if self._extract is not None:
            try:
                found = self._extract(text)
            except Exception as exc:  # noqa: BLE001 - a user's extractor must not end the run
                logger.warning("the task's extract_answer raised %s: %s", type(exc).__name__, exc)
                return None
            return found if isinstance(found, str) and found else None
        return extract_answer(text)[0]

    async def _score(self, traj: Trajectory) -> None:
        # Score only what the model wrote (tool outputs are not its answer), without stop tokens.
        parts = []
        for tr in traj.turns:
            ids = traj.response_ids[tr.start : tr.end]
            if ids and (ids[-1] in self.stop_ids or ids[-1] in self._special_ids):
                ids = ids[:-1]
            parts.append(self.decode(ids))
        text = "\n".join(parts)
        if self.reward_fn is not None:
            res = self.reward_fn(text, traj.ground_truth, traj)
        else:
            assert self.scorer is not None
            res = await self.scorer.score(text, traj)
        if isinstance(res, RewardResult):
            traj.reward, traj.reward_details = float(res.reward), dict(res.details)
        else:
            traj.reward, traj.reward_details = float(res), {}

    async def close(self) -> None:
        """Close the tools this environment created."""
        if self._owns_tools:  # then self.tools is the tools.ToolSet build_tool_set made
            await self.tools.close()


def _describe_mismatch(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return f"first difference at character {n}: {a[n : n + 40]!r} vs {b[n : n + 40]!r}"
