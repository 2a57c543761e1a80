"""Model shapes for random-weight checks, tests and benchmarks (nothing is downloaded), and
:func:`build_model`, the benchmarks' one way to build a model of a named shape.

Kept out of :mod:`otb_tir.defaults.tiny`: that module's code is part of the warm start's cache key
(``warm_start.BUILD_MODULES``), so an edit there would stop the shipped warm start from matching.
"""

from __future__ import annotations

from typing import Any

#: ``transformers.Qwen3Config`` keywords of Qwen3-0.6B's shape, for random-weight GPU checks and
#: benchmarks (``benchmarks/gpu_check.py``, ``benchmarks/bench_engine_decode.py``): nothing is downloaded.
QWEN3_0_6B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
)

#: Two layers, grouped-query attention (4 heads over 2 key/value heads): the smallest shape that runs every
#: code path (``gpu_check.py --cpu-smoke``, the tests' small decoders); vocabulary and positions are the caller's.
TWO_LAYERS = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
)


def _one_kv_head(hidden: int, layers: int) -> dict[str, Any]:
    """A Qwen3 shape of head dim 64 over one key/value head, the built-in tiny policy's vocabulary size."""
    return dict(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=2125,
        tie_word_embeddings=True,
    )


#: The random-weight shapes of the benchmarks' ``--shape`` (besides ``tiny``, the built-in policy):
#: ``small`` (6.6M parameters besides the embedding), ``medium`` (81M), ``qwen3-0.6b`` (596M in all).
SHAPES: dict[str, dict[str, Any]] = {
    "small": _one_kv_head(256, 8),
    "medium": _one_kv_head(768, 12),
    "qwen3-0.6b": QWEN3_0_6B,
}


def build_model(shape: str, device: Any, dtype: Any):
    """A causal LM on ``device`` in ``dtype``, in eval mode: ``tiny`` is the built-in tiny policy (its
    trained weights), any other name a Qwen3 of that :data:`SHAPES` entry with random weights (seed 0;
    ``qwen3-0.6b`` is initialised on ``device`` itself, the smaller ones on the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if shape == "tiny":
        from otb_tir.defaults.tiny import tiny_policy_dir

        model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir(), dtype=dtype)
    else:
        torch.manual_seed(0)
        with torch.device(device if shape == "qwen3-0.6b" else "cpu"):
            model = Qwen3ForCausalLM(Qwen3Config(**SHAPES[shape]))
    return model.to(device=device, dtype=dtype).eval()
