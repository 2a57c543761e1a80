"""The actor: per-token statistics of a causal LM over a rollout batch, and the PPO update.

Works on a plain model (one process) and on an FSDP2-sharded model under ``torchrun`` alike: the
loss of each micro-batch is normalized by the token count of the whole *global* mini-batch and
multiplied by the world size, so FSDP's gradient averaging yields the exact token-mean.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from otb_tir.token_stats import TokenStats, chunk_at_most, token_stats_for_causal_lm
from otb_tir.token_stats_packing import PackedRows, pack_rows, prompt_sharing_mask_dtype
from otb_tir.trainer.config import ActorConfig
from otb_tir.trainer.distributed import TokenStatsModule
from otb_tir.trainer.ppo import Advantages, ppo_policy_loss
from otb_tir.trainer.timing import release_free_memory

logger = logging.getLogger(__name__)


@dataclass
class ActorSettings(ActorConfig):
    """The actor's knobs: the config's own ``actor`` section (:class:`~otb_tir.trainer.config.ActorConfig`,
    every field inherited, none copied) and the two values of the run it does not hold, built from the
    config by :func:`otb_tir.trainer.parts.actor_settings`."""

    temperature: float = 1.0  # the rollout's sampling temperature (log-probs of the sampled distribution)
    autocast_dtype: torch.dtype | None = None  # bf16 autocast on devices that support it

    @property
    def kl_coef(self) -> float:
        """The KL loss's weight: ``kl_loss_coef`` when ``use_kl_loss``, else 0 (no reference is scored)."""
        return self.kl_loss_coef if self.use_kl_loss else 0.0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _autocast(device: torch.device, dtype: torch.dtype | None):
    """Autocast without its weight cache: the cache would hold a low-precision copy of every weight until
    the forward ends (all layers at once, 1.1 GiB at 0.6B), where gradient checkpointing keeps only one
    layer's; without checkpointing autograd holds the copies anyway. Only a tied embedding casts twice."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=False)


def trim_padding(attention_mask: torch.Tensor, response_length: int) -> tuple[int, int]:
    """Columns ``[lo, hi)`` of a ``[b, P+R]`` micro-batch outside which every row is padding.

    Prompts are left-padded and responses right-padded, so the columns before the longest prompt
    and after the longest response carry no token of any row. The response keeps at least one
    column, the prompt at least one. Returns ``(lo, hi)``; the trimmed response length is
    ``hi − P``.
    """
    total = attention_mask.shape[1]
    prompt = total - response_length
    used = attention_mask.bool().any(dim=0)
    idx = used.nonzero().squeeze(1)
    if idx.numel() == 0:
        return 0, total
    lo = min(int(idx[0]), prompt - 1)
    hi = max(int(idx[-1]) + 1, prompt + 1) if response_length else total
    return lo, hi


def _stats(
    model, batch: dict, rows: slice | torch.Tensor, s: ActorSettings, grad: bool, sums: _Sums | None = None
) -> TokenStats:
    """Token statistics of micro-batch ``rows``, ``[b, R]`` each. The forward runs on the columns
    that hold a token of some row (see :func:`trim_padding`), or on the rows' tokens packed
    (``s.pack_rows``, :func:`packing_agrees`); causal attention makes the trimmed columns irrelevant
    to the others, and the stats of the trimmed response columns are 0. ``sums``: counts the
    columns the forward ran (``actor/forward_tokens``)."""
    resp_len = batch["responses"].shape[1]
    device = next(model.parameters()).device
    attn = batch["attention_mask"][rows]
    lo, hi = trim_padding(attn, resp_len)
    r = resp_len - (attn.shape[1] - hi)
    args = (
        batch["input_ids"][rows][:, lo:hi].to(device),
        attn[:, lo:hi].to(device),
        batch["position_ids"][rows][:, lo:hi].to(device),
    )
    lm = model.model if isinstance(model, TokenStatsModule) else model
    chunk = chunk_at_most(s.token_stats_chunk, lm.get_output_embeddings().weight.shape[0])
    # only the policy's tokens are scored: tool-result tokens and the padding after a row's end are not
    # (their statistics are 0, as every reader masks them by the response mask)
    score = batch["response_mask"][rows][:, :r].to(device) if "response_mask" in batch else None
    kw = dict(response_length=r, temperature=s.temperature, fused=s.fused_token_stats, chunk=chunk, score_mask=score)
    pack = None  # FSDP2's root (TokenStatsModule) runs padded rows
    with _autocast(device, s.autocast_dtype):
        if isinstance(model, TokenStatsModule):  # the FSDP2 root: the whole pass inside its forward
            st = TokenStats(*model(*args, **kw))
        else:
            known = _PACKING.get(model, {})
            if s.pack_rows and s.fused_token_stats and known.get("plain") is not False:
                share = prompt_sharing_mask_dtype(model) if known.get("shared") is not False else None
                pack = pack_rows(*args, r, share_prompts=share)
                if pack is not None and not packing_agrees(model, args, kw, pack):
                    pack = None
            st = token_stats_for_causal_lm(model, *args, **kw, packed=pack or False)
    if sums is not None:
        sums.forward_tokens += pack.tokens if pack is not None else args[0].numel()
        sums.forward_real_tokens += pack.real if pack is not None else int(args[1].sum())
    if r == resp_len:
        return st
    return TokenStats(*(torch.nn.functional.pad(t, (0, resp_len - r)) for t in st))


# model -> {"plain" | "shared": does that packing agree with padding} ("shared": rows sharing a prompt)
_PACKING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def packing_agrees(model, args: tuple, kw: dict, pack: PackedRows) -> bool:
    """Whether ``model`` computes the same statistics on packed rows (``pack``: :func:`pack_rows` of
    ``args``) as on padded ones, checked once per model on the first micro-batch it sees that has
    response columns (both forwards without gradient; log-probs of the real
    response tokens within 1e-4 in float32, 5e-2 in lower precision). Packing relies on the model
    building its attention mask from restarting position ids (transformers' masking utilities, or
    flash-attention's varlen call); a model that does not would let rows attend to each other. On a
    mismatch the padded forward runs from then on (the same results, slower), with a warning naming the gap.
    Rows packed with one copy of their shared prompt (``pack.attention_mask``: a 4-D mask the model
    must honour) are checked apart from plain packing; on a mismatch they pack without sharing."""
    kind = "plain" if pack.attention_mask is None else "shared"
    ok = _PACKING.get(model, {}).get(kind)
    if ok is not None:
        return ok
    input_ids, attention_mask, _ = args
    r = kw["response_length"]
    if r == 0:
        return False  # nothing to compare on this micro-batch: ask again on the next
    was_training = model.training
    model.eval()  # no dropout: the two forwards must see the same function
    try:
        with torch.no_grad():
            padded = token_stats_for_causal_lm(model, *args, **kw, packed=False).log_probs.float()
            packed = token_stats_for_causal_lm(model, *args, **kw, packed=pack).log_probs.float()
    finally:
        model.train(was_training)
    real = attention_mask[:, attention_mask.shape[1] - r :].bool()
    gap = float((padded - packed).abs()[real].max()) if bool(real.any()) else 0.0
    low = next(model.parameters()).dtype != torch.float32 or torch.is_autocast_enabled(input_ids.device.type)
    ok = gap <= (5e-2 if low else 1e-4)
    if not ok:
        logger.warning(
            "%s: log-probs of packed rows%s differ from padded rows by %.3g (it does not keep packed rows "
            "apart); the actor runs %s (actor.pack_rows=false skips this check)",
            type(model).__name__,
            " sharing their prompt" if kind == "shared" else "",
            gap,
            "rows packed without sharing prompts" if kind == "shared" else "padded rows",
        )
    _PACKING.setdefault(model, {})[kind] = ok
    return ok


def by_length(batch: dict, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ordered by their response length (stable), so that consecutive micro-batches hold rows
    of similar lengths and :func:`trim_padding` cuts more of the right padding (the aim of verl's
    dynamic batch size). No result depends on the order beyond float rounding: statistics are per
    row, and the loss's token-mean divides by the whole mini-batch's count."""
    resp = batch["responses"].shape[1]
    lengths = batch["attention_mask"][rows][:, batch["attention_mask"].shape[1] - resp :].sum(1)
    return rows[torch.argsort(lengths, stable=True)]


@torch.no_grad()
def compute_old_stats(model, batch: dict, s: ActorSettings) -> TokenStats:
    """Log-probs, entropy and Σπ² of the current policy on every response token ([B, R] each, float32 on
    the CPU, × the response mask); micro-batches of rows of similar lengths (:func:`by_length`)."""
    was_training = model.training
    model.eval()
    mask = batch["response_mask"].float()
    out = TokenStats(*(torch.zeros_like(mask) for _ in range(3)))
    order = by_length(batch, torch.arange(mask.shape[0]))
    for i in range(0, len(order), s.ppo_micro_batch_size):
        rows = order[i : i + s.ppo_micro_batch_size]
        st = _stats(model, batch, rows, s, grad=False)
        for into, got in zip(out, st):
            into[rows] = got.float().cpu()
    model.train(was_training)
    return TokenStats(*(t * mask for t in out))


def _global_tokens(mask: torch.Tensor, world: int, device: torch.device) -> float:
    """The mask = 1 count of a mini-batch over all ranks (at least 1): the token-mean's denominator."""
    num_tokens = mask.sum().to(torch.float64)
    if world > 1:
        num_tokens = num_tokens.to(device)
        dist.all_reduce(num_tokens)
        num_tokens = num_tokens.cpu()
    return float(num_tokens.clamp_min(1.0))


class _Sums:
    """The update's metrics, summed over micro-batches and mini-batches, reduced over ranks at the end."""

    def __init__(self) -> None:
        # loss terms: each micro-batch value is its share of the (rank-scaled) mini-batch token-mean → summed
        self.loss = {"actor/pg_loss": 0.0, "actor/entropy": 0.0, "actor/kl_loss": 0.0}
        self.means = {"actor/clip_frac": 0.0, "actor/ppo_kl": 0.0}
        self.grad_norm = 0.0
        self.n_micro = 0
        self.forward_tokens = 0  # columns through the update's forwards, padding included (this rank)
        self.forward_real_tokens = 0  # of those, the columns holding a token (a shared prompt's once)

    def micro_backward(
        self,
        st: TokenStats,
        old: TokenStats,
        adv: Advantages,
        mrows: torch.Tensor | slice,
        s: ActorSettings,
        ref_log_probs: torch.Tensor | None,
        num_tokens: float,
        world: int,
        device: torch.device,
    ) -> None:
        """The PPO loss of micro-batch ``mrows`` on its token statistics ``st`` (``old``: the batch's
        old statistics; ``adv``: its advantages, loss mask and IS weights), backward, summed."""
        is_w = adv.rollout_is_weights
        out = ppo_policy_loss(
            st.log_probs.float(),
            old.log_probs[mrows].to(device),
            adv.advantages[mrows].to(device),
            adv.loss_mask[mrows].to(device),
            clip_ratio_low=s.clip_ratio_low,
            clip_ratio_high=s.clip_ratio_high,
            clip_ratio_c=s.clip_ratio_c,
            ref_log_probs=None if ref_log_probs is None else ref_log_probs[mrows].to(device),
            kl_coef=s.kl_coef,
            entropy=st.entropy.float(),
            entropy_coef=s.entropy_coeff,
            num_tokens=num_tokens / world,  # FSDP averages gradients over ranks: × world undoes it
            rollout_is_weights=None if is_w is None else is_w[mrows].to(device),
        )
        out.loss.backward()
        self.loss["actor/pg_loss"] += float(out.pg_loss)
        self.loss["actor/entropy"] += float(out.entropy)
        self.loss["actor/kl_loss"] += float(out.kl_loss)
        self.means["actor/clip_frac"] += float(out.clip_frac)
        self.means["actor/ppo_kl"] += float(out.approx_kl)
        # the micro-batch's activations are free now: back to the system, or glibc's heap keeps them
        # beside the next micro-batch's (1.6 GiB a micro-batch at Qwen3-0.6B's shape; timing.release_free_memory)
        del out
        release_free_memory()
        self.n_micro += 1

    def optimizer_step(self, model, optimizer, s: ActorSettings) -> None:
        """Clip the gradient norm and step (skipped when the norm is not finite), then drop the
        gradients. ``grad_clip`` 0 is off: the norm is still measured (max norm ∞ scales by 1), the
        gradient is left as it is."""
        max_norm = s.grad_clip if s.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):  # DTensor under FSDP2: already the global norm
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if torch.isfinite(torch.tensor(grad_norm)):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # the gradients' memory is free for the rollout (2.2 GiB at 0.6B)
        self.grad_norm += grad_norm

    def metrics(self, n_mini: int, world: int, device: torch.device) -> dict[str, float]:
        keys = [*self.loss, *self.means]
        vals = torch.tensor([*self.loss.values(), *self.means.values(), float(self.n_micro)], dtype=torch.float64)
        if world > 1:
            vals = vals.to(device)
            dist.all_reduce(vals)
            vals = vals.cpu()
        n_mini = max(n_mini, 1)
        total_micro = max(float(vals[-1]), 1.0)
        metrics = {}
        for i, k in enumerate(keys):
            # a rank's summed loss terms are world × its share of the global token-mean (num_tokens / world)
            metrics[k] = float(vals[i]) / world / n_mini if k in self.loss else float(vals[i]) / total_micro
        metrics["actor/grad_norm"] = self.grad_norm / n_mini
        metrics["actor/forward_tokens"] = float(self.forward_tokens)
        metrics["actor/forward_real_tokens"] = float(self.forward_real_tokens)
        return metrics


