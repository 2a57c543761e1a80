"""The arithmetic of :class:`~agent_env.engines.hf_decode.FusedDecoder`: a Llama-family model's decode
step and prefill written out as functions of tensors only (what ``torch.compile`` traces): the RMS
norm, the rotary embedding with its halves swapped by one flip, the fused q/k/v and gate/up
projections, attention over the running batch's in-place KV buffers, the additive attention biases.
Which models they reproduce, the weights they take and the probe are in
:mod:`agent_env.engines.hf_decode`."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["attention_bias", "make_prefill", "make_step", "prefill_bias"]


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """As transformers' Llama/Qwen RMSNorm: in float32, scaled by the weight in the input's dtype.
    ``weight`` None: the weight was folded into the next projection
    (:meth:`~agent_env.engines.hf_decode.FusedDecoder.weights`)."""
    if x.dtype == torch.float32:  # one kernel for the normalisation (the same values in float32)
        y = F.rms_norm(x, (x.shape[-1],), None, eps)
    else:
        x32 = x.float()
        y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``sin`` from :func:`_rope` (its first half negated):
    the halves swapped by one flip instead of two slices, a negation and a concatenation."""
    d = x.shape[-1]
    return x * cos + x.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2) * sin


def _rope(pos: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype) -> tuple:
    """cos and sin of positions ``pos`` (any shape), with a trailing rotary dimension; the sin's
    first half negated (what :func:`_rotate` multiplies the swapped halves by)."""
    freqs = pos[..., None].float() * inv_freq.float()
    cos, sin = freqs.cos() * scale, freqs.sin() * scale  # each half once
    return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention bias of a 0/1 column mask: 0 where it keeps a column, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask == 0, float("-inf"))


def _qk_v(x: torch.Tensor, qkv_w: Any, qkv_b: Any, qk_width: int, v_width: int) -> tuple:
    """The query and key heads side by side (one norm and one rotation serve both), and the values."""
    if isinstance(qkv_w, tuple):  # unfused: q, k, v apart
        q, k, v = (F.linear(x, w, bb) for w, bb in zip(qkv_w, qkv_b))
        return torch.cat([q, k], dim=-1), v
    qk, v = F.linear(x, qkv_w, qkv_b).split([qk_width, v_width], dim=-1)
    return qk, v


def _mlp(x: torch.Tensor, gu_w: Any, gu_b: Any, down_w: torch.Tensor, down_b: Any) -> torch.Tensor:
    if isinstance(gu_w, tuple):
        gate, up = (F.linear(x, w, bb) for w, bb in zip(gu_w, gu_b))
    else:
        gate, up = F.linear(x, gu_w, gu_b).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_w, down_b)


