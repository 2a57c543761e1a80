"""The tool calls of an assistant turn, run: concurrently (capped per episode), bounded by a
timeout, never raising (a failure, a malformed call or an unknown tool becomes an error
observation the model reads), each result truncated to the observation budget."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from agent_env.activity import Activity, tracking
from agent_env.errors import EnvError
from agent_env.parsers import ParsedCall
from agent_env.records import ToolCallRecord

logger = logging.getLogger(__name__)

__all__ = ["resolve_tools", "run_calls", "release_sessions"]

Truncate = Callable[[str], "tuple[str, bool, int]"]  # text -> (text, truncated, tokens before)


def resolve_tools(
    tools: Mapping[str, Any] | Sequence[Any] | None,
    names: list[str] | None,
    tool_config: dict[str, dict[str, Any]],
    tool_config_path: str | None,
) -> dict[str, Any]:
    """The episode's tools by name: ``tools`` as given (a mapping or a sequence of tools), or, when
    None, the tool set :func:`tools.build_tool_set` builds from the episode config's settings."""
    if tools is None:
        from tools import ToolError, build_tool_set

        try:
            tools = build_tool_set(names, tool_config, tool_config_path)
        except ToolError as e:
            raise EnvError(f"tools: {e}") from None
    if isinstance(tools, dict):
        return tools  # kept as given: a tools.ToolSet keeps the record of where each tool came from
    if isinstance(tools, Mapping):
        return dict(tools)
    return {t.name: t for t in tools}


async def run_calls(
    tools: Mapping[str, Any],
    calls: Sequence[ParsedCall],
    *,
    session_id: str,
    max_parallel: int,
    timeout: float | None,
    truncate: Truncate,
    activity: Activity | None = None,
) -> list[ToolCallRecord]:
    """Run ``calls`` concurrently (at most ``max_parallel`` at a time) in the session ``session_id``."""
    sem = asyncio.Semaphore(max_parallel)
    return list(
        await asyncio.gather(*(_run_call(tools, c, session_id, sem, timeout, truncate, activity) for c in calls))
    )


async def release_sessions(tools: Mapping[str, Any], names: Iterable[str], session_id: str) -> None:
    """Release the session ``session_id`` of the tools ``names`` (a failure is logged, never raised)."""
    for name in names:
        try:
            await tools[name].release(session_id)
        except Exception:  # noqa: BLE001
            logger.warning("releasing session %s of tool %r failed", session_id, name, exc_info=True)


async def _invoke(tool: Any, args: dict[str, Any], session_id: str, timeout: float | None) -> Any:
    invoke = getattr(tool, "invoke", None)
    if invoke is not None:
        return await invoke(args, session_id=session_id, timeout=timeout)
    # Fallback for tools without Tool.invoke: same contract (never raises, timeout).
    from tools.base import ErrorKind, ToolResult

    t0 = time.perf_counter()
    try:
        res = await asyncio.wait_for(tool.call(args, session_id=session_id), timeout)
    except asyncio.TimeoutError:
        res = ToolResult(f"Error: tool '{tool.name}' timed out after {timeout:g} s.", ok=False, error=ErrorKind.TIMEOUT)
    except Exception as e:  # noqa: BLE001 - a tool failure is an observation, never an exception
        res = ToolResult(
            f"Error: tool '{tool.name}' failed: {type(e).__name__}: {e}", ok=False, error=ErrorKind.RUNTIME
        )
    res.metrics.setdefault("latency_ms", (time.perf_counter() - t0) * 1000)
    return res


async def _run_call(
    tools: Mapping[str, Any],
    pc: ParsedCall,
    session_id: str,
    sem: asyncio.Semaphore,
    timeout: float | None,
    truncate: Truncate,
    activity: Activity | None,
) -> ToolCallRecord:
    rec = ToolCallRecord(name=pc.name, arguments=pc.arguments, raw=pc.raw)
    if pc.error is not None:
        rec.error, text = pc.error, f"Error: {pc.error_message}"
    elif pc.name not in tools:
        rec.error = "unknown_tool"
        text = f"Error: unknown tool '{pc.name}'. Available tools: {', '.join(sorted(tools))}."
    else:
        async with sem:
            with tracking(activity, "tool"):
                res = await _invoke(tools[pc.name], pc.arguments, session_id, timeout)
        rec.executed = True
        rec.ok, rec.error = bool(res.ok), res.error
        rec.latency_ms = float(res.metrics.get("latency_ms", 0.0))
        rec.infra_retries = int(res.metrics.get("infra_retries", 0))
        text = res.text if isinstance(res.text, str) else str(res.text)
    rec.text, rec.truncated, rec.result_tokens = truncate(text)
    return rec
