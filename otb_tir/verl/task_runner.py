"""verl's (v0) TaskRunner with the OTB plugin installed first.

verl 0.9.1's ``RayPPOTrainer.fit`` calls ``compute_advantage`` "on the driver process": the
TaskRunner Ray actor that ``run_ppo`` starts (a separate process from the one that calls
``run_ppo``). :class:`OTBTaskRunner` installs :func:`otb_tir.verl.plugin.install` there, and imports
the agent loop so that ``otb_tir_agent`` is registered in that process too, before verl's
``TaskRunner.run`` builds the trainer. Agent-loop workers (their own Ray actors) load the agent
loop from the agent-loop YAML (``_target_``), so they need no install step.

This module imports verl and Ray at import time; :func:`otb_tir.verl.launch.run_verl` imports it.
"""

from __future__ import annotations

import logging
from typing import Any

from otb_tir.verl import require_verl

require_verl()

import ray  # noqa: E402
from verl.trainer.main_ppo_v0 import TaskRunner as _VerlTaskRunnerActor  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["OTBTaskRunner", "OTBTaskRunnerImpl"]

# `TaskRunner` is a Ray ActorClass; the plain class it wraps is `__ray_actor_class__`.
_VerlTaskRunner = _VerlTaskRunnerActor.__ray_actor_class__


class OTBTaskRunnerImpl(_VerlTaskRunner):
    """verl's TaskRunner whose ``run`` first installs our estimators and registers our agent loop."""

    def run(self, config: Any) -> Any:
        from otb_tir.verl import agent_loop  # noqa: F401  (registers otb_tir_agent in this process)
        from otb_tir.verl.plugin import install, installed

        install()
        if not installed():  # pragma: no cover - install() guarantees it
            raise RuntimeError("the OTB plugin did not install")
        logger.info("OTB estimators installed in the TaskRunner process")
        return super().run(config)


OTBTaskRunner = ray.remote(OTBTaskRunnerImpl)
