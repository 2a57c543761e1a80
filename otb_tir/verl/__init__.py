"""The verl path: run TIR-OTB on verl 0.9.1 (Ray + FSDP + vLLM/sglang).

* :mod:`otb_tir.verl.plugin` — ``install()`` puts our Optimal Token Baseline estimators in
  verl's advantage registry (``optimal_token_baseline``, ``tir_optimal_token_baseline``).
* :mod:`otb_tir.verl.agent_loop` — ``OTBToolAgentLoop``, a verl agent loop that runs
  agent_env's multi-turn episode with our tools and math reward, verl's server manager as engine.
* :mod:`otb_tir.verl.launch` — ``compose_verl_config(cfg)`` and ``run_verl(cfg)``.

Importing ``otb_tir`` never imports verl; these modules import it lazily, and a missing verl
raises :class:`~otb_tir.ConfigError` naming ``pip install 'otb-tir[verl]'``.
"""

from __future__ import annotations

import importlib
from typing import Any

from otb_tir import ConfigError

VERL_VERSION = "0.9.1"
INSTALL_HINT = "pip install 'otb-tir[verl]'"


def require_verl() -> Any:
    """Import verl or raise the one clear error naming the extra that installs it."""
    try:
        return importlib.import_module("verl")
    except ImportError as exc:
        raise ConfigError(
            f"the verl path needs verl {VERL_VERSION} and its trainer dependencies, which are not "
            f"installed ({exc}): {INSTALL_HINT}"
        ) from exc


__all__ = ["INSTALL_HINT", "VERL_VERSION", "require_verl"]
