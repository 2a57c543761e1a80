"""A tiny Qwen3-architecture policy built locally: byte-level BPE tokenizer, chat template, model.

Nothing is downloaded. The tokenizer is trained (deterministically) with ``tokenizers`` on a
generated corpus of math word problems, arithmetic, Python code, tool-call JSON and English, and
carries the Qwen2.5/Qwen3 special tokens. The chat template (``chat_template.jinja`` next to
this file) is Qwen2.5-style: tools in the system prompt, ``<tool_call>`` JSON in assistant turns,
``tool`` messages grouped into one user turn of ``<tool_response>`` blocks.

Typical use::

    from otb_tir.defaults.tiny import tiny_policy_dir
    path = tiny_policy_dir()                      # built once, cached on disk (agent_env.cache)
    tok = AutoTokenizer.from_pretrained(path)     # works offline; vLLM can load it too
    model = AutoModelForCausalLM.from_pretrained(path)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from agent_env.cache import artifact_dir, default_cache_root, publish  # noqa: F401 (default_cache_root: re-exported)

logger = logging.getLogger(__name__)

#: Bump when the build code changes in a way the cache key (settings, template, corpus) misses.
BUILD_VERSION = 1

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
#: Control tokens (``special=True``: dropped by ``decode(skip_special_tokens=True)``).
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
#: Markup tokens, atomic but kept by ``skip_special_tokens`` (as in Qwen2.5/Qwen3).
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")

# Pre-tokenization in the GPT-4/Qwen2 spirit: contractions, letter runs with one leading
# non-letter, single digits (helps arithmetic), punctuation runs, newlines, spaces.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


def chat_template() -> str:
    """The tiny policy's Jinja chat template (Qwen2.5-style, tool calling)."""
    return CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- corpus

_NAMES = [
    "Ava",
    "Ben",
    "Chen",
    "Dana",
    "Eli",
    "Fatima",
    "Gus",
    "Hana",
    "Ivan",
    "Jade",
    "Kofi",
    "Lena",
    "Mia",
    "Noor",
    "Omar",
    "Priya",
]
_ITEMS = [
    "apples",
    "books",
    "coins",
    "marbles",
    "pencils",
    "stickers",
    "cookies",
    "cards",
    "stamps",
    "shells",
    "tickets",
    "eggs",
]
_WORDS = """
    the of and to in is it that for was on are with as be at by this have from or one had not
    but what all were when we there can an your which their said if do will each about how up
    out them then she many some so these would other into has more her two like him see time
    could no make than first been its who now people my made over did down only way find use may
    water long little very after words called just where most know get through back much go good
    new write our me man too any day same right look think also around another came come work
    three word must because does part even place well such here take why help put different away
    again off went old number great tell men say small every found still between name should
    home big give air line set own under read last never us left end along while might next
    sound below saw something thought both few those always show large often together asked
    house world going want school important until form food keep children feet land side without
    boy once animal life enough took four head above kind began almost live page got earth need
    far hand high year mother light country father let night picture being study second soon
    story since white ever paper hard near sentence better best across during today however sure
    knew try told young sun thing whole hear example heard several change answer room sea
    against top turned learn point city play toward five himself usually money seen car morning
    given problem equation remainder divide multiply add subtract total sum product quotient
    fraction integer prime factor square root power value result solve compute check verify
    calculator python tool error expression simplify digits percent price cost buy sell each per
    half twice triple dozen hundred thousand million minutes hours days weeks meters kilometers
    speed distance rate area perimeter volume
""".split()


def _sentence(rng: random.Random) -> str:
    n = rng.randint(5, 14)
    text = " ".join(rng.choice(_WORDS) for _ in range(n))
    return text[0].upper() + text[1:] + rng.choice([".", ".", "?", "!", ","])


