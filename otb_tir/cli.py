"""What ``otb-tir-train`` and ``otb-tir-eval`` share: the argument parser (shipped config, model,
``--print-config``, ``--list`` of the extension points' names,
dotted overrides before and after the options) and the ``--help`` listing of
config sections."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields, is_dataclass
from typing import Any, Sequence

REFERENCE = (
    "--reference (the same page as docs/configuration.md in the source); "
    "--print-config prints every key with the value this run would use"
)


def sections_help(schema: type) -> str:
    """One line per config section with its keys, for an argparse epilog."""
    lines = ["config sections (override any key as section.key=value; nested: actor.optim.lr=1e-4):"]
    for f in fields(schema):
        default: Any = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if not is_dataclass(default):
            continue
        keys = []
        for g in fields(default):
            sub = getattr(default, g.name)
            keys.append(f"{g.name}.*" if is_dataclass(sub) else g.name)
        lines.append(f"  {f.name}: {', '.join(keys)}")
    lines.append(f"every key, its default and meaning: {REFERENCE}")
    return "\n".join(lines)


def parser(prog: str, doc: str, schema: type, default_config: str, model_help: str) -> argparse.ArgumentParser:
    """The options both console scripts take; each adds its own before :func:`parse`."""
    p = argparse.ArgumentParser(
        prog=prog, description=doc, epilog=sections_help(schema), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config",
        default=default_config,
        help=f"a YAML file, or the name of a shipped config (default: {default_config})",
    )
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--print-config", action="store_true", help="print the resolved config (every key) and exit")
    p.add_argument(
        "--reference",
        action="store_true",
        help="print the configuration reference (each key of training and the eval: default, meaning) and exit",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="print every registered tool, reward, advantage estimator, tool-call format and task, "
        "with where each comes from, and exit",
    )
    return p


def shadowed_packages() -> list[str]:
    """otb-tir's top-level packages ``tools`` and ``agent_env`` have common names: a user's own
    package of the same name earlier on ``sys.path`` (the current folder under ``python -m``, or
    ``PYTHONPATH``) would be imported instead. One line per package that resolves elsewhere, naming
    both paths."""
    import importlib.util
    from pathlib import Path

    home = Path(__file__).resolve().parents[1]  # the folder holding otb_tir/, tools/ and agent_env/
    problems = []
    for name in ("tools", "agent_env"):
        module = sys.modules.get(name)
        spec = module.__spec__ if module is not None else importlib.util.find_spec(name)
        ours = home / name
        where = [Path(p).resolve() for p in (spec.submodule_search_locations or [])] if spec else []
        if spec is None or ours not in where:
            found = ", ".join(str(w) for w in where) or (spec.origin if spec else "nothing")
            problems.append(
                f"the package name '{name}' resolves to {found}, not otb-tir's {ours}: a package or folder of "
                f"yours named '{name}' shadows it (on sys.path before otb-tir); rename yours, or run from "
                "another folder / without it on PYTHONPATH"
            )
    return problems


def refuse_shadowed() -> None:
    """Exit 2 with one ``config error:`` line per shadowed package (:func:`shadowed_packages`): the
    console scripts call it first, before anything imports the wrong one."""
    problems = shadowed_packages()
    for problem in problems:
        print(f"config error: {problem}", file=sys.stderr)
    if problems:
        raise SystemExit(2)


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None, example: str) -> argparse.Namespace:
    """Add the dotted overrides, parse (overrides before and after the options alike), set up logging."""
    p.add_argument("overrides", nargs="*", help=f"dotted overrides, e.g. {example}")
    args = p.parse_intermixed_args(argv)
    if args.reference:
        from otb_tir.config_reference import render

        try:
            print(render(), end="", flush=True)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    if args.list:
        from otb_tir.builders import list_plugins
        from tools import ToolError

        try:
            print(list_plugins(_mcp_servers_arg(args)), flush=True)
        except BrokenPipeError:  # e.g. `--list | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except ToolError as e:  # an MCP server that does not start
            print(f"config error: tools: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        raise SystemExit(0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args


def _mcp_servers_arg(args: argparse.Namespace) -> str | None:
    """``multi_turn.mcp_servers`` for ``--list`` (which runs before the config is loaded): the last
    override of it, else the value in the ``--config`` file."""
    for item in reversed(list(args.overrides)):
        key, sep, value = item.partition("=")
        if sep and key.strip().lstrip("+") == "multi_turn.mcp_servers":
            return value.strip() or None
    try:
        from omegaconf import OmegaConf

        from otb_tir.configs import resolve_config

        value = OmegaConf.select(OmegaConf.load(resolve_config(args.config)), "multi_turn.mcp_servers")
    except Exception:  # noqa: BLE001 - no such file / not a mapping: --list still lists the registries
        return None
    return str(value) if value else None
