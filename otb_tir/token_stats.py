"""Per-token statistics of the policy: log-prob of the sampled token, entropy, and Σπ².

Σπ² (the sum of squared vocabulary probabilities, ``Σ_v π(v)²``) is the statistic the Optimal
Token Baseline needs besides the log-prob. Computed naively (``softmax → square → sum``) it costs
several extra ``[T, V]`` float32 tensors: 2.5 GB each at T = 4096, V = 151,936. Everything here
works on chunks of tokens, so the extra memory is a few ``[chunk, V]`` buffers:

- :func:`sum_pi_squared_from_logits` — Σπ² alone from logits (detached).
- :func:`token_stats_from_logits` — log-prob, entropy and Σπ² from logits in one pass.
- :func:`token_stats_from_hidden` — the same from the last hidden states and the LM-head weight,
  never materializing the ``[T, V]`` logits (forward *and* backward recompute the logits of one
  chunk at a time).
- :func:`token_stats_for_causal_lm` — the helper the trainer calls on a transformers causal LM;
  with ``packed=True`` its rows' tokens go through the model packed
  (:func:`otb_tir.token_stats_packing.pack_rows`), not padded.

Maths, for one token with scaled logits ``z = logits / temperature`` and ``m = max z``,
``e = exp(z − m)``, ``s = Σ e``::

    log π(y) = z_y − m − log s
    H        = log s − Σ e·(z − m) / s
    Σπ²      = Σ e² / s² = exp(logsumexp(2z) − 2·logsumexp(z))

All statistics are accumulated in float32 (float64 inputs stay float64). Low-precision logits
(bf16/fp16) are upcast one chunk at a time.

Gradients: the two ``*_from_logits``/``*_from_hidden`` functions are custom autograd functions
(they and the per-chunk kernels live in :mod:`otb_tir.token_stats_kernels`). All three outputs
are differentiable (d log π / dz = onehot − π; dH/dz = −π·(log π + H); dΣπ²/dz = 2π·(π − Σπ²),
each divided by the temperature); the backward pass only computes the terms of the outputs that
actually received a gradient, so using only the log-probs in the loss costs nothing extra.
Detach entropy / Σπ² yourself if you store them.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch

from otb_tir import ConfigError
from otb_tir.token_stats_kernels import HiddenStats, LogitsStats, compute_dtype, rowdot
from otb_tir.token_stats_packing import PackedRows, pack_rows, prompt_sharing_mask_dtype

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "TokenStats",
    "sum_pi_squared_from_logits",
    "chunk_at_most",
    "token_stats_from_logits",
    "token_stats_from_hidden",
    "token_stats_for_causal_lm",
]

#: Default size of one ``[chunk, V]`` float32 working buffer; the chunk (in tokens) is derived
#: from it as ``max(1, DEFAULT_CHUNK_BYTES // (4 * V))`` (110 tokens at V = 151,936).
DEFAULT_CHUNK_BYTES = 64 * 2**20


class TokenStats(NamedTuple):
    """Per-token statistics, each shaped like the labels (float32, or float64 for float64 inputs)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    sum_pi_squared: torch.Tensor


# --------------------------------------------------------------------------------------------
# validation helpers


def _check_temperature(temperature: float) -> float:
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise ConfigError(f"temperature must be a positive number, got {temperature!r}") from None
    if not math.isfinite(t) or t <= 0:
        raise ConfigError(f"temperature must be a positive finite number, got {temperature!r}")
    return t


