"""Test doubles for verl's agent-loop worker: :class:`HFServerManager` stands in for verl's server
manager with a real HF engine on the tiny policy (optionally scripting some requests), and
:func:`_gen_batch` builds the batch verl's trainer hands the agent-loop manager."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch


class HFServerManager:
    """Stand-in for verl's LLMServerClient: same ``generate`` signature, HFEngine behind it."""

    def __init__(self, model_dir: Path, tokenizer, questions: dict[str, str]):
        from transformers import AutoModelForCausalLM

        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.questions = questions  # question text → calculator expression
        self.engine = None
        self.order: list[str] = []  # request ids in first-seen order
        self.outputs: dict[str, list] = {}  # request id → TokenOutputs
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def scripted(self, request_id: str) -> bool:
        return self.order.index(request_id) % 2 == 0

    @torch.no_grad()
    def _teacher_forced(self, prompt_ids, ids, temperature):
        seq = torch.tensor([prompt_ids + ids])
        logits = self.model(seq).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1).tolist()

    def _script(self, prompt_ids: list[int]) -> list[int]:
        text = self.tokenizer.decode(prompt_ids)
        results = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", text, flags=re.S)
        if results:
            reply = f"The answer is \\boxed{{{results[-1].strip()}}}."
        else:
            expr = next(e for q, e in self.questions.items() if q in text)
            tool = getattr(self, "_script_tool", "calculator")  # a test may script a call to another tool
            reply = '<tool_call>{"name": "%s", "arguments": {"expression": "%s"}}</tool_call>' % (tool, expr)
        return self.tokenizer.encode(reply, add_special_tokens=False) + [self.im_end]

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        from agent_env.engines import HFEngine, SamplingParams

        if self.engine is None:
            self.engine = HFEngine(self.model_dir, max_batch_size=8, seed=0)
        if request_id not in self.outputs:
            self.order.append(request_id)
            self.outputs[request_id] = []
        sp = dict(sampling_params)
        assert sp["logprobs"] is True and sp["max_tokens"] >= 1 and self.im_end in sp["stop_token_ids"]
        if self.scripted(request_id):
            ids = self._script(list(prompt_ids))[: sp["max_tokens"]]
            logprobs = self._teacher_forced(list(prompt_ids), ids, sp["temperature"])
        else:
            out = await self.engine.generate(
                list(prompt_ids),
                SamplingParams(
                    max_tokens=sp["max_tokens"],
                    temperature=sp["temperature"],
                    top_p=sp["top_p"],
                    top_k=sp["top_k"],
                    stop_token_ids=list(sp["stop_token_ids"]),
                ),
            )
            ids, logprobs = list(out.token_ids), list(out.logprobs)
        res = TokenOutput(token_ids=ids, log_probs=logprobs, stop_reason="completed")
        self.outputs[request_id].append(res)
        return res


def _gen_batch(vcfg, tokenizer, n_prompts: int, n: int):
    """The batch verl's trainer hands to the agent loop manager: RLHFDataset rows, repeated n times."""
    from verl.protocol import DataProto
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils.dataset.rl_dataset import collate_fn

    ds = create_rl_dataset(vcfg.data.train_files, vcfg.data, tokenizer, None, is_train=True)
    rows = [ds[i] for i in range(n_prompts)]
    batch = DataProto.from_single_dict(collate_fn(rows))
    batch.non_tensor_batch["uid"] = np.array([f"uid{i}" for i in range(n_prompts)], dtype=object)
    return batch.repeat(repeat_times=n, interleave=True), rows


def run_agent_loop(vcfg, manager: HFServerManager, n_prompts: int = 2, n: int = 2):
    """verl's own ``AgentLoopWorker`` on ``vcfg`` with ``manager`` as its server: one batch of
    ``n_prompts`` × ``n`` episodes through ``generate_sequences``; the run's tools and the HF engine
    are closed after. Returns verl's output batch."""
    import asyncio

    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from otb_tir.verl.agent_loop import close_cached_tools

    async def go():
        worker = AgentLoopWorker(vcfg, llm_client=manager)
        batch, _ = _gen_batch(vcfg, worker.tokenizer, n_prompts, n)
        try:
            return await worker.generate_sequences(batch)
        finally:
            await close_cached_tools()
            if manager.engine is not None:
                await manager.engine.close()

    return asyncio.run(go())
