"""SFT warm start of the tiny policy on generated tool-use traces (:mod:`otb_tir.defaults.traces`),
cached on disk.

The trace mixture deliberately leaves the policy *inconsistent* at using tools, so that RL has room
to improve it. :func:`warm_start_policy` trains briefly on CPU, in two phases (``copy_steps`` on the
tool-call traces only, where the policy learns to copy the question into its calls, then ``steps``
on the whole mixture), and caches the result under the user's cache directory keyed by every
setting (:class:`WarmStartSettings`, the one spelling of them); :func:`task_warm_start` builds the
stepped tasks' policies from it (chain from arith, multistep from chain). ``python -m
otb_tir.defaults.check`` builds it and prints how it uses its tools (:mod:`otb_tir.defaults.check`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from otb_tir import ConfigError
from otb_tir.defaults import traces
from otb_tir.defaults.traces import TraceMixture, make_traces, tool_schemas
from otb_tir.trainer.sft import SFTConfig, sft_train, tokenize_conversation

logger = logging.getLogger(__name__)

#: Bump when trace generation or training code changes: cached folders are keyed on it.
WARM_VERSION = 3
_MARKER = "otb_tir_warm_start.json"


@dataclass(frozen=True)
class WarmStartSettings:
    """Everything that determines a warm start (its cache key, with the base model's config)."""

    steps: int = 400
    #: steps of a first phase on the tool-call traces only: the policy learns to copy the
    #: question's numbers into the call (an induction-style skill that appears abruptly, after
    #: ~600 steps here) before the full mixture sets when it calls a tool
    copy_steps: int = 800
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 1.0  # learning rate after the cosine decay, relative to ``lr`` (1 = constant)
    n_traces: int = 3000
    seed: int = 0
    hidden_size: int = 128  # the built-in base model's size (ignored with an explicit ``base``)
    layers: int = 4
    mixture: TraceMixture = field(default_factory=TraceMixture)
    task: str = "arith"  # the built-in task whose train problems the traces solve (arith | chain | multistep)

    def validate(self) -> None:
        from agent_env.math_task.data import TASKS

        if self.task not in TASKS:
            raise ConfigError(f"warm start task must be one of {list(TASKS)}, got {self.task!r}")
        if not isinstance(self.copy_steps, int) or isinstance(self.copy_steps, bool) or self.copy_steps < 0:
            raise ConfigError(f"warm start copy_steps must be an int >= 0, got {self.copy_steps!r}")
        for name in ("steps", "batch_size", "n_traces", "hidden_size", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"warm start {name} must be a positive int, got {value!r}")
        if self.hidden_size % 64:
            raise ConfigError(
                f"warm start hidden_size must be a multiple of 64 (the head size), got {self.hidden_size}"
            )
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.steps:
            raise ConfigError(f"warm start warmup_steps must be in [0, steps), got {self.warmup_steps!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"warm start min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        self.mixture.validate()
        from agent_env.math_task.data import KINDS

        if self.copy_steps and not any(self.mixture.mode_weights(k)["guess"] < 1 for k in KINDS):
            raise ConfigError(
                "copy_steps > 0 needs a mixture with tool-call traces (every kind only guesses); "
                "set copy_steps=0 or give some kind a tool share"
            )
        self.sft_config().validate()

    def sft_config(self, progress: bool = False) -> SFTConfig:
        return SFTConfig(
            steps=self.steps,
            batch_size=self.batch_size,
            lr=self.lr,
            seed=self.seed,
            warmup_steps=self.warmup_steps,
            min_lr_ratio=self.min_lr_ratio,
            progress=progress,
        )

    def copy_sft_config(self, progress: bool = False) -> SFTConfig:
        """The first (tool traces only) phase: same optimiser settings, ``copy_steps`` steps."""
        return replace(
            self.sft_config(progress),
            steps=self.copy_steps,
            seed=self.seed + 1,
            warmup_steps=min(self.warmup_steps, self.copy_steps - 1),
            min_lr_ratio=1.0,
        )

    def base_model_overrides(self) -> dict[str, int]:
        """Keyword arguments of ``otb_tir.defaults.tiny.tiny_policy_dir`` for this base size."""
        return {
            "hidden_size": self.hidden_size,
            "layers": self.layers,
            "heads": self.hidden_size // 64,
            "kv_heads": max(1, self.hidden_size // 128),
            "head_dim": 64,
            "intermediate_size": 3 * self.hidden_size,
        }


def warm_start_policy(
    cache_dir: str | os.PathLike | None = None,
    *,
    steps: int | None = None,
    seed: int = 0,
    n_traces: int | None = None,
    batch_size: int | None = None,
    copy_steps: int | None = None,
    lr: float | None = None,
    hidden_size: int | None = None,
    layers: int | None = None,
    warmup_steps: int | None = None,
    mixture: TraceMixture | None = None,
    base: str | os.PathLike | None = None,
    task: str = "arith",
    shipped: bool = True,
    progress: bool = True,
) -> Path:
    """The tiny policy after a short SFT on generated traces: an HF folder (model + tokenizer with
    its chat template) loadable by ``AutoModelForCausalLM`` / ``AutoTokenizer`` and vLLM.

    Arguments left as ``None`` take :class:`WarmStartSettings`' defaults. Built once and cached as
    ``<cache root>/warm-<hash of every setting>`` (``cache_dir`` overrides the root, default
    ``$OTB_TIR_CACHE`` or ``~/.cache/otb_tir``) by :func:`agent_env.cache.publish` (one build under
    a lock, written to a temporary sibling and renamed into place). ``base`` is the folder to start
    from (default: the built-in tiny model of ``hidden_size`` × ``layers``,
    ``otb_tir.defaults.tiny.tiny_policy_dir(cache_dir, ...)``). A ``otb_tir_warm_start.json`` in the
    folder records the settings, the loss curve and the build times. Bad settings raise
    :class:`ConfigError` before any work.

    **Shipped.** The built-in default (these defaults, the built-in base) ships with the package
    (:mod:`otb_tir.defaults.ship`): when the cache misses and the shipped copy's key is this one,
    its files are copied instead of training, so every machine starts RL from the same weights (a
    build's float results differ between CPUs and library versions, so those are not in the match:
    :func:`otb_tir.defaults.ship.portable_digest`). ``shipped=False`` (``model.warm_start_shipped=false``)
    trains it here instead, into a folder of its own. The key holds every setting, the base (a
    cached artifact by its folder name, which is its key's digest; another folder by its path and
    config), the tools' schemas, the torch and transformers versions and
    :func:`agent_env.cache.code_fingerprint` of the code that makes the traces and trains, so a
    change to any of them misses the cache (and the shipped copy).
    """
    from agent_env.cache import artifact_dir, publish

    given = {
        "steps": steps,
        "copy_steps": copy_steps,
        "n_traces": n_traces,
        "batch_size": batch_size,
        "lr": lr,
        "hidden_size": hidden_size,
        "layers": layers,
        "warmup_steps": warmup_steps,
    }
    settings = WarmStartSettings(
        seed=seed, mixture=mixture or TraceMixture(), task=task, **{k: v for k, v in given.items() if v is not None}
    )
    settings.validate()
    key = warm_start_key(settings, base)
    if not shipped:
        key["source"] = "built here"  # not the shipped copy's folder
    final = artifact_dir(cache_dir, "warm", key)
    schemas = key["tools"]

    def build(tmp: Path) -> dict[str, Any]:
        from otb_tir.defaults import ship

        if shipped and ship.shipped_digest() == ship.portable_digest(key):
            logger.info("warm start: copying the shipped one into %s", final)
            return ship.copy_shipped(tmp)
        base_path = _base_path(base, cache_dir, settings)
        model, tokenizer, record = _train(settings, base_path, schemas, progress)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        losses = record["losses"]
        logger.info(
            "warm start cached in %s (traces %.1f s, training %.1f s, final loss %.3f)",
            final,
            record["trace_seconds"],
            record["train_seconds"],
            sum(losses[-10:]) / len(losses[-10:]),
        )
        return record | {"source": "built here"}

    return publish(final, _MARKER, build, {"key": key | {"base_config": None}})


#: The modules whose code makes the traces and trains the warm start (and the tiny base): their
#: :func:`agent_env.cache.code_fingerprint` is in the key.
BUILD_MODULES = (
    "otb_tir.defaults.traces",
    "otb_tir.defaults.warm_start",
    "otb_tir.defaults.tiny",
    "otb_tir.trainer.sft",
    "agent_env.math_task.data",
    "tools.calculator",
)


def warm_start_key(settings: WarmStartSettings, base: str | os.PathLike | None = None) -> dict[str, Any]:
    """The cache key of :func:`warm_start_policy`'s folder, computed without building anything.

    The base is named portably: the built-in tiny model and any cached artifact by their folder
    name (``<kind>-<digest of their own key>``), so the key is the same on every machine and for
    every cache root; another folder by its absolute path and its ``config.json``."""
    import torch
    import transformers

    from agent_env.cache import code_fingerprint, key_digest
    from otb_tir.defaults.tiny import tiny_policy_key

    if base is None:
        base_id, base_config = f"tiny-qwen3-{key_digest(tiny_policy_key(**settings.base_model_overrides()))}", None
    else:
        base_path = Path(base)
        if not (base_path / "config.json").is_file():
            raise ConfigError(f"base policy folder {base_path} has no config.json (not an HF model folder)")
        if (base_path / _MARKER).is_file() or (base_path / "otb_tir_tiny.json").is_file():
            base_id, base_config = base_path.name, None  # a cached artifact: its name is its key's digest
        else:
            base_id, base_config = str(base_path.resolve()), (base_path / "config.json").read_text()
    return {
        "version": WARM_VERSION,
        "settings": asdict(settings),
        "base": base_id,
        "base_config": base_config,
        "tools": tool_schemas(),
        "code": code_fingerprint(BUILD_MODULES),
        "libraries": {"torch": torch.__version__, "transformers": transformers.__version__},
        # the trace rule only the multistep traces use: in their key, so a change rebuilds them
        **({"stop_hazard": traces.STOP_HAZARD} if settings.task == "multistep" else {}),
    }


def _base_path(
    base: str | os.PathLike | None, cache_dir: str | os.PathLike | None, settings: WarmStartSettings
) -> Path:
    if base is not None:
        return Path(base)
    from otb_tir.defaults.tiny import tiny_policy_dir

    return tiny_policy_dir(cache_dir, **settings.base_model_overrides())


def _train(
    settings: WarmStartSettings, base_path: Path, schemas: list[dict[str, Any]], progress: bool
) -> tuple[Any, Any, dict[str, Any]]:
    """Both SFT phases from ``base_path``: the trained model, its tokenizer and the build's record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    logger.info("warm start: generating %d traces", settings.n_traces)
    traces = make_traces(settings.n_traces, seed=settings.seed, mixture=settings.mixture, task=settings.task)
    examples = [tokenize_conversation(tokenizer, m, tools=schemas) for m in traces]
    t1 = time.perf_counter()
    losses: list[float] = []
    if settings.copy_steps:
        with_call = [e for e, m in zip(examples, traces) if any(x.get("tool_calls") for x in m)]
        if not with_call:
            raise ConfigError("copy_steps > 0 needs traces with tool calls (the mixture has none)")
        logger.info("warm start phase 1: %d steps on the %d tool-call traces", settings.copy_steps, len(with_call))
        losses += sft_train(model, with_call, tokenizer.pad_token_id, settings.copy_sft_config(progress=progress))
    logger.info("warm start phase 2: %d steps on all %d traces", settings.steps, len(examples))
    losses += sft_train(model, examples, tokenizer.pad_token_id, settings.sft_config(progress=progress))
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


#: The chain task's trace mixture: both steps' calls (``tool``) less often than stopping after
#: the first step's call and boxing its intermediate result (``stop_early``, wrong), so greedy
#: decoding starts mostly wrong and RL has to learn to make the second call; direct guesses of
#: an unguessable answer are always wrong.
CHAIN_MIXTURE = TraceMixture(
    tool=0.3, python=0.0, guess=0.2, wrong_tool=0.0, stop_early=0.5, guess_right=0.0, tool_share={}
)
#: SFT steps and traces of the chain task's warm start (continued from the arith warm start).
CHAIN_STEPS = 400
CHAIN_TRACES = 2000
#: The multistep task's: calculator traces in 90 % (each stops after each call with probability
#: ``traces.STOP_HAZARD``, so the policy stops more often than it goes on at every step: greedy
#: decoding stops after the first call and RL has each later call to learn), direct guesses
#: (always wrong) in 10 %. Continued from the chain warm start.
MULTISTEP_MIXTURE = TraceMixture(
    tool=0.9, python=0.0, guess=0.1, wrong_tool=0.0, stop_early=0.0, guess_right=0.0, tool_share={}
)
MULTISTEP_STEPS = 400
MULTISTEP_TRACES = 2000


@dataclass(frozen=True)
class _Stage:
    """A stepped task's warm start: ``base`` task's policy, then SFT on this task's traces."""

    base: str
    mixture: TraceMixture
    steps: int
    n_traces: int


def _stages() -> dict[str, _Stage]:
    """The stepped tasks' warm starts (read when called, so a test can shrink them)."""
    return {
        "chain": _Stage("arith", CHAIN_MIXTURE, CHAIN_STEPS, CHAIN_TRACES),
        "multistep": _Stage("chain", MULTISTEP_MIXTURE, MULTISTEP_STEPS, MULTISTEP_TRACES),
    }


def task_warm_start(
    task: str = "arith",
    cache_dir: str | os.PathLike | None = None,
    *,
    steps: int | None = None,
    copy_steps: int | None = None,
    n_traces: int | None = None,
    chain_steps: int = CHAIN_STEPS,
    shipped: bool = True,
    progress: bool = True,
) -> Path:
    """The built-in policy warm-started for ``task`` (``data.task``): the arith warm start
    (:func:`warm_start_policy` with ``steps`` / ``copy_steps`` / ``n_traces``); for ``chain`` that
    policy after ``chain_steps`` more SFT steps on chain-task traces (:data:`CHAIN_MIXTURE`), for
    ``multistep`` the chain policy after :data:`MULTISTEP_STEPS` on multistep traces
    (:data:`MULTISTEP_MIXTURE`); each stage cached likewise. ``shipped``: the arith stage may be the
    package's copy (:mod:`otb_tir.defaults.ship`); the later stages are always built here."""
    if task == "arith":
        warmup = None if steps is None else min(WarmStartSettings.warmup_steps, steps - 1)  # short test builds
        return warm_start_policy(
            cache_dir,
            steps=steps,
            copy_steps=copy_steps,
            n_traces=n_traces,
            warmup_steps=warmup,
            seed=0,
            shipped=shipped,
            progress=progress,
        )
    stages = _stages()
    if task not in stages:
        raise ConfigError(f"no built-in warm start for task {task!r}; built-in: arith, {', '.join(stages)}")
    stage = stages[task]
    base = task_warm_start(
        stage.base,
        cache_dir,
        steps=steps,
        copy_steps=copy_steps,
        n_traces=n_traces,
        chain_steps=chain_steps,
        shipped=shipped,
        progress=progress,
    )
    sft_steps = chain_steps if task == "chain" else stage.steps
    return warm_start_policy(
        cache_dir,
        base=base,
        task=task,
        steps=sft_steps,
        copy_steps=0,
        n_traces=stage.n_traces,
        warmup_steps=min(50, sft_steps - 1),
        mixture=stage.mixture,
        seed=0,
        progress=progress,
    )
