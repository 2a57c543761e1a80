"""HFEngine's decode step against transformers ``generate`` and a bare decode loop, in one process.

    .venv/bin/python benchmarks/bench_engine_decode.py                  # CPU: the built-in tiny policy
    python benchmarks/bench_engine_decode.py --shape qwen3-0.6b         # a GPU: random Qwen3-0.6B shape
    python benchmarks/bench_engine_decode.py --batch 16 --new 128 --out runs/bench_engine_decode.json
    .venv/bin/python benchmarks/bench_engine_decode.py --busy 1 --shape medium   # one core kept busy

The same ``--batch`` random prompts of ``--prompt`` tokens are decoded for exactly ``--new`` tokens
(no stop) these ways, each warmed up, then timed once a round for ``--reps`` rounds (median and
[min, max]; the rounds interleave the paths, so a slow spell of the VM falls on all of them):

* ``generate``: ``model.generate(do_sample=True, top_k=0, min_new_tokens=max_new_tokens)``, the
  reference;
* ``bare``: a prefill, then one forward per token over a ``DynamicCache`` with the engine's call
  (``logits_to_keep=1``) and one inverse-CDF draw per row on the logits' device (:func:`draw`, the
  engine's way to sample; ``torch.multinomial`` draws an exponential per vocabulary entry, ~1 ms a
  step at batch 16 on this CPU, and made the floor that much slower until 2026-12-05): the floor for a loop of
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
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from otb_tir.defaults.shapes import SHAPES, build_model

ROOT = Path(__file__).resolve().parents[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def draw(logits: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, V]`` at temperature 1, ``[B, 1]``: a uniform per row
    against the cumulative probabilities, as the engine samples (``hf_sampling.sample``, without its
    per-row settings and generators)."""
    cdf = logits.float().softmax(-1).cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)


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
        st["cache"], st["next"] = out.past_key_values, draw(out.logits[:, -1])

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
        st["cache"], st["next"] = out.past_key_values, draw(out.logits[:, -1])
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


def bare_fused_timer(model, prompts: torch.Tensor, compiled: bool) -> tuple[Callable[[int], float], float | None]:
    """The bare loop through the engine's written-out decode step (``compiled``: torch.compile'd),
    built and warmed once (the compile); returns (a timer of ``new`` steps in seconds, compile seconds)."""
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
        nxt = draw(out.logits[:, -1])[:, 0]
        for i in range(n - 1):
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long, device=dev)], dim=1)
            with_slack(cache)
            logits = dec.step(nxt, torch.full((b,), p + i, device=dev), mask, cache_layers(cache))
            nxt = draw(logits)[:, 0]
            nxt.tolist()  # the engine needs each row's token on the host every step

    def timer(new: int) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        loop(new)
        _sync(dev)
        return time.perf_counter() - t0

    timer(8)  # warm-up (the compile)
    return timer, dec.compile_s


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
        choices=["tiny", *SHAPES],
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
    p.add_argument("--reps", type=int, default=5, help="rounds of timings (every path once a round); medians")
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
    timers: dict[str, Callable[[], float]] = {
        "generate": lambda: time_generate(model, prompts, a.new),
        "bare": lambda: time_bare(model, prompts, a.new),
        "bare_slack": lambda: time_bare(model, prompts, a.new, slack=True),
        "bare_thread": lambda: time_bare(model, prompts, a.new, "thread"),
        "bare_to_thread": lambda: time_bare(model, prompts, a.new, "to_thread"),
    }
    if engine.decode_step != "model":
        fused, _ = bare_fused_timer(model, prompts, compiled=False)
        compiled, res["bare_compile_s"] = bare_fused_timer(model, prompts, compiled=True)
        timers["bare_fused"] = lambda: fused(a.new)
        timers["bare_compiled"] = lambda: compiled(a.new)
    for name, eng in {"engine": engine, **others}.items():
        time_engine(eng, prompts, warm)  # warm-up (the compiled engine compiles here)
        timers[name] = lambda eng=eng: time_engine(eng, prompts, a.new)[0]
    time_generate(model, prompts, warm), time_bare(model, prompts, warm)
    # every path once per round, the rounds one after another: a slow spell of the VM falls on all paths
    runs: dict[str, list[float]] = {k: [] for k in timers}
    for _ in range(a.reps):
        for k, timer in timers.items():
            runs[k].append(timer())
    paths = list(timers)
    for k in paths:
        res[k + "_s"] = statistics.median(runs[k])
        res[k + "_runs_s"] = runs[k]
    if "engine_compiled" in others:
        res["engine_compile_s"] = others["engine_compiled"].compile_s
    res["engine_profile"] = profile_engine(engine, prompts, a.new)
    for proc in spinners:
        proc.kill()
    with torch.no_grad():
        logits = model(input_ids=prompts, logits_to_keep=1).logits[:, -1].float()
    res["sampling"] = time_sampling(logits, reps=20)
    ms = {k: res[k + "_s"] / a.new * 1e3 for k in paths}
    spread = {k: (min(runs[k]) / a.new * 1e3, max(runs[k]) / a.new * 1e3) for k in paths}
    res["ms_per_step"] = ms
    floor = ms.get("bare_compiled")
    res["floor"] = "bare_compiled" if floor else None
    # each path's ratio to the floor within a round (the same spell of the VM), then over the rounds
    ratios = {k: sorted(x / f for x, f in zip(runs[k], runs["bare_compiled"])) for k in paths} if floor else {}
    res["vs_floor"] = {k: statistics.median(r) for k, r in ratios.items()}

    def vs(k: str) -> str:
        r = ratios[k]
        return f"{statistics.median(r):.2f}x [{r[0]:.2f}, {r[-1]:.2f}]"

    print(
        f"{res['device']} (torch {res['torch']}), {shape} ({res['parameters'] / 1e6:.1f}M parameters) {dtype}, "
        f"batch {a.batch}, prompt {a.prompt}, {a.new} new tokens, {torch.get_num_threads()} torch threads "
        f"(the engine's steps: {engine.cpu_threads or torch.get_num_threads()}), "
        f"{a.busy} other process(es) spinning"
    )
    print(
        f"median of {a.reps} rounds (every path once a round); [min, max] over the rounds; vs floor: the "
        "median of the rounds' ratios to the floor's time in the same round [min, max]"
    )
    head = f"{'path':<19} {'ms/step':>8} {'[min, max]':>14} {'vs generate':>12}"
    print(head + (f" {'vs floor':>22}" if floor else ""))
    for k, v in ms.items():
        lo, hi = spread[k]
        row = f"{k:<19} {v:8.2f} {f'[{lo:.2f}, {hi:.2f}]':>14} {v / ms['generate']:11.2f}x"
        print(row + (f" {vs(k):>22}" if floor else ""))
    if floor:
        print(
            f"floor: bare_compiled (the fused step through torch.compile, compiled in {res['bare_compile_s']:.1f} s "
            f"before timing); the engine's default ({engine.decode_step}) is {vs('engine')} the floor"
            + (
                f", the compiled engine {vs('engine_compiled')} (compiled in {res['engine_compile_s']:.1f} s)"
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
