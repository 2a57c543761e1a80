"""The training config's ``verl`` section: verl settings this recipe does not model, passed to
verl's ``ppo_trainer`` config as hydra overrides (``trainer=verl`` only).

``verl.<verl key>=value`` on the command line (``+verl.<key>=value`` for a key verl lacks), nested
keys under ``verl:`` in YAML, and the ``verl.overrides`` list all end up in ``verl.overrides``;
the section's own fields (:class:`~otb_tir.trainer.config.VerlConfig`: ``dry_run``, the watchdog's
limits) are the launcher's. No verl import here: the loader runs without verl installed.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from otb_tir import ConfigError

__all__ = ["take_passthrough", "apply_section"]


def take_passthrough(
    sources: list[tuple[str, Any]], overrides: list[str], section: type
) -> tuple[list[str], list[str]]:
    """Our own overrides, and the verl settings given as ``verl.<verl key>=v`` (``+verl.<key>=v`` for a
    key verl lacks) on the command line or as nested keys under ``verl:`` in YAML, as ``key=value`` items
    (taken out of ``sources``). ``section``: the schema of the ``verl`` section (its fields are ours,
    every other key is verl's)."""
    ours_keys = frozenset(f.name for f in fields(section))
    verl: list[str] = []
    for _, src in sources:
        verl += _pop_yaml_passthrough(src, ours_keys)
    ours = []
    for o in overrides:
        key, _, value = o.partition("=")
        plus = key.startswith("+")
        bare = key[1:] if plus else key
        if bare.startswith("verl.") and bare.split(".")[1] not in ours_keys:
            verl.append(("+" if plus else "") + bare[len("verl.") :] + "=" + value)
        else:
            ours.append(o)
    return ours, verl


def apply_section(cfg: DictConfig, items: list[str]) -> None:
    """Append the passthrough items to ``verl.overrides`` and check them."""
    cfg.verl.overrides = [*cfg.verl.overrides, *items]
    bad = [o for o in cfg.verl.overrides if "=" not in o]
    if bad:
        raise ConfigError(
            f"verl.overrides entries must look like key=value (a key of verl's ppo_trainer config), got: {bad}"
        )
    if cfg.verl.overrides and cfg.trainer.name != "verl":
        raise ConfigError(
            f"verl settings {list(cfg.verl.overrides)} only apply to trainer=verl; add trainer=verl "
            "or drop them (the local trainer is configured by this recipe's own keys)"
        )


def _pop_yaml_passthrough(src: Any, ours_keys: frozenset[str]) -> list[str]:
    """Nested verl keys under a YAML ``verl:`` section (besides ours) as ``key=value`` items."""
    if not isinstance(src, DictConfig) or not isinstance(src.get("verl"), DictConfig):
        return []
    section = src.verl
    extra = {k: section[k] for k in list(section.keys()) if k not in ours_keys}
    for k in extra:
        section.pop(k)
    out: list[str] = []

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, DictConfig) and len(node):
            for k in node.keys():
                walk(f"{prefix}.{k}", node[k])
            return
        value = OmegaConf.to_container(node) if isinstance(node, (DictConfig, ListConfig)) else node
        out.append(f"{prefix}={json.dumps(value)}")

    for k, node in extra.items():
        walk(str(k), node)
    return out
