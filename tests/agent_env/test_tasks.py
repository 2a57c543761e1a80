"""Tasks by name (agent_env.tasks) and the one plugin mechanism behind every extension point
(tools.plugins.Registry): built-ins, registered objects, entry points of an installed
distribution, and paths (pkg.mod:attr, file.py:attr)."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from agent_env import EnvError
from agent_env.math_task.data import make_split
from agent_env.parsers import FORMATS, HermesParser, get_parser
from agent_env.rewards import REWARDS
from agent_env.tasks import TASKS, Task, get_task
from otb_tir import ConfigError
from otb_tir.advantage import ESTIMATORS, get_estimator
from tools.plugins import Registry
from tools.registry import TOOLS


def test_the_builtin_tasks_are_registered_like_any_other_and_give_the_generators_items():
    assert {"arith", "chain"} <= set(TASKS.names())
    for name in ("arith", "chain"):
        task = get_task(name)
        assert TASKS.source(name) == f"built-in (agent_env.tasks:{name.upper()})"
        assert task.make_split("test", 5, 0) == make_split("test", 5, seed=0, task=name)
        assert task.reward == "math" and task.warm_start == name
    with pytest.raises(EnvError, match=r"unknown task 'quiz'; available tasks: arith, chain"):
        get_task("quiz")


def test_a_task_from_a_file_or_a_factory(tmp_path):
    f = tmp_path / "my_tasks.py"
    f.write_text(
        textwrap.dedent("""
        from agent_env.tasks import Task

        def items(split, n, seed):
            return [{"prompt": "q", "reward_model": {"ground_truth": "a"}, "data_source": "mine"}] * n

        task = Task(name="mine", data_source="mine", make_split=items, reward="exact_match")

        def make():
            return task

        def not_a_task():
            return 42
        """)
    )
    assert get_task(f"{f}:task") is get_task(f"{f}:make")
    assert get_task(f"{f}:task").make_split("train", 2, 0)[0]["data_source"] == "mine"
    with pytest.raises(EnvError, match="its factory returned int, not an agent_env.tasks.Task"):
        get_task(f"{f}:not_a_task")


@pytest.fixture
def installed_plugins(tmp_path, monkeypatch):
    """An installed distribution (a .dist-info on sys.path) registering one plugin in each group."""
    site = tmp_path / "site"
    (site / "acme_plugins").mkdir(parents=True)
    (site / "acme_plugins" / "__init__.py").write_text(
        textwrap.dedent("""
        from agent_env.parsers import HermesParser
        from agent_env.tasks import get_task

        def score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0

        def zero(token_level_rewards, response_mask, index, **kwargs):
            return token_level_rewards * 0, token_level_rewards * 0

        class Acme(HermesParser):
            name = "acme"

        arith_again = get_task("arith")
        """)
    )
    dist = site / "acme_plugins-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-plugins\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent("""
        [otb_tir.rewards]
        acme_score = acme_plugins:score
        [otb_tir.estimators]
        acme_zero = acme_plugins:zero
        [otb_tir.parsers]
        acme = acme_plugins:Acme
        [otb_tir.tasks]
        acme_arith = acme_plugins:arith_again
        [otb_tir.rewards]
        acme_broken = acme_plugins:missing
        """)
    )
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    yield
    sys.modules.pop("acme_plugins", None)


def test_entry_points_of_an_installed_distribution_reach_every_extension_point(installed_plugins):
    assert REWARDS.resolve("acme_score")(None, "", "") == 1.0
    assert "acme_zero" in ESTIMATORS.names() and get_estimator("acme_zero").__name__ == "zero"
    assert type(get_parser("acme")).__name__ == "Acme" and isinstance(get_parser("acme"), HermesParser)
    assert get_task("acme_arith").name == "arith"
    src = REWARDS.source("acme_score")
    assert src == "entry point otb_tir.rewards:acme_score = acme_plugins:score (distribution acme-plugins)"
    assert ("acme", FORMATS.source("acme")) in FORMATS.describe()
    with pytest.raises(EnvError, match=r"reward 'acme_broken' from entry point 'acme_plugins:missing'.*failed to load"):
        REWARDS.resolve("acme_broken")


def test_register_replace_and_errors_are_the_registrys_own():
    reg = Registry("gadget", "otb_tir.test_gadgets", {"std": "agent_env.parsers:HermesParser"}, error=ConfigError)
    assert reg.resolve("std") is HermesParser and reg.source("std").startswith("built-in")
    reg.register(dict, "box")
    assert reg.resolve("box") is dict and reg.source("box") == "registered"
    reg.register(dict, "box")  # the same object again: fine
    with pytest.raises(ConfigError, match="a gadget named 'box' is already registered"):
        reg.register(list, "box")
    reg.register(list, "box", replace=True)
    assert reg.resolve("box") is list
    reg.register("json:dumps", "lazy")  # an import path, imported on first use
    assert reg.resolve("lazy").__name__ == "dumps"
    with pytest.raises(ConfigError, match=r"unknown gadget 'zz'; available gadgets: box, lazy, std"):
        reg.resolve("zz")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_mod_xyz'"):
        reg.resolve("no_such_mod_xyz:f")
    reg.unregister("box")
    assert "box" not in reg.names()
    # the tool registry is one of these, with its own error type
    assert TOOLS.names()[:2] == ["calculator", "python"] or {"calculator", "python"} <= set(TOOLS.names())


def test_a_registered_task_object_serves_by_name():
    t = Task(name="tmp", data_source="tmp", make_split=lambda s, n, seed: [])
    TASKS.register(t, "tmp_task")
    try:
        assert get_task("tmp_task") is t and TASKS.source("tmp_task") == "registered"
    finally:
        TASKS.unregister("tmp_task")
