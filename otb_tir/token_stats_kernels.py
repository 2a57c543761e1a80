"""The chunked kernels behind :mod:`otb_tir.token_stats`: the per-chunk forward (log π of the label,
entropy, Σπ² of one ``[c, V]`` chunk of logits) and backward (the logits' gradient of whichever of
the three outputs received one) in plain torch, and the two autograd functions that run them chunk
by chunk over flattened inputs: :class:`LogitsStats` on logits ``[N, V]`` and :class:`HiddenStats`
on last hidden states ``[N, H]`` with the LM head, recomputing one chunk's logits at a time in the
forward and the backward pass so the ``[N, V]`` logits never exist. The maths and the gradient
formulas are in :mod:`otb_tir.token_stats`'s docstring; inputs are validated there.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HiddenStats", "LogitsStats", "compute_dtype", "rowdot"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the statistics are accumulated in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# the per-chunk kernels (plain torch; one chunk = [c, V]). Working buffers are allocated once per
# call and reused by every chunk: fresh multi-MB allocations page-fault on every chunk (on CPU a
# fresh buffer made `exp` 4x slower than writing into a reused one).

# log π and z − max z are clamped here before they multiply π: below it π is exactly 0 in float32
# (exp underflows below −104) and float64 (below −746), so the clamp changes no finite product
# and turns 0·(−inf) (a masked vocabulary entry) into 0 instead of NaN.
_LOG_FLOOR = -1.0e4


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot products of two [c, V] tensors without a [c, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0])


def _forward_chunk(
    x: torch.Tensor, labels: torch.Tensor, temperature: float, zs: torch.Tensor, e: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """(log π(label), entropy, Σπ², max x, log Σ exp(z − max z)) of one chunk of raw logits ``x``.

    ``zs`` and ``e`` are [c, V] compute-dtype buffers (``x`` may be ``zs`` itself).
    """
    m = x.amax(dim=-1, keepdim=True).to(zs.dtype)
    torch.sub(x, m, out=zs)
    if temperature != 1.0:
        zs.div_(temperature)  # zs = z − max z ≤ 0, with z = x / T
    torch.exp(zs, out=e)
    s = e.sum(dim=-1)
    s2 = rowdot(e, e)
    lp = zs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    zs.clamp_min_(_LOG_FLOOR)
    ez = rowdot(e, zs)
    log_s = s.log()
    return lp - log_s, log_s - ez / s, s2 / (s * s), m.squeeze(-1), log_s


def _grad_chunk(
    x: torch.Tensor,
    labels: torch.Tensor,
    m: torch.Tensor,
    log_s: torch.Tensor,
    ent: torch.Tensor,
    sp: torch.Tensor,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    g_sp: torch.Tensor | None,
    temperature: float,
    logp: torch.Tensor,
    p: torch.Tensor,
) -> torch.Tensor:
    """d(loss)/d(raw logits) of one chunk, written into (and returned as) the buffer ``p``.

    grad_z = π·(a − g_H·log π + 2·g_sp·π) + g_lp·onehot(label), a = −g_lp − g_H·H − 2·g_sp·Σπ²;
    then divided by T. ``x`` may be ``logp`` itself.
    """
    torch.sub(x, m.unsqueeze(-1), out=logp)
    if temperature != 1.0:
        logp.div_(temperature)
    logp.sub_(log_s.unsqueeze(-1))  # log π, exactly as in the forward pass
    torch.exp(logp, out=p)
    a = torch.zeros_like(m)
    if g_lp is not None:
        a = a - g_lp
    if g_ent is not None:
        a = a - g_ent * ent
    if g_sp is not None:
        a = a - 2.0 * g_sp * sp
    if g_ent is None and g_sp is None:
        grad = p.mul_(a.unsqueeze(-1))
    else:
        inner = logp
        if g_ent is not None:
            inner.clamp_min_(_LOG_FLOOR).mul_(-g_ent.unsqueeze(-1)).add_(a.unsqueeze(-1))
        else:
            inner.zero_().add_(a.unsqueeze(-1))
        if g_sp is not None:
            inner.addcmul_(p, (2.0 * g_sp).unsqueeze(-1))
        grad = p.mul_(inner)
    if g_lp is not None:
        grad.scatter_add_(-1, labels.unsqueeze(-1), g_lp.unsqueeze(-1))
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


def _grads(g_lp, g_ent, g_sp, sl: slice, cd: torch.dtype):
    return tuple(None if g is None else g[sl].to(cd) for g in (g_lp, g_ent, g_sp))


# --------------------------------------------------------------------------------------------
# autograd functions (inputs already flattened: logits [N, V] / hidden [N, H], labels [N])


class LogitsStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, temperature: float, chunk: int):
        n, vocab = logits.shape
        cd = compute_dtype(logits.dtype)
        out = [torch.empty(n, dtype=cd, device=logits.device) for _ in range(5)]
        c = min(chunk, n)
        zbuf = torch.empty(c, vocab, dtype=cd, device=logits.device)
        ebuf = torch.empty_like(zbuf)
        for i in range(0, n, chunk):
            j = min(i + chunk, n)
            r = _forward_chunk(logits[i:j], labels[i:j], temperature, zbuf[: j - i], ebuf[: j - i])
            for dst, src in zip(out, r):
                dst[i:j] = src
        del zbuf, ebuf
        lp, ent, sp, m, log_s = out
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, labels, m, log_s, ent, sp)
        ctx.temperature, ctx.chunk = temperature, chunk
        return lp, ent, sp

    @staticmethod
    def backward(ctx: Any, g_lp, g_ent, g_sp):
        logits, labels, m, log_s, ent, sp = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (g_lp is None and g_ent is None and g_sp is None):
            return None, None, None, None
        n, vocab = logits.shape
        cd = compute_dtype(logits.dtype)
        grad = torch.empty(n, vocab, dtype=logits.dtype, device=logits.device)
        c = min(ctx.chunk, n)
        zbuf = torch.empty(c, vocab, dtype=cd, device=logits.device)
        pbuf = None if cd == logits.dtype else torch.empty_like(zbuf)
        for i in range(0, n, ctx.chunk):
            j = min(i + ctx.chunk, n)
            sl = slice(i, j)
            p = grad[sl] if pbuf is None else pbuf[: j - i]  # write in place when dtypes agree
            g = _grad_chunk(
                logits[sl], labels[sl], m[sl], log_s[sl], ent[sl], sp[sl], *_grads(g_lp, g_ent, g_sp, sl, cd),
                ctx.temperature, zbuf[: j - i], p,
            )  # fmt: skip
            if pbuf is not None:
                grad[sl] = g
        return grad, None, None, None


def _project(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """Raw logits ``h @ W.T (+ b)`` of one chunk into ``out``, in the input dtype (as ``nn.Linear``)."""
    if bias is None:
        return torch.mm(h, weight.T, out=out)
    return torch.addmm(bias, h, weight.T, out=out)


class HiddenStats(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        temperature: float,
        chunk: int,
    ):
        n = hidden.shape[0]
        vocab = weight.shape[0]
        cd = compute_dtype(hidden.dtype)
        out = [torch.empty(n, dtype=cd, device=hidden.device) for _ in range(5)]
        c = min(chunk, n)
        zbuf = torch.empty(c, vocab, dtype=cd, device=hidden.device)
        ebuf = torch.empty_like(zbuf)
        rawbuf = zbuf if hidden.dtype == cd else torch.empty(c, vocab, dtype=hidden.dtype, device=hidden.device)
        for i in range(0, n, chunk):
            j = min(i + chunk, n)
            raw = _project(hidden[i:j], weight, bias, rawbuf[: j - i])
            r = _forward_chunk(raw, labels[i:j], temperature, zbuf[: j - i], ebuf[: j - i])
            for dst, src in zip(out, r):
                dst[i:j] = src
        del zbuf, ebuf, rawbuf
        lp, ent, sp, m, log_s = out
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, m, log_s, ent, sp)
        ctx.temperature, ctx.chunk = temperature, chunk
        return lp, ent, sp

    @staticmethod
    def backward(ctx: Any, g_lp, g_ent, g_sp):
        hidden, weight, bias, labels, m, log_s, ent, sp = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not (need_h or need_w or need_b) or (g_lp is None and g_ent is None and g_sp is None):
            return None, None, None, None, None, None
        n = hidden.shape[0]
        vocab = weight.shape[0]
        dt = hidden.dtype
        cd = compute_dtype(dt)
        gh = torch.empty(hidden.shape, dtype=dt, device=hidden.device) if need_h else None
        # weight / bias gradients are summed over chunks in the compute dtype (float32 for bf16).
        gw = torch.zeros(weight.shape, dtype=cd, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=cd, device=bias.device) if need_b else None
        c = min(ctx.chunk, n)
        zbuf = torch.empty(c, vocab, dtype=cd, device=hidden.device)
        pbuf = torch.empty_like(zbuf)
        rawbuf = zbuf if dt == cd else torch.empty(c, vocab, dtype=dt, device=hidden.device)
        for i in range(0, n, ctx.chunk):
            j = min(i + ctx.chunk, n)
            sl = slice(i, j)
            h = hidden[sl]
            raw = _project(h, weight, bias, rawbuf[: j - i])
            g = _grad_chunk(
                raw, labels[sl], m[sl], log_s[sl], ent[sl], sp[sl], *_grads(g_lp, g_ent, g_sp, sl, cd),
                ctx.temperature, zbuf[: j - i], pbuf[: j - i],
            )  # fmt: skip
            if gw is not None:
                gw.addmm_(g.mT, h.to(cd))
            if gb is not None:
                gb += g.sum(0)
            if gh is not None:
                if dt != cd:
                    g = rawbuf[: j - i].copy_(g)  # the logits' gradient in the input dtype, as autograd would
                torch.mm(g, weight, out=gh[sl])
        gw = None if gw is None else gw.to(weight.dtype)
        gb = None if gb is None else gb.to(bias.dtype)
        return gh, gw, gb, None, None, None
