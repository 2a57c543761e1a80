"""One probe of :mod:`otb_tir.verl.cpu`, run in the verl environment (.venv-verl) by
``test_verl_cpu.py``: ``python verl_cpu_checks.py PROBE patched|unpatched MODEL_DIR OUT.json``.

Each probe does the upstream operation a CPU run needs, in a fresh process, with the patch under
test applied (``patched``) or left out (``unpatched``; the other patches it depends on are applied),
and writes ``{"ok": bool, "error": str | None, ...facts}``. The test asserts that every probe fails
unpatched with the upstream error the module docstring names, and works patched.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback


def _apply(*names: str) -> None:
    from otb_tir.verl import cpu

    cpu.apply(force=True, only=set(names))


def platform(patched: bool, model_dir: str) -> dict:
    os.environ["VERL_PLATFORM"] = "cpu"
    if patched:
        _apply("platform")
    from verl.utils.device import get_device_id, get_device_name, get_nccl_backend

    return {"device": get_device_name(), "device_id": repr(get_device_id()), "backend": get_nccl_backend()}


def process_group(patched: bool, model_dir: str) -> dict:
    os.environ["VERL_PLATFORM"] = "cpu"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _apply("platform", *(["process_group"] if patched else []))
    import torch.distributed as dist
    from verl.utils.distributed import initialize_global_process_group

    initialize_global_process_group()
    backend = str(dist.get_backend())
    dist.destroy_process_group()
    return {"backend": backend}


def engine_device(patched: bool, model_dir: str) -> dict:
    os.environ["VERL_PLATFORM"] = "cpu"
    if patched:
        from otb_tir.verl.cpu import cpu_env

        os.environ["VERL_ENGINE_DEVICE"] = cpu_env()["VERL_ENGINE_DEVICE"]
    _apply("platform")
    from verl.workers.engine.base import EngineRegistry

    cls = EngineRegistry.get_engine_cls(model_type="language_model", backend="fsdp")
    return {"engine": f"{cls.__module__}.{cls.__qualname__}"}


def vllm_version(patched: bool, model_dir: str) -> dict:
    if patched:
        _apply("vllm_version")
    import verl.third_party.vllm as tv

    return {"vllm_version": str(tv.vllm_version)}


def weight_sync(patched: bool, model_dir: str) -> dict:
    """verl's per-bucket ``model.load_weights`` on vLLM-CPU (unpatched) vs the layerwise
    ``model_runner.reload_weights`` the CPU extension uses (patched): new weights must change the
    greedy output and the original weights must bring it back."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    if patched:
        _apply("vllm_version", "weight_sync")
        from verl.workers.rollout.replica import RolloutReplicaRegistry
        from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

        from otb_tir.verl import cpu

        replica = RolloutReplicaRegistry.get("vllm")
        ext = cpu.CPUWorkerExtension
        facts = {
            "replica": replica.__name__,
            "extension_is_verls_subclass": issubclass(ext, vLLMColocateWorkerExtension),
            "extension_name": f"{ext.__module__}.{ext.__qualname__}",
        }
    else:
        facts = {}
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    llm = LLM(
        model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, gpu_memory_utilization=0.3
    )
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}

    def greedy() -> list[int]:
        return list(llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids)

    before = greedy()
    gen = torch.Generator().manual_seed(0)
    changed = [(k, v + 0.5 * torch.randn(v.shape, generator=gen)) if v.dim() == 2 else (k, v) for k, v in state.items()]
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner

    if patched:
        runner.reload_weights(weights_iterator=iter(changed))
        after = greedy()
        runner.reload_weights(weights_iterator=iter(list(state.items())))
        restored = greedy()
    else:
        runner.model.load_weights(changed)  # what verl's _update_weights does, bucket by bucket
        after = greedy()
        restored = after
    return {**facts, "changed_output": after != before, "restored_output": restored == before}


PROBES = {f.__name__: f for f in (platform, process_group, engine_device, vllm_version, weight_sync)}


def main() -> None:
    probe, mode, model_dir, out = sys.argv[1:5]
    res: dict = {"probe": probe, "mode": mode}
    try:
        res.update(PROBES[probe](mode == "patched", model_dir))
        res["ok"], res["error"] = True, None
    except BaseException as e:  # noqa: BLE001 - the upstream failure is the result
        res["ok"], res["error"] = False, f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-3000:]
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
