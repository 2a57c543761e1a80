"""HFEngine's decode step written out for the Llama family, eager or compiled.

A decode step feeds one token per running row. On a small policy on the CPU the model's own
``forward`` spends most of that step in Python and dispatch: transformers' cache classes, mask
building, one small matrix product per projection, output dataclasses. :class:`FusedDecoder` does the
same arithmetic from the model's own weights in one function: the query/key/value and gate/up
projections each in one matrix product (their weights concatenated again whenever they change:
:class:`agent_env.engines.hf_weights.WeightWatch` says when), the token's keys/values written in
place into the running batch's KV buffers (:func:`agent_env.engines.hf_batch.slack_layer_class`),
attention as two batched products over the whole buffers with the columns past the token masked (so
their shapes change only when they grow, every 64 columns) when compiled, over views of the filled
columns when eager, no cache objects, the RMSNorm weights folded into the projections after them, the
rotary halves swapped by one flip. In bfloat16/float16 it is the model's forward to the bit instead
(measured on the CPU): no norm folded, attention by sdpa as the model's (either one otherwise:
log-probs 2e-3 to 6e-3 off), and ``compiled`` runs eagerly (inductor rounds those dtypes otherwise:
7.9e-3), saying why. ``compiled=True`` puts it through ``torch.compile`` (inductor, shapes dynamic so
rows joining and leaving and the growing width do not recompile); the first call compiles (its
seconds are in :attr:`FusedDecoder.compile_s`), torch keeps the result in its on-disk cache for the
next process. The step's and the prefill's arithmetic, as functions of tensors, is in
:mod:`agent_env.engines.hf_forward`; which models, the weights they take and the probe, here.

Measured on 2 cores: the built-in policy's forward alone, 16 rows, ~100 columns, one thread: the
model's 7.1 ms, this step's 3.2 ms eager, 1.8 ms compiled (compiling took 19 s the first time, 4.4 s
from torch's cache); the engine's whole decode step (``benchmarks/bench_engine_decode.py``, recorded
in docs/results.md): 7.8 ms with the model's forward, 6.4 fused, 4.2 compiled. The eager step's
attention over the filled columns only, the folded norm weights and the one-flip rotation
(2026-12-06): 3.0-3.2 → 2.4-2.5 ms for the forward alone (16 rows, 181 of 245 columns filled, one
thread, the two versions run in turn three times).

The engine's prefills (new rows, and next turns on their kept keys/values) go through the same
weights written out for many tokens a row (:meth:`FusedDecoder.prefill`, always eager; attention by
``scaled_dot_product_attention`` as the model's own sdpa forward): a next turn's 10-40 tokens on a
row's 200-300 kept columns took 1.8-2.6 ms against the model's 2.5-3.5 ms, a group's first prompt
(4 rows × 150 tokens) 19-20 against 20.5 ms (one thread, 2026-12-06, a diagnostic A/B in one process).

Which models: :func:`unsupported` says why a model is not one it reproduces (the checks are on the
modules, not only the name: Qwen2, Qwen3 and Llama layers, SiLU MLP, RMS norms, a rotary embedding
with a fixed ``inv_freq``, full attention everywhere). A model that passes them still gets a
probe when the decoder is built (:meth:`FusedDecoder.probe`): a few tokens through the model's own
forward and through this step and its prefill, log-probs compared (float32: within 1e-3, measured
~1e-6; bfloat16/float16: within :data:`PROBE_TOL`, the same logits); a mismatch is an ``EngineError``
naming the gap.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from agent_env.engines.base import EngineError
from agent_env.engines.hf_batch import cache_kwargs, cache_layers, returned_cache, with_slack
from agent_env.engines.hf_forward import attention_bias, make_prefill, make_step, prefill_bias
from agent_env.engines.hf_weights import WeightWatch

logger = logging.getLogger(__name__)

__all__ = ["DECODE_STEPS", "FusedDecoder", "unsupported"]

DECODE_STEPS = ("auto", "model", "fused", "compiled")
MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama"})
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})  # inv_freq fixed at load time
FUSE_BYTES = 512 * 2**20  # concatenate q/k/v and gate/up weights (one copy of them) up to this model size
PROBE_TOL = 1e-5  # bfloat16/float16: the same logits (the eager step is the model's forward to the bit)


def unsupported(model: Any) -> str | None:
    """Why ``model`` is not one :class:`FusedDecoder` reproduces, or None."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in MODEL_TYPES:
        return f"model_type {kind!r} is not one of {sorted(MODEL_TYPES)}"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(cfg, 'hidden_act', None)!r} (the written-out MLP is SiLU-gated)"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return "some layers use sliding-window attention"
    if getattr(cfg, "use_sliding_window", False):
        return "use_sliding_window is set"
    inner = getattr(model, "model", None)
    rope = getattr(inner, "rotary_emb", None)
    if rope is None or not isinstance(getattr(rope, "inv_freq", None), torch.Tensor):
        return "no rotary embedding with an inv_freq buffer"
    if getattr(rope, "rope_type", "default") not in STATIC_ROPE:
        return f"rope_type {rope.rope_type!r} changes its frequencies with the length"
    for layer in getattr(inner, "layers", None) or ():
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(type(m) is torch.nn.Linear for m in linears):
            return "a layer's projections are not plain torch Linear modules (quantized or adapted?)"
        if not hasattr(layer, "input_layernorm") or not hasattr(layer, "post_attention_layernorm"):
            return "a layer without input/post-attention norms"
    if not getattr(inner, "layers", None):
        return "no decoder layers at model.model.layers"
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "attn_logit_softcapping", None):
        return "logit soft-capping"
    return None


