"""The rollout engines side by side on this machine: HFEngine, VLLMEngine and SGLangEngine.

    .venv/bin/python benchmarks/bench_engines.py --keep runs/bench_engines            # decode + learning
    .venv/bin/python benchmarks/bench_engines.py --only decode
    .venv/bin/python benchmarks/bench_engines.py --only learn --seeds 0 1 2 --keep runs/bench_engines

Each engine runs in its own environment (``.venv``, ``.venv-vllm``, ``.venv-sglang``; made by
scripts/install_test_env.sh), as a subprocess of this script:

* ``decode``: the built-in policy serves ``--batch`` concurrent requests of a chat prompt for exactly
  ``--new`` tokens each (temperature 1, no stop), timed after a warm-up, ``--reps`` times; tokens/s
  (median, min and max) and the ratio to HFEngine's median.
* ``learn``: the README's default run, ``recipes/train_tir_math.py rollout.name=ENGINE
  trainer.seed=S`` (15 steps; 100 held-out problems before and after), per seed; held-out accuracy
  before → after (mean and range over the seeds) and the largest lag-0 gap between the engine's and
  the actor's probabilities over all steps (``training/rollout_probs_diff_max``). ``--keep DIR``
  keeps the runs and skips those already finished (a rerun resumes).

sglang on a CPU ignores per-request seeds (its deterministic mode is GPU-only), so its runs are not
reproducible token for token; the seed still sets data order and initialisation.
Figures: docs/results.md (``engines``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINES = {"hf": ".venv", "vllm": ".venv-vllm", "sglang": ".venv-sglang"}


# --------------------------------------------------------------------------- the worker (one engine)


async def _decode(engine_name: str, batch: int, new: int, reps: int) -> dict:
    from transformers import AutoTokenizer

    from agent_env.engines import SamplingParams
    from otb_tir.defaults.tiny import tiny_policy_dir

    path = tiny_policy_dir()
    tok = AutoTokenizer.from_pretrained(path)
    t0 = time.perf_counter()
    if engine_name == "hf":
        from agent_env.engines.hf import HFEngine

        engine = HFEngine(str(path), tok, dtype="float32", max_batch_size=64, stop_at_eos=False)
    else:
        from otb_tir.builders import serving_engine

        engine = serving_engine(engine_name, path, dtype="float32", seed=0, engine_kwargs={})
    startup = time.perf_counter() - t0
    prompts = []
    for i in range(batch):
        text = tok.apply_chat_template(
            [{"role": "user", "content": f"What is {17 + i} * {23 + 2 * i}? Use the calculator."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompts.append(list(tok(text, add_special_tokens=False)["input_ids"]))

    async def run(seed: int) -> int:
        outs = await asyncio.gather(
            *[
                engine.generate(p, SamplingParams(max_tokens=new, temperature=1.0, seed=seed + i, stop_token_ids=[]))
                for i, p in enumerate(prompts)
            ]
        )
        return sum(len(o.token_ids) for o in outs)

    await run(1000)  # warm-up
    rates = []
    for r in range(reps):
        t0 = time.perf_counter()
        n = await run(r * batch)
        rates.append(n / (time.perf_counter() - t0))
    await engine.close()
    return {"startup_s": startup, "tok_per_s": rates}


def worker(args: argparse.Namespace) -> None:
    res = asyncio.run(_decode(args.worker, args.batch, args.new, args.reps))
    Path(args.out).write_text(json.dumps(res))


# --------------------------------------------------------------------------- the driver


def python_of(engine: str) -> str | None:
    exe = REPO / ENGINES[engine] / "bin" / "python"
    return str(exe) if exe.exists() else None


def decode_all(engines: list[str], batch: int, new: int, reps: int) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name in engines:
        python = python_of(name)
        if python is None:
            out[name] = {"error": f"no {ENGINES[name]} (scripts/install_test_env.sh)"}
            continue
        with tempfile.TemporaryDirectory() as tmp:
            res = Path(tmp) / "decode.json"
            cmd = [python, __file__, "--worker", name, "--out", str(res)]
            cmd += ["--batch", str(batch), "--new", str(new), "--reps", str(reps)]
            env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env, timeout=900)
            if proc.returncode != 0 or not res.exists():
                out[name] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no result"}
                continue
            out[name] = json.loads(res.read_text())
    return out


def learn_one(engine: str, seed: int, keep: Path) -> dict:
    run = keep / f"{engine}-seed{seed}"
    summary = run / "summary.json"
    if not summary.exists():
        python = python_of(engine)
        if python is None:
            return {"error": f"no {ENGINES[engine]}"}
        run.parent.mkdir(parents=True, exist_ok=True)
        cmd = [python, str(REPO / "recipes" / "train_tir_math.py"), f"rollout.name={engine}"]
        cmd += [f"trainer.seed={seed}", f"trainer.output_dir={run}", "trainer.save_every=0"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        with open(keep / f"{engine}-seed{seed}.log", "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=keep, env=env, timeout=3600)
        if proc.returncode != 0 or not summary.exists():
            return {"error": f"exit {proc.returncode}: see {keep / f'{engine}-seed{seed}.log'}"}
    s = json.loads(summary.read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    gap = max(r.get("training/rollout_probs_diff_max", float("nan")) for r in rows)
    return {
        "before": s["before"]["accuracy"],
        "after": s["after"]["accuracy"],
        "tool_calls": s["after"]["tool_call_rate"],
        "wall_s": s["wall_time_s"],
        "max_gap": gap,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("decode", "learn"), default=None)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--keep", type=Path, default=None, help="keep the training runs here (a rerun resumes)")
    ap.add_argument("--worker", choices=list(ENGINES), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from otb_tir.machine import speed_reference

    print(f"speed reference: {speed_reference()['matmul_gflops']:.0f} GFLOP/s")
    if args.only in (None, "decode"):
        res = decode_all(args.engines, args.batch, args.new, args.reps)
        hf = statistics.median(res["hf"]["tok_per_s"]) if "tok_per_s" in res.get("hf", {}) else None
        print(f"\ndecode: {args.batch} concurrent requests x {args.new} tokens, the built-in policy, {args.reps} reps")
        print(f"{'engine':8} {'tok/s median':>12} {'[min, max]':>18} {'vs hf':>7} {'start s':>8}")
        for name, r in res.items():
            if "error" in r:
                print(f"{name:8} error: {r['error']}")
                continue
            med = statistics.median(r["tok_per_s"])
            ratio = f"{med / hf:.2f}x" if hf else "-"
            span = f"[{min(r['tok_per_s']):.0f}, {max(r['tok_per_s']):.0f}]"
            print(f"{name:8} {med:12.0f} {span:>18} {ratio:>7} {r['startup_s']:8.1f}")
    if args.only in (None, "learn"):
        keep = args.keep or Path(tempfile.mkdtemp(prefix="bench_engines_"))
        keep = keep.resolve()
        keep.mkdir(parents=True, exist_ok=True)
        print(f"\nlearn: README default run (15 steps, 100 held-out problems), seeds {args.seeds}; runs in {keep}")
        print(
            f"{'engine':8} {'before':>7} {'after mean':>11} {'[min, max]':>14} {'tool calls':>11} "
            f"{'max gap':>9} {'wall s':>7}"
        )
        for name in args.engines:
            runs = [learn_one(name, s, keep) for s in args.seeds]
            errors = [r["error"] for r in runs if "error" in r]
            if errors:
                print(f"{name:8} error: {errors[0]}")
                continue
            after = [r["after"] for r in runs]
            print(
                f"{name:8} {statistics.mean(r['before'] for r in runs):7.2f} {statistics.mean(after):11.2f} "
                f"{f'[{min(after):.2f}, {max(after):.2f}]':>14} {statistics.mean(r['tool_calls'] for r in runs):11.2f} "
                f"{max(r['max_gap'] for r in runs):9.1e} {statistics.mean(r['wall_s'] for r in runs):7.0f}"
            )


if __name__ == "__main__":
    main()
