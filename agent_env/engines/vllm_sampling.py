"""VLLMEngine's requests in vLLM's terms: the Engine's ``SamplingParams`` in, a ``GenerationOutput`` out.

:func:`to_vllm_sampling_params` turns one ``generate`` call into the keyword arguments of
``vllm.SamplingParams`` that implement the Engine contract (one sample, the sampled token's log-prob
only, stop strings kept in the output, ``max_tokens`` capped by what the context window leaves, and
``top_p < 1`` / ``top_k > 0`` refused unless truncated log-probs were accepted), raising
``EngineError`` for what cannot be served; :func:`parse_vllm_completion` turns vLLM's
``CompletionOutput`` back into a :class:`~agent_env.engines.base.GenerationOutput`. Both are pure
(no vllm import; the tests call them without vLLM installed); :mod:`agent_env.engines.vllm`'s driver
thread calls them for every request.
"""

from __future__ import annotations

import logging
from typing import Any

from agent_env.engines.base import EngineError, GenerationOutput, SamplingParams

logger = logging.getLogger(__name__)

_FINISH_MAP = {"stop": "stop", "length": "length", "abort": "abort"}


def to_vllm_sampling_params(
    params: SamplingParams, prompt_len: int, max_model_len: int | None, allow_truncated_logprobs: bool = False
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` implementing the Engine contract.

    ``max_tokens`` is capped by what the context window leaves after the prompt (the request
    then ends with ``"length"``), and a prompt that leaves no room is a clear error.
    """
    if prompt_len < 1:
        raise EngineError("prompt_ids is empty: an engine needs at least one prompt token")
    if params.max_tokens < 1:
        raise EngineError(f"max_tokens must be >= 1, got {params.max_tokens}")
    if params.temperature < 0:
        raise EngineError(f"temperature must be >= 0, got {params.temperature}")
    truncating = params.top_p < 1.0 or params.top_k > 0
    if truncating and not allow_truncated_logprobs:
        raise EngineError(
            f"top_p={params.top_p}, top_k={params.top_k}: vLLM reports log-probs renormalized over the "
            "top-k/top-p kept set, not the contract's full-vocabulary softmax(logits / temperature). "
            "Use top_p=1, top_k=-1, or build VLLMEngine(..., allow_truncated_logprobs=True) to accept that."
        )
    max_tokens = int(params.max_tokens)
    if max_model_len is not None:
        room = max_model_len - prompt_len
        if room < 1:
            raise EngineError(
                f"the prompt has {prompt_len} tokens, which leaves no room in max_model_len={max_model_len}"
            )
        max_tokens = min(max_tokens, room)
    kwargs: dict[str, Any] = {
        "n": 1,
        "max_tokens": max_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,
        "stop": list(params.stop) or None,
        "stop_token_ids": [int(t) for t in params.stop_token_ids] or None,
        "include_stop_str_in_output": True,
        "logprobs": 0,  # the sampled token's log-prob only
        "skip_special_tokens": False,
        "seed": params.seed,
    }
    return kwargs


def parse_vllm_completion(completion: Any) -> GenerationOutput:
    """Turn one ``vllm.CompletionOutput`` into a :class:`GenerationOutput` (ids kept as sampled)."""
    token_ids = [int(t) for t in completion.token_ids]
    raw = completion.logprobs
    if raw is None or len(raw) != len(token_ids):
        raise EngineError(
            f"vLLM returned {0 if raw is None else len(raw)} log-prob entries for {len(token_ids)} tokens"
        )
    logprobs: list[float] = []
    for i, tid in enumerate(token_ids):
        entry = raw[i]
        try:
            logprobs.append(float(entry[tid].logprob))
        except (KeyError, TypeError) as exc:
            raise EngineError(f"vLLM returned no log-prob for sampled token {tid} at position {i}") from exc
    reason = completion.finish_reason
    if reason not in _FINISH_MAP:
        logger.warning("vLLM finish reason %r mapped to 'abort'", reason)
    return GenerationOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=_FINISH_MAP.get(reason, "abort"))
