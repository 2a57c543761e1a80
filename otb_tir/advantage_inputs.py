"""Input handling shared by the advantage estimators of :mod:`otb_tir.advantage`: uids mapped to
dense group ids (``np.unique(..., return_inverse=True)``, no row loop), the shape and 0/1-mask
checks, and the dtypes. Half-precision inputs (bf16/fp16) are computed in float32 (float64 inputs
in float64) and the results cast back to the dtype verl would return (that of
``token_level_rewards`` promoted with ``response_mask``). verl computes in the input dtype, so on
bf16 inputs it sums thousands of values with an 8-bit mantissa; ours equals verl run on the same
inputs upcast to float32.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from otb_tir import ConfigError
from otb_tir.layout import mask_in_unit_interval

#: The estimators' own logger, as before they moved out of :mod:`otb_tir.advantage`.
logger = logging.getLogger("otb_tir.advantage")

__all__ = ["check_2d", "group_ids", "log_ignored", "prepare_inputs"]


def group_ids(index: Any, batch: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map uids (any hashable, mutually comparable values) to dense ids 0..G-1, without a row loop."""
    if isinstance(index, torch.Tensor):
        arr = index.detach().cpu().numpy()
    else:
        arr = np.asarray(index, dtype=object if isinstance(index, (list, tuple)) else None)
    if arr.ndim != 1 or arr.shape[0] != batch:
        raise ConfigError(f"index (uid) must be 1-D with one entry per row ({batch}), got shape {arr.shape}")
    if batch == 0:
        return torch.zeros(0, dtype=torch.long, device=device), 0
    try:
        _, inverse = np.unique(arr, return_inverse=True)
    except TypeError as exc:
        raise ConfigError(f"index (uid) values must be mutually comparable (all str or all int), got {exc}") from None
    inverse = np.asarray(inverse).reshape(-1)
    n_groups = int(inverse.max()) + 1
    return torch.from_numpy(inverse.astype(np.int64)).to(device), n_groups


def check_2d(name: str, t: torch.Tensor | None, shape: torch.Size, required: bool) -> None:
    if t is None:
        if required:
            raise ConfigError(
                f"{name} is required by the Optimal Token Baseline estimators "
                "(compute it with otb_tir.token_stats; in verl set actor.calculate_sum_pi_squared=True)"
            )
        return
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != shape:
        raise ConfigError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like token_level_rewards")


def prepare_inputs(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    tensors: dict[str, torch.Tensor | None],
    required: bool,
) -> tuple[torch.Tensor, torch.dtype, torch.dtype]:
    """Validate shapes and the mask; return (0/1 mask in the compute dtype, compute dtype, output dtype)."""
    if not isinstance(token_level_rewards, torch.Tensor) or token_level_rewards.dim() != 2:
        raise ConfigError(
            "token_level_rewards must be a 2-D [batch, response_length] tensor, got "
            f"{type(token_level_rewards).__name__} of shape {tuple(getattr(token_level_rewards, 'shape', ()))}"
        )
    shape = token_level_rewards.shape
    check_2d("response_mask", response_mask, shape, True)
    for name, t in tensors.items():
        check_2d(name, t, shape, required and name != "rollout_is_weights")
    if not mask_in_unit_interval(response_mask):
        raise ConfigError(
            "response_mask must hold 0/1 values (1 = token sampled by the policy); got values outside [0, 1] or NaN"
        )
    out_dtype = torch.promote_types(token_level_rewards.dtype, response_mask.dtype)
    if not out_dtype.is_floating_point:
        out_dtype = torch.get_default_dtype()
    floats = [out_dtype] + [t.dtype for t in tensors.values() if t is not None and t.dtype.is_floating_point]
    compute_dtype = torch.float64 if torch.float64 in floats else torch.float32
    return response_mask.to(compute_dtype), compute_dtype, out_dtype


def log_ignored(name: str, kwargs: dict[str, Any]) -> None:
    if kwargs:
        logger.debug("%s: ignoring keyword arguments %s", name, sorted(kwargs))
