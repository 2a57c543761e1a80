"""Batch rollout throughput: 64 tool-using episodes on the tiny model, concurrent vs sequential.

    .venv/bin/python benchmarks/bench_rollout.py [--prompts 16] [--n 4] [--think 32] [--engine hf|vllm|both]

Each episode runs 3 assistant turns: the tiny (random) policy samples ``--think`` tokens of its
own, and the turn is completed with a scripted tool call (turn 1: python, turn 2: calculator) or
a final answer (turn 3). A random tiny model almost never writes a well-formed tool call by
itself; the scripting keeps the number of tool calls fixed while all sampling and all tool
execution are real (real HFEngine / VLLMEngine, real sandboxed python, real calculator).

Printed, for the concurrent rollout (``agent_env.rollout``) and for the sequential reference
(the same episodes awaited one after another, in the same process, same engine):
sampled tokens/s, wall time, and the fraction of wall time in which no generate call was in
flight while a tool was running ("generation waited on tools"; issue 4's target: <= 10 %).
Then the ratio concurrent / sequential. The vLLM engine runs in ``.venv-vllm`` (a subprocess of
this script) when that environment exists; otherwise it is reported as skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import time
from pathlib import Path

from agent_env import AgentEnv, EpisodeConfig, rollout_async
from agent_env.activity import Activity
from agent_env.engines.base import GenerationOutput, SamplingParams

ROOT = Path(__file__).resolve().parents[1]  # the checkout (its .venv-vllm)


def tc(name: str, **args: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


class ThinkThenAct:
    """Engine wrapper: the real engine samples ``think`` tokens, then the turn is completed with
    a scripted action (a tool call, or the final answer) and the stop token. The scripted tokens
    get log-prob 0; only the real engine's tokens are counted as sampled."""

    def __init__(self, engine, tokenizer, think: int):
        self.engine = engine
        self.tok = tokenizer
        self.think = think
        self.real_tokens = 0
        eos = tokenizer.eos_token_id
        acts = [
            tc("python", code="import sympy\nprint(sympy.factorint(2**32 + 1))"),
            tc("calculator", expression="641 * 6700417"),
            "So the answer is \\boxed{4294967297}.",
        ]
        self.acts = [self.tok.encode("\n" + a, add_special_tokens=False) + [eos] for a in acts]

    async def generate(self, prompt_ids, params: SamplingParams) -> GenerationOutput:
        turn = self.tok.decode(prompt_ids).count("<|im_start|>assistant") - 1
        act = self.acts[min(turn, len(self.acts) - 1)]
        budget = max(params.max_tokens - len(act), 0)
        ids: list[int] = []
        lps: list[float] = []
        if budget > 0:
            sub = SamplingParams(
                max_tokens=min(self.think, budget),
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                stop_token_ids=[],
                seed=params.seed,
            )
            out = await self.engine.generate(prompt_ids, sub)
            ids, lps = list(out.token_ids), list(out.logprobs)
            self.real_tokens += len(ids)
            stop = set(params.stop_token_ids)
            if ids and ids[-1] in stop:  # it ended the turn itself: drop that, the act ends it
                ids, lps = ids[:-1], lps[:-1]
        if len(ids) + len(act) > params.max_tokens:
            return GenerationOutput(ids, lps, "length")
        return GenerationOutput(ids + act, lps + [0.0] * len(act), "stop")

    async def update_weights(self, named_tensors):
        await self.engine.update_weights(named_tensors)

    async def close(self):
        await self.engine.close()


def make_engine(kind: str, path: Path, tokenizer, seed: int):
    if kind == "hf":
        from agent_env.engines import HFEngine

        return HFEngine(path, tokenizer=tokenizer, seed=seed, stop_at_eos=False, max_batch_size=64)
    from agent_env.engines import VLLMEngine

    return VLLMEngine(path, seed=seed)


