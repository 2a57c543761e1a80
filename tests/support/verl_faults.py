"""Faults a test injects into a verl CPU run (imported in every process of the run through
``VERL_USE_EXTERNAL_MODULES``, after :mod:`otb_tir.verl.cpu`). ``OTB_TIR_VERL_FAULT``:

* ``skip_post_update_sync``: the vLLM worker receives every weight update after the first (the
  initial sync) but does not load it, so the rollout keeps the initial weights;
* ``skip_two_syncs``: the vLLM worker skips loading two consecutive updates, from the first whose
  weights moved by more than ``MOVED`` (max |Δ| over all tensors) since the previous update it
  received, i.e. the syncs after the first two training steps from the first that moved the actor.
  Two, because colocate_async keeps one batch generated ahead: every row of the step after the
  first skipped load began before it (lag 1 by its oldest weights), while the rows of the next step
  that began after the second skipped load are at lag 0 on weights two updates old. Every later
  update loads, so one run holds both arms. Each sync is recorded as a JSON line
  ``{"call", "moved", "skipped"}`` (call 1 = the initial load) in ``OTB_TIR_VERL_FAULT_RECORD``;
* ``fail_sync``: the vLLM worker raises on the first weight update after the initial sync (the
  trainer's side then waits for a receiver that is gone: verl's ``main_ppo`` hangs).
"""

from __future__ import annotations

import json
import os

FAULT = os.environ.get("OTB_TIR_VERL_FAULT", "")
RECORD = os.environ.get("OTB_TIR_VERL_FAULT_RECORD", "")
FAULTS = ("skip_post_update_sync", "skip_two_syncs", "fail_sync")
SKIPS = 2
MOVED = 1e-2  # an optimizer step that moved the policy (Adam at lr 0.1: ~0.1); weight decay alone: < 1e-3
_state: dict = {"n": 0, "previous": None, "skipped": 0}


def _record(entry: dict) -> None:
    if RECORD:
        with open(RECORD, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _skip_two(runner, call: int) -> None:
    """Wrap ``runner.reload_weights`` for this sync: compare what arrived with the previous sync's
    tensors; skip the load the first time they moved and at the sync after it."""
    reload = runner.reload_weights

    def reload_weights(*args, weights_iterator=None, **kwargs):
        weights = [(name, t.detach().clone()) for name, t in weights_iterator]
        previous = _state["previous"]
        moved = (
            0.0
            if previous is None
            else max(float((t.float() - previous[name].float()).abs().max()) for name, t in weights)
        )
        _state["previous"] = dict(weights)
        skip = 0 < _state["skipped"] < SKIPS or (moved > MOVED and not _state["skipped"])
        _state["skipped"] += skip
        _record({"call": call, "moved": moved, "skipped": skip})
        if not skip:
            reload(*args, weights_iterator=iter(weights), **kwargs)

    runner.reload_weights = reload_weights


def _patch(_module) -> None:
    from otb_tir.verl import cpu

    ext = cpu.CPUWorkerExtension
    original = ext.update_weights_from_ipc

    def update_weights_from_ipc(self, *args, **kwargs):
        _state["n"] += 1
        if _state["n"] >= 2 and FAULT == "fail_sync":
            raise RuntimeError("injected fault: the weight sync failed in the vLLM worker")
        skip_all = _state["n"] >= 2 and FAULT == "skip_post_update_sync"
        if not (skip_all or FAULT == "skip_two_syncs"):
            return original(self, *args, **kwargs)
        runner = self.model_runner
        if skip_all:
            runner.reload_weights = lambda *a, **k: None  # receive the buckets, load nothing
        else:
            _skip_two(runner, _state["n"])
        try:
            return original(self, *args, **kwargs)
        finally:
            del runner.reload_weights

    ext.update_weights_from_ipc = update_weights_from_ipc


if FAULT:
    if FAULT not in FAULTS:
        raise ValueError(f"OTB_TIR_VERL_FAULT={FAULT!r}: expected one of {', '.join(FAULTS)}")
    from otb_tir.verl.cpu import after_import

    after_import("verl.workers.rollout.vllm_rollout.utils", _patch)
