"""Pack a multi-turn ``[B, R]`` batch to its policy tokens and back.

A multi-turn response row interleaves tokens sampled by the policy (``response_mask == 1``) with
tokens inserted by the environment (tool responses, ``response_mask == 0``) and right padding.
Per-position statistics across the samples of one prompt must be aligned on the *k-th policy
token* of each row, not on the absolute column; these helpers give that compact layout::

    x             [B, R, ...]      response_mask [B, R]
    compact       [B, L_max, ...]  row b holds x[b, response_mask[b] != 0] left-aligned, then padding
    unpack(compact) -> [B, R, ...]  policy positions filled back, every other position = fill value

Everything is vectorized: the compaction is one gather with flat indices computed once per mask
(by cumulative sums / ``nonzero``), never a Python loop over rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from otb_tir import ConfigError

__all__ = [
    "PolicyLayout",
    "mask_in_unit_interval",
    "pack_policy_tokens",
    "policy_counts",
    "policy_counts_into",
    "unpack_policy_tokens",
]

# float32 counts are exact integers below 2**24.
_FLOAT32_EXACT = 1 << 24


def policy_counts(response_mask: torch.Tensor) -> torch.Tensor:
    """Inclusive running count of policy tokens along each row, ``[B, R]`` int32 (int64 if R ≥ 2**24).

    ``c[b, t] = Σ_{j ≤ t} [mask[b, j] != 0]``. For a policy token, ``c − 1`` is its column in
    the compact layout; for an environment token, ``c`` is the number of policy tokens before
    it; ``c[:, -1]`` is each row's number of policy tokens. This is the pack mapping without the
    copy: the TIR estimator keys its per-group sums on ``(group, c)`` instead of materializing
    compact arrays.
    """
    if not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2:
        raise ConfigError("response_mask must be a 2-D [batch, response_length] tensor")
    dtype = torch.float64 if response_mask.shape[1] >= _FLOAT32_EXACT else torch.float32
    return policy_counts_into((response_mask != 0).to(dtype), None)


def policy_counts_into(mask: torch.Tensor, scratch: torch.Tensor | None) -> torch.Tensor:
    """:func:`policy_counts` of a floating mask with values in [0, 1], computed inside ``scratch``.

    ``scratch`` (a float32 or float64 ``[B, R]`` buffer, overwritten; ``None`` allocates one) is
    reinterpreted as the int32/int64 result, so no new ``[B, R]`` tensor is allocated: on CPU a
    fresh 32 MB tensor costs as much as a pass of arithmetic. ``ceil`` maps every nonzero value in
    (0, 1] to 1; a floating cumulative sum is several times faster than an integer one on CPU and
    exact below 2**24 in float32 (2**53 in float64).
    """
    if scratch is None:
        scratch = torch.empty_like(mask)
    if scratch.dtype == torch.float32 and mask.shape[-1] >= _FLOAT32_EXACT:
        scratch = torch.empty_like(mask, dtype=torch.float64)
    if scratch.dtype not in (torch.float32, torch.float64) or scratch.shape != mask.shape:
        raise ConfigError(f"scratch must be a float32/float64 buffer of shape {tuple(mask.shape)}")
    torch.ceil(mask, out=scratch)
    scratch.cumsum_(-1)
    # Same-size integer view of the same memory; an elementwise copy with full overlap is safe.
    counts = scratch.view(torch.int32 if scratch.dtype == torch.float32 else torch.int64)
    counts.copy_(scratch)
    return counts


def mask_in_unit_interval(mask: torch.Tensor) -> bool:
    """True when every entry lies in [0, 1] (no NaN). One read-only reduction, no temporary.

    Estimators use the mask numerically (as verl does) and count any nonzero entry as a policy
    token; 0/1 masks are the intended input.
    """
    if mask.dtype == torch.bool or mask.numel() == 0:
        return True
    lo, hi = torch.aminmax(mask)
    return bool(lo >= 0) and bool(hi <= 1)


@dataclass(frozen=True)
class PolicyLayout:
    """Where the policy tokens of a ``[B, R]`` batch sit, and where they go in the compact layout.

    Build it once per mask with :meth:`from_mask`, then :meth:`pack` / :meth:`unpack` any number of
    tensors that share that mask.
    """

    policy_mask: torch.Tensor  # [B, R] bool: response_mask != 0
    lengths: torch.Tensor  # [B] int64: number of policy tokens per row
    compact_mask: torch.Tensor  # [B, L_max] bool: k < lengths[b]
    source_index: torch.Tensor  # [N] int64: flat index (b * R + t) of every policy token, row-major
    target_index: torch.Tensor  # [N] int64: flat index (b * L_max + k) of the same token in the compact layout

    @classmethod
    def from_mask(cls, response_mask: torch.Tensor) -> "PolicyLayout":
        if not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2:
            raise ConfigError(
                f"response_mask must be a 2-D [batch, response_length] tensor, got "
                f"{type(response_mask).__name__} with shape {tuple(getattr(response_mask, 'shape', ()))}"
            )
        policy_mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
        batch, _ = policy_mask.shape
        lengths = policy_mask.sum(dim=-1)
        max_len = int(lengths.max().item()) if batch > 0 else 0
        compact_mask = torch.arange(max_len, device=policy_mask.device).unsqueeze(0) < lengths.unsqueeze(1)
        # Both masks enumerate their True entries in row-major order with the same count per row,
        # so the j-th policy token goes to the j-th compact slot.
        source_index = policy_mask.reshape(-1).nonzero().squeeze(1)
        target_index = compact_mask.reshape(-1).nonzero().squeeze(1)
        return cls(policy_mask, lengths, compact_mask, source_index, target_index)

    @property
    def shape(self) -> tuple[int, int]:
        """The full ``(B, R)`` shape."""
        return tuple(self.policy_mask.shape)  # type: ignore[return-value]

    @property
    def max_length(self) -> int:
        """``L_max``: the largest number of policy tokens in one row."""
        return self.compact_mask.shape[1]

    def pack(self, x: torch.Tensor, pad_value: float = 0.0) -> torch.Tensor:
        """``[B, R, ...]`` → ``[B, L_max, ...]`` (policy tokens left-aligned, ``pad_value`` after)."""
        batch, resp = self.shape
        if x.shape[:2] != (batch, resp):
            raise ConfigError(f"cannot pack a tensor of shape {tuple(x.shape)} with a mask of shape {(batch, resp)}")
        trailing = x.shape[2:]
        out = x.new_full((batch * self.max_length, *trailing), pad_value)
        values = x.reshape(batch * resp, *trailing).index_select(0, self.source_index)
        out.index_copy_(0, self.target_index, values)
        return out.view(batch, self.max_length, *trailing)

    def unpack(self, compact: torch.Tensor, fill_value: float = 0.0) -> torch.Tensor:
        """``[B, L_max, ...]`` → ``[B, R, ...]`` (non-policy positions get ``fill_value``)."""
        batch, resp = self.shape
        if compact.shape[:2] != (batch, self.max_length):
            raise ConfigError(
                f"cannot unpack a tensor of shape {tuple(compact.shape)}: expected [{batch}, {self.max_length}, ...]"
            )
        trailing = compact.shape[2:]
        out = compact.new_full((batch * resp, *trailing), fill_value)
        values = compact.reshape(batch * self.max_length, *trailing).index_select(0, self.target_index)
        out.index_copy_(0, self.source_index, values)
        return out.view(batch, resp, *trailing)


def pack_policy_tokens(
    x: torch.Tensor, response_mask: torch.Tensor, pad_value: float = 0.0
) -> tuple[torch.Tensor, PolicyLayout]:
    """Compact ``x`` ``[B, R, ...]`` to its policy tokens: ``(compact [B, L_max, ...], layout)``.

    ``layout.lengths`` gives each row's number of policy tokens; pass ``layout`` to
    :func:`unpack_policy_tokens` (or use ``layout.pack`` for more tensors with the same mask).
    """
    layout = PolicyLayout.from_mask(response_mask)
    return layout.pack(x, pad_value), layout


def unpack_policy_tokens(
    compact: torch.Tensor, layout: PolicyLayout | torch.Tensor, fill_value: float = 0.0
) -> torch.Tensor:
    """Inverse of :func:`pack_policy_tokens`: ``[B, L_max, ...]`` → ``[B, R, ...]``.

    ``layout`` is the :class:`PolicyLayout` returned by the pack, or the ``[B, R]`` response mask
    itself (the layout is then rebuilt). Positions with mask 0 get ``fill_value``.
    """
    if isinstance(layout, torch.Tensor):
        layout = PolicyLayout.from_mask(layout)
    return layout.unpack(compact, fill_value)
