"""HFEngine's decode step against transformers ``generate`` and a bare decode loop, in one process.

    .venv/bin/python benchmarks/bench_engine_decode.py                  # CPU: the built-in tiny policy
    python benchmarks/bench_engine_decode.py --shape qwen3-0.6b         # a GPU: random Qwen3-0.6B shape
    python benchmarks/bench_engine_decode.py --batch 16 --new 128 --out runs/bench_engine_decode.json
    .venv/bin/python benchmarks/bench_engine_decode.py --busy 1 --shape medium   # one core kept busy

The same ``--batch`` random prompts of ``--prompt`` tokens are decoded for exactly ``--new`` tokens
(no stop) these ways, each timed after a warm-up:

* ``generate``: ``model.generate(do_sample=True, top_k=0, min_new_tokens=max_new_tokens)``, the
  reference;
* ``bare``: a prefill, then one forward per token over a ``DynamicCache`` with the engine's call
  (``logits_to_keep=1``) and ``torch.multinomial`` on the logits' device: the floor for a loop of
  forwards in eager PyTorch;
* ``bare_slack``: the same loop with the engine's KV layers, which write each step's keys/values
  into free columns instead of ``torch.cat``-ing the whole cache (``hf_batch.slack_layer_class``);
* ``bare_thread``, ``bare_to_thread``: the same loop in one other thread, and with each step sent
  through ``asyncio.to_thread`` as the engine sends its steps (so a thread's cost shows apart from
  the engine's own);
* ``bare_fused``, ``bare_compiled``: the same loop through the engine's written-out decode step
  (:class:`agent_env.engines.hf_decode.FusedDecoder`) over in-place KV buffers, eager and through
  ``torch.compile``: ``bare_compiled`` is **the floor**, the fastest loop of decode steps this
  project knows how to write; every row's ratio to it is printed (its compile time apart, warm-up);
* ``engine``: :class:`agent_env.engines.hf.HFEngine` serving ``--batch`` concurrent ``generate``
  calls (continuous batching, per-request generators; its steps on the caller's thread on the CPU,
  in a worker thread on a GPU, with its default ``cpu_threads``: half of torch's threads) with its
  default ``decode_step`` (``auto``: the fused step for the built-in policy and Qwen3); then once more
  with device-synchronised timers around its decode forward and its sampling + bookkeeping, the
  rest being its serve loop (and the thread hop, if any);
* ``engine_model``, ``engine_compiled``: the same engine decoding with the model's own forward, and
  with the compiled fused step;
* ``engine_all_threads`` (CPU): the default engine with ``cpu_threads=0``, torch's own thread count.

``--busy K`` keeps K other processes spinning on the CPU through every timing, as the tools'
sandbox processes do beside generation during a rollout. ``--shape``: ``tiny`` (the built-in
policy, 1.1M parameters), random Qwen3 shapes ``small`` (6.6M) and ``medium`` (81M), or
``qwen3-0.6b``.

It prints milliseconds per decode step (wall time / ``--new``) and the ratios to ``generate``, and
the engine's sampling alone on the same logits: on their device, and copied to the host first (what
the engine did before 2026-12-04). Figures: [docs/results.md](../docs/results.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from otb_tir.defaults.shapes import QWEN3_0_6B

ROOT = Path(__file__).resolve().parents[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if shape == "tiny":
        from otb_tir.defaults.tiny import tiny_policy_dir

        model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir(), dtype=dtype)
    elif shape in ("small", "medium"):
        torch.manual_seed(0)
        h, layers = (256, 8) if shape == "small" else (768, 12)
        config = Qwen3Config(
            hidden_size=h,
            intermediate_size=3 * h,
            num_hidden_layers=layers,
            num_attention_heads=h // 64,
            num_key_value_heads=1,
            head_dim=64,
            vocab_size=2125,
            tie_word_embeddings=True,
        )
        model = Qwen3ForCausalLM(config)
    else:
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_0_6B))
    return model.to(device=device, dtype=dtype).eval()


def time_generate(model, prompts: torch.Tensor, new: int) -> float:
    mask = torch.ones_like(prompts)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=prompts,
        attention_mask=mask,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
    )
    _sync(prompts.device)
    assert out.shape[1] == prompts.shape[1] + new, out.shape
    return time.perf_counter() - t0


def time_bare(model, prompts: torch.Tensor, new: int, where: str = "main", slack: bool = False) -> float:
    """``where``: ``main`` (this thread), ``thread`` (the whole loop in one other thread),
    ``to_thread`` (each step through ``asyncio.to_thread``, as the engine runs its steps).
    ``slack``: the cache's layers are the engine's ``SlackLayer`` (keys/values written in place)
    instead of transformers' ``DynamicLayer`` (``torch.cat`` every step)."""
    from transformers import DynamicCache

    from agent_env.engines.hf_batch import with_slack

    b, p = prompts.shape
    dev = prompts.device
    st: dict[str, Any] = {"mask": torch.ones(b, p, dtype=torch.long, device=dev)}

    @torch.no_grad()
    def first() -> None:
        pos = torch.arange(p, device=dev)[None].expand(b, -1)
        cache = DynamicCache(config=model.config)
        out = model(
            input_ids=prompts, attention_mask=st["mask"], position_ids=pos, past_key_values=cache, logits_to_keep=1
        )
        st["cache"], st["next"] = out.past_key_values, torch.multinomial(out.logits[:, -1].float().softmax(-1), 1)

    @torch.no_grad()
    def step(i: int) -> None:
        st["mask"] = torch.cat([st["mask"], torch.ones(b, 1, dtype=torch.long, device=dev)], dim=1)
        if slack:
            with_slack(st["cache"])
        out = model(
            input_ids=st["next"],
            attention_mask=st["mask"],
            position_ids=torch.full((b, 1), p + i, device=dev),
            past_key_values=st["cache"],
            use_cache=True,
            logits_to_keep=1,
        )
        st["cache"], st["next"] = out.past_key_values, torch.multinomial(out.logits[:, -1].float().softmax(-1), 1)
        st["next"].tolist()  # the engine needs each row's token on the host every step

    def loop() -> None:
        first()
        for i in range(new - 1):
            step(i)

    async def hops() -> None:
        await asyncio.to_thread(first)
        for i in range(new - 1):
            await asyncio.to_thread(step, i)

    t0 = time.perf_counter()
    if where == "main":
        loop()
    elif where == "thread":
        t = threading.Thread(target=loop)
        t.start()
        t.join()
    else:
        asyncio.run(hops())
    _sync(dev)
    return time.perf_counter() - t0


