"""VLLMEngine's weight updates: the up-front check of an update against the checkpoint, and the
functions run on vLLM's workers.

:func:`check_update_names` refuses an update whose tensor names or shapes do not match the HF
checkpoint the engine was started from (``checkpoint_shapes`` reads them from the safetensors
headers), before vLLM is touched, so a bad update cannot leave the engine half-updated. The
worker-side functions ``worker_reload`` (CPU: ``reload_weights``, then the tied ``lm_head``'s
repacking redone) and ``worker_load_weights`` (GPU: ``model.load_weights``) are passed to vLLM's
``collective_rpc`` by :meth:`agent_env.engines.vllm.VLLMEngine.update_weights`; they stay at module
level, under this module's importable name, so that vLLM can pickle them by reference when its engine
core runs in another process (``VLLM_ENABLE_V1_MULTIPROCESSING`` on).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from agent_env.engines.base import EngineError


def checkpoint_shapes(model_path: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """Names and shapes of the tensors in the folder's safetensors files (headers only), or None."""
    from pathlib import Path

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_update_names(
    items: list[tuple[str, torch.Tensor]], shapes: Mapping[str, tuple[int, ...]] | None, tied: bool
) -> None:
    """Refuse an update whose names or shapes do not match the checkpoint, before touching vLLM.

    A failed in-place reload could leave the engine half-updated, so a bad update is rejected
    up front. ``lm_head.weight`` is accepted for tied embeddings (HF state dicts carry it; vLLM
    skips it).
    """
    if shapes is None:
        return
    unknown, mismatched = [], []
    for name, t in items:
        if name not in shapes:
            if not (tied and name == "lm_head.weight"):
                unknown.append(name)
        elif tuple(t.shape) != shapes[name]:
            mismatched.append(f"{name}: got {tuple(t.shape)}, checkpoint has {shapes[name]}")
    if unknown or mismatched:
        parts = []
        if unknown:
            parts.append(f"unknown names {unknown[:8]}{' …' if len(unknown) > 8 else ''}")
        if mismatched:
            parts.append(f"wrong shapes {mismatched[:8]}")
        raise EngineError(
            "update_weights refused (" + "; ".join(parts) + "): names and shapes must match the "
            "HF checkpoint the engine was started from; the engine keeps its current weights"
        )


# Worker-side functions (run through ``collective_rpc``; module level so they can be pickled).


def worker_reload(worker: Any, items: list[tuple[str, torch.Tensor]]) -> int:
    runner = worker.model_runner
    runner.reload_weights(weights_iterator=iter(items))
    model = runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied and lm_head is not None and getattr(lm_head, "quant_method", None) is not None:
        lm_head.quant_method.process_weights_after_loading(lm_head)
    return len(items)


def worker_load_weights(worker: Any, items: list[tuple[str, torch.Tensor]]) -> int:
    model = worker.model_runner.get_model()
    device = next(model.parameters()).device
    model.load_weights(weights=((name, t.to(device, non_blocking=True)) for name, t in items))
    return len(items)