class FusedDecoder:
    """One decode step of the running batch through ``model``'s weights (see the module docstring).

    Args:
        model: a causal LM that :func:`unsupported` accepts.
        compiled: put the step through ``torch.compile``; if compiling fails, the eager step runs
            on and :attr:`compile_error` says why (logged; the engine's ``compile_error``).
        probe: compare with the model's own forward now (:meth:`probe`).
        watch: what tells when the weights changed (the engine's, so that its ``update_weights``
            reaches the step); None: one of its own.
    """

    def __init__(
        self, model: Any, compiled: bool = False, probe: bool = True, watch: WeightWatch | None = None
    ) -> None:
        why = unsupported(model)
        if why:
            raise EngineError(f"the fused decode step does not cover this model: {why}")
        self.model = model
        cfg = model.config
        inner = model.model
        attn = inner.layers[0].self_attn
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
        self._watch = watch if watch is not None else WeightWatch(model)
        params = self._watch.params
        low = any(p.dtype != torch.float32 for p in params)  # bfloat16 / float16
        self.shape = {
            "hq": hq,
            "hkv": hkv,
            "head_dim": head_dim,
            "eps": float(inner.layers[0].input_layernorm.variance_epsilon),
            "scaling": float(getattr(attn, "scaling", head_dim**-0.5)),
            "qk_norm": hasattr(attn, "q_norm"),
            "rope_scaling": float(getattr(inner.rotary_emb, "attention_scaling", 1.0)),
            "sdpa": low,  # attention as the model's sdpa (fp32 inside; two products round to the dtype)
        }
        self.fuse = sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values()) <= FUSE_BYTES
        # float32 only: in bfloat16/float16 W · diag(w) rounds otherwise than the model's w * x, then W
        self.fold = self.fuse and not low
        self._eager = make_step(self.shape)
        self._prefill = make_prefill(self.shape)
        self._fn = self._eager
        self.compiled = False
        self.compile_s: float | None = None
        self.compile_error: str | None = None
        if compiled and low:  # as a failed compile: the eager step runs, and says why
            self._compile_failed(
                "float32 only: torch.compile's kernels round bfloat16/float16 otherwise than the model's "
                "forward (7.9e-3 apart in log-probs on the built-in policy in bfloat16)"
            )
        elif compiled:
            try:
                self._fn = torch.compile(self._eager, dynamic=True)
                self.compiled = True
            except Exception as exc:  # noqa: BLE001 - reported, the eager step runs on
                self._compile_failed(exc)
        self._weights: tuple | None = None
        self._signature: Any = None
        if probe:
            self.probe()

    # ------------------------------------------------------------------ weights

    def weights(self) -> tuple:
        """The step's weight arguments; q/k/v and gate/up concatenated again after any change.

        With the projections concatenated (models up to :data:`FUSE_BYTES`) in float32, each
        RMSNorm's weight is folded into the projection after it (``W · diag(w)``: the input norm's
        into q/k/v, the post-attention norm's into gate/up, the final norm's into a copy of the LM
        head), and its place holds None: one multiplication less per norm and step. Not in other
        dtypes, where the fold rounds differently from the model (:attr:`fold`)."""
        sig = self._watch.signature()
        if self._weights is not None and sig == self._signature:
            return self._weights
        inner = self.model.model

        def pair(*mods):
            ws, bs = tuple(m.weight for m in mods), tuple(m.bias for m in mods)
            if not self.fuse:
                return ws, bs
            bias = (
                None
                if all(x is None for x in bs)
                else torch.cat([x if x is not None else w.new_zeros(w.shape[0]) for x, w in zip(bs, ws)])
            )
            return torch.cat(ws).detach(), bias if bias is None else bias.detach()

        def fold(w: Any, norm: torch.Tensor) -> tuple[Any, torch.Tensor | None]:
            return ((w * norm.detach()[None, :]), None) if self.fold else (w, norm)

        layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            qkv_w, qkv_b = pair(a.q_proj, a.k_proj, a.v_proj)
            gu_w, gu_b = pair(m.gate_proj, m.up_proj)
            qkv_w, ln1 = fold(qkv_w, layer.input_layernorm.weight)
            gu_w, ln2 = fold(gu_w, layer.post_attention_layernorm.weight)
            qk_norm = None
            if self.shape["qk_norm"]:  # a row per query head, then per key head: [hq + hkv, head_dim]
                hq, hkv, d = self.shape["hq"], self.shape["hkv"], self.shape["head_dim"]
                qk_norm = torch.cat([a.q_norm.weight.expand(hq, d), a.k_norm.weight.expand(hkv, d)]).detach()
            layers.append(
                (
                    ln1,
                    qkv_w,
                    qkv_b,
                    qk_norm,
                    a.o_proj.weight,
                    a.o_proj.bias,
                    ln2,
                    gu_w,
                    gu_b,
                    m.down_proj.weight,
                    m.down_proj.bias,
                )
            )
        head = self.model.get_output_embeddings()
        head_w, norm = fold(head.weight.detach(), inner.norm.weight)
        self._weights = (
            tuple(layers),
            inner.embed_tokens.weight,
            norm,
            head_w,
            getattr(head, "bias", None),
            inner.rotary_emb.inv_freq,
        )
        self._signature = sig
        return self._weights

    # ------------------------------------------------------------------ the step

    def _compile_failed(self, exc: BaseException | str) -> None:
        self.compile_error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"[:500]
        self._fn, self.compiled = self._eager, False
        logger.warning("torch.compile of the fused decode step failed, running it eagerly: %s", self.compile_error)

    @torch.no_grad()
    def step(
        self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, layers: list, eager: bool = False
    ) -> torch.Tensor:
        """Logits ``[B, V]`` (float32) for ``ids`` ``[B]`` at positions ``pos`` ``[B]``; ``mask``
        ``[B, T+1]`` covers the ``T`` cached columns and this token's. ``layers``: the running
        batch's ``SlackLayer`` s, whose buffers get this token's keys/values at column ``T``.
        ``eager``: the eager step even when compiled (the probe)."""
        t = mask.shape[1] - 1
        bufs = [layer.reserve(1) for layer in layers]
        keys, values = [k for k, _, _ in bufs], [v for _, v, _ in bufs]
        cap = keys[0].shape[-2]
        if any(filled != t for _, _, filled in bufs) or any(k.shape[-2] != cap for k in keys):
            raise EngineError("the running batch's KV layers and its mask disagree on the width")
        col = torch.tensor([t], device=mask.device)
        w = self.weights()
        if eager or ids.shape[0] < 2 or not self.compiled:  # compiled code is traced for 2+ rows
            # eager: views of the filled columns (attention reads t + 1 columns, not the whole capacity)
            bias = attention_bias(mask, keys[0].dtype)
            view = [k[:, :, : t + 1] for k in keys], [v[:, :, : t + 1] for v in values]
            out = self._eager(ids, pos, col, bias, *view, *w)
        else:
            # compiled: the whole buffers (their columns past this token's masked out), not views of the
            # filled columns: a view's strides would change with the buffer's capacity, and compiled code
            # guards on them (recompiling every time the buffers grow)
            full = mask.new_zeros((mask.shape[0], cap))
            full[:, : t + 1] = mask
            bias = attention_bias(full, keys[0].dtype)
            args = (ids, pos, col, bias, keys, values, *w)
            if self.compile_s is None:
                t0 = time.perf_counter()
                try:
                    out = self._fn(*args)
                except Exception as exc:  # noqa: BLE001 - reported, the eager step runs on
                    self._compile_failed(exc)
                    out = self._eager(*args)
                self.compile_s = time.perf_counter() - t0
                logger.info("fused decode step compiled in %.1f s", self.compile_s)
            else:
                out = self._fn(*args)
        for layer in layers:
            layer.advance(1)
        return out

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """The model's forward over new tokens, as the engine's prefill calls it (always eager: the
        shapes change with every call): ``ids``/``pos`` ``[B, L]`` left-padded, ``mask`` ``[B, P+L]``
        over ``cache``'s ``P`` columns (kept keys/values, or none) and the new ones. Returns the last
        token's logits ``[B, V]`` (float32) and a ``DynamicCache`` holding all ``P+L`` columns."""
        from transformers import DynamicCache

        layers = cache_layers(cache)
        n = ids.shape[1]
        past = mask.shape[1] - n
        w = self.weights()
        embed = w[1]
        if past:
            keys, values = [layer.keys for layer in layers], [layer.values for layer in layers]
            if any(k.shape[-2] != past for k in keys):
                raise EngineError("the prefill's kept keys/values and its mask disagree on the width")
        else:
            empty = embed.new_zeros((ids.shape[0], self.shape["hkv"], 0, self.shape["head_dim"]))
            keys = values = [empty] * len(layers)
        logits, keys, values = self._prefill(ids, pos, prefill_bias(mask, n, embed.dtype), keys, values, *w)
        out = DynamicCache(config=self.model.config)
        for i, (k, v) in enumerate(zip(keys, values)):
            out.update(k, v, i)
        return logits, out

    @torch.no_grad()
    def probe(self, rows: int = 2, tokens: int = 5) -> float:
        """Run a short left-padded batch through the model's forward and through this step, from the
        same cache; raise ``EngineError`` if their log-probs differ by more than the dtype allows.
        Returns the largest difference."""
        from transformers import DynamicCache

        model = self.model
        dev = next(model.parameters()).device
        vocab = model.get_input_embeddings().weight.shape[0]
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (rows, tokens), generator=g).to(dev)
        mask = torch.ones(rows, tokens, dtype=torch.long, device=dev)
        mask[1:, :2] = 0  # later rows left-padded
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        was_training = model.training
        model.eval()
        try:
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                use_cache=True,
                **cache_kwargs(model, DynamicCache(config=model.config)),
            )
            cache = returned_cache(out)
            nxt = out.logits[:, -1].argmax(-1)
            step_mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
            step_pos = pos[:, -1] + 1
            mine = DynamicCache(config=model.config)
            for i, layer in enumerate(cache_layers(cache)):
                mine.update(layer.keys.clone(), layer.values.clone(), i)
            with_slack(mine)
            ref = (
                model(
                    input_ids=nxt[:, None],
                    attention_mask=step_mask,
                    position_ids=step_pos[:, None],
                    use_cache=True,
                    **cache_kwargs(model, cache),
                )
                .logits[:, -1]
                .float()
            )
            got = self.step(nxt, step_pos, step_mask, cache_layers(mine), eager=True)
            # the written-out prefill: its last logits, and a step on the keys/values it wrote
            first, written = self.prefill(ids, mask, pos, DynamicCache(config=model.config))
            with_slack(written)
            after = self.step(nxt, step_pos, step_mask, cache_layers(written), eager=True)
        finally:
            if was_training:
                model.train()
        gap = max(
            float((a.log_softmax(-1) - b.log_softmax(-1)).abs().max())
            for a, b in ((ref, got), (out.logits[:, -1].float(), first), (ref, after))
        )
        tol = PROBE_TOL if self.shape["sdpa"] else 1e-3  # float32: measured ~1e-6 (the folds round)
        if not gap <= tol:  # NaN too
            raise EngineError(
                f"the fused decode step (or its prefill) does not reproduce this model's forward: log-probs "
                f"differ by {gap:.3g} (allowed {tol}); use decode_step='model'"
            )
        return gap
