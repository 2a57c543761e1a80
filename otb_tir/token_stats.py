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
  with ``packed=True`` its rows' tokens go through the model packed (:func:`pack_rows`), not padded.

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

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "TokenStats",
    "sum_pi_squared_from_logits",
    "chunk_at_most",
    "token_stats_from_logits",
    "token_stats_from_hidden",
    "token_stats_for_causal_lm",
    "PackedRows",
    "pack_rows",
    "prompt_sharing_mask_dtype",
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


class PackedRows(NamedTuple):
    """Rows packed for one forward (:func:`pack_rows`)."""

    input_ids: torch.Tensor  # [N, L]: N packed rows of the input's width L
    position_ids: torch.Tensor  # [N, L]: each original row's own position ids; 0 on the free tail
    index: torch.Tensor  # [B, R]: where, in the flattened [N * L] hidden states, each label's predictor is
    tokens: int  # N * L: the columns the packed forward runs
    real: int  # of those, the columns that hold a token (a shared prompt's once), not the free tail
    # [N, 1, L, L] when rows share their prompt's tokens (:func:`pack_rows`' ``share_prompts``): which
    # tokens each token attends to (bool for sdpa, additive float for eager attention); None: transformers
    # builds the mask from the position ids
    attention_mask: torch.Tensor | None = None


def prompt_sharing_mask_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the 4-D attention mask :func:`pack_rows` builds for ``model`` when rows share a
    prompt: bool for sdpa, the model's float dtype (additive) for eager attention; None for other
    attention implementations (flash-attention's varlen call takes no such mask), whose rows are packed
    without sharing."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl == "sdpa":
        return torch.bool
    if impl == "eager":
        return next(model.parameters()).dtype
    return None


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    response_length: int,
    share_prompts: torch.dtype | None = None,
) -> PackedRows | None:
    """The real tokens of ``[B, L]`` left-padded prompt + right-padded response rows, packed first-fit
    (longest first) into rows of width ``L``, for a forward with ``attention_mask=None`` and these
    position ids: each row's tokens keep their position ids (counting up by one from the row's
    start), so every place two rows meet, and every free column of the tail (position 0), starts a
    new sequence (transformers' ``find_packed_sequence_indices``) and no token attends across it.

    ``index`` maps the ``[B, R]`` response labels (the last ``R`` columns) to the flattened packed
    hidden states that predict them; a label past a row's last token maps to that row's last token
    (a finite value; its statistics are masked by the caller as on the padded path). ``None`` when the
    rows cannot be packed that way: no mask, a row's tokens not one contiguous run, a row's position
    ids not counting up by one, or a row with no token before its response.

    ``share_prompts`` (the mask's dtype, :func:`prompt_sharing_mask_dtype`): rows whose prompt tokens
    are the same (a group's samples) go through the model with one copy of the prompt, their responses
    after it, each attending to the prompt and to itself only (:func:`_share_prompts`); the result has
    the 4-D ``attention_mask`` that says so. The same statistics and gradients, the prompt's forward and
    backward once per packed row instead of once per sample. Without a repeated prompt, the rows pack
    as above.
    """
    if attention_mask is None or position_ids is None or position_ids.shape != input_ids.shape:
        return None
    b, width = input_ids.shape
    real = attention_mask.bool()
    lengths = real.sum(1)
    cols = torch.arange(width, device=input_ids.device).expand(b, -1)
    first = torch.where(real, cols, width).amin(1)
    last = torch.where(real, cols, -1).amax(1)
    p = width - response_length  # the first response column
    if bool((lengths == 0).any()) or bool((last - first + 1 != lengths).any()) or bool((first >= p).any()):
        return None
    steps = torch.diff(position_ids, dim=1) == 1
    if not bool((steps | ~(real[:, 1:] & real[:, :-1])).all()):
        return None
    shared = None if share_prompts is None else _share_prompts(input_ids, position_ids, first, last, p, share_prompts)
    lens, starts = lengths.tolist(), first.tolist()
    bins: list[list[int]] = []  # rows per packed row
    room: list[int] = []
    for i in sorted(range(b), key=lambda i: -lens[i]):
        j = next((j for j, free in enumerate(room) if free >= lens[i]), None)
        if j is None:
            bins.append([])
            room.append(width)
            j = len(bins) - 1
        bins[j].append(i)
        room[j] -= lens[i]
    ids = input_ids.new_zeros((len(bins), width))
    pos = position_ids.new_zeros((len(bins), width))
    offset = [0] * b  # where row i's first token lands in the flattened packed rows
    for j, rows in enumerate(bins):
        at = 0
        for i in rows:
            n, s0 = lens[i], starts[i]
            if at and int(position_ids[i, s0]) - int(pos[j, at - 1]) == 1:
                return shared  # the two rows' positions would read as one sequence (the mask keeps them apart)
            ids[j, at : at + n] = input_ids[i, s0 : s0 + n]
            pos[j, at : at + n] = position_ids[i, s0 : s0 + n]
            offset[i] = j * width + at
            at += n
    # the label in column p + t is predicted by the hidden state of column p + t - 1 of its row
    k = torch.arange(p - 1, width - 1, device=input_ids.device)[None, :] - first[:, None]
    k = torch.minimum(k, (lengths - 1)[:, None])
    index = torch.tensor(offset, device=input_ids.device)[:, None] + k
    if shared is not None and shared.tokens < len(bins) * width:
        return shared
    return PackedRows(ids, pos, index, len(bins) * width, sum(lens))