def chunk_at_most(tokens: int, vocab: int) -> int:
    """``tokens`` per chunk, fewer where a ``[chunk, V]`` float32 buffer would pass
    :data:`DEFAULT_CHUNK_BYTES` (the trainer's rule: 512 tokens up to V = 32,768, 110 at 151,936)."""
    return max(1, min(tokens, DEFAULT_CHUNK_BYTES // (4 * max(vocab, 1))))


def _resolve_chunk(chunk: int | None, vocab: int) -> int:
    if chunk is None:
        return max(1, DEFAULT_CHUNK_BYTES // (4 * max(vocab, 1)))
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"chunk must be a positive int (tokens per chunk) or None, got {chunk!r}")
    return chunk


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ConfigError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def _check_labels(labels: torch.Tensor, expected_shape: torch.Size, vocab: int, what: str) -> None:
    if not isinstance(labels, torch.Tensor):
        raise ConfigError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ConfigError(f"labels must be an integer tensor of token ids, got dtype {labels.dtype}")
    if labels.shape != expected_shape:
        raise ConfigError(
            f"labels shape {tuple(labels.shape)} must equal the {what} shape without its last "
            f"dimension, {tuple(expected_shape)}"
        )
    if labels.numel():
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= vocab:
            raise ConfigError(
                f"labels must be token ids in [0, {vocab}), got values in [{lo}, {hi}] "
                "(replace padding/ignore ids such as -100 by a valid id and mask them out)"
            )


# --------------------------------------------------------------------------------------------
# public API


@torch.no_grad()
def sum_pi_squared_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, chunk: int | None = None
) -> torch.Tensor:
    """Σπ² = Σ_v softmax(logits / temperature)_v² over the last dimension, chunked over tokens.

    Equal to ``exp(logsumexp(2z) − 2·logsumexp(z))``; computed as ``Σe²/(Σe)²`` with
    ``e = exp(z − max z)``, in float32 (float64 for float64 input), ``chunk`` tokens at a time
    (default: a 64 MiB float32 buffer's worth), so the extra memory is a few ``[chunk, V]``
    buffers. Works on ``[..., V]``; returns ``[...]``. The result is detached (use
    :func:`token_stats_from_logits` for a differentiable Σπ²).
    """
    _check_float("logits", logits)
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ConfigError(f"logits must have a non-empty last (vocabulary) dimension, got shape {tuple(logits.shape)}")
    t = _check_temperature(temperature)
    vocab = logits.shape[-1]
    c = _resolve_chunk(chunk, vocab)
    flat = logits.reshape(-1, vocab)
    n = flat.shape[0]
    cd = compute_dtype(logits.dtype)
    out = torch.empty(n, dtype=cd, device=logits.device)
    zbuf = torch.empty(min(c, n), vocab, dtype=cd, device=logits.device)
    for i in range(0, n, c):
        j = min(i + c, n)
        x = flat[i:j]
        e = torch.sub(x, x.amax(dim=-1, keepdim=True).to(cd), out=zbuf[: j - i])
        if t != 1.0:
            e.div_(t)
        e.exp_()
        s = e.sum(dim=-1)
        out[i:j] = rowdot(e, e) / (s * s)
    return out.view(logits.shape[:-1])


def token_stats_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk: int | None = None,
) -> TokenStats:
    """Log-prob of ``labels``, entropy and Σπ² of ``softmax(logits / temperature)``, one pass.

    ``logits``: ``[..., V]`` (any float dtype; bf16/fp16 are upcast one chunk at a time);
    ``labels``: integer ``[...]`` in ``[0, V)``. Returns :class:`TokenStats` of ``[...]`` tensors
    (float32; float64 for float64 logits). Extra memory: a few ``[chunk, V]`` buffers (default
    chunk: a 64 MiB float32 buffer's worth of tokens). All three outputs are differentiable with
    respect to ``logits`` (see the module docstring); the backward pass writes the ``[..., V]``
    gradient chunk by chunk.
    """
    _check_float("logits", logits)
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ConfigError(f"logits must have a non-empty last (vocabulary) dimension, got shape {tuple(logits.shape)}")
    vocab = logits.shape[-1]
    _check_labels(labels, logits.shape[:-1], vocab, "logits")
    if labels.device != logits.device:
        raise ConfigError(f"labels are on {labels.device} but logits on {logits.device}")
    t = _check_temperature(temperature)
    c = _resolve_chunk(chunk, vocab)
    lp, ent, sp = LogitsStats.apply(logits.reshape(-1, vocab), labels.reshape(-1).long(), t, c)
    shape = labels.shape
    return TokenStats(lp.view(shape), ent.view(shape), sp.view(shape))


