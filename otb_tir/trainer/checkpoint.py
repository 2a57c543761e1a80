"""Checkpoints that survive SIGKILL: model, optimizer, scheduler, data cursor and RNG states.

Each checkpoint is written to a temporary folder and renamed into place, so a run killed mid-save
leaves the previous checkpoint intact; ``latest`` is read by listing complete ``step_*`` folders.

One process: ``step_N/state.pt`` holds everything. Under torchrun/FSDP2: ``step_N/dcp/`` holds the
sharded model and optimizer (``torch.distributed.checkpoint``, every rank writes its own shards)
and ``step_N/state.pt`` (written last, by rank 0) the scheduler, data cursor, step, every rank's
RNG state and ``distributed: True``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str | Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Atomically write ``state`` (any torch-serializable dict) as ``root/step_<step>``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    _publish(tmp, final, state, root, keep)
    return final


def _publish(tmp: Path, final: Path, state: dict, root: Path, keep: int) -> None:
    """Write ``state.pt`` last into ``tmp``, fsync it, rename ``tmp`` to ``final``, prune old steps."""
    torch.save(state, tmp / "state.pt")
    with open(tmp / "state.pt", "rb") as f:
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and (p / "state.pt").is_file()]
    return [p for _, p in sorted(found)]


def load_latest(root: str | Path) -> tuple[int, dict[str, Any]] | None:
    """(step, state) of the newest complete checkpoint, or None."""
    ckpts = list_checkpoints(root)
    if not ckpts:
        return None
    path = ckpts[-1]
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    return int(_STEP.match(path.name).group(1)), state


def save_distributed_checkpoint(
    root: str | Path, step: int, model, optimizer, state: dict[str, Any], *, rank: int, world: int, keep: int = 2
) -> Path:
    """Collective: every rank writes its model/optimizer shards with DCP, rank 0 adds ``state.pt``
    (``state`` + ``distributed: True``) and renames the folder into place once all shards are down."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(root)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    dist.barrier()  # every shard is on disk
    if rank == 0:
        _publish(tmp, final, {**state, "distributed": True, "world_size": world}, root, keep)
    dist.barrier()
    return final


def load_distributed_state(path: str | Path, model, optimizer) -> None:
    """Collective: load ``path/dcp`` into the (FSDP-sharded) ``model`` and its ``optimizer``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
