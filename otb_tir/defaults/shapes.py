"""Model shapes for random-weight checks, tests and benchmarks (nothing is downloaded):
:func:`build_model`, the benchmarks' one way to build a model of a named shape, and :func:`save_shape`,
a random-weight model folder of a shape with a tokenizer of its vocabulary size (:func:`shape_tokenizer`:
the built-in tiny policy's, its chat template included, padded with filler tokens), which any trainer
or engine loads like a downloaded model (``benchmarks/bench_scale.py``).

Kept out of :mod:`otb_tir.defaults.tiny`: that module's code is part of the warm start's cache key
(``warm_start.BUILD_MODULES``), so an edit there would stop the shipped warm start from matching.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from otb_tir import ConfigError

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


def _gqa(hidden: int, layers: int, kv_heads: int, intermediate: int) -> dict[str, Any]:
    """A Qwen3 shape of head dim 64 over ``kv_heads`` key/value heads, with a 49,152-token vocabulary
    (SmolLM2's: models of 30M-150M parameters use ~50k; Qwen3's 151,936 alone would be 58M parameters
    at the 30M shape's width and 117M at the 150M one's), tied embeddings."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=kv_heads,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
    )


#: The random-weight shapes of the benchmarks' ``--shape`` (besides ``tiny``, the built-in policy):
#: ``small`` (6.6M parameters in all, 6.0M besides the embedding), ``medium`` (80.7M, 79.1M besides),
#: ``qwen3-0.6b`` (596.0M, 440.5M besides),
#: and bench_scale's steps between the tiny policy and Qwen3-0.6B: ``30m`` (29.9M in all, 18.9M of them
#: the embedding) and ``150m`` (151.0M in all, 37.7M the embedding).
SHAPES: dict[str, dict[str, Any]] = {
    "small": _one_kv_head(256, 8),
    "medium": _one_kv_head(768, 12),
    "qwen3-0.6b": QWEN3_0_6B,
    "30m": _gqa(384, 7, kv_heads=2, intermediate=1024),
    "150m": _gqa(768, 18, kv_heads=4, intermediate=2048),
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
    model = model.to(device=device, dtype=dtype)
    model.tie_weights()  # a move to the meta device makes new parameters: the output embedding is untied
    return model.eval()


# ----------------------------------------------------------------------------- model folders of a shape

_FOLDER_MARKER = "otb_tir_shape.json"
FILLER = "<filler_{}>"  # the tokens shape_tokenizer adds: never produced by encoding text, decodable


def shape_config(shape: str) -> Any:
    """The transformers config of ``shape``: ``tiny`` (the built-in tiny policy's), a :data:`SHAPES`
    name (a ``Qwen3Config``), or the path of a transformers ``config.json`` (any architecture
    ``AutoModelForCausalLM`` builds, e.g. Qwen2.5-0.5B's); anything else is a ConfigError."""
    from transformers import AutoConfig, Qwen3Config

    if shape == "tiny":
        from otb_tir.defaults.tiny import tiny_policy_dir

        return AutoConfig.from_pretrained(tiny_policy_dir())
    if shape in SHAPES:
        return Qwen3Config(**SHAPES[shape])
    path = Path(shape).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"unknown shape {shape!r}: give tiny, one of {sorted(SHAPES)}, or the path of a transformers config.json"
        )
    try:
        d = json.loads(path.read_text())
        return AutoConfig.for_model(d.pop("model_type"), **d)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{path} is not a transformers config.json with a known model_type: {e}") from None


def shape_tokenizer(vocab_size: int) -> Any:
    """The built-in tiny policy's tokenizer, chat template and special tokens (same ids) unchanged,
    with filler tokens (``<filler_N>`` at id N) appended to its vocabulary up to exactly ``vocab_size``
    tokens: a model's whole vocabulary is sampled and decoded, text encodes as with the tiny policy's."""
    import tempfile

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from otb_tir.defaults.tiny import tiny_policy_dir

    base = AutoTokenizer.from_pretrained(tiny_policy_dir())
    if vocab_size < len(base):
        raise ConfigError(f"vocab_size {vocab_size} is below the tiny tokenizer's {len(base)} tokens")
    d = json.loads(base.backend_tokenizer.to_str())
    vocab = d["model"]["vocab"]
    for added in d["added_tokens"]:  # the markup tokens into the vocabulary at their ids: no holes
        vocab.setdefault(added["content"], added["id"])
    if sorted(vocab.values()) != list(range(len(base))):
        raise ConfigError("the tiny tokenizer's ids are not contiguous")  # a changed tiny tokenizer
    vocab.update({FILLER.format(i): i for i in range(len(base), vocab_size)})
    with tempfile.TemporaryDirectory() as tmp:  # the tiny folder's tokenizer config, the new vocabulary
        base.save_pretrained(tmp)
        Tokenizer.from_str(json.dumps(d)).save(str(Path(tmp) / "tokenizer.json"))
        return AutoTokenizer.from_pretrained(tmp)


def save_shape(shape: str, folder: str | Path, seed: int = 0) -> Path:
    """A float32 model of ``shape`` (:func:`shape_config`) with random weights (``seed``) and its
    :func:`shape_tokenizer`, saved into ``folder`` (end of turn ``<|im_end|>``, padding
    ``<|endoftext|>``: the tokenizer's ids replace the config's). A folder already holding the same
    shape and seed is kept as it is. Returns the folder."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = Path(folder)
    config = shape_config(shape)
    tokenizer = shape_tokenizer(config.vocab_size)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id, None
    record = json.loads(json.dumps({"config": config.to_diff_dict(), "seed": seed}, default=str))
    marker = folder / _FOLDER_MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("record") == record:
        return folder
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    marker.write_text(json.dumps({"shape": shape, "parameters": params, "record": record}, indent=1))
    return folder
