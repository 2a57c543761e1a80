"""One multi-turn tool episode, token-in-token-out.

The policy writes an assistant turn; the parser finds its tool calls; the tools run (concurrently,
inside the episode's own python session); their results go back as ``tool`` messages; the policy
writes again; … until it answers, or a budget ends the episode. The token bookkeeping is
:mod:`agent_env.template`'s, the records :mod:`agent_env.records`', the tool calls
:mod:`agent_env.tool_calls`'; what counts as an answer is the task's (:meth:`agent_env.tasks.Task.answer`);
the settings are :class:`~agent_env.episode_config.EpisodeConfig`'s (re-exported here).

Finish reasons (decided in one place, :meth:`AgentEnv._finish_reason`): ``answer`` (a turn
without tool calls that writes a final answer), ``void_turn`` (neither a tool call nor a final
answer), ``max_turns`` (the last allowed turn still called tools), ``length`` (the total response
budget R ran out while sampling), ``turn_length`` (the per-turn cap ran out before the stop
token), ``tool_overflow`` (the tool responses would not fit in R), ``abort`` (the engine aborted).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from agent_env.activity import Activity, tracking
from agent_env.engines.base import Engine, GenerationOutput, SamplingParams
from agent_env.episode_config import EpisodeConfig
from agent_env.errors import EnvError
from agent_env.parsers import ParsedCall, get_parser
from agent_env.records import FINISH_REASONS, ToolCallRecord, Trajectory, Transcript, TurnRecord
from agent_env.rewards import RewardResult, RewardScorer
from agent_env.tasks import DEFAULT_TASK, get_task
from agent_env.template import ChatTemplate
from agent_env.tool_calls import release_sessions, resolve_tools, run_calls

logger = logging.getLogger(__name__)

__all__ = ["EpisodeConfig", "ToolCallRecord", "TurnRecord", "Trajectory", "AgentEnv", "FINISH_REASONS"]


RewardFn = Callable[[str, Any, "Trajectory"], "RewardResult | float"]


@dataclass
class _Turn:
    """One assistant turn while the episode runs: what was sampled, and how far it got."""

    record: TurnRecord  # its tool_calls: the parsed calls, replaced by their results once they run
    out: GenerationOutput
    ended: bool  # the model sampled a stop token (not cut by a budget)
    calls: list[ParsedCall]
    answer: str | None
    tools_ran: bool = False
    inserted: bool = False  # the observations fit in the budget and were inserted


class AgentEnv:
    """The environment: a tokenizer with a chat template, tools, a parser and budgets.

    ``tools`` is a mapping name → :class:`tools.Tool` or a sequence of tools; ``None`` builds the
    tool set of ``config`` with :func:`tools.build_tool_set` (and :meth:`close` closes them).
    ``reward_fn(response_text, ground_truth, trajectory)`` returns a :class:`RewardResult` or a
    float; the default is the reward section's (:class:`agent_env.rewards.RewardScorer`: the
    task's reward unless the section names another).
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: Mapping[str, Any] | Sequence[Any] | None = None,
        config: EpisodeConfig | None = None,
        reward_fn: RewardFn | None = None,
    ) -> None:
        self.config = config or EpisodeConfig()
        self.tokenizer = tokenizer
        self.parser = get_parser(self.config.format)
        self._owns_tools = tools is None  # then self.tools is the tools.ToolSet build_tool_set made
        cfg = self.config
        self.tools = resolve_tools(tools, cfg.tools, cfg.tool_config, cfg.tool_config_path)
        if self.config.format == "code_block" and "python" not in self.tools:
            raise EnvError(
                "the code_block parser runs code with the 'python' tool, which is not among "
                f"the episode's tools {sorted(self.tools)}"
            )
        self.reward_fn = reward_fn
        self.task = get_task(self.config.task or DEFAULT_TASK)
        # the reward section's functions, resolved now: one that does not import stops the run here
        self.scorer = (
            RewardScorer(self.config.reward, default=self.task.reward, extract=self.task.extract_answer)
            if reward_fn is None
            else None
        )
        tool_schemas = [t.schema() for t in self.tools.values()] or None
        bind = getattr(self.parser, "bind_tools", None)  # parsers that type arguments by the tools' schemas
        if callable(bind):
            bind(tool_schemas or [])
        self.template = ChatTemplate(
            tokenizer, tool_schemas, self.config.chat_template_kwargs, self.config.stop_token_ids
        )
        self.stop_ids = self.template.stop_ids

    # ------------------------------------------------------------------ template and text

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.template.render(messages, add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.template.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.template.decode(ids)

    def initial_messages(self, prompt: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return self.template.initial_messages(prompt, self.config.system_prompt)

    def truncate_tool_text(self, text: str) -> tuple[str, bool, int]:
        """``(text, truncated, n_tokens)``: cut ``text`` to ``max_tool_response_length`` tokens
        (marker included), keeping the configured side."""
        cfg = self.config
        return self.template.truncate(
            text, cfg.max_tool_response_length, cfg.tool_response_truncate_side, cfg.truncation_marker
        )

    def extract_answer(self, text: str) -> str | None:
        """The final answer in ``text``, by the task's extraction (the math one unless the task has its own)."""
        return self.task.answer(text)

    # ------------------------------------------------------------------ the episode

    async def run(
        self,
        engine: Engine,
        prompt: str | Sequence[Mapping[str, Any]],
        *,
        uid: str | None = None,
        ground_truth: Any = None,
        seed: int | None = None,
        sample_index: int = 0,
        activity: Activity | None = None,
        data_source: str | None = None,
        extra_info: Mapping[str, Any] | None = None,
    ) -> Trajectory:
        """Run one episode with ``engine`` and return its :class:`Trajectory`."""
        t_start = time.perf_counter()
        if self.scorer is not None:  # the math-verify helper starts now, not at the first answer it must compare
            self.scorer.prewarm()
        ep = self._start(prompt, uid, sample_index)
        finish: str | None = None
        try:
            for t in range(self.config.max_assistant_turns):
                turn = await self._generate_turn(engine, ep, t, seed, activity)
                if finish := self._finish_reason(ep, turn):
                    break
                await self._run_tools(ep, turn, activity)
                self._insert_observations(ep, turn)
                if finish := self._finish_reason(ep, turn):
                    break
            self._check_final_rendering(ep)
        finally:
            await release_sessions(self.tools, ep.used_tools, ep.session_id)
        traj = ep.trajectory(finish or "max_turns", ground_truth, data_source, extra_info, sample_index)
        await self._score(traj, activity)
        traj.timings["wall_s"] = time.perf_counter() - t_start
        return traj

    def _start(self, prompt: str | Sequence[Mapping[str, Any]], uid: str | None, sample_index: int) -> Transcript:
        uid = uid if uid is not None else uuid.uuid4().hex
        messages = self.initial_messages(prompt)
        return Transcript(
            uid=uid,
            session_id=f"{uid}:{sample_index}:{uuid.uuid4().hex[:8]}",
            messages=messages,
            prompt_ids=self.template.prompt_ids(messages),
        )

    async def _generate_turn(
        self, engine: Engine, ep: Transcript, t: int, seed: int | None, activity: Activity | None
    ) -> _Turn:
        """Sample assistant turn ``t``, append its tokens and message, and parse it."""
        cfg = self.config
        params = SamplingParams(
            max_tokens=min(cfg.max_tokens_per_turn, cfg.response_length - len(ep.resp)),
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            stop_token_ids=list(self.stop_ids),
            seed=None if seed is None else seed * 1000 + t,
        )
        g0 = time.perf_counter()
        with tracking(activity, "gen"):
            out = await engine.generate(ep.stream_ids, params)
        ep.timings["generate_s"] += time.perf_counter() - g0
        ids = list(out.token_ids)
        if len(out.logprobs) != len(ids) or len(ids) > params.max_tokens:
            raise EnvError(
                f"engine {type(engine).__name__} broke the Engine contract: "
                f"{len(ids)} tokens, {len(out.logprobs)} log-probs, max_tokens={params.max_tokens}"
            )
        start = len(ep.resp)
        ep.extend(ids, out.logprobs)
        # The turn ends with the stop token the model sampled. An engine that stopped on another
        # token (e.g. an extra eos id of the model) also ends the turn; the template's rendering
        # then differs and the mismatch is detected when observations are inserted.
        ended = bool(ids) and (ids[-1] in self.stop_ids or out.finish_reason == "stop")
        text = self.decode(ids)
        content = self.decode(self.template.content_ids(ids)) if ended else text
        calls = self.parser.parse(content)
        answer = self.extract_answer(content)
        record = TurnRecord(
            index=t,
            start=start,
            end=len(ep.resp),
            obs_start=len(ep.resp),
            obs_end=len(ep.resp),
            text=text,
            engine_finish_reason=out.finish_reason,
            has_answer=answer is not None,
            void=not calls and answer is None,
        )
        if ended and out.finish_reason != "abort":  # calls of a turn cut short are not recorded
            record.tool_calls = [
                ToolCallRecord(name=c.name, arguments=c.arguments, raw=c.raw, error=c.error) for c in calls
            ]
        ep.turns.append(record)
        ep.messages.append({"role": "assistant", "content": content})
        return _Turn(record, out, ended, calls, answer)

    def _finish_reason(self, ep: Transcript, turn: _Turn) -> str | None:
        """Why the episode ends after ``turn`` (just sampled, or with its observations inserted),
        or None when it goes on."""
        cfg = self.config
        if not turn.tools_ran:
            if turn.out.finish_reason == "abort":
                return "abort"
            if not turn.ended:
                return "length" if len(ep.resp) >= cfg.response_length else "turn_length"
            if not turn.calls:
                return "answer" if turn.answer is not None else "void_turn"
            if turn.record.index == cfg.max_assistant_turns - 1:
                return "max_turns"  # the calls are recorded, not run
            return None
        if not turn.inserted:
            return "tool_overflow"
        return "length" if len(ep.resp) >= cfg.response_length else None

    async def _run_tools(self, ep: Transcript, turn: _Turn, activity: Activity | None) -> None:
        """Run the turn's calls (concurrently, capped by ``max_parallel_calls``) into its record."""
        k0 = time.perf_counter()
        # noted before the calls run, so sessions are released even if the episode is cancelled
        ep.used_tools.update(c.name for c in turn.calls if c.ok and c.name in self.tools)
        records = await run_calls(
            self.tools,
            turn.calls,
            session_id=ep.session_id,
            max_parallel=self.config.max_parallel_calls,
            timeout=self.config.tool_timeout,
            truncate=self.truncate_tool_text,
            activity=activity,
        )
        ep.timings["tools_s"] += time.perf_counter() - k0
        turn.record.tool_calls = records
        turn.tools_ran = True

    def _insert_observations(self, ep: Transcript, turn: _Turn) -> None:
        """Insert the tool messages (+ the next assistant header) as the template's delta, if they fit in R."""
        records = turn.record.tool_calls
        # a parser may build the messages itself (tool roles, ids, names); the hook is optional
        tool_messages = getattr(self.parser, "tool_messages", None)
        if tool_messages is not None:
            obs = list(tool_messages(records, turn.calls))
        else:
            obs = [{"role": "tool", "content": self.parser.format_observation(r.text)} for r in records]
        delta_text, mismatch = self.template.delta(ep.stream_ids, ep.messages, obs)
        if mismatch and ep.mismatch is None:
            self._record_mismatch(ep, f"turn {turn.record.index}: {mismatch}")
        delta_ids = self.template.encode_exact(delta_text)
        if len(ep.resp) + len(delta_ids) >= self.config.response_length:
            return
        ep.messages.extend(obs)
        ep.extend(delta_ids)
        turn.record.obs_end = len(ep.resp)
        turn.inserted = True

    def _check_final_rendering(self, ep: Transcript) -> None:
        """The template's rendering of the whole conversation vs the token stream."""
        if ep.mismatch is None:
            mismatch = self.template.final_mismatch(ep.stream_ids, ep.messages)
            if mismatch:
                self._record_mismatch(ep, "final: " + mismatch)

    def _record_mismatch(self, ep: Transcript, note: str) -> None:
        ep.mismatch = note
        msg = (
            f"{self.template.name} renders the conversation differently from the tokens the model "
            f"produced ({note}); the trajectory keeps the model's tokens and is flagged template_mismatch"
        )
        if self.config.on_template_mismatch == "error":
            raise EnvError(msg)
        logger.warning(msg)

    async def _score(self, traj: Trajectory, activity: Activity | None) -> None:
        """Set the trajectory's reward: what the model wrote (no tool output, no stop tokens), scored."""
        r0 = time.perf_counter()
        with tracking(activity, "reward"):
            text = "\n".join(
                self.decode(self.template.content_ids(traj.response_ids[tr.start : tr.end])) for tr in traj.turns
            )
            if self.reward_fn is not None:
                res = self.reward_fn(text, traj.ground_truth, traj)
            else:
                assert self.scorer is not None
                res = await self.scorer.score(text, traj)
            if isinstance(res, RewardResult):
                traj.reward, traj.reward_details = float(res.reward), dict(res.details)
            else:
                traj.reward, traj.reward_details = float(res), {}
        traj.timings["reward_s"] = time.perf_counter() - r0

    async def close(self) -> None:
        """Close the tools this environment created."""
        if self._owns_tools:
            await self.tools.close()