def ppo_update(
    model,
    optimizer,
    batch: dict,
    old: TokenStats,
    adv: Advantages,
    mini_batches: list[torch.Tensor],
    s: ActorSettings,
    ref_log_probs: torch.Tensor | None = None,
) -> dict[str, float]:
    """One pass of PPO over ``mini_batches`` (lists of row indices); one optimizer step each. A
    mini-batch's micro-batches take its rows in order of length (:func:`by_length`). ``batch``: the
    rollout's tensors (read only); ``old``: :func:`compute_old_stats` of it; ``adv``: its advantages.

    Under FSDP every rank must pass the same number of mini-batches, each with the same number of
    rows (the same micro-batch count: each forward/backward is a collective). The token-mean's
    denominator is the mask=1 count of the global mini-batch (all ranks), so the averaged gradient
    equals a one-process run's on the same rows. Metrics are global: the loss terms are the
    token-means over all ranks' rows; clip fraction and ppo_kl are means of micro-batch means.
    """
    model.train()
    world = _world()
    device = next(model.parameters()).device
    sums = _Sums()
    sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2: reduce gradients once per mini-batch
    for rows in mini_batches:
        num_tokens = _global_tokens(adv.loss_mask[rows], world, device)
        rows = by_length(batch, rows)  # micro-batches of similar lengths: less padding through the model
        optimizer.zero_grad(set_to_none=True)
        starts = list(range(0, len(rows), s.ppo_micro_batch_size))
        for j in starts:
            if sync is not None:
                sync(j == starts[-1])
            mrows = rows[j : j + s.ppo_micro_batch_size]
            st = _stats(model, batch, mrows, s, grad=True, sums=sums)
            sums.micro_backward(st, old, adv, mrows, s, ref_log_probs, num_tokens, world, device)
        sums.optimizer_step(model, optimizer, s)
    return sums.metrics(len(mini_batches), world, device)


