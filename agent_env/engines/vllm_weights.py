"""VLLMEngine's weight updates: the up-front check of an update against the checkpoint, and the
functions run on vLLM's workers.

:func:`~agent_env.engines.base.check_update_names` (shared with SGLangEngine) refuses an update
whose tensor names or shapes do not match the HF checkpoint, before vLLM is touched. The
worker-side functions ``worker_reload`` (CPU: ``reload_weights``, then the tied ``lm_head``'s
repacking redone) and ``worker_load_weights`` (GPU: ``model.load_weights``) are passed to vLLM's
``collective_rpc`` by :meth:`agent_env.engines.vllm.VLLMEngine.update_weights`; they stay at module
level, under this module's importable name, so that vLLM can pickle them by reference when its engine
core runs in another process (``VLLM_ENABLE_V1_MULTIPROCESSING`` on).
"""

from __future__ import annotations

from typing import Any

import torch

from agent_env.engines.base import check_update_names, checkpoint_shapes  # noqa: F401 - re-exported

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
