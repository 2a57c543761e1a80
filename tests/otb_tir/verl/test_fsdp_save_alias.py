"""π_old in verl's ``separate_async`` on a CPU: the save that keeps it must be a copy.

verl 0.9.1's ``DetachActorWorker`` (``verl/experimental/separation/engine_workers.py``) saves the
actor's shards with ``fsdp2_sharded_save_to_cpu`` (``verl/utils/fsdp_utils.py``) before the first
update of a ``parameter_sync_step`` cycle and restores them for every later old-log-prob pass. That
save takes ``param._local_tensor.detach().cpu()``, which on a CPU tensor is the live parameter: the
optimizer step moves the "saved" π_old along, and the restore copies the current weights onto
themselves. The glue row ``fsdp2_save_copy`` makes the saved tensors copies, installed by the CPU
layer (:mod:`otb_tir.verl.cpu`) and by our plugin entry point alone (:mod:`otb_tir.verl.v1`: a GPU
run with ``param_offload=True`` keeps the parameters on the CPU too).

Each probe is a fresh process that gets verl the way a run's processes do (``import verl``; with
:func:`otb_tir.verl.cpu.cpu_env` that loads the CPU layer through ``VERL_USE_EXTERNAL_MODULES``),
wraps a tiny model in FSDP2 (world size 1, gloo) and drives ``DetachActorWorker``'s own
``save_model_to_cpu`` / ``restore_model_from_cpu``: save π_old, take an optimizer step, save the
current weights, restore π_old, compare.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.optional import need

need("verl")

REPO = Path(__file__).resolve().parents[3]

PROBE = r"""
import json
import types

import torch
import torch.distributed as dist
import verl  # noqa: F401  (loads VERL_USE_EXTERNAL_MODULES, as in every verl process)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from verl.experimental.separation.engine_workers import DetachActorWorker

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
mesh = init_device_mesh("cpu", (1,))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

# DetachActorWorker's own save/restore, on the parts of a worker they read
worker = object.__new__(DetachActorWorker)
worker._strategy_handlers = None
worker.config = types.SimpleNamespace(actor=types.SimpleNamespace(strategy="fsdp2"))
worker.actor = types.SimpleNamespace(engine=types.SimpleNamespace(module=model))

def weights():
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}

worker.save_model_to_cpu(0)  # π_old
pi_old = weights()
model(torch.randn(5, 4)).square().sum().backward()
optimizer.step()
current = weights()
worker.save_model_to_cpu(1)
saved = {n: t for n, (t, _) in worker.cpu_saved_models[0][0].items()}
worker.restore_model_from_cpu(0)  # what the old-log-prob pass computes with
restored_old = weights()
worker.restore_model_from_cpu(1)
back = weights()
same = lambda a, b: all(torch.equal(a[n], b[n]) for n in a)
print("PROBE " + json.dumps({
    "patched": getattr(worker.copy_handler, "_otb_tir_copy", False),
    "step_moved_weights": not same(pi_old, current),
    "saved_is_pi_old": same(saved, pi_old),
    "saved_is_current": same(saved, current),
    "restored_old_is_pi_old": same(restored_old, pi_old),
    "back_to_current": same(back, current),
}))
dist.destroy_process_group()
"""


def _probe(how: str) -> subprocess.Popen:
    """``how``: "none" (verl as installed: neither our plugin nor the CPU layer), "plugin" (verl's
    plugin entry point only, as on an accelerator machine) or "cpu" (the CPU layer, as a run here)."""
    from otb_tir.verl.cpu import ENV_FLAG, cpu_env

    env = {k: v for k, v in os.environ.items() if k not in (ENV_FLAG, "VERL_USE_EXTERNAL_MODULES")}
    env["VERL_USE_EXTERNAL_PLUGINS"] = "none" if how == "none" else "auto"
    if how == "cpu":
        env.update(cpu_env())
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-c", PROBE], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture(scope="module")
def probes() -> dict[str, dict]:
    found = {}
    for batch in (("none", "plugin"), ("cpu",)):  # two at once: two cores
        running = {how: _probe(how) for how in batch}
        for how, proc in running.items():
            out, _ = proc.communicate(timeout=600)
            lines = [line for line in out.splitlines() if line.startswith("PROBE ")]
            assert proc.returncode == 0 and lines, f"probe ({how}) failed:\n{out[-4000:]}"
            found[how] = json.loads(lines[-1][len("PROBE ") :])
    return found


@pytest.mark.slow
def test_unpatched_verl_keeps_a_view_of_the_live_weights_as_pi_old(probes):
    """The bug, on verl as installed: π_old's saved copy follows the optimizer step."""
    r = probes["none"]
    assert not r["patched"] and r["step_moved_weights"]
    assert r["saved_is_current"] and not r["saved_is_pi_old"]
    assert not r["restored_old_is_pi_old"], "restoring π_old gives the current weights"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["cpu", "plugin"])
def test_the_saved_pi_old_is_a_copy_with_the_cpu_layer_and_with_the_plugin_alone(probes, how):
    """With the CPU layer as a run loads it, and with only verl's plugin entry point (an accelerator
    machine whose parameters are offloaded to the CPU): the saved copy differs from the current
    weights, and restoring it gives π_old back (then the current weights again)."""
    r = probes[how]
    assert r["patched"] and r["step_moved_weights"]
    assert r["saved_is_pi_old"] and not r["saved_is_current"]
    assert r["restored_old_is_pi_old"] and r["back_to_current"]