def on_policy_micro_batches(
    s: ActorSettings, uid, rows: int, rows_per_mini: int, epochs: int, group_local: bool
) -> list[torch.Tensor] | None:
    """The micro-batches of a step that takes its old statistics from the update's own forward
    (:func:`on_policy_update`), or None where it cannot.

    It can when ``actor.reuse_update_forward`` is on, for one epoch and one mini-batch (one optimizer
    step: exactly on-policy), and either one micro-batch holds all ``rows`` of this rank (any estimator),
    or the estimator is group-local (``group_local``: each group's advantages depend on its own rows
    only, as every built-in's; a registered one says so with ``fn.group_local = True``) and every
    micro-batch holds whole groups of ``uid``: groups are packed in the order of their ids into
    micro-batches of at most ``ppo_micro_batch_size`` rows; a group larger than that → None."""
    if not (s.reuse_update_forward and epochs == 1 and rows_per_mini >= rows):
        return None
    if s.ppo_micro_batch_size >= rows:
        return [torch.arange(rows)]
    if not group_local:
        return None
    import numpy as np

    _, inverse = np.unique(np.asarray(uid, dtype=object).astype(str), return_inverse=True)
    groups = [torch.as_tensor(np.flatnonzero(inverse == g)) for g in range(int(inverse.max()) + 1)]
    if max(len(g) for g in groups) > s.ppo_micro_batch_size:
        return None
    out: list[list[torch.Tensor]] = [[]]
    for g in groups:  # consecutive groups while they fit (equal group sizes: the same count on every rank)
        if sum(len(x) for x in out[-1]) + len(g) > s.ppo_micro_batch_size:
            out.append([])
        out[-1].append(g)
    return [torch.cat(x) for x in out]


