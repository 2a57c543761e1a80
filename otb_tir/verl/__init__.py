"""The verl path: run TIR-OTB on verl 0.9.1 (Ray + FSDP + vLLM/sglang).

* :mod:`otb_tir.verl.plugin` — ``install()`` puts our Optimal Token Baseline estimators in
  verl's advantage registry (``optimal_token_baseline``, ``tir_optimal_token_baseline``).
* :mod:`otb_tir.verl.agent_loop` — ``OTBToolAgentLoop``, a verl agent loop that runs
  agent_env's multi-turn episode with our tools and math reward, verl's server manager as engine.
* :mod:`otb_tir.verl.v1` — the V1 trainer modes ``otb_sync``, ``otb_colocate_async`` and
  ``otb_separate_async``: verl's default trainer with the Σπ² step it lacks for the OTB estimators.
* :mod:`otb_tir.verl.launch` — ``compose_verl_config(cfg)`` and ``run_verl(cfg)``.
* :mod:`otb_tir.verl.glue` — every place where we reach into verl, in one declared table.

Importing ``otb_tir`` never imports verl; these modules import it lazily, and a missing verl
raises :class:`~otb_tir.ConfigError` naming ``pip install 'otb-tir[verl]'``.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from agent_env import install_hint
from otb_tir import ConfigError

logger = logging.getLogger(__name__)

VERL_VERSION = "0.9.1"
INSTALL_HINT = install_hint("verl")
#: set to 1 (the recipe's ``verl.allow_untested_version=true``) to run with a verl other than VERL_VERSION
UNTESTED_ENV = "OTB_TIR_ALLOW_UNTESTED_VERL"


def require_verl() -> Any:
    """Import verl or raise the one clear error naming the extra that installs it."""
    try:
        return importlib.import_module("verl")
    except ImportError as exc:
        raise ConfigError(
            f"the verl path (verl.dry_run too: it checks the config against verl's own classes) needs verl "
            f"{VERL_VERSION} and its trainer dependencies, which are not installed ({exc}): {INSTALL_HINT}"
        ) from exc


def check_verl_version(allow_untested: bool | None = None) -> str:
    """The installed verl's version; any other than :data:`VERL_VERSION` is a :class:`ConfigError`
    unless ``allow_untested`` (default: the ``OTB_TIR_ALLOW_UNTESTED_VERL=1`` environment variable).
    Our glue reaches into verl's classes and functions by name (:mod:`otb_tir.verl.glue`): another
    version may have moved them, and the run would fail late or, worse, quietly do something else."""
    version = str(getattr(require_verl(), "__version__", "unknown"))
    if allow_untested is None:
        allow_untested = os.environ.get(UNTESTED_ENV) == "1"
    if version != VERL_VERSION:
        if not allow_untested:
            raise ConfigError(
                f"otb-tir's verl integration is tested with verl {VERL_VERSION} (the pin of {INSTALL_HINT}); "
                f"this environment has verl {version}. Install verl=={VERL_VERSION}, or run anyway with "
                f"verl.allow_untested_version=true ({UNTESTED_ENV}=1 outside the recipe)"
            )
        logger.warning("verl %s is untested with otb-tir (tested: %s); running anyway as asked", version, VERL_VERSION)
    return version


def has_accelerator() -> bool:
    """A CUDA/ROCm GPU or an Ascend NPU that torch can use."""
    import torch

    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:  # pragma: no cover - torch_npu quirks
        return False


__all__ = ["INSTALL_HINT", "UNTESTED_ENV", "VERL_VERSION", "check_verl_version", "has_accelerator", "require_verl"]