def time_bare_fused(model, prompts: torch.Tensor, new: int, compiled: bool) -> tuple[float, float | None]:
    """The bare loop through the engine's written-out decode step (``compiled``: torch.compile'd),
    timed after a warm-up that compiles it; returns (seconds, compile seconds)."""
    from transformers import DynamicCache

    from agent_env.engines.hf_batch import cache_kwargs, cache_layers, returned_cache, with_slack
    from agent_env.engines.hf_decode import FusedDecoder

    dec = FusedDecoder(model, compiled=compiled, probe=False)
    b, p = prompts.shape
    dev = prompts.device

    @torch.no_grad()
    def loop(n: int) -> None:
        mask = torch.ones(b, p, dtype=torch.long, device=dev)
        pos = torch.arange(p, device=dev)[None].expand(b, -1)
        out = model(
            input_ids=prompts,
            attention_mask=mask,
            position_ids=pos,
            logits_to_keep=1,
            use_cache=True,
            **cache_kwargs(model, DynamicCache(config=model.config)),
        )
        cache = returned_cache(out)
        nxt = torch.multinomial(out.logits[:, -1].float().softmax(-1), 1)[:, 0]
        for i in range(n - 1):
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long, device=dev)], dim=1)
            with_slack(cache)
            logits = dec.step(nxt, torch.full((b,), p + i, device=dev), mask, cache_layers(cache))
            nxt = torch.multinomial(logits.softmax(-1), 1)[:, 0]
            nxt.tolist()  # the engine needs each row's token on the host every step

    loop(min(new, 8))  # warm-up (the compile)
    _sync(dev)
    t0 = time.perf_counter()
    loop(new)
    _sync(dev)
    return time.perf_counter() - t0, dec.compile_s


