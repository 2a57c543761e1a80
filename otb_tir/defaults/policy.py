"""The policy of a run, resolved once at its entry points (``otb-tir-train`` / the recipe,
``otb-tir-eval``, the verl launch): :func:`resolve_policy`.

Everything below the entry points (the builders, the local trainer's parts, the evaluation, verl's
config) reads ``model.path`` as given; only here does an empty one become the built-in tiny policy
after its cached SFT warm start for the run's built-in task (``data.task``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["resolve_policy"]


def resolve_policy(cfg: Any) -> Path:
    """``model.path`` as a folder; when it is empty, the built-in warm-started tiny policy, written
    into ``cfg.model.path`` (so ``config.yaml`` and ``summary.json`` name the folder that ran).

    Under ``torchrun`` every rank calls this: the warm start's cache builds it once under a lock
    (:func:`agent_env.cache.publish`) and the others find it there."""
    from otb_tir.builders import policy_path, task

    if not cfg.model.path:
        from otb_tir.defaults.warm_start import task_warm_start

        m = cfg.model
        cfg.model.path = str(
            task_warm_start(
                task(cfg).warm_start,
                steps=m.warm_start_steps,
                copy_steps=m.warm_start_copy_steps,
                shipped=m.warm_start_shipped,
            )
        )
    return policy_path(cfg)
