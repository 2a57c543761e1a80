"""SGLang engine: sglang's offline ``sglang.Engine`` in process, token ids in and out.

Tested on real sglang (0.5.23, its torch-native CPU backend, ``.venv-sglang`` from
``scripts/install_sglang_env.sh``) by ``tests/agent_env/test_engine_contract.py``: log-probs against
the HF model's own, seeds, stop tokens and strings, length and abort, weight updates taking effect
(and a stale-cache control without the flush), cancellation, multi-turn episodes' token invariants.
On a GPU the same code runs sglang's CUDA path (not exercised here: no GPU is lent to CI).

The request/response translation is factored into the pure functions :func:`build_sglang_request`
and :func:`parse_sglang_output`.

Log-probs: sglang reports ``log_softmax(logits / temperature)`` of the full vocabulary (before
top-k/top-p filtering), the Engine contract; top-k/top-p sampling is refused unless accepted
(``allow_truncated_logprobs``), because the sampled distribution is then not the one the
log-probs describe. ``SGLANG_RETURN_ORIGINAL_LOGPROB`` switches sglang to pre-temperature
log-probs, so the engine refuses to start when it is set.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any, Iterable, Mapping

import torch

from agent_env.engines.base import (
    EngineError,
    EngineStats,
    GenerationOutput,
    SamplingParams,
    check_update_names,
    checkpoint_shapes,
    missing_extra,
    named_tensor_list,
)

logger = logging.getLogger(__name__)

_FINISH_MAP = {"stop": "stop", "length": "length", "abort": "abort"}


def build_sglang_request(
    prompt_ids: list[int], params: SamplingParams, allow_truncated_logprobs: bool = False
) -> dict[str, Any]:
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
    if (params.top_p < 1.0 or params.top_k > 0) and not allow_truncated_logprobs:
        raise EngineError(
            f"top_p={params.top_p}, top_k={params.top_k}: sglang samples from the truncated distribution "
            "but reports full-vocabulary log-probs, so the rollout log-probs would not be those of the "
            "tokens' sampling distribution. Use top_p=1, top_k=-1, or build "
            "SGLangEngine(..., allow_truncated_logprobs=True) to accept that."
        )
    sampling: dict[str, Any] = {
        "max_new_tokens": int(params.max_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,
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


def _tied_embeddings(model_path: str) -> bool:
    import json
    from pathlib import Path

    config = Path(model_path) / "config.json"
    return bool(config.exists() and json.loads(config.read_text()).get("tie_word_embeddings", False))


class SGLangEngine:
    """sglang's offline engine behind the async :class:`~agent_env.engines.base.Engine` protocol.

    ``engine_kwargs`` go to ``sglang.Engine`` unchanged (its ``ServerArgs``: ``tp_size``,
    ``mem_fraction_static``, ``context_length`` …). Without CUDA it runs sglang's CPU engine
    (:mod:`agent_env.engines.sglang_cpu`: checked at start, float32 when ``dtype="auto"``).
    Build it under ``if __name__ == "__main__":`` (sglang spawns its scheduler process).
    """

    def __init__(
        self,
        model_path: str,
        tokenizer: str | None = None,
        dtype: str = "auto",
        mem_fraction_static: float | None = None,
        seed: int | None = None,
        allow_truncated_logprobs: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        flag = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").strip().lower()
        if flag in {"1", "true", "yes", "on"}:
            raise EngineError(
                "SGLANG_RETURN_ORIGINAL_LOGPROB is set: sglang would return pre-temperature "
                "log-probs, which breaks the Engine contract (softmax(logits / temperature)); unset it"
            )
        device = engine_kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        self.on_cpu = device == "cpu"
        kwargs: dict[str, Any] = {}
        if self.on_cpu:
            from agent_env.engines.sglang_cpu import CPU_DEFAULTS, prepare_cpu

            prepare_cpu()  # before sglang is imported: it selects the CPU engine
            kwargs.update(CPU_DEFAULTS)
            if dtype == "auto":
                dtype = "float32"
        try:
            import sglang
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise missing_extra("sglang", "sglang") from exc
        kwargs.update({"model_path": str(model_path), "dtype": dtype, "log_level": "error"})
        if tokenizer is not None:
            kwargs["tokenizer_path"] = str(tokenizer)
        if mem_fraction_static is not None:
            kwargs["mem_fraction_static"] = mem_fraction_static
        if seed is not None:
            kwargs["random_seed"] = int(seed)
        kwargs.update(engine_kwargs)
        self.allow_truncated_logprobs = allow_truncated_logprobs
        # sglang honours a request's sampling_seed only with enable_deterministic_inference, which its
        # CPU attention backends do not support (0.5.23 refuses it at start): said once, not hidden
        self.honours_seed = bool(kwargs.get("enable_deterministic_inference", False))
        if not self.honours_seed:
            logger.warning(
                "sglang: per-request sampling seeds are ignored (they need enable_deterministic_inference%s): "
                "rollouts are not reproducible run to run",
                ", which sglang's CPU attention backends do not support" if self.on_cpu else "=True",
            )
        self._shapes = checkpoint_shapes(model_path)
        self._tied = _tied_embeddings(model_path)
        self._engine = sglang.Engine(**kwargs)
        self._tp_size = int(getattr(getattr(self._engine, "server_args", None), "tp_size", 1) or 1)
        self._closed = False
        self._pending: set[str] = set()
        self._open = asyncio.Event()  # cleared while weights load: new requests wait
        self._open.set()
        self._idle = asyncio.Event()  # set when no request runs: a weight update waits for it
        self._idle.set()
        self.stats = EngineStats()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        if self._closed:
            raise EngineError("SGLangEngine is closed")
        request = build_sglang_request(prompt_ids, params, self.allow_truncated_logprobs)
        rid = uuid.uuid4().hex
        await self._open.wait()
        self._pending.add(rid)
        self._idle.clear()
        self.stats.requests += 1
        self.stats.max_concurrent = max(self.stats.max_concurrent, len(self._pending))
        try:
            output = await self._engine.async_generate(rid=rid, **request)
        except asyncio.CancelledError:
            # sglang does not abort a request whose caller went away: abort it, or it decodes on
            self._engine.tokenizer_manager.abort_request(rid)
            self.stats.aborted += 1
            raise
        except ValueError as exc:  # sglang's input validation (a prompt longer than the context ...)
            raise EngineError(f"sglang refused the request: {exc}") from exc
        finally:
            self._pending.discard(rid)
            if not self._pending:
                self._idle.set()
        result = parse_sglang_output(output)
        self.stats.generated_tokens += len(result.token_ids)
        return result

    async def update_weights(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        flush_cache: bool = True,
    ) -> None:
        """Load new weights with ``update_weights_from_tensor`` and flush the radix cache.

        Requests already running finish on the old weights; those issued after the call wait and
        run on the new. ``Engine.update_weights_from_tensor`` drives its own
        event loop (it cannot be awaited from a running loop), so the request goes to the engine's
        tokenizer manager directly, as sglang's HTTP endpoint does. ``flush_cache=False`` exists
        for the stale-cache control in the tests only.
        """
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )
        from sglang.srt.utils import MultiprocessingSerializer

        if self._closed:
            raise EngineError("SGLangEngine is closed")
        items = named_tensor_list(named_tensors)
        # a bad name or shape would kill sglang's scheduler (an assertion in its weight loader)
        check_update_names(items, self._shapes, self._tied)
        payload = [MultiprocessingSerializer.serialize(items) for _ in range(self._tp_size)]
        manager = self._engine.tokenizer_manager
        self._open.clear()  # requests issued from now on run on the new weights
        try:
            await self._idle.wait()  # the running ones finish on the old
            # sglang 0.5.23 loads weights inside a session (begin: restore packed weights; end: post-process)
            for step, call in (
                ("begin_weight_update", lambda: manager.begin_weight_update(BeginWeightUpdateReqInput(), None)),
                (
                    "update_weights_from_tensor",
                    lambda: manager.update_weights_from_tensor(
                        UpdateWeightsFromTensorReqInput(
                            serialized_named_tensors=payload, load_format=None, flush_cache=flush_cache
                        ),
                        None,
                    ),
                ),
                ("end_weight_update", lambda: manager.end_weight_update(EndWeightUpdateReqInput(), None)),
            ):
                success, message = await call()
                if not success:
                    if step == "update_weights_from_tensor":
                        await manager.end_weight_update(EndWeightUpdateReqInput(), None)
                    raise EngineError(f"sglang {step} failed: {message}")
            self.stats.weight_updates += 1
            if flush_cache:
                await self.reset_prefix_cache()
        finally:
            self._open.set()

    async def reset_prefix_cache(self) -> None:
        flushed = await self._engine.tokenizer_manager.flush_cache()
        if not getattr(flushed, "success", True):
            raise EngineError("sglang flush_cache failed (requests still running?)")

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self._engine.shutdown)
