"""Engines behind one async protocol (see :mod:`agent_env.engines.base`).

``HFEngine``, ``VLLMEngine`` and ``SGLangEngine`` are exported lazily: importing this package
never imports transformers models, vllm or sglang; the engine's module is imported on first use
of its name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agent_env.engines.base import Engine, EngineError, GenerationOutput, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from agent_env.engines.hf import HFEngine  # noqa: F401 (exported lazily, see _LAZY)
    from agent_env.engines.sglang import SGLangEngine  # noqa: F401
    from agent_env.engines.vllm import VLLMEngine  # noqa: F401

_LAZY = {
    "HFEngine": "agent_env.engines.hf",
    "VLLMEngine": "agent_env.engines.vllm",
    "SGLangEngine": "agent_env.engines.sglang",
}

__all__ = ["Engine", "EngineError", "GenerationOutput", "SamplingParams", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