async def run_engine(kind: str, args) -> dict[str, float]:
    from transformers import AutoTokenizer

    import tools
    from otb_tir.defaults.tiny import tiny_policy_dir

    path = tiny_policy_dir()
    tok = AutoTokenizer.from_pretrained(path)
    base = make_engine(kind, path, tok, args.seed)
    eng = ThinkThenAct(base, tok, args.think)
    tool_list = [tools.get_tool("python", workers=args.workers), tools.get_tool("calculator")]
    cfg = EpisodeConfig(
        max_assistant_turns=3,
        max_tokens_per_turn=args.think + 64,
        response_length=3 * (args.think + 64) + 256,
        temperature=1.0,
    )
    env = AgentEnv(tok, tool_list, cfg)
    prompts = [{"prompt": f"Factor 2^32 + 1 (problem {i}).", "ground_truth": "4294967297"} for i in range(args.prompts)]
    results: dict[str, float] = {}
    try:
        # warm-up: worker pools, sympy imports, first forward passes
        await rollout_async(eng, env, prompts[:2], n=1, seed=args.seed, progress=False)

        eng.real_tokens = 0
        batch = await rollout_async(eng, env, prompts, n=args.n, seed=args.seed, progress=True)
        trajs = batch.trajectories
        calls = sum(t.num_tool_calls for t in trajs)
        ok_calls = sum(c.ok for t in trajs for tr in t.turns for c in tr.tool_calls)
        results.update(
            {
                "conc_wall_s": batch.stats["wall_s"],
                "conc_tok_s": eng.real_tokens / batch.stats["wall_s"],
                "conc_wait_frac": batch.stats["gen_waited_on_tools_frac"],
                "episodes": len(trajs),
                "tool_calls": calls,
                "ok_calls": ok_calls,
                "finish": json.dumps(
                    {r: sum(t.finish_reason == r for t in trajs) for r in {t.finish_reason for t in trajs}}
                ),
            }
        )

        # sequential reference: the same episodes, one at a time
        eng.real_tokens = 0
        act = Activity()
        t0 = time.perf_counter()
        k = 0
        from tqdm.auto import tqdm

        for item in tqdm(prompts, desc="sequential", leave=False):
            for j in range(args.n):
                await env.run(
                    eng,
                    item["prompt"],
                    uid=str(k),
                    ground_truth=item["ground_truth"],
                    seed=args.seed + k,
                    sample_index=j,
                    activity=act,
                )
                k += 1
        wall = time.perf_counter() - t0
        s = act.summary()
        results.update(
            {"seq_wall_s": wall, "seq_tok_s": eng.real_tokens / wall, "seq_wait_frac": s["gen_waited_on_tools_frac"]}
        )
    finally:
        await base.close()
        for t in tool_list:
            await t.close()
    return results


def report(kind: str, r: dict[str, float]) -> None:
    print(
        f"\n== engine: {kind}  ({int(r['episodes'])} episodes, {int(r['tool_calls'])} tool calls, "
        f"{int(r['ok_calls'])} ok; finish reasons {r['finish']})"
    )
    print(f"{'':<12}{'tokens/s':>10}{'wall s':>9}{'gen waited on tools':>22}")
    print(f"{'concurrent':<12}{r['conc_tok_s']:>10.1f}{r['conc_wall_s']:>9.2f}{100 * r['conc_wait_frac']:>21.1f}%")
    print(f"{'sequential':<12}{r['seq_tok_s']:>10.1f}{r['seq_wall_s']:>9.2f}{100 * r['seq_wait_frac']:>21.1f}%")
    ratio = r["conc_tok_s"] / r["seq_tok_s"] if r["seq_tok_s"] else float("nan")
    target = "met" if r["conc_wait_frac"] <= 0.10 else "NOT met"
    print(f"concurrent / sequential tokens/s: {ratio:.2f}x; waited-on-tools target <= 10 %: {target}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--think", type=int, default=32, help="tokens the model samples per turn before acting")
    ap.add_argument("--workers", type=int, default=4, help="python sandbox workers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", choices=["hf", "vllm", "both"], default="both")
    ap.add_argument(
        "--json", action="store_true", help="print the results as one JSON line (used for the vLLM subprocess)"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    kinds = ["hf", "vllm"] if args.engine == "both" else [args.engine]
    for kind in kinds:
        if kind == "vllm":
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                venv = ROOT / ".venv-vllm" / "bin" / "python"
                if not (ROOT / "agent_env" / "engines" / "vllm.py").exists() or not venv.exists():
                    print("\n== engine: vllm  skipped (no agent_env/engines/vllm.py or no .venv-vllm)")
                    continue
                cmd = [
                    str(venv),
                    __file__,
                    "--engine",
                    "vllm",
                    "--json",
                    "--prompts",
                    str(args.prompts),
                    "--n",
                    str(args.n),
                    "--think",
                    str(args.think),
                    "--workers",
                    str(args.workers),
                    "--seed",
                    str(args.seed),
                ]
                env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                if proc.returncode != 0 or not lines:
                    print(f"\n== engine: vllm  FAILED in .venv-vllm (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
                    continue
                report("vllm", json.loads(lines[-1]))
                continue
        r = asyncio.run(run_engine(kind, args))
        if args.json:
            print(json.dumps(r))
        else:
            report(kind, r)


if __name__ == "__main__":
    main()
