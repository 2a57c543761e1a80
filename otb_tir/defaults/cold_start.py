"""The cold start of a pretrained model: a short SFT on the task's own tool-use traces before RL
(ReTool's, SimpleTIR's and rStar2-Agent's first stage), cached on disk like the tiny policy's warm start.

``model.cold_start.base`` names the folder to start from (or ``smollm2``: SmolLM2-135M-Instruct,
:func:`otb_tir.defaults.smollm2.smollm2_dir`); the run's entry point (:func:`otb_tir.defaults.policy.resolve_policy`)
builds the SFT'd folder once and RL starts from it (``summary.json``: ``start_model``). The traces are the
task's solver's (:func:`otb_tir.defaults.traces.make_traces`, the tiny policy's generator), rendered by the
base's chat template with the run's tools; the mixture (``mixture``: calls through both steps, stopping
after the first call, direct guesses) teaches the call format and leaves RL its headroom.

Differences from the tiny policy's warm start (:mod:`otb_tir.defaults.warm_start`, which is unchanged: its
key and the shipped copy stay as they are): one phase, a learning rate for a pretrained model, and the
forward and backward under bfloat16 autocast where ``model.dtype=auto`` would choose it
(:func:`otb_tir.trainer.parts.model_dtype_for`'s rule), float32 master weights.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from otb_tir import ConfigError
from otb_tir.defaults.traces import TraceMixture

log = logging.getLogger(__name__)

__all__ = ["COLD_MIXTURE", "ColdStartSettings", "cold_start_key", "cold_start_policy", "named_model"]

COLD_VERSION = 1
_MARKER = "otb_tir_cold_start.json"

#: The chain task's cold-start traces: both steps' calls in 40 %, the first call then its result boxed
#: (wrong) in 40 %, a direct guess (wrong: the numbers are too large to guess) in 20 %: after the SFT the
#: model writes well-formed calls and mostly stops one step short, so RL has the second call to learn.
COLD_MIXTURE = TraceMixture(
    tool=0.4, python=0.0, guess=0.2, wrong_tool=0.0, stop_early=0.4, guess_right=0.0, tool_share={}
)

#: The modules whose code makes the traces and trains: their fingerprint is in the key.
BUILD_MODULES = (
    "otb_tir.defaults.cold_start",
    "otb_tir.defaults.traces",
    "otb_tir.trainer.sft",
    "agent_env.math_task.data",
    "agent_env.math_task.chains",
    "tools.calculator",
)


@dataclass(frozen=True)
class ColdStartSettings:
    """Everything that determines a cold start besides the base folder (its cache key)."""

    steps: int = 60
    batch_size: int = 8
    lr: float = 3e-5
    warmup_steps: int = 5
    min_lr_ratio: float = 0.1
    n_traces: int = 480
    seed: int = 0
    task: str = "chain"
    tools: tuple[str, ...] = ("calculator",)
    dtype: str = "float32"  # float32 | bfloat16 (autocast over float32 weights): resolved before the key
    mixture: TraceMixture = field(default_factory=lambda: COLD_MIXTURE)

    def validate(self) -> None:
        from agent_env.math_task.data import TASKS

        if self.task not in TASKS:
            raise ConfigError(f"model.cold_start: task must be one of {list(TASKS)}, got {self.task!r}")
        for name in ("steps", "batch_size", "n_traces"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.cold_start.{name} must be a positive int, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ConfigError(f"model.cold_start.lr must be positive, got {self.lr!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"model.cold_start dtype must be float32 or bfloat16, got {self.dtype!r}")
        self.mixture.validate()


def named_model(name: str) -> Path:
    """A model folder by name: ``smollm2`` (SmolLM2-135M-Instruct, converted once into the cache), else
    ``name`` as a path."""
    if name == "smollm2":
        from otb_tir.defaults.smollm2 import smollm2_dir

        return smollm2_dir()
    return Path(name).expanduser()


def cold_start_key(settings: ColdStartSettings, base: Path) -> dict[str, Any]:
    """The cache key: the settings, the base (a cached artifact by its folder name, else its absolute path
    and config), the tools' schemas, the code and the library versions."""
    import torch
    import transformers

    from agent_env.cache import code_fingerprint
    from otb_tir.defaults.traces import tool_schemas

    if not (base / "config.json").is_file():
        raise ConfigError(f"model.cold_start.base: {base} has no config.json (not an HF model folder)")
    cached = any((base / m).is_file() for m in ("otb_tir_smollm2.json", "otb_tir_warm_start.json", _MARKER))
    return {
        "version": COLD_VERSION,
        "settings": asdict(settings),
        "base": base.name if cached else str(base.resolve()),
        "base_config": None if cached else (base / "config.json").read_text(),
        "tools": tool_schemas(settings.tools),
        "code": code_fingerprint(BUILD_MODULES),
        "libraries": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def cold_start_policy(
    base: str | os.PathLike, settings: ColdStartSettings | None = None, cache_dir: str | os.PathLike | None = None
) -> Path:
    """``base`` after the cold-start SFT of ``settings``: an HF folder (model, tokenizer, chat template),
    built once under a lock and cached as ``<cache root>/cold-<digest of the key>``; a
    ``otb_tir_cold_start.json`` in it records the settings, the loss curve and the build's times."""
    from agent_env.cache import artifact_dir, publish

    settings = settings or ColdStartSettings()
    settings.validate()
    base = named_model(str(base))
    key = cold_start_key(settings, base)
    final = artifact_dir(cache_dir, "cold", key)

    def build(tmp: Path) -> dict[str, Any]:
        model, tokenizer, record = _train(settings, base, key["tools"])
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        log.info(
            "cold start cached in %s (traces %.1f s, SFT %.1f s, final loss %.3f)",
            final,
            record["trace_seconds"],
            record["train_seconds"],
            sum(record["losses"][-5:]) / len(record["losses"][-5:]),
        )
        return record

    if not (final / _MARKER).is_file():
        log.info("cold start of %s: %d SFT steps on %d %s traces (%s)", base, settings.steps, settings.n_traces,
                 settings.task, settings.dtype)  # fmt: skip
    return publish(final, _MARKER, build, {"key": key | {"base_config": None}})


def training_context(dtype: str):
    """The context the whole SFT runs in: bfloat16 autocast without its weight cache for ``bfloat16``.
    One autocast context spans every step, so with the cache (torch's default) each forward after the
    first would compute with the bfloat16 copies of the *first* step's weights: the optimizer's updates
    never reach the forward, and the model drifts along a stale gradient (measured on SmolLM2: 60 steps
    at lr 1e-4 took the loss on its own traces from 0.8 to 4.0, against 0.01 in float32)."""
    import contextlib

    import torch

    if dtype == "bfloat16":
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    return contextlib.nullcontext()


def _train(settings: ColdStartSettings, base: Path, schemas: list[dict[str, Any]]) -> tuple[Any, Any, dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from otb_tir.defaults.traces import make_traces
    from otb_tir.trainer.sft import SFTConfig, sft_train, tokenize_conversation

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    traces = make_traces(settings.n_traces, seed=settings.seed, mixture=settings.mixture, task=settings.task)
    examples = [tokenize_conversation(tokenizer, m, tools=schemas) for m in traces]
    t1 = time.perf_counter()
    sft = SFTConfig(
        steps=settings.steps,
        batch_size=settings.batch_size,
        lr=settings.lr,
        warmup_steps=min(settings.warmup_steps, settings.steps - 1),
        min_lr_ratio=settings.min_lr_ratio,
        seed=settings.seed,
        progress=True,
    )
    with training_context(settings.dtype):
        losses = sft_train(model, examples, tokenizer.pad_token_id, sft)
    t2 = time.perf_counter()
    return (
        model,
        tokenizer,
        {
            "losses": losses,
            "trace_seconds": t1 - t0,
            "train_seconds": t2 - t1,
            "tokens_per_example": sum(len(e.input_ids) for e in examples) / len(examples),
        },
    )
