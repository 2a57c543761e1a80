"""Check the user's verl overrides against verl's own config, and apply them (for :mod:`otb_tir.verl.compose`).

The hydra side of composing verl's ``ppo_trainer`` config: :func:`verl_config_dir` (verl's
``trainer/config`` folder) and ``compose_base`` (hydra's compose API on it, a rejected override a
:class:`~otb_tir.ConfigError`); the ``key=value`` items of ``cfg.verl.overrides`` and the caller's
``overrides`` collected, parsed with hydra's override parser (no sweeps), told apart as config-group
picks or key settings, checked for a value of the wrong kind for verl's key, and re-applied last on
top of the recipe's values; and ``set_verl_key`` / ``_exists``, which set only keys verl's config has (a typo
in a key name fails loudly). They live apart from the recipe's translation into verl's keys
(:mod:`otb_tir.verl.compose`) because they know nothing of the recipe; the loader's side of the
``verl`` section (collecting ``verl.<key>=value`` without importing verl) is
:func:`otb_tir.trainer.config.load_config`, through :func:`otb_tir.config.take_passthrough`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from otb_tir import ConfigError
from otb_tir.verl import require_verl

logger = logging.getLogger(__name__)

__all__ = [
    "apply_user_overrides",
    "check_override_kinds",
    "compose_base",
    "is_group_override",
    "parse_overrides",
    "set_verl_key",
    "user_overrides",
    "verl_config_dir",
]


def verl_config_dir() -> Path:
    """verl's ``trainer/config`` folder (ppo_trainer.yaml and its defaults)."""
    verl = require_verl()
    return Path(verl.__file__).resolve().parent / "trainer" / "config"


def compose_base(overrides: Sequence[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        try:
            return compose(config_name="ppo_trainer", overrides=list(overrides))
        except Exception as exc:  # hydra's OverrideParseException, ConfigCompositionException, ...
            msg = " ".join(str(exc).split())
            raise ConfigError(
                f"verl {require_verl().__version__} rejected the overrides {list(overrides)}: {msg}"
            ) from None


def user_overrides(cfg: DictConfig, overrides: Sequence[str]) -> list[str]:
    items = [*(OmegaConf.select(cfg, "verl.overrides", default=None) or []), *overrides]
    bad = [o for o in items if not isinstance(o, str) or ("=" not in o and not o.startswith("~"))]
    if bad:
        raise ConfigError(f"verl overrides must look like key=value (a key of verl's ppo_trainer config), got {bad}")
    return list(items)


def parse_overrides(items: Sequence[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(items))
    except Exception as exc:  # hydra's OverrideParseException
        raise ConfigError(f"bad verl override in {list(items)}: {exc}") from None
    sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
    if sweeps:
        raise ConfigError(f"verl overrides take one value each (no sweeps): {sweeps}")
    return parsed


def is_group_override(o) -> bool:
    return o.package is not None or (isinstance(o.value(), str) and (verl_config_dir() / o.key_or_group).is_dir())


def _kind(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (dict, DictConfig)):
        return "mapping"
    if isinstance(value, (list, tuple, ListConfig)):
        return "list"
    return "str"


def check_override_kinds(base: DictConfig, parsed: list) -> None:
    """A value of the wrong kind for verl's key (a word for a number, a scalar for a section...)."""
    for o in parsed:
        if o.is_delete() or is_group_override(o):
            continue
        if not _exists(base, o.key_or_group) or OmegaConf.is_missing(base, o.key_or_group):
            continue
        current = OmegaConf.select(base, o.key_or_group)
        have, want = _kind(o.value()), _kind(current)
        if have is None or want is None or have == want or (want == "str" and have in ("number", "bool")):
            continue
        default = (
            ""
            if want == "mapping"
            else f" (default {OmegaConf.to_container(current) if want == 'list' else current!r})"
        )
        raise ConfigError(
            f"verl override {o.input_line!r}: verl's '{o.key_or_group}' is a {want}{default}, got a {have}"
        )


def apply_user_overrides(vcfg: DictConfig, parsed: list) -> None:
    """Re-apply the (already validated) user overrides on top of the recipe's values."""
    for o in parsed:
        if is_group_override(o):
            continue
        key = o.key_or_group
        if o.is_delete():
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(vcfg, parent) if parent else vcfg
            if isinstance(node, DictConfig) and leaf in node:
                with open_dict(node):
                    del node[leaf]
            continue
        recipe_value = OmegaConf.select(vcfg, key, default=None)
        OmegaConf.update(vcfg, key, o.value(), merge=True, force_add=True)
        logger.info("verl override %s (the recipe had %r)", o.input_line, recipe_value)


def set_verl_key(vcfg: DictConfig, key: str, value: Any) -> None:
    """Set an *existing* verl key (a typo in a key name fails loudly)."""
    if not _exists(vcfg, key):
        raise ConfigError(f"verl {require_verl().__version__} has no config key '{key}'")
    OmegaConf.update(vcfg, key, value, merge=False)


def _exists(vcfg: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(vcfg, parent) if parent else vcfg
    return isinstance(node, DictConfig) and leaf in node.keys()  # (`in node` is False for ??? values)
