"""The settings of one episode: :class:`EpisodeConfig`, its range checks, and how it is built from a
config's ``rollout`` / ``multi_turn`` / ``reward`` sections (:meth:`EpisodeConfig.from_sections`).
The episode that runs with it is :class:`agent_env.episode.AgentEnv` (which re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from agent_env.errors import EnvError
from agent_env.parsers import get_parser
from agent_env.rewards import RewardConfig
from tools.assembly import plain

__all__ = ["EpisodeConfig"]


@dataclass(frozen=True)
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
    # extraction decides when a turn is an answer; None = agent_env.tasks.DEFAULT_TASK (arith: math)
    task: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """The one range check of the episode's settings (the training and eval configs' ``rollout``
        and ``multi_turn`` keys are checked here, through :meth:`from_sections`); errors name the
        config key, e.g. ``'rollout.top_p'``."""

        def bad(name: str, msg: str) -> EnvError:
            return EnvError(f"invalid episode config: '{_config_key(name)}' {msg}")

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
                raise bad(name, f"must be a positive integer, got {v!r}")
        if self.tool_response_truncate_side not in ("head", "tail", "middle"):
            raise bad(
                "tool_response_truncate_side", f"must be head, tail or middle, got {self.tool_response_truncate_side!r}"
            )
        if self.tool_timeout is not None and not self.tool_timeout > 0:
            raise bad("tool_timeout", f"must be positive or None, got {self.tool_timeout!r}")
        if not self.temperature >= 0:
            raise bad("temperature", f"must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.on_template_mismatch not in ("record", "error"):
            raise bad("on_template_mismatch", f"must be 'record' or 'error', got {self.on_template_mismatch!r}")

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
        return cls(**d)

    @classmethod
    def from_sections(cls, rollout: Any, multi_turn: Any, reward: Any = None, **overrides: Any) -> "EpisodeConfig":
        """The episode a config describes, from its sections under verl's names: ``rollout``
        (``response_length``, ``max_tokens_per_turn``, ``temperature``, ``top_p``, ``top_k``),
        ``multi_turn`` (``format``, ``max_assistant_turns``, ``max_tool_response_length``,
        ``tool_response_truncate_side``, ``max_parallel_calls``, and the tool set: ``tools``,
        ``tool_config``, ``tool_config_path``, ``tool_timeout``) and ``reward`` (RewardConfig's
        fields). Sections are mappings or attribute objects (OmegaConf, verl's config); a key a
        section lacks keeps EpisodeConfig's default; ``overrides`` (EpisodeConfig fields) win."""
        d = {**_section_dict(rollout, _ROLLOUT_KEYS), **_section_dict(multi_turn, _MULTI_TURN_KEYS)}
        if d.get("tool_config") is None:
            d.pop("tool_config", None)
        if reward is not None:
            d["reward"] = {k: plain(v) for k, v in _section_dict(reward).items()}
        d.update(overrides)
        return cls.from_dict(d)


_ROLLOUT_KEYS = ("response_length", "max_tokens_per_turn", "temperature", "top_p", "top_k")
_MULTI_TURN_KEYS = (
    *("format", "max_assistant_turns", "max_tool_response_length", "tool_response_truncate_side"),
    *("max_parallel_calls", "tools", "tool_config", "tool_config_path", "tool_timeout"),
)


def _config_key(name: str) -> str:
    """A field's key in the config's sections (``rollout.top_p``, ``multi_turn.format``)."""
    if name in _ROLLOUT_KEYS:
        return f"rollout.{name}"
    return f"multi_turn.{name}" if name in _MULTI_TURN_KEYS else name


def _section_dict(section: Any, keys: Sequence[str] | None = None) -> dict[str, Any]:
    """The ``keys`` a config section has (None: all): a mapping, an OmegaConf node or an attribute object."""
    if keys is None:
        return {str(k): v for k, v in section.items()} if hasattr(section, "items") else dict(vars(section))
    if isinstance(section, Mapping) or hasattr(section, "keys"):  # dicts, OmegaConf DictConfig
        return {k: section[k] for k in keys if k in section}
    return {k: getattr(section, k) for k in keys if hasattr(section, k)}
