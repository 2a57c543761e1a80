"""HFEngine's requests: checking a call's prompt and ``SamplingParams``, and sampling tokens.

:func:`make_request` turns one ``generate`` call into a :class:`Request` or raises ``EngineError``
for what the engine cannot serve (an empty prompt, ids outside the vocabulary, a prompt as long as
the model's context, bad temperature / top-p / top-k / max_tokens, stop strings without a
tokenizer), and gives it its own torch generator (seeded from ``SamplingParams.seed``, else from
the engine-wide seed in call order). A :class:`Request` is resolved into the caller's event loop
from the engine's worker thread. :func:`sample` draws one token per batch row with per-row
temperature, top-k, top-p and generator; its log-probs follow the Engine contract (see
:mod:`agent_env.engines.hf`).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import torch

from agent_env.engines.base import EngineError, GenerationOutput, SamplingParams


@dataclass
class Request:
    """One ``generate`` call in flight: its tokens so far, and the caller's future and loop."""

    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    generator: torch.Generator
    stop_ids: frozenset[int]
    stop_window: int  # tokens to decode when looking for a stop string
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def resolve(self, reason: str | None = None) -> None:
        out = GenerationOutput(list(self.out_ids), list(self.logprobs), reason or self.finish_reason or "abort")

        def _set() -> None:
            if not self.future.done():
                self.future.set_result(out)

        _call_in_loop(self.loop, _set)

    def fail(self, exc: BaseException) -> None:
        def _set() -> None:
            if not self.future.done():
                self.future.set_exception(exc)

        _call_in_loop(self.loop, _set)


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # the caller's event loop is closed: nobody is waiting any more
        pass


def make_request(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    context: int | None,
    has_tokenizer: bool,
    seed_rng: random.Random | None,
    eos_ids: frozenset[int],
) -> Request:
    """A checked request for the running event loop. ``context``: the model's
    ``max_position_embeddings`` (None: unknown); ``seed_rng``: the engine-wide seed's generator."""
    if not isinstance(params, SamplingParams):
        raise EngineError(f"params must be a SamplingParams, got {type(params).__name__}")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise EngineError("prompt_ids is empty: the engine needs at least one prompt token")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise EngineError(f"prompt_ids contain ids outside the vocabulary [0, {vocab_size})")
    if params.max_tokens < 1:
        raise EngineError(f"max_tokens must be >= 1, got {params.max_tokens}")
    if params.temperature < 0:
        raise EngineError(f"temperature must be >= 0 (0 = greedy), got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise EngineError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k == 0 or params.top_k < -1:
        raise EngineError(f"top_k must be -1 (disabled) or >= 1, got {params.top_k}")
    if context is not None and len(prompt) >= context:
        raise EngineError(f"the prompt has {len(prompt)} tokens; the model's context is {context}")
    stops = [s for s in params.stop if s]
    if stops and not has_tokenizer:
        raise EngineError("stop strings need a tokenizer: pass tokenizer= to HFEngine")
    seed = params.seed
    if seed is None and seed_rng is not None:
        seed = seed_rng.getrandbits(63)
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    loop = asyncio.get_running_loop()
    return Request(
        prompt_ids=prompt,
        params=params,
        future=loop.create_future(),
        loop=loop,
        generator=gen,
        stop_ids=frozenset(int(t) for t in params.stop_token_ids) | eos_ids,
        stop_window=(4 * max(map(len, stops)) + 2) if stops else 0,
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]):
    """One token per row with per-row temperature/top-k/top-p and per-row generators.

    Returns ``(tokens [B], logprobs [B])`` on the logits' device; log-probs are under
    ``softmax(logits / T)`` over the full vocabulary (raw logits for greedy rows). The work stays on
    the logits' device (a GPU's [B, V] logits are not copied to the host); only each row's uniform
    draw comes from its CPU generator, so a seed gives the same draw on any device.
    """
    b, v = logits.shape
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    greedy = temps == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temps).to(dev)[:, None], dim=-1)
    sample_rows = [i for i, p in enumerate(params) if p.temperature != 0]
    tokens = logp.argmax(dim=-1) if len(sample_rows) < b else None  # greedy rows' tokens (none: not needed)
    if sample_rows:
        sub = logp[sample_rows] if len(sample_rows) < b else logp
        u = torch.stack([torch.rand((), generator=generators[i], dtype=torch.float64) for i in sample_rows]).float()
        top_k = [params[i].top_k if params[i].top_k > 0 else v for i in sample_rows]
        top_p = [params[i].top_p for i in sample_rows]
        if min(top_k) < v or min(top_p) < 1:
            sorted_logp, order = sub.sort(dim=-1, descending=True)
            probs = sorted_logp.exp()
            ranks = torch.arange(v, device=dev)[None, :]
            before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
            k = torch.tensor(top_k, device=dev)[:, None]
            p = torch.tensor(top_p, dtype=torch.float32, device=dev)[:, None]
            keep = (ranks < k) & ((before < p) | (ranks == 0))
            probs = torch.where(keep, probs, 0.0)
        else:
            order, probs = None, sub.exp()
        cdf = probs.cumsum(dim=-1)
        target = (u.to(dev) * cdf[:, -1])[:, None]
        choice = torch.searchsorted(cdf, target, right=True).flatten().clamp_(max=v - 1)
        # Guard against float round-off at the top end: never pick a zero-probability token. Only a
        # draw past the last kept token can pick one (an inner zero's cdf equals its predecessor's,
        # which searchsorted finds first), so on the CPU the guard runs only when one did.
        if dev.type != "cpu" or bool((probs.gather(1, choice[:, None]) == 0).any()):
            last_kept = (probs > 0).long().cumsum(dim=-1).argmax(dim=-1)
            choice = torch.minimum(choice, last_kept)
        picked = order.gather(1, choice[:, None]).flatten() if order is not None else choice
        if len(sample_rows) < b:
            tokens[sample_rows] = picked
        else:
            tokens = picked
    return tokens, logp.gather(1, tokens[:, None]).flatten()