_ENGLISH = [
    "The answer is {a}.",
    "Let me think step by step.",
    "First, I will compute the product, then add the remainder.",
    "I need to use the calculator to be sure.",
    "The result of the tool call is {a}, so the final answer is \\boxed{{{a}}}.",
    "We know that {x} times {y} equals {p}.",
    "So the total number is {a}.",
    "This problem asks for the remainder when {x} is divided by {y}.",
    "Therefore, the solution of the equation is x = {a}.",
    "Let's check the work with Python.",
    "There are {x} groups with {y} items in each group.",
    "The tool returned an error; I will fix the expression and try again.",
]
_CODE = [
    "print({x} * {y} + {z})",
    "x = {x}\ny = {y}\nprint(x ** 2 + y)",
    "import math\nprint(math.gcd({x}, {y}))",
    "from sympy import symbols, solve\nx = symbols('x')\nprint(solve({x}*x - {y}, x))",
    "def f(n):\n    return sum(range(n + 1))\n\nprint(f({x}))",
    "total = 0\nfor i in range({x}):\n    total += i * {y}\nprint(total)",
    "from fractions import Fraction\nprint(Fraction({x}, {y}) + Fraction(1, {z}))",
    "print(pow({x}, {y}, {z}))",
    "result = [i for i in range({x}) if i % {z} == 0]\nprint(len(result))",
    "Traceback (most recent call last):\n  File \"<stdin>\", line 1, in <module>\nZeroDivisionError: division by zero",
]


