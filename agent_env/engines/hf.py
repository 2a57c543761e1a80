"""HFEngine: a transformers causal LM in process, with continuous batching over asyncio.

Many episodes ``await engine.generate(...)`` at once; a background asyncio task gathers their
requests into one running batch that shares forward passes:

* new requests are prefilled together (left-padded, attention mask, position ids counted from
  each row's first real token) and their KV caches are merged into the running batch between
  decode steps (continuous batching: a request never waits for a whole wave to finish);
* each decode step feeds the last sampled token of every running row through one forward with a
  transformers ``DynamicCache`` whose layers keep free columns past the last one, so the step writes
  its keys/values in place instead of copying the cache (``hf_batch.slack_layer_class``); rows that
  finish (stop token, stop string, ``max_tokens``) leave the batch at once and left columns that
  only hold padding are trimmed;
* a request that continues a finished one (the next turn of a multi-turn episode: the same tokens,
  the sampled turn, then the tool's answer) is prefilled on that request's kept keys/values, so only
  its new tokens go through the model (:class:`~agent_env.engines.hf_batch.PrefixCache`);
* on a GPU the torch work runs in a worker thread (``asyncio.to_thread``), so the event loop serves
  other episodes' tool calls while the model computes; on the CPU each step runs on the event loop's
  own thread and the loop serves them between steps (tools run in their own processes or threads
  either way). A CPU forward in a second thread beside the caller's own OpenMP team took about
  twice as long (``benchmarks/bench_engine_decode.py``), hence ``worker_thread``.

Log-probs follow the Engine contract: ``log_softmax(logits / temperature)`` over the full
vocabulary for the sampled token (top-k/top-p truncation only decides what can be sampled). For
greedy decoding (``temperature == 0``) the log-probs are those of the raw logits (temperature 1).

Checking a call and sampling are in :mod:`agent_env.engines.hf_sampling`; prefilling new rows,
merging them into the running batch's KV cache and dropping finished ones, in
:mod:`agent_env.engines.hf_batch`; loading the model and copying new weights in, in
:mod:`agent_env.engines.hf_model`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections import deque
from typing import Any, Iterable, Mapping

import torch

from agent_env.engines.base import EngineError, GenerationOutput, SamplingParams
from agent_env.engines.hf_batch import (
    PrefixCache,
    RunningBatch,
    cache_kwargs,
    cache_layers,
    returned_cache,
    with_slack,
)
from agent_env.engines.hf_model import copy_weights, eos_ids, load_model
from agent_env.engines.hf_sampling import Request, make_request, sample
from agent_env.engines.hf_weights import WeightWatch
from tools.base import calls_in_flight

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_PREFIX_CACHE_BYTES", "HFEngine"]

DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20
INLINE_YIELDS = 8  # event-loop iterations between two steps run on the loop's thread


class HFEngine(RunningBatch):
    """Engine over a Hugging Face causal LM (CPU or GPU), continuous batching with a KV cache.

    Args:
        model_or_path: a local model folder (``AutoModelForCausalLM.from_pretrained``) or a model
            object. A model object is deep-copied unless ``share_weights=True``.
        tokenizer: tokenizer or folder; needed for stop strings. Defaults to the model folder.
        device: torch device for the engine's model (ignored when sharing weights).
        dtype: torch dtype (or its name) for a model loaded or copied here; log-probs are always
            computed in float32 from the logits.
        max_batch_size: most requests decoded together; the rest wait in FIFO order.
        seed: engine-wide seed: requests without their own ``SamplingParams.seed`` draw their
            seed from it in call order, so the same requests in the same order give the same
            samples. Without any seed, sampling is not reproducible.
        share_weights: use the given model object itself (no copy): the trainer's optimizer steps
            are seen immediately, and :meth:`update_weights` only drops what the engine derived from
            the weights (cached keys/values, the fused step's concatenated weights): call it after a
            write through ``p.data``, which nothing else shows (:mod:`agent_env.engines.hf_weights`).
        stop_at_eos: also stop (``"stop"``) at the tokenizer's / generation config's eos ids, as
            vLLM does by default. The eos token is included in the output.
        prefix_cache_bytes: most bytes of keys/values kept from finished requests for the next turn
            of their conversation (None: 256 MiB; 0 = off: every request is prefilled from its
            first token).
            Dropped whenever the model's weights change (in place or by :meth:`update_weights`).
        worker_thread: run each compute step and weight update in a worker thread (True) or on the
            event loop's thread between its other callbacks (False). None: True on a GPU, False on
            the CPU, where two threads running torch's OpenMP kernels slow the second one ~2×
            (recorded on 2 cores: the same decode step 3.8 ms on the caller's thread, 7.5 ms through
            ``asyncio.to_thread``).
        cpu_threads: torch threads for the engine's steps when they run on the caller's thread on the
            CPU (the rest of the process keeps its own setting; between two rollouts, when the engine
            is empty, torch's setting is back). None: adaptive — half of torch's threads, at least 1,
            while a tool call of this process is under way (:func:`tools.base.calls_in_flight`: the
            tools' sandbox processes run beside generation), all of them while none is (decode 1.45×
            to 1.9× faster on idle cores than on half, tiny to 151M parameters, ``bench_bf16.py``
            2026-12-07); N: always N; 0: torch's own setting. With a core busy, torch's two-thread
            kernels stall on it: on 2 cores a decode step of the tiny policy took 25.2 ms on 2
            threads and 10.6 ms on 1, while on idle cores
            2 threads were faster, 7.1 against 11.0 ms (``benchmarks/bench_engine_decode.py --busy 1``,
            recorded in docs/results.md).
        decode_step: how a decode step runs (:mod:`agent_env.engines.hf_decode`): ``"model"``, the
            model's own forward; ``"fused"``, the step written out from the model's weights (Qwen2,
            Qwen3, Llama layers; ~2× fewer milliseconds per step on a small CPU policy; the prefills
            are written out the same way, eagerly);
            ``"compiled"``, that step through ``torch.compile`` (faster again per step, but the first
            compile takes seconds to tens of seconds, in :attr:`compile_s`; a failed compile runs the
            eager step and says so in the log and :attr:`compile_error`);
            ``"auto"`` (default): ``"fused"`` where the model is one it covers, else ``"model"``
            (:attr:`decode_step` says which runs, the log says why). Whichever runs is checked
            against the model's forward on a few tokens when the engine is built.
    """

    def __init__(
        self,
        model_or_path: Any,
        tokenizer: Any = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        max_batch_size: int = 64,
        seed: int | None = None,
        share_weights: bool = False,
        stop_at_eos: bool = True,
        prefix_cache_bytes: int | None = None,
        worker_thread: bool | None = None,
        cpu_threads: int | None = None,
        decode_step: str = "auto",
    ) -> None:
        from agent_env.engines.hf_decode import DECODE_STEPS

        if max_batch_size < 1:
            raise EngineError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if decode_step not in DECODE_STEPS:
            raise EngineError(f"decode_step must be one of {list(DECODE_STEPS)}, got {decode_step!r}")
        model, tokenizer = load_model(model_or_path, tokenizer, device=device, dtype=dtype, share_weights=share_weights)
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.share_weights = share_weights
        self.device = next(model.parameters()).device
        self.worker_thread = self.device.type != "cpu" if worker_thread is None else bool(worker_thread)
        if cpu_threads is not None and (isinstance(cpu_threads, bool) or cpu_threads < 0):
            raise EngineError(f"cpu_threads must be >= 0 (0 = torch's own setting) or None, got {cpu_threads!r}")
        self.adaptive_threads = cpu_threads is None  # all threads while no tool call is under way
        if cpu_threads is None:
            cpu_threads = max(1, torch.get_num_threads() // 2)
        # only where the steps run on the caller's thread on the CPU (a thread count is per thread)
        self.cpu_threads = cpu_threads if self.device.type == "cpu" and not self.worker_thread else 0
        self._threads_before: int | None = None  # torch's setting while the engine's own is in force
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self._watch = WeightWatch(model)  # when the weights changed (hf_weights: what it sees, what not)
        self._eos_ids: frozenset[int] = frozenset(eos_ids(model, tokenizer) if stop_at_eos else ())
        self._seed_rng = random.Random(seed) if seed is not None else None
        self._lock = threading.Lock()  # one compute step or weight update at a time
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._cache = None  # DynamicCache of the running batch
        self._mask: torch.Tensor | None = None  # [B, T] attention mask over cached positions
        self._next: torch.Tensor | None = None  # [B] last sampled token, not yet in the cache
        self._pos: torch.Tensor | None = None  # [B] position id of that token
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False
        self._prefix = PrefixCache(DEFAULT_PREFIX_CACHE_BYTES if prefix_cache_bytes is None else prefix_cache_bytes)
        self.stats = {
            "steps": 0,
            "prefills": 0,
            "decoded_rows": 0,
            "max_running": 0,
            "prefilled_tokens": 0,  # tokens fed through the model by prefills
            "prefix_hits": 0,  # requests prefilled on a finished request's keys/values
            "prefix_tokens": 0,  # tokens those requests did not feed again
            "prefill_rows_shared": 0,  # rows copied from a row with the same tokens in their prefill
            "shared_prefix_tokens": 0,  # tokens rows of one prefill had in common, fed once for all of them
        }
        self._decoder = self._build_decoder(decode_step)

    # ------------------------------------------------------------------ public API

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        if self._closed:
            raise EngineError("this HFEngine is closed")
        req = make_request(
            prompt_ids,
            params,
            vocab_size=self.vocab_size,
            context=getattr(self.model.config, "max_position_embeddings", None),
            has_tokenizer=self.tokenizer is not None,
            seed_rng=self._seed_rng,
            eos_ids=self._eos_ids,
        )
        self._ensure_worker()
        self._waiting.append(req)
        assert self._wake is not None
        self._wake.set()
        try:
            return await req.future
        except asyncio.CancelledError:
            req.finish_reason = "abort"  # the step loop drops it at its next step
            raise

    async def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Copy new weights into the engine's model (a no-op copy when sharing weights).

        Keys/values cached for requests in flight were computed with the old weights: they are
        dropped, and those requests are prefilled again (prompt + tokens so far) with the new ones.
        """
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        await self._compute(self._update_weights_sync, items)

    async def _compute(self, fn, *args) -> None:
        """``fn(*args)`` in a worker thread, or here on the loop's thread (see ``worker_thread``)."""
        if self.worker_thread:
            await asyncio.to_thread(fn, *args)
        else:
            fn(*args)

    async def close(self) -> None:
        """Stop the worker; requests still in flight return with ``finish_reason="abort"``."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        with self._lock:
            self._abort_all()

    async def __aenter__(self) -> "HFEngine":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def decode_step(self) -> str:
        """Which decode step runs: ``"model"``, ``"fused"`` or ``"compiled"`` (``"fused"`` after a failed compile)."""
        if self._decoder is None:
            return "model"
        return "compiled" if self._decoder.compiled else "fused"

    @property
    def compile_s(self) -> float | None:
        """Seconds the compiled step's first call took (None before it, or when nothing compiles)."""
        return None if self._decoder is None else self._decoder.compile_s

    @property
    def compile_error(self) -> str | None:
        """Why ``torch.compile`` failed, if it did (the eager step ran instead)."""
        return None if self._decoder is None else self._decoder.compile_error

    def _build_decoder(self, decode_step: str):
        from agent_env.engines.hf_decode import FusedDecoder, unsupported

        if decode_step == "model":
            return None
        why = unsupported(self.model)
        if why and decode_step == "auto":
            logger.info("HFEngine decodes with the model's forward: %s", why)
            return None
        if why:
            raise EngineError(f"decode_step={decode_step!r}: the fused decode step does not cover this model: {why}")
        try:
            return FusedDecoder(self.model, compiled=decode_step == "compiled", watch=self._watch)
        except EngineError as exc:  # the probe: the written-out step does not reproduce this model's forward
            if decode_step != "auto":
                raise
            logger.warning("HFEngine decodes with the model's forward: %s", exc)
            return None

    # ------------------------------------------------------------------ background loop

    def _ensure_worker(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._task.get_loop() is loop:
            return
        if self._task is not None and not self._task.done():
            raise EngineError("this HFEngine is already serving another event loop")
        # A previous loop ended (e.g. a new asyncio.run): whatever it left is unreachable now.
        with self._lock:
            self._abort_all()
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._serve(), name="HFEngine.serve")

    async def _serve(self) -> None:
        assert self._wake is not None
        while True:
            if not self._waiting and not self._active:
                self._wake.clear()
                await self._wake.wait()
            # Let callers scheduled in the same tick join this step. Inline, also let the loop run the
            # episodes a few iterations further (tool replies in, next turns out) between steps.
            for _ in range(1 if self.worker_thread else INLINE_YIELDS):
                await asyncio.sleep(0)
            try:
                await self._compute(self._step)
            except Exception as exc:  # noqa: BLE001 - report to every caller, keep serving
                logger.exception("HFEngine step failed")
                with self._lock:
                    for req in [*self._active, *self._waiting]:
                        req.fail(EngineError(f"generation failed: {exc!r}"))
                    self._waiting.clear()
                    self._reset_batch()
                    self._restore_threads()

    def _abort_all(self) -> None:
        for req in [*self._active, *self._waiting]:
            req.resolve("abort")
        self._waiting.clear()
        self._reset_batch()
        self._restore_threads()

    # ------------------------------------------------------------------ compute (worker thread)

    @torch.no_grad()
    def _step(self) -> None:
        with self._lock:
            was_training = self.model.training
            if was_training:  # a shared trainer model: no dropout, and keep the KV cache on
                self.model.eval()
            self._own_threads()
            try:
                self._step_locked()
            finally:
                if was_training:
                    self.model.train()
                if not self._active and not self._waiting:
                    self._restore_threads()  # empty: the rest of the process runs with its own setting

    def _own_threads(self) -> None:
        if not self.cpu_threads:
            return
        if self._threads_before is None:
            self._threads_before = torch.get_num_threads()
        want = self.cpu_threads
        if self.adaptive_threads and not calls_in_flight():  # no tool's process beside: every thread
            want = max(want, self._threads_before)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def _restore_threads(self) -> None:
        if self._threads_before is not None:
            if torch.get_num_threads() != self._threads_before:
                torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def _step_locked(self) -> None:
        self.stats["steps"] += 1
        if self._active:
            finished = self._decode()
            # rows whose caller went away (cancelled) leave too
            finished += [i for i, r in enumerate(self._active) if r.future.done() and i not in finished]
            if finished:
                self._drop_rows(sorted(set(finished)))
        admit: list[Request] = []
        while self._waiting and len(self._active) + len(admit) < self.max_batch_size:
            req = self._waiting.popleft()
            if req.future.done() or req.finish_reason == "abort":
                continue  # cancelled before it started
            admit.append(req)
        if admit:
            first = len(self._active)
            try:
                self._prefill(admit)
            except BaseException:
                # rows not merged yet are in neither list: back to the queue, where the failure reaches them
                merged = {id(r) for r in self._active}
                self._waiting.extendleft(reversed([r for r in admit if id(r) not in merged]))
                raise
            finished = [first + i for i, r in enumerate(self._active[first:]) if r.finish_reason is not None]
            if finished:
                self._drop_rows(finished)
        self.stats["max_running"] = max(self.stats["max_running"], len(self._active))

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        if self._decoder is not None:  # a prefill: written out as the decode step is
            return self._decoder.prefill(input_ids, attention_mask, position_ids, cache)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **cache_kwargs(self.model, cache),
        )
        return out.logits[:, -1, :].float(), returned_cache(out)

    def _decode_forward(self, mask: torch.Tensor) -> torch.Tensor:
        """The running batch's logits for its next tokens (``mask``: the cached columns and theirs)."""
        assert self._next is not None and self._pos is not None
        if self._decoder is not None:
            return self._decoder.step(self._next, self._pos, mask, cache_layers(self._cache))
        logits, self._cache = self._forward(self._next[:, None], mask, self._pos[:, None], self._cache)
        return logits

    def _decode(self) -> list[int]:
        assert self._next is not None and self._mask is not None and self._pos is not None
        b = len(self._active)
        mask = torch.cat([self._mask, torch.ones(b, 1, dtype=self._mask.dtype, device=self.device)], dim=1)
        with_slack(self._cache)  # this step writes its keys/values in place, no copy of the cache
        logits = self._decode_forward(mask)
        self._mask = mask
        self._pos = self._pos + 1
        self.stats["decoded_rows"] += b
        return self._accept(self._active, logits, rows=range(b))

    def _weights_signature(self) -> tuple:
        return self._watch.signature()

    def _accept(self, reqs: list[Request], logits: torch.Tensor, rows: range) -> list[int]:
        """Sample one token per row, record it, set it as the row's next input; return finished rows."""
        tokens, logprobs = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        assert self._next is not None
        self._next[rows.start : rows.stop] = tokens.to(self.device)
        # one copy to the host for both (float64 holds every token id and float32 log-prob exactly)
        host = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)]).cpu()
        finished = []
        for row, req, tok, lp in zip(rows, reqs, map(int, host[0].tolist()), host[1].tolist()):
            req.out_ids.append(tok)
            req.logprobs.append(lp)
            if req.future.done():
                finished.append(row)
                continue
            if tok in req.stop_ids or self._hit_stop_string(req):
                req.finish_reason = "stop"
            elif len(req.out_ids) >= req.params.max_tokens:
                req.finish_reason = "length"
            if req.finish_reason is not None:
                req.resolve()
                finished.append(row)
        return finished

    def _hit_stop_string(self, req: Request) -> bool:
        if not req.stop_window:
            return False
        # A stop string that just appeared ends inside the newest token and spans at most
        # 4 bytes per character, hence at most stop_window tokens (each token has >= 1 byte).
        tail = self.tokenizer.decode(req.out_ids[-req.stop_window :], skip_special_tokens=False)
        return any(s and s in tail for s in req.params.stop)

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def _update_weights_sync(self, items: list[tuple[str, torch.Tensor]]) -> None:
        with self._lock:
            if not self.share_weights:
                copy_weights(self.model, items)
            self._watch.changed()  # the fused step's weights are rebuilt (a write through p.data shows nowhere else)
            self._prefix.clear()  # kept keys/values are stale too (the signature would also tell)
            # In-flight rows: their cached keys/values are stale; prefill them again next step.
            if self._active:
                for req in reversed(self._active):
                    if not req.future.done():
                        self._waiting.appendleft(req)
                self._reset_batch()