def token_stats_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk: int | None = None,
    bias: torch.Tensor | None = None,
) -> TokenStats:
    """Fused LM head + statistics: the stats of ``softmax((hidden @ W.T + bias) / temperature)``.

    ``hidden``: ``[..., H]``; ``lm_head_weight``: ``[V, H]`` (same dtype and device as
    ``hidden``); ``labels``: integer ``[...]``; optional ``bias``: ``[V]``. The ``[..., V]`` logits
    are never materialized: forward and backward each recompute ``chunk`` tokens' logits at a time
    (the matmul runs in the input dtype, exactly as ``nn.Linear`` would; the statistics in
    float32). Gradients flow to ``hidden``, ``lm_head_weight`` and ``bias`` (weight/bias gradients
    are accumulated over chunks in float32 for low-precision inputs).
    """
    _check_float("hidden", hidden)
    _check_float("lm_head_weight", lm_head_weight)
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[0] < 1:
        raise ConfigError(f"lm_head_weight must be [V, H] with V ≥ 1, got shape {tuple(lm_head_weight.shape)}")
    if hidden.ndim < 1 or hidden.shape[-1] != lm_head_weight.shape[1]:
        raise ConfigError(
            f"hidden's last dimension must equal lm_head_weight's H = {lm_head_weight.shape[1]}, "
            f"got hidden shape {tuple(hidden.shape)}"
        )
    if hidden.dtype != lm_head_weight.dtype or hidden.device != lm_head_weight.device:
        raise ConfigError(
            f"hidden ({hidden.dtype}, {hidden.device}) and lm_head_weight ({lm_head_weight.dtype}, "
            f"{lm_head_weight.device}) must share dtype and device"
        )
    vocab, hdim = lm_head_weight.shape
    if bias is not None:
        _check_float("bias", bias)
        if bias.shape != (vocab,) or bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise ConfigError(
                f"bias must be [{vocab}] with hidden's dtype and device, got {tuple(bias.shape)} {bias.dtype}"
            )
    _check_labels(labels, hidden.shape[:-1], vocab, "hidden")
    if labels.device != hidden.device:
        raise ConfigError(f"labels are on {labels.device} but hidden on {hidden.device}")
    t = _check_temperature(temperature)
    c = _resolve_chunk(chunk, vocab)
    lp, ent, sp = HiddenStats.apply(hidden.reshape(-1, hdim), lm_head_weight, bias, labels.reshape(-1).long(), t, c)
    shape = labels.shape
    return TokenStats(lp.view(shape), ent.view(shape), sp.view(shape))