def time_engine(engine, prompts: torch.Tensor, new: int) -> tuple[float, dict[str, Any]]:
    from agent_env.engines.base import SamplingParams

    async def go():
        params = SamplingParams(max_tokens=new, temperature=1.0)
        outs = await asyncio.gather(*(engine.generate(row, params) for row in prompts.tolist()))
        assert all(len(o.token_ids) == new for o in outs), [len(o.token_ids) for o in outs]

    before = dict(engine.stats)
    t0 = time.perf_counter()
    asyncio.run(go())
    dt = time.perf_counter() - t0
    return dt, {k: engine.stats[k] - before.get(k, 0) for k in engine.stats}


def profile_engine(engine, prompts: torch.Tensor, new: int) -> dict[str, float]:
    """The engine again, with device-synchronised timers around its decode forward and its sampling and
    bookkeeping (``_accept``); the rest of the wall time is its serve loop (and the thread hop, if any)."""
    dev = prompts.device
    acc = {"forward_s": 0.0, "accept_s": 0.0}

    def timed(name: str, key: str):
        fn = getattr(engine, name)

        def wrapper(*a, **k):
            _sync(dev)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            _sync(dev)
            acc[key] += time.perf_counter() - t0
            return out

        setattr(engine, name, wrapper)

    timed("_decode_forward", "forward_s")
    timed("_accept", "accept_s")
    try:
        wall, _ = time_engine(engine, prompts, new)
    finally:
        del engine._decode_forward, engine._accept  # back to the class's methods
    return {"wall_s": wall, **acc, "other_s": wall - acc["forward_s"] - acc["accept_s"]}


