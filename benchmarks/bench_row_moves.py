"""The running batch's row moves (rows dropped when they finish a turn, prefilled rows merged in)
against the way they were done until 2026-12-06, in one process.

    .venv/bin/python benchmarks/bench_row_moves.py                       # the built-in policy's KV shape
    .venv/bin/python benchmarks/bench_row_moves.py --shape qwen3-0.6b    # 28 layers × 8 KV heads × 128

Each timing is one move followed by what the next decode step does first: ``reserve(1)`` on every
layer (:func:`agent_env.engines.hf_batch.slack_layer_class`), which reallocates the buffers when
the move replaced the keys/values.

* ``drop``: 2 of ``--batch`` rows at ``--width`` columns leave (``RunningBatch._drop_rows``): now
  one ``index_select`` of the kept rows' buffers, free columns included; the reference
  ``index_select``-ed the keys/values and the next ``reserve`` copied them into new buffers.
* ``merge``: 4 prefilled rows of ``--width`` × 3/4 columns join ``--batch`` − 4 running rows
  (``RunningBatch._merge``): now each side copied once into new buffers with free columns; the
  reference padded both sides, concatenated them, and the next ``reserve`` copied them again.

The rounds interleave new and reference; median and [min, max] over ``--reps`` rounds, and the
ratio reference ÷ new. Figures: [docs/results.md](../docs/results.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, PretrainedConfig

from agent_env.engines.hf_batch import RunningBatch, cache_layers, slack_layer_class, with_slack


class _NoPrefixCache:
    max_bytes = 0


class _Batch(RunningBatch):
    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._prefix = _NoPrefixCache()
        self.stats = {}


def _cache(config: PretrainedConfig, b: int, t: int, heads: int, d: int) -> DynamicCache:
    cache = DynamicCache(config=config)
    for i in range(config.num_hidden_layers):
        cache.update(torch.randn(b, heads, t, d), torch.randn(b, heads, t, d), i)
    return cache


def _running(config, b: int, t: int, heads: int, d: int) -> _Batch:
    """A running batch after a decode step: slack buffers, each layer's view of their first t columns."""
    rb = _Batch()
    rb._cache = _cache(config, b, t, heads, d)
    with_slack(rb._cache)
    for layer in cache_layers(rb._cache):
        layer.reserve(1)
    rb._active = list(range(b))
    rb._mask = torch.ones(b, t, dtype=torch.long)
    rb._next, rb._pos = torch.zeros(b, dtype=torch.long), torch.full((b,), t)
    return rb


def _next_step(rb: _Batch) -> None:
    for layer in cache_layers(rb._cache):
        layer.reserve(1)


def _reference_drop(rb: _Batch, rows: list[int]) -> None:
    keep = torch.tensor([i for i in range(len(rb._active)) if i not in set(rows)])
    for layer in cache_layers(rb._cache):  # the columns' left trim is 0 here: every row is full
        layer.keys, layer.values = layer.keys.index_select(0, keep), layer.values.index_select(0, keep)


def _reference_merge(rb: _Batch, cache, t_new: int) -> None:
    t_old = rb._mask.shape[1]
    width = max(t_old, t_new)
    pad = torch.nn.functional.pad
    for old, new in zip(cache_layers(rb._cache), cache_layers(cache)):
        for name in ("keys", "values"):
            a, b = pad(getattr(old, name), (0, 0, width - t_old, 0)), pad(getattr(new, name), (0, 0, width - t_new, 0))
            setattr(old, name, torch.cat([a, b], dim=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=["tiny", "qwen3-0.6b"], default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--width", type=int, default=200)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if a.shape == "tiny":
        from transformers import AutoConfig

        from otb_tir.defaults.tiny import tiny_policy_dir

        config = AutoConfig.from_pretrained(tiny_policy_dir())
        heads = config.num_key_value_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    else:
        from transformers import Qwen3Config

        config, heads, d = Qwen3Config(num_hidden_layers=28, num_key_value_heads=8, head_dim=128), 8, 128
    b, t, t_new = a.batch, a.width, a.width * 3 // 4
    times: dict[str, list[float]] = {k: [] for k in ("drop", "drop_ref", "merge", "merge_ref")}
    merged = list(range(4))
    for _ in range(a.reps):
        for name in times:
            rb = _running(config, b if name.startswith("drop") else b - 4, t, heads, d)
            new = _cache(config, 4, t_new, heads, d)
            t0 = time.perf_counter()
            if name == "drop":
                rb._drop_rows([3, 9])
            elif name == "drop_ref":
                _reference_drop(rb, [3, 9])
            elif name == "merge":
                rb._merge(merged, new, torch.ones(4, t_new, dtype=torch.long), torch.full((4,), t_new))
            else:
                _reference_merge(rb, new, t_new)
            _next_step(rb)
            times[name].append(time.perf_counter() - t0)
    assert all(isinstance(layer, slack_layer_class()) for layer in cache_layers(rb._cache))
    kv_mb = 2 * config.num_hidden_layers * b * heads * t * d * 4 / 2**20
    print(
        f"# bench_row_moves: shape {a.shape} ({config.num_hidden_layers} layers × {heads} KV heads × {d}), "
        f"{b} rows × {t} columns ({kv_mb:.1f} MB of keys/values, float32), {a.reps} rounds, one thread"
    )
    print("| move | now ms | before ms | before ÷ now |")
    print("|---|---|---|---|")
    for move in ("drop", "merge"):
        new_ms, ref_ms = (sorted(x * 1e3 for x in times[k]) for k in (move, move + "_ref"))
        ratio = statistics.median(ref_ms) / statistics.median(new_ms)
        print(
            f"| {move} | {statistics.median(new_ms):.2f} [{new_ms[0]:.2f}, {new_ms[-1]:.2f}] "
            f"| {statistics.median(ref_ms):.2f} [{ref_ms[0]:.2f}, {ref_ms[-1]:.2f}] | {ratio:.2f}× |"
        )


if __name__ == "__main__":
    main()
