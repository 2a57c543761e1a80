"""Faults a test injects into a verl CPU run (imported in every process of the run through
``VERL_USE_EXTERNAL_MODULES``, after :mod:`otb_tir.verl.cpu`). ``OTB_TIR_VERL_FAULT``:

* ``skip_post_update_sync``: the vLLM worker receives every weight update after the first (the
  initial sync) but does not load it, so the rollout keeps the initial weights;
* ``fail_sync``: the vLLM worker raises on the first weight update after the initial sync (the
  trainer's side then waits for a receiver that is gone: verl's ``main_ppo`` hangs).
"""

from __future__ import annotations

import os

FAULT = os.environ.get("OTB_TIR_VERL_FAULT", "")
_calls = {"n": 0}


def _patch(_module) -> None:
    from otb_tir.verl import cpu

    ext = cpu.CPUWorkerExtension
    original = ext.update_weights_from_ipc

    def update_weights_from_ipc(self, *args, **kwargs):
        _calls["n"] += 1
        if _calls["n"] >= 2 and FAULT == "fail_sync":
            raise RuntimeError("injected fault: the weight sync failed in the vLLM worker")
        if _calls["n"] >= 2 and FAULT == "skip_post_update_sync":
            runner = self.model_runner
            runner.reload_weights = lambda *a, **k: None  # receive the buckets, load nothing
            try:
                return original(self, *args, **kwargs)
            finally:
                del runner.reload_weights
        return original(self, *args, **kwargs)

    ext.update_weights_from_ipc = update_weights_from_ipc


if FAULT:
    if FAULT not in ("skip_post_update_sync", "fail_sync"):
        raise ValueError(f"OTB_TIR_VERL_FAULT={FAULT!r}: expected skip_post_update_sync or fail_sync")
    from otb_tir.verl.cpu import after_import

    after_import("verl.workers.rollout.vllm_rollout.utils", _patch)
