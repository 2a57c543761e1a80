#!/usr/bin/env python
"""bfloat16 against float32 on this CPU, per shape: the engine's decode and the actor's update
forward + backward, and how far bfloat16's log-probs are from float32's.

    python benchmarks/bench_bf16.py                                  # tiny, 30m, 150m, qwen3-0.6b
    python benchmarks/bench_bf16.py --shapes tiny,30m --models runs/bench_scale/models

Per shape (``otb_tir/defaults/shapes.py``, random weights, seed 0; a folder under ``--models`` is
reused, as bench_scale writes them), in one process, each timed ``--reps`` times after a warm-up
(median; the two dtypes alternate, so a slow spell of the VM falls on both):

* ``decode``: :class:`agent_env.engines.hf.HFEngine` (its defaults: fused decode step where the model
  has one, half of torch's threads) serving ``--batch`` random prompts of ``--prompt`` tokens for
  exactly ``--new`` tokens each, with the model's weights in float32 and in bfloat16 (a copy):
  milliseconds per decode step (wall / new tokens); ``*_all_threads``: the same with
  ``cpu_threads=0`` (all of torch's threads, as when no tool's process runs beside).
* ``update``: the actor's forward + backward (``otb_tir.token_stats.token_stats_for_causal_lm``,
  fused Σπ² / log-probs, the sum of log-probs as the loss) over ``--rows`` rows of ``--prompt`` +
  ``--response`` tokens, float32 against ``torch.autocast("cpu", torch.bfloat16)`` over the float32
  weights (what ``model.dtype=bfloat16`` means: float32 master weights).
* ``gap``: on the same rows, the largest and the mean absolute difference between the log-probs of
  the bfloat16 weights and those of float32 (response tokens), and the same for autocast.

``torch.backends.cpu.get_cpu_capability()`` and the CPU's native bfloat16 instructions
(:func:`otb_tir.machine.native_bf16`: avx512_bf16, AMX) are printed: without them bfloat16 is
emulated and slower. A ratio > 1 is
bfloat16 faster. Writes ``--out`` (default ``runs/bench_bf16.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("tiny", "30m", "150m", "qwen3-0.6b")


def cpu_bf16() -> dict[str, object]:
    from otb_tir.machine import native_bf16

    return {"capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16() or "none"}


def load(shape: str, models: Path):
    from transformers import AutoModelForCausalLM

    from otb_tir.defaults.shapes import save_shape

    folder = models / shape
    save_shape(shape, folder)  # kept when already there
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def time_decode(model, prompts: torch.Tensor, new: int, cpu_threads: int | None = None) -> float:
    from agent_env.engines.base import SamplingParams
    from agent_env.engines.hf import HFEngine

    engine = HFEngine(
        model, share_weights=True, stop_at_eos=False, max_batch_size=len(prompts), seed=0, cpu_threads=cpu_threads
    )

    async def go():
        params = SamplingParams(max_tokens=new, temperature=1.0)
        outs = await asyncio.gather(*(engine.generate(row, params) for row in prompts.tolist()))
        assert all(len(o.token_ids) == new for o in outs)

    t0 = time.perf_counter()
    asyncio.run(go())
    dt = time.perf_counter() - t0
    asyncio.run(engine.close())
    return dt / new * 1e3


def stats(model, ids: torch.Tensor, response: int, grad: bool, autocast: bool):
    from otb_tir.token_stats import token_stats_for_causal_lm

    attn = torch.ones_like(ids)
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with torch.set_grad_enabled(grad), ctx:
        return token_stats_for_causal_lm(model, ids, attn, pos, response_length=response, fused=True, chunk=512)


def time_update(model, ids: torch.Tensor, response: int, autocast: bool) -> float:
    model.train()
    t0 = time.perf_counter()
    st = stats(model, ids, response, grad=True, autocast=autocast)
    st.log_probs.float().sum().backward()
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    model.eval()
    return dt


def one_shape(shape: str, a: argparse.Namespace) -> dict[str, object]:
    model = load(shape, a.models)
    half = copy.deepcopy(model).to(torch.bfloat16)
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (a.batch, a.prompt), generator=g)
    ids = torch.randint(10, vocab, (a.rows, a.prompt + a.response), generator=g)
    out: dict[str, object] = {"shape": shape, "parameters": sum(p.numel() for p in model.parameters())}
    # gap first (no gradient): bfloat16 weights, and autocast over float32 weights, against float32
    ref = stats(model, ids, a.response, grad=False, autocast=False).log_probs.float()
    for name, lp in (
        ("bf16_weights", stats(half, ids, a.response, grad=False, autocast=False).log_probs.float()),
        ("autocast", stats(model, ids, a.response, grad=False, autocast=True).log_probs.float()),
    ):
        d = (lp - ref).abs()
        out[f"gap_{name}_max"], out[f"gap_{name}_mean"] = float(d.max()), float(d.mean())
    decode = {"float32": [], "bfloat16": [], "float32_all_threads": [], "bfloat16_all_threads": []}
    update = {"float32": [], "autocast_bf16": []}
    time_decode(model, prompts, 4), time_decode(half, prompts, 4)  # warm-up
    time_update(model, ids, a.response, False), time_update(model, ids, a.response, True)
    for _ in range(a.reps):
        decode["float32"].append(time_decode(model, prompts, a.new))
        decode["bfloat16"].append(time_decode(half, prompts, a.new))
        decode["float32_all_threads"].append(time_decode(model, prompts, a.new, cpu_threads=0))
        decode["bfloat16_all_threads"].append(time_decode(half, prompts, a.new, cpu_threads=0))
        update["float32"].append(time_update(model, ids, a.response, False))
        update["autocast_bf16"].append(time_update(model, ids, a.response, True))
    for k, v in decode.items():
        out[f"decode_ms_{k}"] = statistics.median(v)
    for k, v in update.items():
        out[f"update_s_{k}"] = statistics.median(v)
    out["decode_bf16_speedup"] = out["decode_ms_float32"] / out["decode_ms_bfloat16"]
    out["update_bf16_speedup"] = out["update_s_float32"] / out["update_s_autocast_bf16"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--models", type=Path, default=ROOT / "runs" / "bench_scale" / "models")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--response", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_bf16.json")
    a = p.parse_args(argv)
    from otb_tir.machine import speed_reference

    cpu = cpu_bf16()
    gflops = speed_reference()["matmul_gflops"]
    print(f"# bench_bf16 {time.strftime('%Y-%m-%d %H:%M')}: cpu capability {cpu['capability']}, native bfloat16 "
          f"{cpu['native_bf16']}, torch {torch.__version__}, {torch.get_num_threads()} threads, speed reference "
          f"{gflops:.1f} GFLOP/s; decode {a.batch} x ({a.prompt} + {a.new}), update {a.rows} x ({a.prompt} + "
          f"{a.response}), median of {a.reps}", flush=True)  # fmt: skip
    rows = []
    for shape in [s for s in a.shapes.split(",") if s]:
        r = one_shape(shape, a)
        rows.append(r)
        print(f"# {shape}: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})}",
              flush=True)  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"cpu": cpu, "speed_reference_gflops": gflops, "rows": rows}, indent=1))
    print()
    print("| shape | params | decode ms/step fp32 | bf16 | bf16 speed-up | fp32 all threads | bf16 all threads "
          "| update s fp32 | autocast bf16 | speed-up | log-prob gap bf16 weights max / mean "
          "| autocast max / mean |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['parameters'] / 1e6:.1f}M | {r['decode_ms_float32']:.1f} | "
              f"{r['decode_ms_bfloat16']:.1f} | {r['decode_bf16_speedup']:.2f}× | "
              f"{r['decode_ms_float32_all_threads']:.1f} | {r['decode_ms_bfloat16_all_threads']:.1f} | "
              f"{r['update_s_float32']:.2f} | "
              f"{r['update_s_autocast_bf16']:.2f} | {r['update_bf16_speedup']:.2f}× | "
              f"{r['gap_bf16_weights_max']:.3f} / {r['gap_bf16_weights_mean']:.4f} | "
              f"{r['gap_autocast_max']:.3f} / {r['gap_autocast_mean']:.4f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