def _corpus_lines(seed: int, n_samples: int) -> list[str]:
    """A deterministic training corpus for the tokenizer."""
    rng = random.Random(seed)
    lines: list[str] = []
    template = chat_template()
    lines.append(template)
    for _ in range(n_samples):
        x, y, z = rng.randint(2, 999), rng.randint(2, 99), rng.randint(2, 20)
        p, a = x * y, rng.randint(0, 99999)
        name, other, item = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_ITEMS)
        kind = rng.randrange(7)
        if kind == 0:
            lines.append(
                f"{name} has {x} {item}. {other} gives {name} {y} more {item} and then {name} "
                f"shares them equally among {z} friends. How many {item} does each friend get?"
            )
        elif kind == 1:
            op = rng.choice(["+", "-", "*", "/", "**", "%"])
            lines.append(f"{x} {op} {y} = ?  Compute ({x} {op} {y}) * {z} - {a}.")
        elif kind == 2:
            lines.append(rng.choice(_CODE).format(x=x, y=y, z=z))
        elif kind == 3:
            tool = rng.choice(["calculator", "python"])
            if tool == "calculator":
                args = {"expression": f"{x}*{y}+{z}"}
            else:
                args = {"code": rng.choice(_CODE).format(x=x, y=y, z=z)}
            call = json.dumps({"name": tool, "arguments": args})
            lines.append(f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>")
            lines.append(f"<|im_start|>user\n<tool_response>\n{p + z}\n</tool_response><|im_end|>")
        elif kind == 4:
            lines.append(" ".join(rng.choice(_ENGLISH).format(a=a, x=x, y=y, p=p) for _ in range(3)))
        elif kind == 5:
            lines.append(" ".join(_sentence(rng) for _ in range(rng.randint(1, 4))))
        else:
            lines.append(f"Solve {x}x + {y} = {p + y}. Answer: \\boxed{{{x}}}. Simplify \\frac{{{y}}}{{{z}}}.")
    return lines


# ----------------------------------------------------------------------------- tokenizer


TOKENIZER_CORPUS_SAMPLES = 20000


def build_tiny_tokenizer(vocab_size: int = 3072, seed: int = 0, corpus_samples: int = TOKENIZER_CORPUS_SAMPLES):
    """Train the tiny byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``.

    Deterministic: the same arguments give the same vocabulary, merges and ids. Every byte
    sequence is encodable (byte-level alphabet), so any unicode text round-trips through
    ``encode``/``decode``. ``<|im_end|>`` is the eos token (end of an assistant turn),
    ``<|endoftext|>`` the pad token; the chat template is attached.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_fixed = 256 + len(SPECIAL_TOKENS) + len(MARKUP_TOKENS)
    if vocab_size < n_fixed + 1:
        raise ValueError(f"vocab_size must be at least {n_fixed + 1} (bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(seed, corpus_samples), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    hf.add_tokens(MARKUP_TOKENS, special_tokens=False)
    hf.chat_template = chat_template()
    return hf


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True)
class TinyModelSettings:
    """Architecture of the tiny Qwen3 model (defaults: ~1.4 M parameters, fast on a CPU)."""

    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 384
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0


def build_tiny_model(tokenizer, hidden_size: int = 128, layers: int = 4, seed: int = 0, **overrides):
    """A randomly initialised ``Qwen3ForCausalLM`` sized for ``tokenizer`` (tied embeddings, fp32).

    ``overrides`` are further :class:`TinyModelSettings` fields (``heads``, ``kv_heads``,
    ``head_dim``, ``intermediate_size``, ``max_position_embeddings``, ``rope_theta``).
    The same ``seed`` and settings give bit-identical weights.
    """
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    s = TinyModelSettings(hidden_size=hidden_size, layers=layers, **overrides)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=s.max_position_embeddings,
        rope_theta=s.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    config.rope_parameters = {"rope_type": "default", "rope_theta": s.rope_theta}
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, do_sample=True)
    model.eval()
    return model


# ----------------------------------------------------------------------------- cached folder

_MARKER = "otb_tir_tiny.json"


def tiny_policy_dir(
    cache_dir: str | os.PathLike | None = None,
    *,
    vocab_size: int = 3072,
    tokenizer_seed: int = 0,
    hidden_size: int = 128,
    layers: int = 4,
    seed: int = 0,
    **overrides,
) -> Path:
    """Build the tiny tokenizer + model once and ``save_pretrained`` both into a cached folder.

    The folder is ``<cache root>/tiny-qwen3-<hash of the build settings>`` (see
    :func:`agent_env.cache.default_cache_root`; ``cache_dir`` overrides the root), published by
    :func:`agent_env.cache.publish`: built once under a lock, in a temporary sibling renamed into
    place, so concurrent processes never see a half-written folder.
    ``AutoTokenizer.from_pretrained(path)`` and ``AutoModelForCausalLM.from_pretrained(path)``
    then work offline.
    """
    key = tiny_policy_key(
        vocab_size=vocab_size,
        tokenizer_seed=tokenizer_seed,
        hidden_size=hidden_size,
        layers=layers,
        seed=seed,
        **overrides,
    )
    final = artifact_dir(cache_dir, "tiny-qwen3", key)

    def build(tmp: Path) -> None:
        logger.info("building the tiny policy into %s", final)
        tokenizer = build_tiny_tokenizer(vocab_size=vocab_size, seed=tokenizer_seed)
        model = build_tiny_model(tokenizer, hidden_size=hidden_size, layers=layers, seed=seed, **overrides)
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)

    return publish(final, _MARKER, build, key)


def tiny_policy_key(
    *,
    vocab_size: int = 3072,
    tokenizer_seed: int = 0,
    hidden_size: int = 128,
    layers: int = 4,
    seed: int = 0,
    **overrides,
) -> dict:
    """The cache key of :func:`tiny_policy_dir`'s folder (same arguments), computed without building:
    ``agent_env.cache.key_digest`` of it names the folder, ``tiny-qwen3-<digest>``."""
    settings = TinyModelSettings(hidden_size=hidden_size, layers=layers, **overrides)
    return {
        "build_version": BUILD_VERSION,
        "vocab_size": vocab_size,
        "tokenizer_seed": tokenizer_seed,
        "seed": seed,
        "model": asdict(settings),
        "template_sha": hashlib.sha256(chat_template().encode()).hexdigest(),
        "corpus_sha": hashlib.sha256(
            "\n".join(_corpus_lines(tokenizer_seed, TOKENIZER_CORPUS_SAMPLES)).encode()
        ).hexdigest(),
        "tokens": [_SPLIT_PATTERN, SPECIAL_TOKENS, MARKUP_TOKENS],
    }