def on_policy_update(
    model,
    optimizer,
    batch: dict,
    s: ActorSettings,
    micro_batches: list[torch.Tensor],
    loss_mask: torch.Tensor,
    estimate,
    ref_log_probs: torch.Tensor | None = None,
) -> tuple[TokenStats, torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """One optimizer step over the batch, exactly on-policy, one forward per micro-batch
    (:func:`on_policy_micro_batches`): each micro-batch's forward gives its old statistics (its own
    values, detached: the ratio is exactly 1, as TRL's with ``num_iterations=1``), ``estimate(rows,
    old_rows)`` their advantages and IS weights (``[b, R]`` each, the weights or None), then the loss
    on the same forward and its backward; the step after the last. The separate old-log-prob pass of
    the two-pass update (:func:`compute_old_stats`, then :func:`ppo_update`) is skipped: the same old
    statistics, advantages and update. ``loss_mask``: the whole batch's (the filters'), whose count is
    the token-mean's denominator. Returns the old statistics, the advantages (× ``loss_mask``), the IS
    weights (None without) and the update's metrics. Under FSDP every rank calls it on its own rows
    (the same number of micro-batches)."""
    model.train()
    world = _world()
    device = next(model.parameters()).device
    sums = _Sums()
    optimizer.zero_grad(set_to_none=True)
    sync = getattr(model, "set_requires_gradient_sync", None)
    mask = batch["response_mask"].float()
    old = TokenStats(*(torch.zeros_like(mask) for _ in range(3)))
    adv_all, is_all = torch.zeros_like(mask), None
    num_tokens = _global_tokens(loss_mask, world, device)
    for j, rows in enumerate(micro_batches):
        if sync is not None:
            sync(j == len(micro_batches) - 1)
        st = _stats(model, batch, rows, s, grad=True, sums=sums)
        mine = TokenStats(*(t.detach().float().cpu() * mask[rows] for t in st))
        for into, got in zip(old, mine):
            into[rows] = got
        a, is_w = estimate(rows, mine)
        adv_all[rows] = a.float() * loss_mask[rows]
        if is_w is not None:
            is_all = torch.ones_like(mask) if is_all is None else is_all
            is_all[rows] = is_w.float()
        adv = Advantages(adv_all, loss_mask, is_all)
        sums.micro_backward(st, old, adv, rows, s, ref_log_probs, num_tokens, world, device)
        del st
    sums.optimizer_step(model, optimizer, s)
    return old, adv_all, is_all, sums.metrics(1, world, device)
