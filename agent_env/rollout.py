"""Batch rollout: B prompts × n samples as concurrent episodes, collated into the training batch
(docs/architecture.md, "The data contract of a training batch").

``rollout(engine, env_or_config, prompts, n)`` runs every episode as an asyncio task, so one
episode's tool calls overlap the generation of the others (an engine such as ``HFEngine``
batches the concurrent generate calls into shared forward passes). The result is a
:class:`RolloutBatch`:

- ``prompts [B·n, P]`` left-padded, ``responses [B·n, R]`` right-padded,
  ``input_ids / attention_mask / position_ids [B·n, P+R]``, ``response_mask [B·n, R]``,
  ``rollout_log_probs [B·n, R]`` (0.0 where the mask is 0), ``token_level_rewards [B·n, R]``
  (the reward on the last mask-1 token of the row), as torch tensors;
- ``uid`` (numpy object array, shared by the n samples of a prompt) and further per-row numpy
  arrays (``finish_reason``, ``num_turns``, ``void_turns``, ``malformed_calls``,
  ``num_tool_calls``, ``template_mismatch``, ``reward``);
- the per-episode :class:`~agent_env.records.Trajectory` records and aggregate ``stats``.

Rows are ordered prompt-major: row ``i*n + j`` is sample ``j`` of prompt ``i``.
R is ``EpisodeConfig.response_length`` (the whole multi-turn budget, ``pad_to="budget"``,
the default, so every batch has the same width) or the longest response present
(``pad_to="longest"``, at least 1). A zero-length response (an engine that returned nothing) is a
row of padding with ``attention_mask`` 0 there and no reward position; its reward is still in
``batch["reward"]`` and its trajectory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Mapping, Sequence

import numpy as np
import torch

from agent_env.activity import Activity
from agent_env.episode import AgentEnv, EpisodeConfig
from agent_env.errors import EnvError
from agent_env.records import Prompt, Trajectory, last_policy_token

logger = logging.getLogger(__name__)

__all__ = ["RolloutBatch", "rollout", "rollout_async", "collate", "run_sync"]

TENSOR_KEYS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rollout_log_probs",
    "token_level_rewards",
)


@dataclass
class RolloutBatch:
    """The collated batch (``batch[key]`` reads tensors and per-row numpy arrays alike)."""

    tensors: dict[str, torch.Tensor]
    non_tensors: dict[str, np.ndarray]
    trajectories: list[Trajectory]
    stats: dict[str, float] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"{key!r}; the batch has {sorted(self.tensors) + sorted(self.non_tensors)}")

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __len__(self) -> int:
        return len(self.trajectories)

    def keys(self) -> Iterator[str]:
        yield from self.tensors
        yield from self.non_tensors


def collate(
    trajectories: Sequence[Trajectory], *, pad_token_id: int, response_length: int | None = None
) -> RolloutBatch:
    """Collate trajectories into the training batch (docs/architecture.md). ``response_length`` is R (``None``: the
    longest response, at least 1); a response longer than R is an error."""
    if not trajectories:
        raise EnvError("cannot collate an empty list of trajectories")
    B = len(trajectories)
    P = max(len(t.prompt_ids) for t in trajectories)
    longest = max(len(t.response_ids) for t in trajectories)
    R = max(longest, 1) if response_length is None else int(response_length)
    if longest > R:
        raise EnvError(f"a response has {longest} tokens, more than the batch width R={R}")
    prompts = torch.full((B, P), pad_token_id, dtype=torch.long)
    prompt_attn = torch.zeros((B, P), dtype=torch.long)
    responses = torch.full((B, R), pad_token_id, dtype=torch.long)
    resp_attn = torch.zeros((B, R), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.long)
    logprobs = torch.zeros((B, R), dtype=torch.float32)
    rewards = torch.zeros((B, R), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        lp, lr = len(t.prompt_ids), len(t.response_ids)
        if not (len(t.response_mask) == len(t.rollout_logprobs) == lr):
            raise EnvError(
                f"trajectory {i} is inconsistent: {lr} response ids, {len(t.response_mask)} mask "
                f"entries, {len(t.rollout_logprobs)} log-probs"
            )
        if lp:
            prompts[i, P - lp :] = torch.tensor(t.prompt_ids, dtype=torch.long)
            prompt_attn[i, P - lp :] = 1
        if lr:
            responses[i, :lr] = torch.tensor(t.response_ids, dtype=torch.long)
            resp_attn[i, :lr] = 1
            response_mask[i, :lr] = torch.tensor(t.response_mask, dtype=torch.long)
            logprobs[i, :lr] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
    # The reward on the last policy (mask 1) token of each row.
    last, has_policy = last_policy_token(response_mask)
    reward_vals = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    rows = torch.nonzero(has_policy).squeeze(1)
    rewards[rows, last[rows]] = reward_vals[rows]
    attention_mask = torch.cat([prompt_attn, resp_attn], dim=1)
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_log_probs": logprobs,
        "token_level_rewards": rewards,
    }

    def arr(values: list[Any], dtype: Any = object) -> np.ndarray:
        a = np.empty(len(values), dtype=dtype)
        a[:] = values
        return a

    non_tensors = {
        "uid": arr([t.uid for t in trajectories]),
        "finish_reason": arr([t.finish_reason for t in trajectories]),
        "reward": np.array([t.reward for t in trajectories], dtype=np.float32),
        "num_turns": np.array([t.num_turns for t in trajectories], dtype=np.int64),
        "void_turns": np.array([t.void_turns for t in trajectories], dtype=np.int64),
        "malformed_calls": np.array([t.malformed_calls for t in trajectories], dtype=np.int64),
        "num_tool_calls": np.array([t.num_tool_calls for t in trajectories], dtype=np.int64),
        "template_mismatch": np.array([t.template_mismatch is not None for t in trajectories], dtype=bool),
    }
    return RolloutBatch(tensors=tensors, non_tensors=non_tensors, trajectories=list(trajectories))


async def rollout_async(
    engine: Any,
    env_or_config: AgentEnv | EpisodeConfig | Mapping[str, Any],
    prompts: Sequence[Any],
    n: int = 1,
    *,
    tokenizer: Any = None,
    tools: Any = None,
    seed: int | None = None,
    max_concurrent_episodes: int | None = None,
    pad_to: Literal["budget", "longest"] = "budget",
    progress: bool = True,
) -> RolloutBatch:
    """Async form of :func:`rollout` (use it inside a running event loop)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise EnvError(f"n (samples per prompt) must be a positive integer, got {n!r}")
    if pad_to not in ("budget", "longest"):
        raise EnvError(f"pad_to must be 'budget' or 'longest', got {pad_to!r}")
    if max_concurrent_episodes is not None and max_concurrent_episodes < 1:
        raise EnvError(f"max_concurrent_episodes must be positive or None, got {max_concurrent_episodes!r}")
    items = [Prompt.from_row(p, index=i) for i, p in enumerate(prompts)]
    if not items:
        raise EnvError("rollout needs at least one prompt")
    own_env = not isinstance(env_or_config, AgentEnv)
    if isinstance(env_or_config, AgentEnv):
        env = env_or_config
    else:
        cfg = env_or_config if isinstance(env_or_config, EpisodeConfig) else EpisodeConfig.from_dict(env_or_config)
        tok = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        if tok is None:
            raise EnvError(
                "rollout with an EpisodeConfig needs a tokenizer: pass tokenizer=, or an AgentEnv, "
                "or an engine with a .tokenizer attribute"
            )
        env = AgentEnv(tok, tools=tools, config=cfg)
    activity = Activity()
    sem = asyncio.Semaphore(max_concurrent_episodes) if max_concurrent_episodes else None
    jobs = []
    for i, item in enumerate(items):
        uid = item.uid if item.uid is not None else uuid.uuid4().hex
        for j in range(n):
            jobs.append((i * n + j, item, uid, j))

    async def one(idx: int, item: Prompt, uid: str, j: int) -> tuple[int, Trajectory]:
        ep_seed = None if seed is None else seed + idx
        async with sem if sem is not None else contextlib.nullcontext():
            return idx, await env.run(
                engine,
                item.prompt,
                uid=uid,
                ground_truth=item.ground_truth,
                data_source=item.data_source,
                extra_info=item.extra_info,
                seed=ep_seed,
                sample_index=j,
                activity=activity,
            )

    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    results: list[Trajectory | None] = [None] * len(jobs)
    tasks = [asyncio.ensure_future(one(*job)) for job in jobs]
    try:
        with tqdm(total=len(tasks), desc="rollout", unit="ep", disable=not progress, leave=False) as bar:
            for fut in asyncio.as_completed(tasks):
                idx, traj = await fut
                results[idx] = traj
                bar.update(1)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        if own_env:
            await env.close()
    wall = time.perf_counter() - t0
    trajs = [r for r in results if r is not None]
    pad_id = env.tokenizer.pad_token_id
    if pad_id is None:
        pad_id = env.stop_ids[0]
    c0 = time.perf_counter()
    batch = collate(
        trajs, pad_token_id=pad_id, response_length=env.config.response_length if pad_to == "budget" else None
    )
    collate_s = time.perf_counter() - c0
    sampled = sum(sum(t.response_mask) for t in trajs)
    batch.stats = {
        "wall_s": wall,
        "episodes": float(len(trajs)),
        "sampled_tokens": float(sampled),
        "sampled_tokens_per_s": sampled / wall if wall > 0 else 0.0,
        "reward_mean": float(np.mean([t.reward for t in trajs])),
        "tool_calls": float(sum(t.num_tool_calls for t in trajs)),
        "malformed_calls": float(sum(t.malformed_calls for t in trajs)),
        "void_turn_episodes": float(sum(t.void_turns > 0 for t in trajs)),
        "collate_s": collate_s,
        **activity.summary(),
    }
    return batch


