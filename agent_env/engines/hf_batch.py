"""HFEngine's running batch: the KV cache of the rows decoded together, and its bookkeeping.

The running batch is left-padded: row ``i`` of the ``DynamicCache`` layers, of the attention mask
``_mask`` ``[B, T]``, of ``_next`` (its last sampled token, not yet in the cache) and of ``_pos``
(that token's position id) belong to request ``_active[i]``. :class:`RunningBatch` (a mixin of
:class:`agent_env.engines.hf.HFEngine`, which holds that state) appends freshly prefilled rows,
left-padding whichever side is shorter (:meth:`RunningBatch._merge`), drops finished rows and trims
the left columns that are padding for every row left (:meth:`RunningBatch._drop_rows`). Only
full-attention caches (transformers >= 4.56 ``DynamicLayer``) can be merged this way.
"""

from __future__ import annotations

from typing import Any

import torch

from agent_env.engines.base import EngineError
from agent_env.engines.hf_sampling import Request


def cache_layers(cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise EngineError("unsupported KV cache (needs transformers >= 4.56 DynamicCache layers)")
    for layer in layers:
        if type(layer).__name__ != "DynamicLayer":
            raise EngineError(f"HFEngine batches full-attention KV caches only; this model uses {type(layer).__name__}")
    return layers


def zero_padding(cache, mask: torch.Tensor) -> None:
    # Padded positions are masked out; zeroing them makes sure no NaN can leak through 0 * NaN.
    pad = (mask == 0)[:, None, :, None]
    if pad.any():
        for layer in cache_layers(cache):
            layer.keys.masked_fill_(pad, 0.0)
            layer.values.masked_fill_(pad, 0.0)


class RunningBatch:
    """The running batch's state and the row bookkeeping over it (mixed into HFEngine)."""

    device: torch.device
    _active: list[Request]
    _cache: Any
    _mask: torch.Tensor | None
    _next: torch.Tensor | None
    _pos: torch.Tensor | None

    def _reset_batch(self) -> None:
        self._active = []
        self._cache = self._mask = self._next = self._pos = None

    def _merge(self, reqs: list[Request], cache, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        """Append prefilled rows to the running batch, left-padding whichever side is shorter."""
        n = len(reqs)
        new_next = torch.zeros(n, dtype=torch.long, device=self.device)
        if not self._active:
            self._active = list(reqs)
            self._cache, self._mask, self._next, self._pos = cache, mask, new_next, lengths.clone()
            return
        assert self._mask is not None and self._next is not None and self._pos is not None
        t_old, t_new = self._mask.shape[1], mask.shape[1]
        width = max(t_old, t_new)
        old_layers, new_layers = cache_layers(self._cache), cache_layers(cache)
        for old, new in zip(old_layers, new_layers):
            for name in ("keys", "values"):
                a, b = getattr(old, name), getattr(new, name)
                a = torch.nn.functional.pad(a, (0, 0, width - t_old, 0))
                b = torch.nn.functional.pad(b, (0, 0, width - t_new, 0))
                setattr(old, name, torch.cat([a, b], dim=0))
        self._mask = torch.cat(
            [
                torch.nn.functional.pad(self._mask, (width - t_old, 0)),
                torch.nn.functional.pad(mask, (width - t_new, 0)),
            ],
            dim=0,
        )
        self._next = torch.cat([self._next, new_next])
        self._pos = torch.cat([self._pos, lengths])
        self._active.extend(reqs)

    def _drop_rows(self, rows: list[int]) -> None:
        gone = set(rows)
        keep = [i for i in range(len(self._active)) if i not in gone]
        if not keep:
            self._reset_batch()
            return
        assert self._mask is not None and self._next is not None and self._pos is not None
        idx = torch.tensor(keep, device=self.device)
        mask = self._mask.index_select(0, idx)
        # Trim left columns that are padding for every remaining row.
        live = mask.any(dim=0).nonzero()
        start = int(live[0]) if len(live) else 0
        for layer in cache_layers(self._cache):
            layer.keys = layer.keys.index_select(0, idx)[:, :, start:, :]
            layer.values = layer.values.index_select(0, idx)[:, :, start:, :]
        self._mask = mask[:, start:]
        self._next = self._next.index_select(0, idx)
        self._pos = self._pos.index_select(0, idx)
        self._active = [self._active[i] for i in keep]
