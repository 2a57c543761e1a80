"""One async protocol for every inference engine: token ids in → token ids, log-probs, finish reason out.

Engines never re-tokenize: the episode hands them the exact prompt ids and keeps the exact ids
they sample (token-in-token-out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol, runtime_checkable

import torch


@dataclass
class SamplingParams:
    """Sampling settings for one generate call (names as in vLLM)."""

    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    stop: list[str] = field(default_factory=list)  # stop strings; included in the output
    stop_token_ids: list[int] = field(default_factory=list)  # e.g. <|im_end|>; included in the output
    seed: int | None = None


@dataclass
class GenerationOutput:
    """What one generate call returns.

    ``token_ids`` are exactly the sampled ids (a matched stop string / stop token is included,
    nothing is appended); ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under
    softmax(logits / temperature) over the full vocabulary (top-p/top-k truncation not
    renormalized in), i.e. what the trainer recomputes with the same temperature;
    ``finish_reason`` is ``"stop"``
    (stop token or stop string), ``"length"`` (max_tokens reached) or ``"abort"``.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@runtime_checkable
class Engine(Protocol):
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput: ...

    async def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Load new policy weights (on-policy training). Must leave no stale cache behind."""
        ...

    async def close(self) -> None: ...


class EngineError(Exception):
    """Engine misconfiguration (missing extra, bad model path)."""


def missing_extra(package: str, extra: str) -> EngineError:
    """The one clear error for an optional dependency that is not installed."""
    from agent_env import install_hint

    return EngineError(
        f"this engine needs the optional package '{package}', which is not installed: {install_hint(extra)}"
    )


def named_tensor_list(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """``update_weights``' argument (a mapping or ``(name, tensor)`` pairs) as a checked list of
    detached ``(name, tensor)`` pairs; anything else, or nothing at all, is an :class:`EngineError`."""
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    for item in items:
        if not (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise EngineError(f"update_weights expects (name: str, tensor: torch.Tensor) pairs, got {item!r:.120}")
    if not items:
        raise EngineError("update_weights got no tensors")
    return [(name, t.detach()) for name, t in items]
