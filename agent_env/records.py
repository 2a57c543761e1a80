"""The records of an episode: a :class:`Trajectory` (the data contract of docs/architecture.md),
its :class:`TurnRecord` s and their :class:`ToolCallRecord` s, the :data:`FINISH_REASONS`, and the
:class:`Transcript` an episode writes while it runs (:meth:`Transcript.trajectory` closes it)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from agent_env.errors import EnvError
from agent_env.tool_metrics import MALFORMED_KINDS

__all__ = ["FINISH_REASONS", "Prompt", "ToolCallRecord", "TurnRecord", "Trajectory", "Transcript", "last_policy_token"]

FINISH_REASONS = ("answer", "void_turn", "max_turns", "length", "turn_length", "tool_overflow", "abort")


@dataclass(frozen=True)
class Prompt:
    """One problem as an episode receives it: the prompt (a string or chat messages), what the reward
    compares against, and the row's identity. Built once, by :meth:`from_row`, wherever a row enters
    (the trainer, the evaluation, verl's agent loop, :func:`~agent_env.rollout`)."""

    prompt: Any  # str | list of chat messages
    ground_truth: Any = None
    uid: str | None = None  # shared by the samples of one prompt (their group); None: a fresh one per prompt
    data_source: str | None = None
    extra_info: Any = None

    @classmethod
    def from_row(cls, row: Any, *, uid: str | None = None, prompt_key: str = "prompt", index: int = 0) -> "Prompt":
        """A :class:`Prompt` from a dataset row (verl's layout: ``prompt``, ``reward_model.ground_truth``,
        ``data_source``, ``extra_info``), a mapping ``{"prompt", "ground_truth" | "answer", "uid"}``, a
        string, a list of chat messages, or a :class:`Prompt`. ``uid`` replaces the row's;
        ``prompt_key``: the field holding the prompt (verl's agent loop reads ``raw_prompt``);
        ``index``: the row's position, for the error."""
        if isinstance(row, Prompt):
            return row if uid is None else replace(row, uid=uid)
        if isinstance(row, str) or (isinstance(row, Sequence) and not isinstance(row, Mapping)):
            return cls(prompt=row, uid=uid)
        if not isinstance(row, Mapping):
            raise EnvError(
                f"prompt {index} must be a string, a list of chat messages or a mapping, got {type(row).__name__}"
            )
        if prompt_key not in row:
            raise EnvError(
                f"prompt {index} is a mapping without a {prompt_key!r} key (keys: {sorted(row)}); expected "
                f"{{{prompt_key!r}: str | messages, 'ground_truth' or 'reward_model': {{'ground_truth': ...}}, "
                "'uid': optional}"
            )
        reward_model = row.get("reward_model")
        if isinstance(reward_model, Mapping) and "ground_truth" in reward_model:
            gt = reward_model["ground_truth"]
        else:
            gt = row.get("ground_truth", row.get("answer"))
        own = row.get("uid")
        extra = row.get("extra_info")
        return cls(
            prompt=row[prompt_key],
            ground_truth=gt,
            uid=uid if uid is not None else (None if own is None else str(own)),
            data_source=row.get("data_source"),
            extra_info=dict(extra) if isinstance(extra, Mapping) else extra,
        )


def last_policy_token(response_mask: Any) -> tuple[Any, Any]:
    """``(last, has)``: per row of a ``[B, R]`` response mask, the column of its last policy
    (mask 1) token, and whether it has one (``last`` is R − 1 where it has none). Where the reward
    of a row sits: the one definition of that position (:func:`~agent_env.rollout.collate`,
    ``otb_tir.advantage.place_reward_on_last_policy_token``)."""
    import torch

    mask = torch.as_tensor(response_mask).bool()
    width = mask.shape[-1]
    last = width - 1 - torch.flip(mask, dims=[-1]).long().argmax(dim=-1)
    return last, mask.any(dim=-1)


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


@dataclass
class Transcript:
    """One episode while it runs: the conversation, the token stream (ids, mask, log-probs), the
    turns so far, the first template mismatch, the tools whose session ``session_id`` it used."""

    uid: str
    session_id: str
    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    resp: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    mismatch: str | None = None
    used_tools: set[str] = field(default_factory=set)
    timings: dict[str, float] = field(default_factory=lambda: {"generate_s": 0.0, "tools_s": 0.0, "reward_s": 0.0})

    @property
    def stream_ids(self) -> list[int]:
        """The prompt and the response so far: what the model sees next."""
        return self.prompt_ids + self.resp

    def extend(self, ids: list[int], logps: Sequence[float] | None = None) -> None:
        """Append ``ids``: sampled (mask 1) with the engine's ``logps``, or inserted (mask 0, log-prob 0.0)."""
        self.resp += ids
        self.mask += [0 if logps is None else 1] * len(ids)
        self.logps += [0.0] * len(ids) if logps is None else [float(x) for x in logps]

    def trajectory(
        self,
        finish_reason: str,
        ground_truth: Any = None,
        data_source: Any = None,
        extra_info: Mapping[str, Any] | None = None,
        sample_index: int = 0,
    ) -> Trajectory:
        """The finished episode (its reward not yet set)."""
        calls = [c for tr in self.turns for c in tr.tool_calls]
        return Trajectory(
            uid=self.uid,
            prompt_ids=self.prompt_ids,
            response_ids=self.resp,
            response_mask=self.mask,
            rollout_logprobs=self.logps,
            turns=self.turns,
            messages=self.messages,
            reward=0.0,
            reward_details={},
            finish_reason=finish_reason,
            num_turns=len(self.turns),
            void_turns=sum(tr.void for tr in self.turns),
            malformed_calls=sum(c.error in MALFORMED_KINDS for c in calls),
            num_tool_calls=len(calls),
            tool_errors=sum(c.executed and not c.ok for c in calls),
            template_mismatch=self.mismatch,
            timings=self.timings,
            ground_truth=ground_truth,
            data_source=None if data_source is None else str(data_source),
            extra_info=dict(extra_info or {}),
            sample_index=sample_index,
        )
