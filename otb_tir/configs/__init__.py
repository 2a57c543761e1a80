"""The configs shipped with the package: ``tir_math_cpu.yaml`` (training's built-in CPU default),
``tir_math_qwen3_8b_gpu.yaml`` (the seed's Qwen3-8B run on 8 GPUs with verl, docs/verl.md) and
``eval_tool_use.yaml`` (the tool-use evaluation). ``--config NAME`` picks one by name."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent


def resolve_config(value: str | Path) -> Path:
    """A config file path, or the name of a shipped config (``tir_math_cpu``, ``eval_tool_use.yaml``)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path
    shipped = CONFIG_DIR / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if str(value) == path.name and shipped.is_file():
        return shipped
    return path  # the loader reports "config file not found"
