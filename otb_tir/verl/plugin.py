"""Replace verl's two Optimal Token Baseline estimators with ours.

verl 0.9.1's ``compute_advantage`` (``verl/trainer/ppo/ray_trainer.py``) passes ``sum_pi_squared``,
``old_log_probs`` and ``rollout_is_weights`` only when ``algorithm.adv_estimator`` is one of
``optimal_token_baseline`` / ``tir_optimal_token_baseline``, and then calls the function registered
under that name in ``verl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY`` with
``token_level_rewards, response_mask, config, index, sum_pi_squared, old_log_probs,
rollout_is_weights`` as keywords. Our functions take the same keywords (``config`` lands in
``**kwargs``) and return the same ``(advantages, returns)``; they are vectorized instead of looping
over rows. :func:`install` swaps the two registry entries in the *current process*: call it in the
process that runs ``compute_advantage`` (verl's driver, the TaskRunner actor — see
:mod:`otb_tir.verl.launch`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from otb_tir.verl import require_verl

logger = logging.getLogger(__name__)

__all__ = ["ESTIMATOR_NAMES", "USER_ESTIMATOR_ENV", "install", "installed", "uninstall", "verl_estimator_name"]

ESTIMATOR_NAMES = ("optimal_token_baseline", "tir_optimal_token_baseline")

_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}


def _registry() -> dict[str, Callable[..., Any]]:
    require_verl()
    from verl.trainer.ppo import core_algos

    return core_algos.ADV_ESTIMATOR_REGISTRY


def _ours() -> dict[str, Callable[..., Any]]:
    from otb_tir.advantage import optimal_token_baseline, tir_optimal_token_baseline

    return {"optimal_token_baseline": optimal_token_baseline, "tir_optimal_token_baseline": tir_optimal_token_baseline}


#: ``<name verl uses>=<our estimator name or path>``, set by the launcher when
#: ``algorithm.adv_estimator`` is a user's estimator (:func:`verl_estimator_name`)
USER_ESTIMATOR_ENV = "OTB_TIR_USER_ESTIMATOR"


def verl_estimator_name(name: str) -> str:
    """The name verl's config and registry use for our estimator ``name``: the name itself, or, for
    a path (``pkg.mod:fn`` / ``file.py:fn``), ``otb_user_<fn>``."""
    from tools.plugins import is_path_name

    if is_path_name(name):
        return "otb_user_" + name.rpartition(":")[2].replace(".", "_")
    return name


def _install_user_estimator(registry: dict[str, Callable[..., Any]]) -> None:
    """Register the user's estimator named in :data:`USER_ESTIMATOR_ENV` in verl's registry (the
    same function local training resolves: :data:`otb_tir.advantage.ESTIMATORS`)."""
    import os

    spec = os.environ.get(USER_ESTIMATOR_ENV)
    if not spec:
        return
    verl_name, _, ours = spec.partition("=")
    from otb_tir.advantage import get_estimator

    fn = get_estimator(ours)
    if registry.get(verl_name) is not fn:
        registry[verl_name] = fn
        logger.info("verl advantage estimator %r -> %s (%s)", verl_name, ours, getattr(fn, "__qualname__", fn))


def install() -> dict[str, Callable[..., Any]]:
    """Point verl's two OTB registry entries at ours (idempotent), and register a user's estimator
    (:data:`USER_ESTIMATOR_ENV`); returns verl's originals."""
    with _lock:
        registry = _registry()
        _install_user_estimator(registry)
        ours = _ours()
        for name, fn in ours.items():
            current = registry.get(name)
            if current is fn:
                continue
            if current is not None and name not in _originals:
                _originals[name] = current
            registry[name] = fn
            logger.info("verl advantage estimator %r -> %s.%s", name, fn.__module__, fn.__qualname__)
        return dict(_originals)


def installed() -> bool:
    """Whether both registry entries are ours in this process."""
    registry = _registry()
    return all(registry.get(name) is fn for name, fn in _ours().items())


def uninstall() -> None:
    """Put verl's original functions back (for tests and comparisons)."""
    with _lock:
        registry = _registry()
        for name, fn in _originals.items():
            registry[name] = fn