def rollout(
    engine: Any,
    env_or_config: AgentEnv | EpisodeConfig | Mapping[str, Any],
    prompts: Sequence[Any],
    n: int = 1,
    **kwargs: Any,
) -> RolloutBatch:
    """Run ``len(prompts) × n`` episodes concurrently and collate them (see the module docstring).

    ``prompts``: strings, chat-message lists, mappings ``{"prompt": ..., "ground_truth": ...,
    "uid": ...}``, dataset rows or :class:`~agent_env.records.Prompt` s (:meth:`Prompt.from_row`).
    ``env_or_config``: an :class:`AgentEnv`, or an :class:`EpisodeConfig` / mapping (then
    ``tokenizer=`` or ``engine.tokenizer`` gives the tokenizer and the tools are built from
    ``config.tools`` unless ``tools=`` is given). Keyword arguments: see :func:`rollout_async`.
    From inside a running event loop, ``await rollout_async(...)`` instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run_sync(rollout_async(engine, env_or_config, prompts, n, **kwargs))
    raise EnvError("rollout() was called inside a running event loop; use `await rollout_async(...)` there")


_local = threading.local()


def run_sync(coro: Any) -> Any:
    """Run ``coro`` to completion on this thread's persistent event loop.

    Unlike ``asyncio.run`` (a new loop each call), the loop is kept between calls, so tools and
    engines that bind resources to the loop they first ran on (sandbox worker subprocesses,
    futures) stay valid across successive ``rollout()`` calls of a training loop.
    """
    loop = getattr(_local, "loop", None)
    if loop is None or loop.is_closed():
        loop = asyncio.new_event_loop()
        _local.loop = loop
    return loop.run_until_complete(coro)
