"""HFEngine's model: loading it (or copying the caller's), its eos ids, and copying new weights into it
(:meth:`~agent_env.engines.hf.HFEngine.update_weights`), each check an :class:`EngineError` naming
what is wrong."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from agent_env.engines.base import EngineError

__all__ = ["copy_weights", "eos_ids", "load_model"]


def load_model(
    model_or_path: Any,
    tokenizer: Any,
    *,
    device: str | torch.device,
    dtype: torch.dtype | str | None,
    share_weights: bool,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` as the engine keeps them (see :class:`~agent_env.engines.hf.HFEngine`'s
    arguments): the model loaded from a folder or deep-copied (the caller's own with
    ``share_weights``), on ``device`` in ``dtype``, in eval mode without gradients unless shared; the
    tokenizer loaded from its folder (the model's by default)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise EngineError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16', 'float16'")
        dtype = getattr(torch, dtype)
    if isinstance(model_or_path, (str, os.PathLike)):
        path = Path(model_or_path).expanduser()
        if not (path / "config.json").is_file():
            raise EngineError(f"no model folder at {path} (expected a config.json saved by save_pretrained)")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
        except (OSError, ValueError) as exc:
            raise EngineError(f"could not load a causal LM from {path}: {exc}") from exc
        model.to(device)
        if tokenizer is None:
            tokenizer = path
    elif isinstance(model_or_path, torch.nn.Module):
        if share_weights:
            model = model_or_path
        else:
            model = copy.deepcopy(model_or_path)
            model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    else:
        raise EngineError(f"model_or_path must be a model folder or a torch module, got {type(model_or_path).__name__}")
    if not isinstance(model, PreTrainedModel):
        raise EngineError("HFEngine needs a transformers PreTrainedModel (causal LM with a KV cache)")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    if not share_weights:
        model.eval()
        model.requires_grad_(False)
    return model, tokenizer


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """The eos token ids of the model's generation config and of the tokenizer."""
    ids: list[int] = []
    gc = getattr(model, "generation_config", None)
    for source in (getattr(gc, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.extend([source] if isinstance(source, int) else list(source))
    return ids


def copy_weights(model: Any, items: list[tuple[str, torch.Tensor]]) -> None:
    """Copy ``(name, tensor)`` pairs into ``model``'s parameters and buffers of those names, on their
    device and in their dtype. An unknown name stops it before anything is copied, a wrong shape at
    that tensor."""
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers(remove_duplicate=False)))
    unknown = [name for name, _ in items if name not in params]
    if unknown:
        raise EngineError(
            f"update_weights got {len(unknown)} names the engine's model does not have, e.g. {unknown[:3]}"
        )
    for name, tensor in items:
        target = params[name]
        if target.shape != tensor.shape:
            raise EngineError(f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
