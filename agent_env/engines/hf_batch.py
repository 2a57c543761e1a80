"""HFEngine's running batch: the KV cache of the rows decoded together, and its bookkeeping.

The running batch is left-padded: row ``i`` of the ``DynamicCache`` layers, of the attention mask
``_mask`` ``[B, T]``, of ``_next`` (its last sampled token, not yet in the cache) and of ``_pos``
(that token's position id) belong to request ``_active[i]``. :class:`RunningBatch` (a mixin of
:class:`agent_env.engines.hf.HFEngine`, which holds that state) appends freshly prefilled rows,
prefilling them first (:meth:`RunningBatch._prefill`: fresh rows from their first token, rows that
continue a kept request on its keys/values, rows with the same tokens through the model once),
left-padding whichever side is shorter (:meth:`RunningBatch._merge`), drops finished rows and trims
the left columns that are padding for every row left (:meth:`RunningBatch._drop_rows`). Only
full-attention caches (transformers >= 4.56 ``DynamicLayer``) can be merged this way.

:class:`PrefixCache` keeps the keys/values of finished requests for the next turn of the same
conversation: a multi-turn episode's next prompt is the previous one, the turn it sampled and the
tool's answer, token for token, so its prefill needs only the new tokens (vLLM's prefix caching
does the same in blocks). Entries are bounded in bytes (least recently stored first out) and
dropped whenever the model's weights change.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from agent_env.engines.base import EngineError
from agent_env.engines.hf_sampling import Request

#: tokens a prefill's rows must have in common for the common part to go through the model once
#: (:meth:`RunningBatch._share_common_prefix`): a system prompt with its tool schemas is 100+
SHARED_PREFIX_MIN = 32
SLACK_COLUMNS = 64  # free columns a running batch's keys/values get past its last one (SlackLayer)


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The KV cache argument of ``model``'s forward under the installed transformers: ``cache`` where
    its forward takes it (transformers >= 5.2x; ``past_key_values`` is deprecated there, to go in
    5.40), ``past_key_values`` before."""
    forward = type(model).forward
    name = _CACHE_ARG.get(forward)
    if name is None:
        import inspect

        name = _CACHE_ARG[forward] = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
    return {name: cache}


def returned_cache(out: Any) -> Any:
    """The KV cache a forward returned (``out.cache``, or ``out.past_key_values`` before)."""
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values


_CACHE_ARG: dict[Any, str] = {}


