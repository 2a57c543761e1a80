"""Engines behind one async protocol (see :mod:`agent_env.engines.base`)."""

from agent_env.engines.base import Engine, EngineError, GenerationOutput, SamplingParams

__all__ = ["Engine", "EngineError", "GenerationOutput", "SamplingParams"]
