"""One async protocol for every inference engine: token ids in → token ids, log-probs, finish reason out.

Engines never re-tokenize: the episode hands them the exact prompt ids and keeps the exact ids
they sample (token-in-token-out).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol, runtime_checkable

import torch

from agent_env.errors import install_hint


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


@dataclass
class EngineStats:
    """What a serving engine (vLLM, sglang) counted since it started. ``steps``: the engine's own
    decode steps where it reports them (vLLM's offline loop), ``None`` where it does not (sglang)."""

    requests: int = 0
    generated_tokens: int = 0
    weight_updates: int = 0
    max_concurrent: int = 0
    aborted: int = 0
    steps: int | None = None
    extra: dict[str, float] = field(default_factory=dict)


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


def checkpoint_shapes(model_path: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """Names and shapes of the tensors in the folder's safetensors files (headers only), or None."""
    from pathlib import Path

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_update_names(
    items: list[tuple[str, torch.Tensor]], shapes: Mapping[str, tuple[int, ...]] | None, tied: bool
) -> None:
    """Refuse an update whose names or shapes do not match the checkpoint, before the engine is touched.

    A failed in-place reload could leave the engine half-updated, so a bad update is rejected
    up front. ``lm_head.weight`` is accepted for tied embeddings (HF state dicts carry it; the
    engines skip it).
    """
    if shapes is None:
        return
    unknown, mismatched = [], []
    for name, t in items:
        if name not in shapes:
            if not (tied and name == "lm_head.weight"):
                unknown.append(name)
        elif tuple(t.shape) != shapes[name]:
            mismatched.append(f"{name}: got {tuple(t.shape)}, checkpoint has {shapes[name]}")
    if unknown or mismatched:
        parts = []
        if unknown:
            parts.append(f"unknown names {unknown[:8]}{' …' if len(unknown) > 8 else ''}")
        if mismatched:
            parts.append(f"wrong shapes {mismatched[:8]}")
        raise EngineError(
            "update_weights refused (" + "; ".join(parts) + "): names and shapes must match the "
            "HF checkpoint the engine was started from; the engine keeps its current weights"
        )
