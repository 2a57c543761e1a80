"""Supervised fine-tuning on chat conversations, with the loss on assistant tokens only.

The loss mask comes from the tokenizer's own chat template: the conversation is rendered prefix by
prefix (``messages[:k]`` with the generation prompt, then ``messages[:k+1]``), so the tokens an
assistant message adds after ``<|im_start|>assistant\\n`` up to and including its end-of-turn token
are exactly the tokens the policy would generate in an episode. Tool responses, user turns, the
system prompt and the template's glue are masked out.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from otb_tir import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class SFTExample:
    """One tokenized conversation: ``input_ids`` and ``loss_mask`` (1 on assistant tokens)."""

    input_ids: list[int]
    loss_mask: list[int]


def _render_ids(tokenizer, messages: list[dict[str, Any]], tools, add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_conversation(
    tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> SFTExample:
    """Render ``messages`` with the chat template and mark the assistant tokens.

    Each assistant turn contributes the tokens after the generation prompt through its eos token
    (``tokenizer.eos_token``, ``<|im_end|>`` for Qwen-style templates); whatever the template adds
    after the eos (a newline) is masked, as the policy never samples it. Raises
    :class:`ConfigError` if the template is not prefix-stable (rendering a prefix of the
    conversation does not give a prefix of the tokens), since the mask would then be wrong.
    """
    if not messages or not any(m.get("role") == "assistant" for m in messages):
        raise ConfigError("an SFT conversation needs at least one assistant message")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"tokenizer {type(tokenizer).__name__} has no chat template")
    eos_id = tokenizer.eos_token_id
    full = _render_ids(tokenizer, messages, tools, add_generation_prompt=False)
    mask = [0] * len(full)
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = len(_render_ids(tokenizer, messages[:k], tools, add_generation_prompt=True))
        upto = _render_ids(tokenizer, messages[: k + 1], tools, add_generation_prompt=False)
        if full[: len(upto)] != upto or upto[:start] != full[:start]:
            raise ConfigError(
                "the chat template is not prefix-stable: rendering the first "
                f"{k + 1} messages is not a token prefix of the whole conversation"
            )
        end = len(upto)
        if eos_id is not None and eos_id in upto[start:end]:
            end = start + upto[start:end].index(eos_id) + 1  # keep the eos, drop the template's glue after it
        for i in range(start, end):
            mask[i] = 1
    return SFTExample(full, mask)


def collate(examples: Sequence[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad into ``input_ids``, ``attention_mask`` and ``labels`` (-100 off the loss mask)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e.input_ids)
        row = torch.tensor(e.input_ids, dtype=torch.long)
        ids[r, :n] = row
        attn[r, :n] = 1
        m = torch.tensor(e.loss_mask, dtype=torch.bool)
        labels[r, :n] = torch.where(m, row, torch.full_like(row, -100))
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def _common_prefix_len(ids: torch.Tensor, attn: torch.Tensor) -> int:
    """Length of the token prefix shared by every row (within every row's real tokens)."""
    same = (ids == ids[:1]).all(dim=0) & (attn == 1).all(dim=0)
    bad = (~same).nonzero()
    return int(bad[0, 0]) if len(bad) else ids.size(1)


def _loss_from_hidden(model, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the next token where it has a label; the LM head runs on those rows only."""
    targets = labels[:, 1:]
    sel = targets != -100
    h = hidden[:, :-1][sel]
    logits = model.get_output_embeddings()(h).float()
    return torch.nn.functional.cross_entropy(logits, targets[sel], reduction="sum")


def masked_lm_loss(
    model, batch: dict[str, torch.Tensor], *, share_prefix: bool = True, min_prefix: int = 16
) -> torch.Tensor:
    """Token-mean next-token cross-entropy over the positions whose *target* has a label.

    With ``share_prefix`` the token prefix common to every row (the system prompt with the tool
    schemas, the same in every conversation) is run once with batch size 1 and its KV cache
    repeated for the batch: the same loss and gradients as the plain forward (tests check it)
    for a fraction of the compute. Only ``model.model`` / ``get_output_embeddings()`` style
    causal LMs with a KV cache use that path; anything else gets the plain forward.
    """
    ids, attn, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    n_targets = (labels[:, 1:] != -100).sum()
    if n_targets == 0:
        raise ConfigError("the batch has no labelled (assistant) tokens")
    base = getattr(model, "model", None)
    prefix = 0
    if share_prefix and base is not None and ids.size(0) > 1:
        labelled = (labels != -100).any(dim=0).nonzero()
        first_label = int(labelled[0, 0]) if len(labelled) else ids.size(1)
        # every target up to the prefix end (predicted from prefix logits) must be unlabelled
        prefix = min(_common_prefix_len(ids, attn), first_label - 1)
    if prefix < min_prefix:
        hidden = base(input_ids=ids, attention_mask=attn).last_hidden_state if base is not None else None
        if hidden is None:
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            targets = labels[:, 1:]
            return torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100
            )
        return _loss_from_hidden(model, hidden, labels) / n_targets
    bsz = ids.size(0)
    out = base(input_ids=ids[:1, :prefix], use_cache=True)
    cache = out.past_key_values
    cache.batch_repeat_interleave(bsz)
    positions = torch.arange(prefix, ids.size(1)).unsqueeze(0).expand(bsz, -1)
    hidden = base(
        input_ids=ids[:, prefix:], attention_mask=attn, past_key_values=cache, position_ids=positions, use_cache=True
    ).last_hidden_state
    # the prefix's last position predicts the first suffix token: unlabelled by construction
    return _loss_from_hidden(model, hidden, labels[:, prefix:]) / n_targets


@dataclass
class SFTConfig:
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    progress: bool = True

    def validate(self) -> None:
        for name in ("steps", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"sft.{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.lr > 0:
            raise ConfigError(f"sft.lr must be positive, got {self.lr!r}")


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def sft_train(
    model,
    examples: Sequence[SFTExample],
    pad_id: int,
    cfg: SFTConfig | None = None,
    callback: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` in place with AdamW on shuffled mini-batches of ``examples``; returns the
    loss of every step. Batches are drawn without replacement (reshuffled each epoch) with a
    ``random.Random(cfg.seed)`` so runs are reproducible. ``callback(step, loss)`` is called after
    every optimizer step (e.g. to save checkpoints); the model is in train mode then."""
    from tqdm.auto import tqdm

    cfg = cfg or SFTConfig()
    cfg.validate()
    if not examples:
        raise ConfigError("no SFT examples")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    model.train()
    order: list[int] = []
    losses: list[float] = []
    bar = tqdm(range(cfg.steps), desc="sft", disable=not cfg.progress, mininterval=2.0)
    for step in bar:
        if len(order) < cfg.batch_size:
            extra = list(range(len(examples)))
            rng.shuffle(extra)
            order.extend(extra)
        idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
        batch = collate([examples[i] for i in idx], pad_id)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = masked_lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if callback is not None:
            callback(step + 1, losses[-1])
    model.eval()
    return losses
