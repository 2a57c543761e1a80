"""The one config loader: a dataclass schema's defaults ← a YAML file ← dotted ``key=value``
overrides, validated. An unknown or ill-typed key fails at start with
:class:`~otb_tir.ConfigError` naming the key, the valid keys and the closest match.

The training config (:mod:`otb_tir.trainer.config`) and the evaluation config
(:mod:`otb_tir.evaluation.config`) are schemas loaded by :func:`load_structured`;
:func:`take_passthrough` takes out the keys a section hands on to another program's config (the
training config's ``verl.<verl key>=value``), so they need no schema here.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from otb_tir import ConfigError

__all__ = ["load_structured", "take_passthrough"]


def _valid_keys(prefix: str, schema: type) -> list[str]:
    """The keys allowed at the dotted path ``prefix`` of the schema ([] if it is not a section)."""
    obj: Any = schema()
    for part in [p for p in prefix.split(".") if p]:
        obj = getattr(obj, part, None)
    return [f.name for f in fields(obj)] if is_dataclass(obj) else []


def _key_paths(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of the schema under ``prefix``, sections included."""
    out: list[str] = []
    for name in _valid_keys(prefix, schema):
        path = f"{prefix}.{name}" if prefix else name
        out += [path, *_key_paths(schema, path)]
    return out


def _key_error(key: str, schema: type) -> ConfigError:
    parent, _, leaf = key.rpartition(".")
    valid = _valid_keys(parent, schema)
    hint = difflib.get_close_matches(leaf, valid, n=1)
    where = f"under '{parent}'" if parent else "at the top level"
    msg = f"unknown config key '{key}'; valid keys {where}: {', '.join(valid)}"
    if hint:
        msg += f" (did you mean '{(parent + '.' if parent else '') + hint[0]}'?)"
    else:  # the key exists in another section (e.g. verl's top-level custom_reward_function)
        elsewhere = [p for p in _key_paths(schema) if p.endswith("." + leaf) and p != key]
        if elsewhere:
            msg += f" (did you mean {' or '.join(repr(p) for p in elsewhere[:3])}?)"
    return ConfigError(msg)


def load_structured(
    schema: type,
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    choices: Mapping[str, Sequence[Any]] | None = None,
    check: Callable[[DictConfig, frozenset[str]], None] | None = None,
    sources_hook: Callable[[list[tuple[str, Any]], list[str]], list[str]] | None = None,
) -> DictConfig:
    """``schema``'s defaults ← YAML file ← ``key=value`` overrides, validated.

    Raises ConfigError for unknown keys, values of the wrong type and values outside ``choices``
    (dotted key → allowed values); ``check(cfg, given)`` validates further, ``given`` being the
    dotted keys the user set (command line, or a YAML file other than a shipped config): a default
    that depends on another key may follow it, a value the user gave may not be changed. ``sources_hook(sources,
    overrides)`` may take keys out of the YAML sources and the overrides before they are merged
    (the training config's verl passthrough) and returns the overrides to merge.
    """
    cfg = OmegaConf.structured(schema)
    sources: list[tuple[str, Any]] = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        sources.append((str(path), OmegaConf.load(path)))
    overrides = list(overrides)
    if sources_hook is not None:
        overrides = sources_hook(sources, overrides)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key=value (e.g. rollout.n=4), got: {bad}")
    given: set[str] = set()
    from otb_tir.configs import CONFIG_DIR

    for origin, src in sources:
        if Path(origin).resolve().parent != CONFIG_DIR:  # a shipped config holds defaults, not the user's choices
            given |= _leaf_keys(src)
    if overrides:
        sources.append(("command line", OmegaConf.from_dotlist(list(overrides))))
        given |= _leaf_keys(sources[-1][1])
    for origin, src in sources:
        try:
            cfg = OmegaConf.merge(cfg, src)
        except (ConfigKeyError, ConfigAttributeError) as e:
            key = getattr(e, "full_key", None) or str(e)
            raise _key_error(str(key), schema) from None
        except ValidationError as e:
            msg = str(e.msg).splitlines()[0]
            if "is not a ListConfig" in msg:  # data.train_files=a.parquet: the brackets were left out
                msg = f"a list is expected: write it as {e.full_key}=[a, b] (one item: {e.full_key}=[a])"
            raise ConfigError(f"{origin}: bad value for '{e.full_key}': {msg}") from None
        except OmegaConfBaseException as e:  # pragma: no cover - other OmegaConf failures
            raise ConfigError(f"{origin}: {e}") from None
    for key, allowed in (choices or {}).items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"'{key}' must be one of {', '.join(map(str, allowed))}; got {value!r}")
    if check is not None:
        check(cfg, frozenset(given))
    return cfg


def _leaf_keys(node: Any, prefix: str = "") -> set[str]:
    """Dotted keys of the leaves of a config node (a mapping's keys, not a list's items)."""
    if isinstance(node, (dict, DictConfig)):
        out: set[str] = set()
        for k in node.keys():
            value = node[k] if not isinstance(node, DictConfig) else node._get_node(k)
            out |= _leaf_keys(value, f"{prefix}{k}.")
            out.add(f"{prefix}{k}")
        return out
    return set()


def take_passthrough(
    sources: list[tuple[str, Any]], overrides: list[str], section: str, schema: type
) -> tuple[list[str], list[str]]:
    """The overrides to merge, and the keys of ``section`` that its ``schema`` lacks, handed on as
    ``key=value`` items (``+key=value`` for ``+<section>.<key>=value``): given as
    ``<section>.<key>=value`` on the command line or as nested keys under ``<section>:`` in the YAML
    sources (taken out of them). For :func:`load_structured`'s ``sources_hook``."""
    schema_keys = frozenset(f.name for f in fields(schema))
    passed: list[str] = []
    for _, src in sources:
        passed += _pop_yaml_passthrough(src, section, schema_keys)
    ours = []
    for o in overrides:
        key, _, value = o.partition("=")
        plus = key.startswith("+")
        bare = key[1:] if plus else key
        if bare.startswith(section + ".") and bare.split(".")[1] not in schema_keys:
            passed.append(("+" if plus else "") + bare[len(section) + 1 :] + "=" + value)
        else:
            ours.append(o)
    return ours, passed


def _pop_yaml_passthrough(src: Any, section: str, schema_keys: frozenset[str]) -> list[str]:
    """The nested keys under a YAML source's ``section`` that its schema lacks, as ``key=value`` items."""
    if not isinstance(src, DictConfig) or not isinstance(src.get(section), DictConfig):
        return []
    node = src[section]
    extra = {k: node[k] for k in list(node.keys()) if k not in schema_keys}
    for k in extra:
        node.pop(k)
    out: list[str] = []

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, DictConfig) and len(node):
            for k in node.keys():
                walk(f"{prefix}.{k}", node[k])
            return
        value = OmegaConf.to_container(node) if isinstance(node, (DictConfig, ListConfig)) else node
        out.append(f"{prefix}={json.dumps(value)}")

    for k, item in extra.items():
        walk(str(k), item)
    return out