def make_step(shape: dict[str, Any]) -> Callable:
    """The step as a function of tensors only (what ``torch.compile`` traces); ``shape``'s numbers
    are constants of it."""
    hq, hkv, d, eps, scaling = shape["hq"], shape["hkv"], shape["head_dim"], shape["eps"], shape["scaling"]
    g, qk_norm, scale_rope, sdpa = hq // hkv, shape["qk_norm"], shape["rope_scaling"], shape["sdpa"]

    def step(ids, pos, col, bias, keys, values, layers, embed, norm, head, head_bias, inv_freq):
        b = ids.shape[0]
        h = F.embedding(ids, embed)
        cos, sin = _rope(pos, inv_freq, scale_rope, h.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        # sdpa: [B, 1, 1, W]; else [B * hkv, 1, W]: a row per key/value head, broadcast over its g query heads
        bias = bias[:, None, None] if sdpa else (bias if hkv == 1 else bias.repeat_interleave(hkv, dim=0))[:, None]
        for (ln1, qkv_w, qkv_b, qk_norm_w, o_w, o_b, ln2, gu_w, gu_b, down_w, down_b), k_buf, v_buf in zip(
            layers, keys, values
        ):
            w = k_buf.shape[-2]
            qk, v = _qk_v(_rms(h, ln1, eps), qkv_w, qkv_b, (hq + hkv) * d, hkv * d)
            qk, v = qk.reshape(b, hq + hkv, d), v.reshape(b, hkv, d)
            if qk_norm:  # each head's own weight row
                qk = _rms(qk, qk_norm_w, eps)
            q, k = _rotate(qk, cos, sin).split([hq, hkv], dim=1)
            k_buf.index_copy_(2, col, k[:, :, None, :])
            v_buf.index_copy_(2, col, v[:, :, None, :])
            if sdpa:  # as the model's sdpa forward: keys/values repeated per query head (its repeat_kv)
                k_all, v_all = (x if g == 1 else x.repeat_interleave(g, dim=1) for x in (k_buf, v_buf))
                att = F.scaled_dot_product_attention(q[:, :, None, :], k_all, v_all, attn_mask=bias, scale=scaling)
            else:  # the buffers (or views of their first W columns) as [B * hkv, W, d]: no copy
                scores = torch.baddbmm(
                    bias, q.reshape(b * hkv, g, d), k_buf.reshape(b * hkv, w, d).transpose(1, 2), alpha=scaling
                )
                probs = scores.float().softmax(dim=-1).to(v_buf.dtype)
                att = torch.bmm(probs, v_buf.reshape(b * hkv, w, d))
            h = h + F.linear(att.reshape(b, hq * d), o_w, o_b)
            h = h + _mlp(_rms(h, ln2, eps), gu_w, gu_b, down_w, down_b)
        return F.linear(_rms(h, norm, eps), head, head_bias).float()

    return step


def make_prefill(shape: dict[str, Any]) -> Callable:
    """New tokens of some rows (a prompt, or a next turn on its kept keys/values) written out as the
    decode step is: ``ids``/``pos`` ``[B, L]`` (left-padded), ``bias`` ``[B, L, P+L]`` (additive:
    0 where a token attends, -inf elsewhere), per layer the kept keys/values ``[B, hkv, P, d]``
    (``P`` may be 0). Returns the last position's logits (float32) and, per layer, the keys and
    values of all ``P+L`` columns."""
    hq, hkv, d, eps, scaling = shape["hq"], shape["hkv"], shape["head_dim"], shape["eps"], shape["scaling"]
    g, qk_norm, scale_rope = hq // hkv, shape["qk_norm"], shape["rope_scaling"]

    def prefill(ids, pos, bias, past_keys, past_values, layers, embed, norm, head, head_bias, inv_freq):
        b, n = ids.shape
        h = F.embedding(ids, embed)
        cos, sin = _rope(pos, inv_freq, scale_rope, h.dtype)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        bias = bias[:, None]  # [B, 1, L, P+L]: every head
        keys, values = [], []
        for (ln1, qkv_w, qkv_b, qk_norm_w, o_w, o_b, ln2, gu_w, gu_b, down_w, down_b), k_past, v_past in zip(
            layers, past_keys, past_values
        ):
            qk, v = _qk_v(_rms(h, ln1, eps), qkv_w, qkv_b, (hq + hkv) * d, hkv * d)
            qk, v = qk.reshape(b, n, hq + hkv, d), v.reshape(b, n, hkv, d)
            if qk_norm:
                qk = _rms(qk, qk_norm_w, eps)
            q, k = _rotate(qk, cos, sin).split([hq, hkv], dim=2)
            k_all = torch.cat([k_past, k.transpose(1, 2)], dim=2)  # [B, hkv, P+L, d]
            v_all = torch.cat([v_past, v.transpose(1, 2)], dim=2)
            keys.append(k_all)
            values.append(v_all)
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2), k_all, v_all, attn_mask=bias, scale=scaling, enable_gqa=g > 1
            )
            att = att.transpose(1, 2).reshape(b, n, hq * d)
            h = h + F.linear(att, o_w, o_b)
            h = h + _mlp(_rms(h, ln2, eps), gu_w, gu_b, down_w, down_b)
        return F.linear(_rms(h[:, -1], norm, eps), head, head_bias).float(), keys, values

    return prefill


def prefill_bias(mask: torch.Tensor, new: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, L, P+L]`` additive bias of a prefill of ``new`` (= L) tokens per row after ``P`` kept
    columns, from the rows' ``[B, P+L]`` 0/1 mask: a token attends to the columns the mask keeps up to
    its own; a padding token to itself as well (so no row of scores is all -inf: it gives a finite
    value nothing reads)."""
    width = mask.shape[1]
    past = width - new
    cols = torch.arange(width, device=mask.device)
    rows = torch.arange(new, device=mask.device)[:, None] + past
    allowed = (mask[:, None, :] != 0) & (cols[None, None, :] <= rows[None]) | (cols[None, None, :] == rows[None])
    return attention_bias(allowed, dtype)
