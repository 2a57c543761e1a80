"""otb-tir's stand-in for ``sgl_kernel``, sglang's compiled CPU kernels (``.venv-sglang`` only).

NOT the real package. sglang's CPU kernels are not published on PyPI (no CPU wheel, and its
sdists stop at 0.5.10.post1 without the kernel sources), yet with ``SGLANG_USE_CPU_ENGINE=1``
sglang imports a few ``*_cpu`` names from ``sgl_kernel`` at module level. This module provides
exactly those names so sglang starts and takes its torch-native paths:

- ``assign_req_to_token_pool_cpu``: implemented here in plain torch (every decode step calls it);
  ``tests/agent_env/test_sglang_cpu_stand_in.py`` checks it against a brute-force loop.
- every other name raises ``NotImplementedError`` naming itself when called: a run that reaches one
  stops there, saying which kernel it needed (KV-cache moves between layers, used by speculative
  decoding and hierarchical caching, are the ones known; a dense model's generation never calls them).

``torch.ops.sgl_kernel`` stays empty, so sglang's ``cpu_has_amx_support()`` is False and it uses
its torch-native attention and sampling backends. Installed by scripts/install_sglang_env.sh as a
path entry (a ``.pth`` file) of that environment only. Upstream, a published CPU build of
``sgl-kernel`` would make this module unnecessary.
"""

from __future__ import annotations

import torch

STAND_IN = True  # real sgl_kernel has no such attribute: tests and the start-up check look for it


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[o_i : o_i + end[i] - start[i]]``
    with ``o_i`` the sum of the earlier requests' lengths (sglang's triton ``assign_req_to_token_pool``)."""
    del pool_len  # the row length is req_to_token's own
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, s, e in zip(rows, starts, ends):
        n = int(e) - int(s)
        if n > 0:
            req_to_token[int(row), int(s) : int(e)] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += max(n, 0)


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this is otb-tir's stand-in for sglang's CPU kernels "
            "(agent_env/engines/sglang_cpu/stand_in), which implements only what a dense model's "
            "generation needs; this sglang feature needs the real sgl-kernel CPU build"
        )

    kernel.__name__ = name
    return kernel


# imported by sglang at module level with SGLANG_USE_CPU_ENGINE=1 (0.5.23): KV-cache moves between
# layers, and speculative decoding's tree building and verification
MISSING = (
    "copy_all_layer_kv_cache_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)
for _name in MISSING:
    globals()[_name] = _missing(_name)
del _name