# Config attributes that make a model's logits differ from ``hidden @ W.T``: the fused path would
# silently compute the wrong distribution for them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def token_stats_for_causal_lm(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    response_length: int,
    temperature: float = 1.0,
    fused: bool = True,
    chunk: int | None = None,
    packed: bool | PackedRows = False,
    score_mask: torch.Tensor | None = None,
) -> TokenStats:
    """Token statistics of the response tokens of a transformers causal LM, ``[B, response_length]``.

    Runs the decoder backbone (``model.get_decoder()``) on ``input_ids [B, P+R]`` and scores
    ``responses = input_ids[:, -R:]`` with the hidden states of the positions that predict them
    (``[:, -R-1:-1]``) against ``model.get_output_embeddings()`` — tied embeddings included. With
    ``fused=True`` this goes through :func:`token_stats_from_hidden` (no ``[B, R, V]`` logits);
    ``fused=False`` takes the logits from the model's own ``forward`` (``logits_to_keep`` = the
    response positions) and uses :func:`token_stats_from_logits`: whatever the model applies after
    its LM head (Gemma2's soft-capping, Cohere's and Granite's logit scaling) is applied. Models
    whose logits are not a plain linear map of the hidden state need ``fused=False``.

    ``packed=True`` (with ``fused``): the rows' real tokens go through the backbone packed into as few
    rows as fit (:func:`pack_rows`: ``attention_mask=None``, position ids restarting at each row's
    start, from which transformers builds the block-diagonal causal mask, or flash-attention its
    varlen call), instead of each row padded to the longest; the statistics come back in the same
    ``[B, R]`` layout. Where the rows cannot be packed (a row's tokens not contiguous, position ids
    not counting up by one inside a row) the padded forward runs. Whether a model honours packed
    position ids is the caller's to check (the actor compares the two once per model). ``packed`` may
    also be :func:`pack_rows`' result for these rows, used as it is.

    ``score_mask`` (``[B, response_length]``, bool or 0/1): score only these tokens; the others'
    statistics are 0 (a mask with no token scores every token, as without one: a loss over none of
    them keeps its graph). The actor passes the response mask: tool-result tokens and the padding after a
    row's end are never scored (they were: the LM head and its backward ran on all ``B × R`` positions,
    about 3× the policy tokens of a tool-using batch).
    """
    if isinstance(response_length, bool) or not isinstance(response_length, int):
        raise ConfigError(f"response_length must be an int, got {response_length!r}")
    if input_ids.ndim != 2:
        raise ConfigError(f"input_ids must be [B, P+R], got shape {tuple(input_ids.shape)}")
    r = response_length
    if not 0 <= r < input_ids.shape[1]:
        raise ConfigError(
            f"response_length must be in [0, {input_ids.shape[1]}) (at least one prompt token "
            f"must precede the response), got {r}"
        )
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ConfigError(f"{type(model).__name__} has no output embedding (LM head) with a weight")
    config = getattr(model, "config", None)
    if fused:
        for attr in _LOGIT_TRANSFORMS:
            val = getattr(config, attr, None)
            if val not in (None, 1, 1.0):
                raise ConfigError(
                    f"{type(model).__name__} sets config.{attr}={val!r}: its logits are not "
                    "hidden @ W.T, so the fused path does not apply; pass fused=False "
                    "(actor.fused_token_stats=false), which takes the logits from the model's own forward"
                )
    if not fused:  # the model's own forward: soft-capping / logit scaling applied as the model does
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=r + 1,
        )
        labels = input_ids[:, input_ids.shape[1] - r :]
        st = token_stats_from_logits(out.logits[:, :-1, :], labels, temperature, chunk)
        if score_mask is None:
            return st
        keep = _score_mask(score_mask, labels)
        if keep is None:
            return st
        return TokenStats(*(torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device)) for t in st))
    backbone = model.get_decoder()
    labels = input_ids[:, input_ids.shape[1] - r :]
    keep = None if score_mask is None else _score_mask(score_mask, labels)
    pack = packed if isinstance(packed, PackedRows) else None
    if packed is True:
        pack = pack_rows(input_ids, attention_mask, position_ids, r, share_prompts=prompt_sharing_mask_dtype(model))
    if pack is not None:
        ids, mask, pos = pack.input_ids, pack.attention_mask, pack.position_ids
        out = backbone(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        flat = hidden.reshape(-1, hidden.shape[-1])
        h = flat[pack.index] if keep is None else flat[pack.index[keep]]
    else:
        out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        h = hidden[:, hidden.shape[1] - r - 1 : hidden.shape[1] - 1, :]
        if keep is not None:
            h = h[keep]
    weight, bias = head.weight, getattr(head, "bias", None)
    weight, bias = _full(weight), _full(bias)
    if weight.dtype != h.dtype:  # e.g. an fp32 head under autocast: score as nn.Linear would
        h = h.to(weight.dtype)
    if keep is None:
        return token_stats_from_hidden(h, weight, labels, temperature, chunk, bias=bias)
    st = token_stats_from_hidden(h, weight, labels[keep], temperature, chunk, bias=bias)
    return TokenStats(*(t.new_zeros(labels.shape).masked_scatter(keep, t) for t in st))


def _score_mask(score_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if tuple(score_mask.shape) != tuple(labels.shape):
        raise ConfigError(
            f"score_mask must be shaped like the response labels {tuple(labels.shape)}, got {tuple(score_mask.shape)}"
        )
    keep = score_mask.to(device=labels.device) != 0
    return keep if bool(keep.any()) else None  # nothing to score: all positions (their stats masked by the caller)


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A sharded DTensor parameter (FSDP2) gathered to a full, differentiable tensor."""
    if t is not None and hasattr(t, "full_tensor") and hasattr(t, "placements"):
        return t.full_tensor()
    return t
