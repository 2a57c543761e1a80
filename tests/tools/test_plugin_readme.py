"""The README's "Adding a tool" section does what it says: its Python block, saved as the user's
``my_tools.py``, its YAML block and its ``pyproject.toml`` entry point build a working tool through
the same assembly training and eval use; its commands use keys the configs have. The blocks are
read from README.md, so documentation and test cannot drift apart. (The routes run end to end,
training and eval as subprocesses, in tests/recipes/test_user_tools.py.)"""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from tools import build_tool_set

ROOT = Path(__file__).resolve().parents[2]
HEADING = re.compile(r"^#+\s*Adding a tool\s*$", re.MULTILINE)


def adding_a_tool_section() -> str:
    text = (ROOT / "README.md").read_text()
    match = HEADING.search(text)
    if not match:
        pytest.fail("no 'Adding a tool' section in README.md")
    rest = text[match.end() :]
    following = re.search(r"^#{1,3}\s", rest, re.MULTILINE)
    return rest[: following.start()] if following else rest


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", adding_a_tool_section(), re.DOTALL)


def test_section_is_short_with_one_example_per_route():
    section = adding_a_tool_section()
    assert len(blocks("python")) == 1 and len(blocks("yaml")) == 1 and len(blocks("toml")) == 1
    assert len(blocks("bash")) == 2
    lines = [line for line in section.strip().splitlines() if line.strip() and not line.startswith("```")]
    assert len(lines) <= 40, f"the section has {len(lines)} lines of code+text"


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(blocks("python")[0])
    (tmp_path / "my_tools.yaml").write_text(blocks("yaml")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("my_tools", None)


def test_yaml_route_builds_the_documented_tool(user_module):
    ts = build_tool_set(["calculator"], None, "my_tools.yaml")
    try:
        assert sorted(ts) == ["calculator", "word_count"]
        assert {r["name"]: r["cls"] for r in ts.describe()}["word_count"] == "my_tools.WordCount"
        res = asyncio.run(ts["word_count"].invoke({"text": "to be or not to be"}))
        assert (res.ok, res.text) == (True, "6")
        bad = asyncio.run(ts["word_count"].invoke({"txt": "oops"}))
        assert bad.error == "bad_arguments" and "missing required argument 'text'" in bad.text
    finally:
        asyncio.run(ts.close())


def test_entry_point_route_names_the_documented_class(user_module):
    import importlib

    table = tomllib.loads(blocks("toml")[0])["project"]["entry-points"]["otb_tir.tools"]
    ((name, target),) = table.items()
    module, attr = target.split(":")
    cls = getattr(importlib.import_module(module), attr)
    assert cls.name == name == "word_count"


def test_documented_commands_use_real_keys():
    from otb_tir.evaluation import load_eval_config
    from otb_tir.trainer.config import load_config

    for block in blocks("bash"):
        for line in block.strip().splitlines():
            words = shlex.split(line.split("#", 1)[0])
            words = [w for w in words if not w.startswith("PYTHONPATH=")]
            prog, args = words[0], words[1:]
            overrides = [a for a in args if "=" in a and not a.startswith("-")]
            overrides = [
                o for o in overrides if not o.startswith("multi_turn.tool_config_path=")
            ]  # file checked at run
            if prog == "otb-tir-train":
                load_config(None, overrides)
            else:
                assert prog == "otb-tir-eval"
                load_eval_config(overrides=overrides)


def extending_section() -> str:
    text = (ROOT / "README.md").read_text()
    rest = text.split("\n## Extending\n", 1)[1]
    return rest.split("\n### Adding a tool", 1)[0]


def test_extending_examples_load_with_the_users_files(tmp_path, monkeypatch):
    """Every command and inline override of the README's Extending section (before its tool part)
    loads, with the section's Python block saved as my_task.py and the user files it names (copies
    of the plugins tests/recipes/test_user_plugins.py runs end to end)."""
    section = extending_section()
    plugins = ROOT / "tests" / "data" / "plugins"
    (tmp_path / "my_task.py").write_text(re.findall(r"```python\n(.*?)```", section, re.DOTALL)[0])
    (tmp_path / "my_reward.py").write_text((plugins / "quiz_task.py").read_text())
    (tmp_path / "my_est.py").write_text((plugins / "loo_estimator.py").read_text())
    parser_src = (plugins / "logging_parser.py").read_text()
    (tmp_path / "my_parser.py").write_text(parser_src + "\n\nMyParser = LoggingHermes\n")
    monkeypatch.chdir(tmp_path)
    from otb_tir.builders import task_split
    from otb_tir.evaluation import load_eval_config
    from otb_tir.trainer.config import load_config

    commands = [
        line for block in re.findall(r"```bash\n(.*?)```", section, re.DOTALL) for line in block.strip().splitlines()
    ]
    inline = re.findall(r"`((?:algorithm|multi_turn|reward|data)\.[\w.]+=[^` ]+)`", section)
    assert len(commands) == 4 and {o.split("=")[0] for o in inline} >= {"algorithm.adv_estimator", "multi_turn.format"}
    for line in commands:
        words = shlex.split(line.split("#", 1)[0])
        overrides = [w for w in words[1:] if "=" in w]
        cfg = load_config(None, overrides)
        if any(o.startswith("data.task=") for o in overrides):
            assert task_split(cfg, "train", 2, 0)[0]["reward_model"]["ground_truth"] == "Lima"
            load_eval_config(overrides=overrides)
    for override in inline:
        load_config(None, [override])
    assert "compute_score(data_source, solution_str, ground_truth, extra_info)" in section
    assert "--list" in section
