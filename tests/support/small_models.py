"""Small random decoder models of the families the project claims (seeded, built locally: nothing
downloaded), for tests that need a model other than the built-in tiny policy."""

from __future__ import annotations

from typing import Any

import torch

from otb_tir.defaults.shapes import TWO_LAYERS

# two layers, grouped-query attention (4 heads over 2 key/value heads), 300 tokens
SMALL = {**TWO_LAYERS, "vocab_size": 300, "max_position_embeddings": 128}


def small_decoder(family: str = "qwen3", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any):
    """A ``family`` ("qwen3", "qwen2" or "llama") causal LM of :data:`SMALL`'s shape with ``overrides``
    (any config field), seeded with ``seed``, in eval mode."""
    import transformers as tf

    classes = {
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
    }
    config_cls, model_cls = classes[family]
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**SMALL, **overrides})).to(dtype).eval()