def time_sampling(logits: torch.Tensor, reps: int) -> dict[str, float]:
    from agent_env.engines.base import SamplingParams
    from agent_env.engines.hf_sampling import sample

    params = [SamplingParams(max_tokens=1, temperature=1.0)] * logits.shape[0]
    gens = [torch.Generator().manual_seed(i) for i in range(logits.shape[0])]
    out = {}
    for name, src in (("on_device", lambda: logits), ("via_host", lambda: logits.cpu())):
        sample(src(), params, gens)
        _sync(logits.device)
        t0 = time.perf_counter()
        for _ in range(reps):
            tok, lp = sample(src(), params, gens)
            torch.stack([tok.double(), lp.double()]).cpu()
        out[name + "_ms"] = (time.perf_counter() - t0) / reps * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    from agent_env.engines.hf import HFEngine

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shape",
        choices=["tiny", "small", "medium", "qwen3-0.6b"],
        default=None,
        help="default: tiny on CPU, else 0.6B",
    )
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--busy", type=int, default=0, help="other processes kept spinning during the timings")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = a.shape or ("tiny" if device.type == "cpu" else "qwen3-0.6b")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    model = build_model(shape, device, dtype)
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (a.batch, a.prompt), generator=g).to(device)
    common = dict(device=device, share_weights=True, stop_at_eos=False, max_batch_size=a.batch, seed=0)
    engine = HFEngine(model, **common)
    others = {"engine_model": HFEngine(model, decode_step="model", **common)}
    if engine.decode_step != "model":
        others["engine_compiled"] = HFEngine(model, decode_step="compiled", **common)
    if device.type == "cpu":
        others["engine_all_threads"] = HFEngine(model, cpu_threads=0, **common)
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL) for _ in range(a.busy)
    ]
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": shape,
        "dtype": str(dtype),
        "batch": a.batch,
        "prompt": a.prompt,
        "new": a.new,
        "busy": a.busy,
        "engine_cpu_threads": engine.cpu_threads,
        "engine_decode_step": engine.decode_step,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    warm = min(a.new, 8)
    time_generate(model, prompts, warm), time_bare(model, prompts, warm), time_engine(engine, prompts, warm)
    res["generate_s"] = time_generate(model, prompts, a.new)
    res["bare_s"] = time_bare(model, prompts, a.new)
    res["bare_slack_s"] = time_bare(model, prompts, a.new, slack=True)
    res["bare_thread_s"] = time_bare(model, prompts, a.new, "thread")
    res["bare_to_thread_s"] = time_bare(model, prompts, a.new, "to_thread")
    paths = ["generate", "bare", "bare_slack", "bare_thread", "bare_to_thread"]
    if engine.decode_step != "model":
        res["bare_fused_s"], _ = time_bare_fused(model, prompts, a.new, compiled=False)
        res["bare_compiled_s"], res["bare_compile_s"] = time_bare_fused(model, prompts, a.new, compiled=True)
        paths += ["bare_fused", "bare_compiled"]
    res["engine_s"], res["engine_stats"] = time_engine(engine, prompts, a.new)
    paths.append("engine")
    for name, other in others.items():
        time_engine(other, prompts, warm)  # warm-up (the compiled engine compiles here)
        res[name + "_s"], _ = time_engine(other, prompts, a.new)
        paths.append(name)
    if "engine_compiled" in others:
        res["engine_compile_s"] = others["engine_compiled"].compile_s
    res["engine_profile"] = profile_engine(engine, prompts, a.new)
    for proc in spinners:
        proc.kill()
    with torch.no_grad():
        logits = model(input_ids=prompts, logits_to_keep=1).logits[:, -1].float()
    res["sampling"] = time_sampling(logits, reps=20)
    ms = {k: res[k + "_s"] / a.new * 1e3 for k in paths}
    res["ms_per_step"] = ms
    floor = ms.get("bare_compiled")
    res["floor"] = "bare_compiled" if floor else None
    print(
        f"{res['device']} (torch {res['torch']}), {shape} ({res['parameters'] / 1e6:.1f}M parameters) {dtype}, "
        f"batch {a.batch}, prompt {a.prompt}, {a.new} new tokens, {torch.get_num_threads()} torch threads "
        f"(the engine's steps: {engine.cpu_threads or torch.get_num_threads()}), "
        f"{a.busy} other process(es) spinning"
    )
    print(f"{'path':<19} {'ms/step':>8} {'vs generate':>12}" + (f" {'vs floor':>9}" if floor else ""))
    for k, v in ms.items():
        print(f"{k:<19} {v:8.2f} {v / ms['generate']:11.2f}x" + (f" {v / floor:8.2f}x" if floor else ""))
    if floor:
        print(
            f"floor: bare_compiled (the fused step through torch.compile, compiled in {res['bare_compile_s']:.1f} s "
            f"before timing); the engine's default ({engine.decode_step}) is {ms['engine'] / floor:.2f}x the floor"
            + (
                f", the compiled engine {ms['engine_compiled'] / floor:.2f}x "
                f"(compiled in {res['engine_compile_s']:.1f} s)"
                if "engine_compiled" in ms
                else ""
            )
        )
    pr = res["engine_profile"]
    print(
        "engine, timed with device syncs (ms/step): "
        + ", ".join(f"{k[:-2]} {v / a.new * 1e3:.2f}" for k, v in pr.items())
    )
    s = res["sampling"]
    print(
        f"sampling {a.batch} x {vocab} logits: on their device {s['on_device_ms']:.2f} ms, "
        f"via the host {s['via_host_ms']:.2f} ms"
    )
    out = Path(a.out or ROOT / "runs" / "bench_engine_decode.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