def cache_layers(cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise EngineError("unsupported KV cache (needs transformers >= 4.56 DynamicCache layers)")
    for layer in layers:
        if type(layer).__name__ not in ("DynamicLayer", "SlackLayer"):
            raise EngineError(f"HFEngine batches full-attention KV caches only; this model uses {type(layer).__name__}")
    return layers


_SLACK_LAYER: type | None = None


def slack_layer_class() -> type:
    """``SlackLayer``: a transformers ``DynamicLayer`` whose keys/values are views of buffers with
    free columns after the last one, so a decode step writes its token's keys/values in place.

    ``DynamicLayer.update`` appends with ``torch.cat``, which copies the whole cache every step: at
    300 columns × 16 rows on the CPU a decode step took 8.6 ms that way and 7.6 ms with this layer
    (``benchmarks/bench_engine_decode.py``, rows ``bare`` / ``bare_slack``, recorded). Here a step
    copies only its new columns; the buffers are reallocated (with :data:`SLACK_COLUMNS` free
    columns) when they are full or when ``keys`` / ``values`` were replaced from outside (the
    running batch's merges, row drops and trims assign new tensors: the next update starts from
    those). The values the model sees are the same tensors' values, in the same
    ``[B, heads, T, dim]`` shape (a view with the buffer's strides)."""
    global _SLACK_LAYER
    if _SLACK_LAYER is None:
        from transformers.cache_utils import DynamicLayer

        class SlackLayer(DynamicLayer):
            def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
                super().__init__()
                self.dtype, self.device = keys.dtype, keys.device
                self.keys, self.values = keys, values
                self.is_initialized = True
                self._bufs: tuple[torch.Tensor, torch.Tensor] | None = None
                self._views: tuple[torch.Tensor, torch.Tensor] | None = None

            def reserve(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
                """Buffers holding the ``t`` filled columns with room for ``n`` more after them
                (reallocated when full or when ``keys``/``values`` were replaced from outside), and ``t``."""
                t = self.keys.shape[-2]
                views, bufs = self._views, self._bufs  # set together: views of bufs' first columns
                ours = views is not None and views[0] is self.keys and views[1] is self.values
                if not ours or bufs[0].shape[-2] < t + n:
                    # zeros, not empty: the free columns are masked, and 0 × NaN would still be NaN
                    bufs = tuple(
                        old.new_zeros((*old.shape[:-2], t + n + SLACK_COLUMNS, old.shape[-1]))
                        for old in (self.keys, self.values)
                    )
                    bufs[0][..., :t, :].copy_(self.keys)
                    bufs[1][..., :t, :].copy_(self.values)
                    self._bufs = bufs
                    self._views = (self.keys, self.values) = (bufs[0][..., :t, :], bufs[1][..., :t, :])
                return bufs[0], bufs[1], t

            def advance(self, n: int) -> None:
                """Take ``n`` more columns of the buffers (written by the caller) into ``keys``/``values``."""
                t = self.keys.shape[-2] + n
                self.keys, self.values = self._bufs[0][..., :t, :], self._bufs[1][..., :t, :]
                self._views = (self.keys, self.values)

            def update(self, key_states, value_states, *args, **kwargs):
                keys, values, t = self.reserve(key_states.shape[-2])
                n = key_states.shape[-2]
                keys[..., t : t + n, :].copy_(key_states)
                values[..., t : t + n, :].copy_(value_states)
                self.advance(n)
                return self.keys, self.values

        _SLACK_LAYER = SlackLayer
    return _SLACK_LAYER


def with_slack(cache) -> None:
    """Turn ``cache``'s plain ``DynamicLayer`` layers (full attention, filled) into ``SlackLayer``
    ones holding the same keys/values (see :func:`slack_layer_class`)."""
    layers = cache_layers(cache)
    cls = slack_layer_class()
    for i, layer in enumerate(layers):
        if type(layer) is not cls and layer.is_initialized and layer.keys.numel():
            layers[i] = cls(layer.keys, layer.values)


def zero_padding(cache, mask: torch.Tensor) -> None:
    # Padded positions are masked out; zeroing them makes sure no NaN can leak through 0 * NaN.
    pad = (mask == 0)[:, None, :, None]
    if pad.any():
        for layer in cache_layers(cache):
            layer.keys.masked_fill_(pad, 0.0)
            layer.values.masked_fill_(pad, 0.0)


class RunningBatch:
    """The running batch's state and the row bookkeeping over it (mixed into HFEngine): admitting
    prefilled rows, dropping finished ones. The engine supplies the model's forward and the sampler
    (``_forward``, ``_accept``) and the weights' signature."""

    model: Any
    device: torch.device
    stats: dict[str, int]
    _active: list[Request]
    _cache: Any
    _mask: torch.Tensor | None
    _next: torch.Tensor | None
    _pos: torch.Tensor | None
    _prefix: "PrefixCache"

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

    def _prefill(self, reqs: list[Request]) -> None:
        """Admit ``reqs`` in one forward: those that continue a kept request on its keys/values (only
        their new tokens go through the model) together with the rest, from their first token."""
        group: list[tuple] = []  # (request, kept tokens, kept keys/values, their mask)
        weights = self._weights_signature() if self._prefix.max_bytes else None
        for r in reqs:
            hit = self._prefix.take(r.prompt_ids + r.out_ids, weights)  # never one when the cache is off
            group.append((r, *hit) if hit else (r, 0, [], None))
        self.stats["prefix_hits"] += sum(1 for g in group if g[1])
        self.stats["prefix_tokens"] += sum(g[1] for g in group)
        if self._prefix.max_bytes:
            group = self._share_common_prefix(group)
        self._prefill_group(group)

    def _share_common_prefix(self, group: list[tuple]) -> list[tuple]:
        """Rows prefilled from their first token whose sequences start alike (different prompts after
        one system prompt and its tool schemas) get that common prefix's keys/values from one forward of
        it, as if it were kept: only their own tokens then go through the model. At least
        ``SHARED_PREFIX_MIN`` tokens in common and two distinct sequences, else ``group`` as it is."""
        fresh = [i for i, g in enumerate(group) if not g[1]]
        seqs = {tuple(group[i][0].prompt_ids + group[i][0].out_ids) for i in fresh}
        if len(seqs) < 2:
            return group  # one sequence (or none): its copies already go through the model once
        first, *rest = seqs
        n = min(len(s) for s in seqs) - 1  # every row keeps at least one token of its own to feed
        for other in rest:
            n = next((k for k in range(n) if first[k] != other[k]), n)
        if n < SHARED_PREFIX_MIN:
            return group
        from transformers import DynamicCache

        ids = torch.tensor([first[:n]], dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)[None]
        _, cache = self._forward(ids, torch.ones_like(ids), pos, DynamicCache(config=self.model.config))
        kv = [(layer.keys, layer.values) for layer in cache_layers(cache)]
        mask = torch.ones(n, dtype=torch.long)
        self.stats["prefills"] += 1
        self.stats["prefilled_tokens"] += n
        self.stats["shared_prefix_tokens"] += n * (len(seqs) - 1)
        return [(g[0], n, kv, mask) if i in fresh else g for i, g in enumerate(group)]

    def _prefill_group(self, group: list[tuple]) -> None:
        from transformers import DynamicCache

        reqs = [r for r, *_ in group]
        seqs = [r.prompt_ids + r.out_ids for r in reqs]  # out_ids is non-empty after a weight update
        # Rows with the same tokens (the n samples of one prompt; samples that wrote the same turn)
        # go through the model once and are copied.
        index: dict[tuple[tuple[int, ...], int], int] = {}
        inverse = [index.setdefault((tuple(s), g[1]), len(index)) for s, g in zip(seqs, group)]
        rows = []  # the first row of each distinct sequence, in order (its id is its place here)
        for i, j in enumerate(inverse):
            if j == len(rows):
                rows.append(i)
        past = [group[i][1] for i in rows]  # tokens kept for each row
        kept = [group[i][3].shape[0] if group[i][3] is not None else 0 for i in rows]  # their columns
        new = [seqs[i][n:] for i, n in zip(rows, past)]
        p_width, width = max(kept), max(map(len, new))
        b = len(rows)
        ids = torch.zeros((b, width), dtype=torch.long)
        mask = torch.zeros((b, p_width + width), dtype=torch.long)
        pos = torch.zeros((b, width), dtype=torch.long)
        for i, (s, n, w) in enumerate(zip(new, past, kept)):
            ids[i, width - len(s) :] = torch.tensor(s)
            if w:  # the kept keys/values' columns, left-padded to p_width
                mask[i, p_width - w : p_width] = group[rows[i]][3].cpu()
            mask[i, p_width + width - len(s) :] = 1
            pos[i, width - len(s) :] = torch.arange(n, n + len(s))
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        cache = DynamicCache(config=self.model.config)
        if p_width:
            pad = torch.nn.functional.pad
            some = next(group[i][2] for i, w in zip(rows, kept) if w)  # a kept row: the layers' shapes

            def kept_columns(i: int, w: int, layer: int, which: int) -> torch.Tensor:
                if w:
                    return pad(group[i][2][layer][which], (0, 0, p_width - w, 0))
                ref = some[layer][which]  # a row prefilled from its first token: p_width masked columns
                return ref.new_zeros((1, ref.shape[1], p_width, ref.shape[3]))

            for layer, _ in enumerate(cache_layers(cache)):
                keys = torch.cat([kept_columns(i, w, layer, 0) for i, w in zip(rows, kept)])
                values = torch.cat([kept_columns(i, w, layer, 1) for i, w in zip(rows, kept)])
                cache.update(keys, values, layer)
        logits, cache = self._forward(ids, mask, pos, cache)
        zero_padding(cache, mask)
        if p_width:  # close the gaps between kept and new columns: the row's columns, right-aligned
            order = torch.argsort(mask, dim=1, stable=True)  # padding first, then the row's own in order
            mask = mask.gather(1, order)
            start = int(mask.argmax(dim=1).min())  # the first column any row uses
            order, mask = order[:, start:], mask[:, start:]
            for layer in cache_layers(cache):
                idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
        if b < len(group):
            expand = torch.tensor(inverse, device=self.device)
            logits, mask = logits.index_select(0, expand), mask.index_select(0, expand)
            for layer in cache_layers(cache):
                layer.keys, layer.values = layer.keys.index_select(0, expand), layer.values.index_select(0, expand)
        self.stats["prefills"] += 1
        self.stats["prefilled_tokens"] += sum(map(len, new))
        self.stats["prefill_rows_shared"] += len(group) - b
        lengths = torch.tensor([len(s) for s in seqs], device=self.device)
        self._merge(reqs, cache, mask, lengths)
        first = len(self._active) - len(reqs)
        self._accept(reqs, logits, rows=range(first, first + len(reqs)))

    def _keep_for_next_turn(self, rows: list[int]) -> None:
        """Store the keys/values of the rows that finished a turn (stop or length) in the prefix cache:
        each row from its first real column (with the padding columns inside it, masked)."""
        prefix = self._prefix
        if not prefix.max_bytes or self._mask is None:
            return
        weights = self._weights_signature()
        layers = cache_layers(self._cache)
        masks = self._mask.index_select(0, torch.tensor(rows, device=self._mask.device))
        starts = masks.argmax(dim=1).tolist()  # each row's first real column (the mask is 0/1)
        counts = masks.sum(dim=1).tolist()
        for i, start, count in zip(rows, starts, counts):
            req = self._active[i]
            if req.finish_reason not in ("stop", "length"):
                continue  # aborted or failed: no next turn
            tokens = tuple((req.prompt_ids + req.out_ids)[:-1])  # the last sampled token was never fed
            if count != len(tokens) or prefix.again(tokens, weights):
                continue
            kv = [
                (layer.keys[i : i + 1, :, start:].clone(), layer.values[i : i + 1, :, start:].clone())
                for layer in layers
            ]
            prefix.put(tokens, kv, self._mask[i, start:].clone(), weights)

    def _weights_signature(self) -> Any:
        raise NotImplementedError

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def _accept(self, reqs: list[Request], logits: torch.Tensor, rows: range) -> list[int]:
        raise NotImplementedError

    def _drop_rows(self, rows: list[int]) -> None:
        self._keep_for_next_turn(rows)
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


class PrefixCache:
    """Keys/values of finished requests, keyed by the tokens they hold (see the module docstring).

    ``put`` stores one row's per-layer ``(keys, values)`` (``[1, heads, W, dim]``) and its mask
    (``[W]``, 1 on the ``T`` columns that hold its tokens, in order) under those ``T`` tokens;
    :meth:`again` counts one more store of tokens already held (samples of one prompt that wrote the
    same turn: one copy in memory, taken once per store). ``take(prompt)`` returns the longest
    stored entry whose tokens are a strict prefix of ``prompt`` (at least one new token is left to
    feed) as ``(T, kv, mask)`` and uses one of its stores up. ``weights`` is a signature of the
    model's weights (:class:`agent_env.engines.hf_weights.WeightWatch`): an entry stored under other
    weights is never returned, because its keys/values are stale. Returned tensors are shared: copy,
    never write.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise EngineError(f"prefix_cache_bytes must be >= 0 (0 = off), got {max_bytes}")
        self.max_bytes = max_bytes
        # tokens -> [per-layer (keys, values), mask, stores left]
        self._entries: OrderedDict[tuple[int, ...], list] = OrderedDict()
        self._bytes = 0
        self._weights: Any = None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    @staticmethod
    def _size(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _check(self, weights: Any) -> None:
        if weights != self._weights:
            self.clear()
            self._weights = weights

    def again(self, tokens: tuple[int, ...], weights: Any) -> bool:
        """One more store of ``tokens`` if they are held (True), else False (then :meth:`put` them)."""
        self._check(weights)
        entry = self._entries.get(tokens)
        if entry is None:
            return False
        entry[2] += 1
        self._entries.move_to_end(tokens)
        return True

    def put(
        self, tokens: tuple[int, ...], kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, weights: Any
    ) -> None:
        if self.again(tokens, weights):
            return
        size = self._size(kv)
        if not tokens or size > self.max_bytes:
            return
        self._entries[tokens] = [kv, mask, 1]  # most recently stored last
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (gone, _, _) = self._entries.popitem(last=False)
            self._bytes -= self._size(gone)

    def take(self, prompt: list[int], weights: Any) -> tuple[int, list, torch.Tensor] | None:
        self._check(weights)
        best = None
        for tokens in self._entries:
            n = len(tokens)
            if n >= len(prompt) or (best is not None and n <= len(best)) or prompt[n - 1] != tokens[-1]:
                continue  # (the last token first: most entries differ there)
            if tuple(prompt[:n]) == tokens:
                best = tokens
        if best is None:
            return None
        entry = self._entries[best]
        entry[2] -= 1
        if entry[2] == 0:
            del self._entries[best]
            self._bytes -= self._size(entry[0])
        return len(best), entry[0], entry[1]
