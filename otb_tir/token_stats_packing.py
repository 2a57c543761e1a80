"""Rows packed for one forward of the actor (:func:`pack_rows`), instead of each padded to the longest.

:func:`otb_tir.token_stats.token_stats_for_causal_lm` (``packed=True``) runs the decoder backbone on
:func:`pack_rows`' result and reads each label's predictor back through its ``index``; rows that share
their prompt's tokens (a group's samples) can go through with one copy of the prompt
(:func:`prompt_sharing_mask_dtype`, ``share_prompts``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["PackedRows", "pack_rows", "prompt_sharing_mask_dtype"]


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
