"""A verl agent loop that runs agent_env's multi-turn tool episode.

verl 0.9.1's ``AgentLoopWorker`` builds one agent loop per sample with
``hydra.utils.instantiate(<entry of the agent-loop YAML>, trainer_config=..., server_manager=...,
tokenizer=..., processor=..., dataset_cls=..., data_config=..., tools=...)`` and awaits
``loop.run(sampling_params, **dataset_fields)``. :class:`OTBToolAgentLoop` does that with
:meth:`agent_env.AgentEnv.run` (token-in-token-out, our tool-call parsers, our tools, our math
reward) and verl's server manager behind the :class:`agent_env.engines.base.Engine` protocol
(:class:`ServerManagerEngine`). It returns verl's ``AgentLoopOutput``: ``prompt_ids``,
``response_ids`` (assistant turns and inserted tool-response tokens), ``response_mask`` (1 policy /
0 inserted), ``response_logprobs`` (the server's log-probs at mask = 1, 0.0 elsewhere),
``reward_score`` (so verl's reward workers are skipped), ``num_turns`` and ``metrics``.

Settings come from verl's config (single source of truth): ``rollout.response_length`` is the
episode's total response budget R, ``rollout.multi_turn.{format, max_assistant_turns,
max_parallel_calls, max_tool_response_length, tool_response_truncate_side}`` the episode limits
(``max_tool_response_length`` counts tokens here, verl's own loop counts characters; verl's
``left``/``right`` truncation sides mean keep ``tail``/``head``). Our own settings are keyword
arguments in the agent-loop YAML entry (see ``configs/agent_loop.yaml``): ``otb_tools`` (tool
names for :func:`tools.get_tool`), ``tool_config`` (keyword config per tool), ``tool_config_path``
(a verl-style tools YAML for :func:`tools.load_tools`, replaces ``otb_tools``), ``otb_mcp_servers``
(an ``mcpServers`` file, :mod:`tools.mcp`: each worker process starts its own client sessions),
``max_tokens_per_turn``, ``tool_timeout``, ``system_prompt``, ``reward`` (the reward section,
:class:`agent_env.math_task.reward.RewardConfig`: which function scores each data source, bounded,
and the math reward's shaping), ``otb_format`` (the tool-call format, any name of
:data:`agent_env.parsers.FORMATS`; verl's ``multi_turn.format`` otherwise) and ``otb_task``
(:data:`agent_env.tasks.TASKS`: its answer extraction and default reward). The reward is computed
here, in verl's agent-loop worker, by the same resolved function local training and the eval use.

Sampling: temperature / top-p / top-k come from verl's ``sampling_params`` (so validation's greedy
``temperature=0`` works); the episode adds ``max_tokens`` (per-turn cap, within what is left of R)
and its stop token ids, and always asks the server for log-probs (the Engine contract needs them).
Rows whose rendered prompt exceeds ``rollout.prompt_length`` are not run: they come back with an
empty response, reward 0 and ``extra_fields["otb_skipped"] = "prompt_too_long"`` (nothing is
trained on them), instead of verl's silent left-truncation of a prompt the policy never saw.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Mapping, Sequence
from uuid import uuid4

from otb_tir.verl import require_verl

require_verl()

from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from agent_env import AgentEnv, EnvError, EpisodeConfig, Trajectory  # noqa: E402
from agent_env.engines.base import EngineError, GenerationOutput, SamplingParams  # noqa: E402
from agent_env.records import Prompt  # noqa: E402
from agent_env.rewards import ERROR_KINDS as REWARD_ERROR_KINDS  # noqa: E402
from agent_env.tool_metrics import COUNT_KEYS, episode_counts  # noqa: E402
from tools.assembly import ToolSet, plain  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["AGENT_NAME", "OTBToolAgentLoop", "ServerManagerEngine", "close_cached_tools", "episode_config_from_verl"]

AGENT_NAME = "otb_tir_agent"

# verl's multi_turn.tool_response_truncate_side names the side that is cut; ours the side kept.
_TRUNCATE_SIDE = {"left": "tail", "right": "head", "middle": "middle", "head": "head", "tail": "tail"}


class ServerManagerEngine:
    """:class:`~agent_env.engines.base.Engine` over verl's server manager (``LLMServerClient``).

    Each call is ``await server_manager.generate(request_id=..., prompt_ids=...,
    sampling_params={...})`` → verl ``TokenOutput(token_ids, log_probs, stop_reason)``. One
    ``request_id`` per episode keeps its turns on one server (prefix caching, as verl's loops do).
    """

    def __init__(
        self,
        server_manager: Any,
        sampling_params: Mapping[str, Any],
        request_id: str | None = None,
        **generate_kwargs: Any,
    ) -> None:
        self.server_manager = server_manager
        self.base = {k: v for k, v in dict(sampling_params).items() if k not in ("max_tokens", "max_new_tokens")}
        self.request_id = request_id or uuid4().hex
        self.generate_kwargs = generate_kwargs
        self.calls = 0
        # the weight versions (verl's global steps) the episode's turns were generated with: verl's V1
        # trainer bounds and reports staleness from the trajectory's min/max (TransferQueue tags)
        self.min_global_steps: int | None = None
        self.max_global_steps: int | None = None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        sp = dict(self.base)
        sp["logprobs"] = True
        sp["max_tokens"] = int(params.max_tokens)
        stop_ids = set(sp.get("stop_token_ids") or []) | set(params.stop_token_ids or [])
        if stop_ids:
            sp["stop_token_ids"] = sorted(int(i) for i in stop_ids)
        if params.stop:
            sp["stop"] = list(params.stop)
        self.calls += 1
        out = await self.server_manager.generate(
            request_id=self.request_id, prompt_ids=list(prompt_ids), sampling_params=sp, **self.generate_kwargs
        )
        ids = [int(t) for t in out.token_ids]
        self._versions(getattr(out, "extra_fields", None) or {})
        stop_reason = getattr(out, "stop_reason", None)
        if stop_reason == "aborted":
            return GenerationOutput(token_ids=[], logprobs=[], finish_reason="abort")
        logprobs = out.log_probs
        if logprobs is None or len(logprobs) != len(ids):
            raise EngineError(
                f"the verl server returned {len(ids)} tokens but "
                f"{'no' if logprobs is None else len(logprobs)} log-probs although logprobs were requested"
            )
        if ids and ids[-1] in stop_ids:
            finish = "stop"
        elif len(ids) >= params.max_tokens:
            finish = "length"
        else:
            finish = "stop"  # an eos id of the model or a stop string
        return GenerationOutput(token_ids=ids, logprobs=[float(x) for x in logprobs], finish_reason=finish)

    def _versions(self, extra: Mapping[str, Any]) -> None:
        lo = extra.get("min_global_steps", extra.get("global_steps"))
        hi = extra.get("max_global_steps", extra.get("global_steps"))
        if lo is not None:
            self.min_global_steps = int(lo) if self.min_global_steps is None else min(self.min_global_steps, int(lo))
        if hi is not None:
            self.max_global_steps = int(hi) if self.max_global_steps is None else max(self.max_global_steps, int(hi))

    def version_fields(self) -> dict[str, int]:
        """``min_global_steps`` / ``max_global_steps`` over the episode's turns (those the server reported)."""
        out = {}
        if self.min_global_steps is not None:
            out["min_global_steps"] = self.min_global_steps
        if self.max_global_steps is not None:
            out["max_global_steps"] = self.max_global_steps
        return out

    async def update_weights(self, named_tensors: Any) -> None:
        raise EngineError("weights of verl's rollout servers are synchronized by verl's trainer, not by the episode")

    async def close(self) -> None:
        return None


def episode_config_from_verl(
    rollout_config: Any,
    *,
    max_tokens_per_turn: int | None = None,
    tool_timeout: float | None = 10.0,
    system_prompt: str | None = None,
    reward: Mapping[str, Any] | None = None,
    tools: Sequence[str] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    format: str | None = None,
    task: str | None = None,
) -> EpisodeConfig:
    """The :class:`EpisodeConfig` that verl's ``actor_rollout_ref.rollout`` section describes."""
    mt = rollout_config.multi_turn
    R = int(rollout_config.response_length)
    side = _TRUNCATE_SIDE.get(str(mt.tool_response_truncate_side))
    if side is None:
        raise EnvError(
            f"rollout.multi_turn.tool_response_truncate_side={mt.tool_response_truncate_side!r}: "
            f"expected one of {sorted(_TRUNCATE_SIDE)}"
        )
    # verl's sections carry the same names as ours (agent_env's EpisodeConfig.from_sections reads them);
    # what verl names differently, lacks, or means otherwise (its multi_turn.tool_config_path is a
    # file of verl's tools, which this loop does not use) is given here.
    return EpisodeConfig.from_sections(
        rollout_config,
        mt,
        reward or {},
        tools=None if tools is None else list(tools),
        tool_config={},
        tool_config_path=None,
        max_assistant_turns=int(mt.max_assistant_turns or 8),
        max_tokens_per_turn=min(int(max_tokens_per_turn or R), R),
        tool_response_truncate_side=side,
        tool_timeout=tool_timeout,
        system_prompt=system_prompt,
        chat_template_kwargs=dict(chat_template_kwargs or {}),
        format=str(format or mt.format),  # ours (agent-loop YAML's otb_format) wins over verl's key
        task=task,
    )


# One AgentEnv (and one set of tools: sandbox worker pools) per process, event loop and settings:
# verl builds an agent loop object per sample, so nothing heavy may live on the instance.
_ENVS: dict[tuple, AgentEnv] = {}


async def close_cached_tools() -> None:
    """Close the tools the agent loops of this event loop created (e.g. at the end of a worker)."""
    loop_id = id(asyncio.get_running_loop())
    for key in [k for k in _ENVS if k[0] == loop_id]:
        env = _ENVS.pop(key)
        await env.tools.close()


def _build_tools(
    names: Sequence[str] | None,
    tool_config: Mapping[str, Any],
    tool_config_path: str | None,
    mcp_servers: str | None = None,
):
    """The tool set, by the same assembly as the local trainer and the evaluation."""
    from tools import ToolError, build_tool_set

    try:
        return build_tool_set(names, tool_config, tool_config_path, mcp_servers)
    except ToolError as e:
        raise EnvError(f"{AGENT_NAME}: tools: {e}") from None


@register(AGENT_NAME)
class OTBToolAgentLoop(AgentLoopBase):
    """agent_env's episode as a verl agent loop (see the module docstring for the settings)."""

    def __init__(
        self,
        *args: Any,
        tools: Any = None,
        otb_tools: Sequence[str] | None = None,
        tool_config: Mapping[str, Any] | None = None,
        tool_config_path: str | None = None,
        otb_mcp_servers: str | None = None,
        max_tokens_per_turn: int | None = None,
        tool_timeout: float | None = 10.0,
        system_prompt: str | None = None,
        reward: Mapping[str, Any] | None = None,
        otb_format: str | None = None,
        otb_task: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        verl_tools = getattr(tools, "tools", None) or []
        if verl_tools:
            logger.warning(
                "%s ignores verl's own tools (%s) from rollout.multi_turn.tool_config_path; "
                "list ours with otb_tools / tool_config_path in the agent-loop YAML",
                AGENT_NAME,
                [getattr(t, "name", t) for t in verl_tools],
            )
        self.otb_tool_names = None if otb_tools is None else list(plain(otb_tools))
        self.otb_tool_config = dict(plain(tool_config) or {})
        self.otb_tool_config_path = tool_config_path
        self.otb_mcp_servers = otb_mcp_servers
        self.episode_config = episode_config_from_verl(
            self.rollout_config,
            max_tokens_per_turn=max_tokens_per_turn,
            tool_timeout=tool_timeout,
            system_prompt=system_prompt,
            reward=plain(reward),
            tools=self.otb_tool_names,
            chat_template_kwargs=plain(self.apply_chat_template_kwargs),
            format=otb_format,
            task=otb_task,
        )
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)

    def _env(self) -> AgentEnv:
        key = (
            id(asyncio.get_running_loop()),
            id(self.tokenizer),
            json.dumps(
                [self.otb_tool_names, self.otb_tool_config, self.otb_tool_config_path, self.otb_mcp_servers],
                sort_keys=True,
                default=str,
            ),
            repr(self.episode_config),
        )
        env = _ENVS.get(key)
        if env is None:
            tools = _build_tools(
                self.otb_tool_names, self.otb_tool_config, self.otb_tool_config_path, self.otb_mcp_servers
            )
            env = AgentEnv(self.tokenizer, tools=tools, config=self.episode_config)
            _ENVS[key] = env
        return env

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        if kwargs.get("raw_prompt") is None:
            raise EnvError(f"{AGENT_NAME} needs the dataset field 'raw_prompt' (verl's data.return_raw_chat=True)")
        row = Prompt.from_row(kwargs, prompt_key="raw_prompt")
        messages = [dict(m) for m in row.prompt]
        env = self._env()
        # the sandbox pools start before the episode, shared by the worker's episodes: under load the
        # start-up can take longer than a tool call's timeout, and in the first call it would count
        # against it (seen in colocate_async: the first two batches' tool calls all timed out)
        if isinstance(env.tools, ToolSet):
            await env.tools.start()
        want_logprobs = bool(sampling_params.get("logprobs", False))

        prompt_ids = env.encode(env.render(env.initial_messages(messages), add_generation_prompt=True))
        if len(prompt_ids) > self.prompt_length:
            logger.warning(
                "prompt of %d tokens exceeds rollout.prompt_length=%d: episode skipped (empty response)",
                len(prompt_ids),
                self.prompt_length,
            )
            return AgentLoopOutput(
                prompt_ids=prompt_ids[-self.prompt_length :],
                response_ids=[],
                response_mask=[],
                response_logprobs=[] if want_logprobs else None,
                reward_score=0.0,
                num_turns=1,
                metrics=AgentLoopMetrics(),
                extra_fields={
                    "turn_scores": [],
                    "tool_rewards": [],
                    "otb_skipped": "prompt_too_long",
                    "reward_extra_info": _reward_extra_info(None),
                    # nothing was generated: the version the prompt was taken at (verl's V1 tags need one)
                    **(
                        {
                            "min_global_steps": int(kwargs["global_steps"]),
                            "max_global_steps": int(kwargs["global_steps"]),
                        }
                        if kwargs.get("global_steps") is not None
                        else {}
                    ),
                },
            )

        engine = ServerManagerEngine(self.server_manager, sampling_params)
        traj = await env.run(
            engine,
            messages,
            uid=row.uid,
            ground_truth=row.ground_truth,
            data_source=row.data_source,
            extra_info=row.extra_info if isinstance(row.extra_info, dict) else None,
        )
        tool_rounds = sum(1 for t in traj.turns if t.obs_end > t.obs_start)
        return AgentLoopOutput(
            prompt_ids=list(traj.prompt_ids),
            response_ids=list(traj.response_ids),
            response_mask=list(traj.response_mask),
            response_logprobs=list(traj.rollout_logprobs) if want_logprobs else None,
            reward_score=float(traj.reward),
            num_turns=1 + traj.num_turns + tool_rounds,  # verl counts user + assistant + tool turns
            metrics=AgentLoopMetrics(
                generate_sequences=traj.timings.get("generate_s", 0.0),
                tool_calls=traj.timings.get("tools_s", 0.0),
                compute_score=traj.timings.get("reward_s", 0.0),
            ),
            extra_fields={
                "turn_scores": [],
                "tool_rewards": [],
                "otb_finish_reason": traj.finish_reason,
                "otb_template_mismatch": traj.template_mismatch,
                "reward_extra_info": _reward_extra_info(traj),
                **engine.version_fields(),
            },
        )


def _reward_extra_info(traj: Trajectory | None) -> dict[str, float]:
    """Per-trajectory figures verl logs next to the reward (same keys for every row): ``acc``,
    ``void_turns``, ``assistant_turns`` and ``tool_<count>`` for each count of
    :func:`agent_env.tool_metrics.episode_counts`, the definition training and the evaluation use,
    and ``reward_error_<kind>`` (1 when the reward function failed that way, see
    :mod:`agent_env.rewards`)
    (:func:`~agent_env.tool_metrics.pooled_tool_metrics` of the rows gives the batch's figures)."""
    if traj is None:
        counts = dict.fromkeys(COUNT_KEYS, 0.0)
        return {
            "acc": 0.0,
            "void_turns": 0.0,
            "assistant_turns": 0.0,
            **{f"tool_{k}": v for k, v in counts.items()},
            **{f"reward_error_{k}": 0.0 for k in REWARD_ERROR_KINDS},
        }
    kind = traj.reward_details.get("reward_error")
    return {
        **{f"reward_error_{k}": float(kind == k) for k in REWARD_ERROR_KINDS},
        "acc": float(bool(traj.reward_details.get("correct", False))),
        "void_turns": float(traj.void_turns),
        "assistant_turns": float(traj.num_turns),
        **{f"tool_{k}": v for k, v in episode_counts(traj).items()},
    }
