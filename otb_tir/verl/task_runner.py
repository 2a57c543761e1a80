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
import os
from typing import Any

from otb_tir.verl import require_verl

require_verl()

import ray  # noqa: E402
from verl.trainer.main_ppo_v0 import BaseTaskRunner  # noqa: E402
from verl.trainer.main_ppo_v0 import TaskRunner as _VerlTaskRunnerActor  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["OTBTaskRunner", "OTBTaskRunnerImpl"]

# verl's module binds the name `TaskRunner` to the Ray ActorClass, so a subclass of the class it
# wraps reaches the Ray worker with that base class pickled by value: a copy, on which the
# zero-argument `super()` of its `__init__` fails ("super(type, obj): obj must be an instance or
# subtype of type"; seen on the first real run). We subclass verl's `BaseTaskRunner` (all that
# TaskRunner.__init__ initializes) and call TaskRunner's `run` on ourselves.
_verl_run = _VerlTaskRunnerActor.__ray_actor_class__.run


class OTBTaskRunnerImpl(BaseTaskRunner):
    """verl's TaskRunner whose ``run`` first installs our estimators and registers our agent loop."""

    def run(self, config: Any) -> Any:
        from otb_tir.verl import agent_loop  # noqa: F401  (registers otb_tir_agent in this process)
        from otb_tir.verl.plugin import install, installed

        install()
        if not installed():  # pragma: no cover - install() guarantees it
            raise RuntimeError("the OTB plugin did not install")
        logger.info("OTB estimators installed in the TaskRunner process")
        out = os.environ.get("OTB_TIR_OUTPUT_DIR")
        if out:  # launched by the recipe: progress for the watchdog, contract checks, our metrics files
            from otb_tir.verl import hooks

            loggers = [x for x in os.environ.get("OTB_TIR_LOGGERS", "jsonl,tensorboard").split(",") if x]
            hooks.install(out, loggers, resume=os.environ.get("OTB_TIR_RESUME") == "1")
        return _verl_run(self, config)


OTBTaskRunner = ray.remote(OTBTaskRunnerImpl)
