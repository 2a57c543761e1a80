"""SGLang engine: sglang's offline ``sglang.Engine`` in process, token ids in and out.

UNTESTED ON REAL SGLANG: sglang needs CUDA and cannot be installed on the machines this project
is developed on. The code follows sglang's documented offline-engine API
(``Engine.async_generate(input_ids=..., sampling_params=..., return_logprob=True)``, output
``meta_info['output_token_logprobs']`` as ``(logprob, token_id, text)`` triples,
``meta_info['finish_reason'] = {'type': 'stop'|'length'|'abort', 'matched': ...}``,
``update_weights_from_tensor``, ``flush_cache``). The request/response translation is factored
into the pure functions :func:`build_sglang_request` and :func:`parse_sglang_output`, which are
tested on recorded-shape data.

Log-probs: by default sglang reports ``log_softmax(logits / temperature)`` before top-k/top-p
filtering, which is exactly the Engine contract. The environment variable
``SGLANG_RETURN_ORIGINAL_LOGPROB`` switches it to pre-temperature log-probs, so the engine refuses
to start when it is set to a true value.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Iterable, Mapping

import torch

from agent_env.engines.base import EngineError, GenerationOutput, SamplingParams, missing_extra, named_tensor_list

logger = logging.getLogger(__name__)

_FINISH_MAP = {"stop": "stop", "length": "length", "abort": "abort"}


def build_sglang_request(prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments for ``sglang.Engine.async_generate`` for one token-id prompt.

    ``no_stop_trim`` keeps a matched stop string / stop token in the output (the Engine contract
    includes it); ``skip_special_tokens=False`` keeps the text faithful to the ids (the ids are
    what the episode keeps, the text is only informative).
    """
    if not prompt_ids:
        raise EngineError("prompt_ids is empty: an engine needs at least one prompt token")
    if params.max_tokens < 1:
        raise EngineError(f"max_tokens must be >= 1, got {params.max_tokens}")
    if params.temperature < 0:
        raise EngineError(f"temperature must be >= 0, got {params.temperature}")
    sampling: dict[str, Any] = {
        "max_new_tokens": int(params.max_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.stop_token_ids:
        sampling["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
    if params.seed is not None:
        # Honoured by sglang only with --enable-deterministic-inference (documented there).
        sampling["sampling_seed"] = int(params.seed)
    return {
        "input_ids": [int(t) for t in prompt_ids],
        "sampling_params": sampling,
        "return_logprob": True,
        # -1: log-probs of the output tokens only (no prompt scoring).
        "logprob_start_len": -1,
    }


def parse_sglang_output(output: Mapping[str, Any]) -> GenerationOutput:
    """Translate one ``async_generate`` result dict into a :class:`GenerationOutput`.

    The ids come from ``meta_info['output_token_logprobs']`` (one ``(logprob, id, text)`` per
    sampled token, the finishing token included); when sglang also returns ``output_ids`` they
    must agree, otherwise the response is rejected rather than silently trained on.
    """
    meta = output.get("meta_info")
    if not isinstance(meta, Mapping):
        raise EngineError(f"sglang output has no meta_info dict: keys {sorted(output)}")
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise EngineError("sglang output lacks meta_info['output_token_logprobs']: request return_logprob=True")
    token_ids: list[int] = []
    logprobs: list[float] = []
    for i, item in enumerate(triples):
        if not isinstance(item, (list, tuple)) or len(item) < 2:
            raise EngineError(f"output_token_logprobs[{i}] is {item!r}, expected (logprob, token_id, text)")
        lp, tid = item[0], item[1]
        if lp is None:
            raise EngineError(f"sglang returned no log-prob for output token {i} (id {tid})")
        token_ids.append(int(tid))
        logprobs.append(float(lp))
    output_ids = output.get("output_ids")
    if output_ids is not None and [int(t) for t in output_ids] != token_ids:
        raise EngineError(
            f"sglang output_ids ({len(output_ids)} ids) disagree with output_token_logprobs ({len(token_ids)} ids)"
        )
    fr = meta.get("finish_reason")
    if isinstance(fr, Mapping):
        kind = fr.get("type")
    else:
        kind = fr
    if kind not in _FINISH_MAP:
        raise EngineError(f"unknown sglang finish_reason {fr!r}")
    return GenerationOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=_FINISH_MAP[kind])


class SGLangEngine:
    """sglang's offline engine behind the async :class:`~agent_env.engines.base.Engine` protocol.

    ``engine_kwargs`` go to ``sglang.Engine`` unchanged (its ``ServerArgs``: ``tp_size``,
    ``mem_fraction_static``, ``context_length`` …).
    """

    def __init__(
        self,
        model_path: str,
        tokenizer: str | None = None,
        dtype: str = "auto",
        mem_fraction_static: float | None = None,
        seed: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        try:
            import sglang
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise missing_extra("sglang", "sglang") from exc
        flag = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").strip().lower()
        if flag in {"1", "true", "yes", "on"}:
            raise EngineError(
                "SGLANG_RETURN_ORIGINAL_LOGPROB is set: sglang would return pre-temperature "
                "log-probs, which breaks the Engine contract (softmax(logits / temperature)); unset it"
            )
        kwargs: dict[str, Any] = {"model_path": str(model_path), "dtype": dtype}
        if tokenizer is not None:
            kwargs["tokenizer_path"] = str(tokenizer)
        if mem_fraction_static is not None:
            kwargs["mem_fraction_static"] = mem_fraction_static
        if seed is not None:
            kwargs["random_seed"] = int(seed)
        kwargs.update(engine_kwargs)
        self._engine = sglang.Engine(**kwargs)
        self._tp_size = int(getattr(getattr(self._engine, "server_args", None), "tp_size", 1) or 1)
        self._closed = False

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        if self._closed:
            raise EngineError("SGLangEngine is closed")
        output = await self._engine.async_generate(**build_sglang_request(prompt_ids, params))
        return parse_sglang_output(output)

    async def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Load new weights with ``update_weights_from_tensor`` and flush the radix cache.

        ``Engine.update_weights_from_tensor`` drives its own event loop (it cannot be awaited from
        a running loop), so the request goes to the engine's tokenizer manager directly, as
        sglang's HTTP endpoint does.
        """
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        items = named_tensor_list(named_tensors)
        payload = [MultiprocessingSerializer.serialize(items) for _ in range(self._tp_size)]
        obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, load_format=None, flush_cache=True)
        manager = self._engine.tokenizer_manager
        success, message = await manager.update_weights_from_tensor(obj, None)
        if not success:
            raise EngineError(f"sglang update_weights_from_tensor failed: {message}")
        flushed = await manager.flush_cache()
        if not getattr(flushed, "success", True):
            raise EngineError("sglang flush_cache failed after a weight update (requests still running?)")

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self._engine.shutdown)
