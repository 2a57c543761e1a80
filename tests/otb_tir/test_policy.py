"""The policy is resolved once, at the entry points (otb_tir.defaults.policy.resolve_policy); below
them ``model.path`` is read as given (otb_tir.builders.policy_path)."""

from __future__ import annotations

import pytest

from otb_tir import ConfigError
from otb_tir.builders import SHIPPED_CHAT_TEMPLATE, policy_path
from otb_tir.defaults.policy import resolve_policy
from otb_tir.trainer.config import load_config


def test_below_the_entry_points_an_empty_model_path_is_an_error_naming_the_resolver():
    with pytest.raises(ConfigError, match="model.path is not set.*resolve_policy"):
        policy_path(load_config(None, []))


def test_a_given_model_path_is_kept(tiny_model_dir):
    cfg = load_config(None, [f"model.path={tiny_model_dir}"])
    assert resolve_policy(cfg) == tiny_model_dir.resolve()
    assert cfg.model.path == str(tiny_model_dir)


def test_an_empty_model_path_becomes_the_tasks_warm_start_and_the_config_names_it():
    from otb_tir.defaults.warm_start import task_warm_start

    cfg = load_config(None, ["data.task=arith"])
    path = resolve_policy(cfg)
    assert path == task_warm_start("arith").resolve() and (path / "config.json").is_file()
    assert cfg.model.path == str(path)  # what config.yaml and summary.json then name


def test_the_shipped_chat_template_the_builders_name_is_the_tiny_policys():
    from otb_tir.defaults.tiny import CHAT_TEMPLATE_PATH

    assert SHIPPED_CHAT_TEMPLATE == CHAT_TEMPLATE_PATH.resolve() and SHIPPED_CHAT_TEMPLATE.is_file()
