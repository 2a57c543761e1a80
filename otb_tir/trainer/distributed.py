"""The local trainer on one multi-GPU machine: ``torchrun --nproc_per_node N`` with torch FSDP2.

Design (see docs/training.md, "Several GPUs on one machine"):

* **Process group.** ``torchrun`` sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; :func:`init_distributed`
  starts NCCL on CUDA (one GPU per ``LOCAL_RANK``) and gloo on CPU. Without those variables
  (or with ``WORLD_SIZE=1``) nothing changes: one process, no process group.
* **Data.** Every rank draws the same global batch of prompts from the data cursor and rolls out a
  contiguous block of it (:func:`shard_range`); all ``n`` samples of a prompt stay on one rank, so
  every uid group is whole where the advantages are computed and TIR-OTB / OTB / GRPO / RLOO
  baselines are exactly those of a one-process run. Episode seeds are offset by the block start,
  so each episode draws the same samples as in a one-process run of the same batch.
* **Actor.** The policy is wrapped in :class:`TokenStatsModule` (its ``forward`` is the fused
  token-statistics pass) and ``fully_shard``-ed per decoder layer and at that root, so the
  embedding / final norm / LM head (tied or not) are gathered by FSDP's own hooks and their
  gradients reduce-scattered like every other parameter. Mixed precision: a
  ``MixedPrecisionPolicy`` (bf16 params, fp32 gradient reduction) on CUDA when
  ``model.dtype=bfloat16``; fp32 on CPU.
* **Rollout weights.** The HF engine needs an unsharded model: each rank keeps its own engine copy
  and after every update receives the full state dict (:func:`full_state_dict`, an all-gather of
  each parameter) to copy in.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from otb_tir import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: one process, no process group

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) outside torchrun."""
    try:
        return (
            int(os.environ.get("RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)),
        )
    except ValueError as e:
        raise ConfigError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers (as torchrun sets them): {e}") from None


def init_distributed(device: str = "auto", backend: str = "auto") -> DistInfo:
    """Start the process group when run under ``torchrun`` with several processes.

    ``device``: auto | cpu | cuda (``trainer.device``); ``backend``: auto | gloo | nccl.
    On CUDA each process takes ``cuda:LOCAL_RANK``.
    """
    from otb_tir.builders import resolve_device

    rank, world, local = env_world()
    want_cuda = resolve_device(device).type == "cuda"  # the one resolver (auto → CUDA when there is one)
    if want_cuda:
        if local >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK={local} but only {torch.cuda.device_count()} CUDA devices are visible: "
                "use torchrun --nproc_per_node <= the number of GPUs"
            )
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world <= 1:
        return DistInfo(0, 1, 0, dev if want_cuda else torch.device("cpu"), None)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise ConfigError("trainer.dist_backend=nccl needs CUDA devices; use gloo (or auto) on CPU")
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend}
        if dev.type == "cuda":
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
    if dist.get_world_size() != world:  # pragma: no cover - inconsistent launcher environment
        raise ConfigError(f"WORLD_SIZE={world} but the process group has {dist.get_world_size()} ranks")
    log.info("rank %d/%d on %s (%s)", rank, world, dev, backend)
    return DistInfo(rank, world, local, dev, backend)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """Contiguous ``[start, stop)`` of ``n`` items for ``rank``: sizes differ by at most one, the
    first ``n % world`` ranks take the extra item; the ranges tile ``[0, n)`` in rank order."""
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is not in [0, {world})")
    if n < 0:
        raise ConfigError(f"cannot split {n} items")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard_items(items: Sequence[Any], rank: int, world: int) -> tuple[list[Any], int]:
    """This rank's contiguous block of ``items`` and the global index of its first item."""
    start, stop = shard_range(len(items), rank, world)
    return list(items[start:stop]), start


def gather_objects(objs: list, world: int) -> list:
    """Concatenate every rank's list (rank order) on every rank; ``objs`` itself when ``world == 1``."""
    if world == 1:
        return objs
    out: list[list] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(out, objs)
    return [o for part in out for o in part]


def gather_tensors(tensors: dict[str, torch.Tensor], world: int) -> dict[str, torch.Tensor]:
    """Every rank's ``[rows, ...]`` tensors concatenated along rows in rank order (CPU)."""
    if world == 1:
        return tensors
    parts: list[dict[str, torch.Tensor]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in tensors.items()})
    return {k: torch.cat([p[k] for p in parts]) for k in tensors}


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def broadcast_object(obj: Any, world: int, src: int = 0) -> Any:
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class TokenStatsModule(nn.Module):
    """``forward`` = :func:`otb_tir.token_stats.token_stats_for_causal_lm` of ``model``.

    The FSDP2 root: the fused statistics read the LM head's weight outside ``model.forward``, so
    the whole pass must run inside one root ``forward`` for FSDP to gather the root parameters
    and reduce their gradients. Returns a plain tuple of tensors (FSDP hooks its backward on them).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        response_length: int,
        temperature: float = 1.0,
        fused: bool = True,
        chunk: int | None = None,
        score_mask=None,
    ):
        from otb_tir.token_stats import token_stats_for_causal_lm

        st = token_stats_for_causal_lm(
            self.model,
            input_ids,
            attention_mask,
            position_ids,
            response_length=response_length,
            temperature=temperature,
            fused=fused,
            chunk=chunk,
            score_mask=score_mask,
        )
        # fresh tensors, not views of one buffer: FSDP hooks its pre-backward on these outputs
        return st.log_probs.clone(), st.entropy.clone(), st.sum_pi_squared.clone()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks to shard one by one (``model._no_split_modules`` classes)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(
            f"{type(model).__name__} names no decoder-layer class in _no_split_modules; "
            "FSDP needs the transformer blocks to shard"
        )
    return layers


def fsdp_wrap(
    model: nn.Module, info: DistInfo, param_dtype: torch.dtype | None = None, reshard_after_forward: bool = True
) -> TokenStatsModule:
    """Shard ``model`` with FSDP2 over all ranks: each decoder layer, then the root wrapper.

    ``param_dtype`` (CUDA only): compute dtype of the gathered parameters (gradients reduced in
    fp32, the sharded master weights stay fp32). Returns the :class:`TokenStatsModule` root; the HF
    model is ``root.model`` (sharded in place, its state-dict keys unchanged).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    mp = MixedPrecisionPolicy()
    if param_dtype is not None and param_dtype != torch.float32:
        if info.device.type != "cuda":
            log.warning("mixed precision %s needs a GPU; FSDP trains in float32 on %s", param_dtype, info.device)
        else:
            mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    model.to(info.device)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    root = TokenStatsModule(model)
    fully_shard(root, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return root


def full_state_dict(model: nn.Module, cpu: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of an FSDP-sharded ``model`` on every rank (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.cpu() for k, v in sd.items()} if cpu else sd
