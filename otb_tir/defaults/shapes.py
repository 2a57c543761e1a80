"""Model shapes for random-weight checks and benchmarks on a GPU (nothing is downloaded).

Kept out of :mod:`otb_tir.defaults.tiny`: that module's code is part of the warm start's cache key
(``warm_start.BUILD_MODULES``), so an edit there would stop the shipped warm start from matching.
"""

from __future__ import annotations

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