def _share_prompts(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    first: torch.Tensor,
    last: torch.Tensor,
    p: int,
    dtype: torch.dtype,
) -> PackedRows | None:
    """:func:`pack_rows` with one copy of each repeated prompt (``share_prompts``). Rows are grouped by
    their prompt tokens (columns ``first .. p-1``); a packed row holds a prompt, then as many of its
    group's responses (columns ``p .. last``) as fit in twice the input's width (at least one), and
    the mask lets a prompt token attend to the prompt's earlier tokens and a response token to the
    whole prompt and its own earlier tokens: what each row attends to when padded. The tail attends to
    itself only (no row of the mask is empty). ``None`` when no prompt repeats."""
    b, width = input_ids.shape
    starts, ends = first.tolist(), last.tolist()
    groups: dict[tuple, list[int]] = {}  # (prompt tokens, their position ids) -> rows
    for i in range(b):
        key = (tuple(input_ids[i, starts[i] : p].tolist()), tuple(position_ids[i, starts[i] : p].tolist()))
        groups.setdefault(key, []).append(i)
    if all(len(rows) == 1 for rows in groups.values()):
        return None
    cap = 2 * width
    units: list[tuple[int, list[int], int]] = []  # (the row whose prompt leads, rows whose responses follow, length)
    for rows in groups.values():
        n_prompt = p - starts[rows[0]]
        for i in rows:
            n = ends[i] + 1 - p
            if not units or units[-1][0] != rows[0] or units[-1][2] + n > cap:
                units.append((rows[0], [], n_prompt))
            lead, members, length = units[-1]
            units[-1] = (lead, [*members, i], length + n)
    # units first fit (longest first) into packed rows as wide as the longest unit, at least the input
    w = max(width, max(u[2] for u in units))
    bins: list[list[int]] = []
    room: list[int] = []
    for u in sorted(range(len(units)), key=lambda u: -units[u][2]):
        j = next((j for j, free in enumerate(room) if free >= units[u][2]), None)
        if j is None:
            bins.append([])
            room.append(w)
            j = len(bins) - 1
        bins[j].append(u)
        room[j] -= units[u][2]
    n_rows = len(bins)
    ids = input_ids.new_zeros((n_rows, w))
    pos = position_ids.new_zeros((n_rows, w))
    allow = torch.zeros((n_rows, w, w), dtype=torch.bool, device=input_ids.device)
    causal = torch.ones((w, w), dtype=torch.bool, device=input_ids.device).tril()
    labels = torch.arange(width - p)
    pred = torch.zeros((b, width - p), dtype=torch.long)  # [B, R] flat index of each label's predictor
    for j, unit_ids in enumerate(bins):
        at = 0
        for u in unit_ids:
            lead, rows, _ = units[u]
            n_prompt = p - starts[lead]
            s0 = at
            ids[j, s0 : s0 + n_prompt] = input_ids[lead, starts[lead] : p]
            pos[j, s0 : s0 + n_prompt] = position_ids[lead, starts[lead] : p]
            allow[j, s0 : s0 + n_prompt, s0 : s0 + n_prompt] = causal[:n_prompt, :n_prompt]
            at += n_prompt
            for i in rows:
                n = ends[i] + 1 - p
                ids[j, at : at + n] = input_ids[i, p : p + n]
                pos[j, at : at + n] = position_ids[i, p : p + n]
                allow[j, at : at + n, s0 : s0 + n_prompt] = True
                allow[j, at : at + n, at : at + n] = causal[:n, :n]
                # label t (column p + t) is predicted by the token before it: the prompt's last for
                # t = 0, the row's response token t - 1 after; past the row's end, its last token
                k = torch.minimum(labels - 1, torch.tensor(n - 1))
                pred[i] = torch.where(k >= 0, j * w + at + k, j * w + s0 + n_prompt - 1)
                at += n
        tail = torch.arange(at, w, device=input_ids.device)
        allow[j, tail, tail] = True
    if dtype == torch.bool:
        mask = allow[:, None]
    else:
        mask = torch.zeros(allow.shape, dtype=dtype, device=input_ids.device)
        mask = mask.masked_fill(~allow, torch.finfo(dtype).min)[:, None]
    return PackedRows(ids, pos, pred.to(input_ids.device), n_rows * w, sum(u[2] for u in units), mask)


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A sharded DTensor parameter (FSDP2) gathered to a full, differentiable tensor."""
    if t is not None and hasattr(t, "full_tensor") and hasattr(t, "placements"):
        return t.full_tensor()
    return t
