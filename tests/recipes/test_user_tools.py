"""A user's own tools, walked the way a user walks it: plugin code that lives outside the project,
reached (a) as a module on PYTHONPATH named in a verl-style tools YAML, (b) as an installed
distribution that registers an ``otb_tir.tools`` entry point, (c) as a stateful (verl-style)
tool, used by training (``otb-tir-train`` / ``python -m otb_tir.train`` as a subprocess run from a
temporary folder, one process and ``torchrun`` with 2 ranks), by the evaluation (``otb-tir-eval``)
and by the verl agent loop under verl's real ``AgentLoopWorker``.

The policy is the tiny model SFT'd to call ``lookup`` on every assistant turn
(``tests/support/tool_caller.py``, built once and cached). Every assertion is on an observable
effect: the plugin's own log of the calls it received (process, class, session id), the run's
``metrics.jsonl`` / ``summary.json``, the eval report.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tests.support.optional import need
from tests.support.user_runs import TRAIN, read_log

PLUGIN = Path(__file__).resolve().parents[1] / "data" / "plugins" / "lookup_plugin.py"
BIN = Path(sys.executable).parent

EVAL = [
    "data.size=2",
    "rollout.n=2",
    "eval.pass_k=[1,2]",
    "eval.without_tools=false",
    "rollout.response_length=192",
    "rollout.max_tokens_per_turn=48",
    "multi_turn.max_assistant_turns=3",
    "output.progress=false",
]

pytestmark = pytest.mark.slow


@pytest.fixture
def user(tmp_path):
    """A user's folder outside the project: their plugin module, their YAMLs, their runs."""
    home = tmp_path / "user"
    (home / "code").mkdir(parents=True)
    shutil.copy(PLUGIN, home / "code" / "lookup_plugin.py")
    return home


def _env(*paths: Path) -> dict[str, str]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[:3]} failed:\n{proc.stderr[-4000:]}"
    return proc


def _yaml(home: Path, log: Path, stateful: bool = False) -> Path:
    if stateful:
        body = f"""
            tools:
              - class_name: lookup_plugin.SessionLookup
                config: {{log_path: {log}}}
                tool_schema:
                  type: function
                  function:
                    name: lookup
                    description: Look up a query and return a short note.
                    parameters:
                      type: object
                      properties: {{query: {{type: string, description: what to look up}}}}
                      required: [query]
        """
    else:
        body = f"""
            tools:
              - class_name: lookup_plugin.Lookup
                config: {{log_path: {log}}}
        """
    path = home / ("session_tools.yaml" if stateful else "my_tools.yaml")
    path.write_text(textwrap.dedent(body))
    return path


def _train_metrics(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    return rows[0]


def _check_same_success_rate(train_row: dict, summary: dict, report: dict) -> None:
    """Finding 2 of the issue: one definition. The policy calls `lookup` on all 3 turns; the third
    call is on the last allowed turn and never runs: not executed, not failed."""
    ev = report["with_tools"]["overall"]
    assert train_row["tools/success_rate"] == 1.0 and ev["tools/success_rate"] == 1.0
    assert summary["after"]["tool_success_rate"] == 1.0
    assert train_row["tools/not_executed"] == train_row["tools/calls"] / 3 > 0
    assert ev["tools/not_executed"] == ev["tools/calls"] / 3 > 0
    assert train_row["tools/failed"] == 0 and ev["errors/total"] == 0


def test_yaml_plugin_on_pythonpath_reaches_training_and_eval(policy, user):
    """Finding 1 of the issue: a tool plugged in through multi_turn.tool_config_path was replaced
    by the built-in tools in training (0 calls to the plugin)."""
    log = user / "calls.jsonl"
    tools_yaml = _yaml(user, log)
    env = _env(user / "code")
    out = user / "run"
    _run(
        [
            sys.executable,
            "-m",
            "otb_tir.train",
            "--model",
            str(policy),
            *TRAIN,
            f"trainer.output_dir={out}",
            f"multi_turn.tool_config_path={tools_yaml}",
        ],
        user,
        env,
    )
    calls = [r for r in read_log(log) if r["event"] == "call"]
    row = _train_metrics(out)
    summary = json.loads((out / "summary.json").read_text())
    # training rollouts (2 prompts × 2) and the after-eval (2 prompts) all called the plugin, 2 runs each
    assert len(calls) == row["tools/ok"] + 2 * 2 and row["tools/ok"] == 4 * 2
    assert {c["cls"] for c in calls} == {"Lookup"} and all(c["args"] == {"query": "otb"} for c in calls)
    assert os.getpid() not in {c["pid"] for c in calls}
    (used,) = summary["tools"]
    assert used["name"] == "lookup" and used["cls"] == "lookup_plugin.Lookup"
    assert str(tools_yaml) in used["source"] and used["config"] == {"log_path": str(log)}

    before = len(calls)
    rep_dir = user / "eval"
    _run(
        [
            sys.executable,
            "-m",
            "otb_tir.eval",
            "--model",
            str(policy),
            *EVAL,
            f"output.dir={rep_dir}",
            f"multi_turn.tool_config_path={tools_yaml}",
        ],
        user,
        env,
    )
    report = json.loads((rep_dir / "eval.json").read_text())
    calls = [r for r in read_log(log) if r["event"] == "call"]
    assert len(calls) - before == report["with_tools"]["overall"]["tools/ok"] == 2 * 2 * 2
    assert report["meta"]["tool_set"] == summary["tools"]
    _check_same_success_rate(row, summary, report)


def _install_entry_point_dist(user: Path) -> Path:
    """Build and install the user's tool package (it registers `lookup` in the otb_tir.tools group)."""
    src = user / "otb_lookup_dist"
    src.mkdir()
    shutil.copy(PLUGIN, src / "otb_lookup_plugin.py")
    (src / "pyproject.toml").write_text(
        textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "otb-lookup-plugin"
        version = "0.0.1"

        [tool.setuptools]
        py-modules = ["otb_lookup_plugin"]

        [project.entry-points."otb_tir.tools"]
        lookup = "otb_lookup_plugin:Lookup"
    """)
    )
    site = user / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    shutil.rmtree(src)  # only the installed copy remains
    assert any(p.name.startswith("otb_lookup_plugin") and p.suffix == ".dist-info" for p in site.iterdir())
    return site


def test_entry_point_plugin_reaches_training_and_eval_through_the_console_scripts(policy, user):
    site = _install_entry_point_dist(user)
    log = user / "ep_calls.jsonl"
    env = _env(site)
    tool_args = ["multi_turn.tools=[lookup]", f"multi_turn.tool_config.lookup.log_path={log}"]
    out = user / "run"
    _run(
        [str(BIN / "otb-tir-train"), "--model", str(policy), *TRAIN, f"trainer.output_dir={out}", *tool_args], user, env
    )
    row = _train_metrics(out)
    summary = json.loads((out / "summary.json").read_text())
    calls = [r for r in read_log(log) if r["event"] == "call"]
    assert len(calls) == row["tools/ok"] + 2 * 2 and row["tools/ok"] == 8
    (used,) = summary["tools"]
    assert used["cls"] == "otb_lookup_plugin.Lookup"
    assert used["source"].startswith("entry point otb_tir.tools:lookup") and "otb-lookup-plugin" in used["source"]

    rep_dir = user / "eval"
    _run([str(BIN / "otb-tir-eval"), "--model", str(policy), *EVAL, f"output.dir={rep_dir}", *tool_args], user, env)
    report = json.loads((rep_dir / "eval.json").read_text())
    assert len(read_log(log)) - len(calls) == report["with_tools"]["overall"]["tools/ok"] == 8
    _check_same_success_rate(row, summary, report)


def _sessions(log: Path) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = defaultdict(list)
    for r in read_log(log):
        by[r["session_id"]].append(r)
    return by


def _check_one_session_per_trajectory(by: dict[str, list[dict]], n_trajectories: int) -> None:
    assert len(by) == n_trajectories
    for sid, events in by.items():
        kinds = [e["event"] for e in events]
        # created on its first call, 2 calls (the 3rd turn's call is never run), released once at the end
        assert kinds == ["create", "call", "call", "release"], (sid, kinds)
        assert [e["n"] for e in events if e["event"] == "call"] == [1, 2]  # state never shared
        assert len({e["pid"] for e in events}) == 1


def test_stateful_plugin_gets_one_session_per_trajectory_in_training_torchrun_and_eval(policy, user):
    log = user / "sessions.jsonl"
    tools_yaml = _yaml(user, log, stateful=True)
    env = _env(user / "code")
    _run(
        [
            sys.executable,
            "-m",
            "otb_tir.train",
            "--model",
            str(policy),
            *TRAIN,
            f"trainer.output_dir={user / 'a'}",
            f"multi_turn.tool_config_path={tools_yaml}",
        ],
        user,
        env,
    )
    _check_one_session_per_trajectory(_sessions(log), 2 * 2 + 2)  # training rollouts + after-eval
    assert _train_metrics(user / "a")["tools/success_rate"] == 1.0

    log.unlink()
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "otb_tir.train",
            "--model",
            str(policy),
            *TRAIN,
            f"trainer.output_dir={user / 'b'}",
            f"multi_turn.tool_config_path={tools_yaml}",
        ],
        user,
        env,
    )
    by = _sessions(log)
    _check_one_session_per_trajectory(by, 2 * 2 + 2)
    pids = Counter(events[0]["pid"] for events in by.values())
    assert len(pids) == 2  # both ranks ran episodes with the plugin, each in its own process
    assert _train_metrics(user / "b")["tools/success_rate"] == 1.0

    log.unlink()
    _run(
        [
            sys.executable,
            "-m",
            "otb_tir.eval",
            "--model",
            str(policy),
            *EVAL,
            f"output.dir={user / 'eval'}",
            f"multi_turn.tool_config_path={tools_yaml}",
        ],
        user,
        env,
    )
    _check_one_session_per_trajectory(_sessions(log), 2 * 2)


def test_bad_tool_config_stops_at_start_with_the_reason(policy, user):
    env = _env(user / "code")
    bad = user / "bad.yaml"
    bad.write_text("tools:\n  - class_name: lookup_plugn.Lookup\n")
    for cmd, what in [
        (["-m", "otb_tir.train", f"trainer.output_dir={user / 'r'}"], "train"),
        (["-m", "otb_tir.eval", f"output.dir={user / 'e'}"], "eval"),
    ]:
        for extra, match in [
            ([f"multi_turn.tool_config_path={bad}"], "cannot import module 'lookup_plugn'"),
            (["multi_turn.tools=[]"], "yields no tools"),
            (["multi_turn.tools=[lookup]"], "unknown tool 'lookup'"),
            (
                ["multi_turn.tool_config.python.timeout=1", "multi_turn.tools=[calculator]"],
                "settings for \\['python'\\]",
            ),
        ]:
            proc = subprocess.run(
                [sys.executable, *cmd, "--model", str(policy), *extra],
                cwd=user,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert proc.returncode == 2, (what, extra, proc.stderr[-2000:])
            import re

            assert re.search(match, proc.stderr), (what, extra, proc.stderr[-2000:])
    assert not (user / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize("route", ["stateful_yaml", "entry_point"])
def test_user_plugins_under_verls_agent_loop_worker(policy, user, monkeypatch, tmp_path, route):
    """verl's real AgentLoopWorker builds our agent loop from the composed config; the agent loop
    assembles the same tool set (the user's stateful YAML tool, or the installed entry-point tool)
    and runs the tool-caller policy."""
    need("verl")

    import numpy as np

    from otb_tir.trainer.config import load_config
    from otb_tir.verl.compose import compose_verl_config, validate_verl_config
    from tests.support.verl_agent_loop import HFServerManager, run_agent_loop

    log = user / "verl_calls.jsonl"
    if route == "stateful_yaml":
        monkeypatch.syspath_prepend(str(user / "code"))
        tool_args = [f"multi_turn.tool_config_path={_yaml(user, log, stateful=True)}"]
    else:
        monkeypatch.syspath_prepend(str(_install_entry_point_dist(user)))
        tool_args = ["multi_turn.tools=[lookup]", f"multi_turn.tool_config.lookup.log_path={log}"]
    cfg = load_config(
        None,
        [
            f"model.path={policy}",
            "trainer=verl",
            "rollout.name=vllm",
            f"trainer.output_dir={tmp_path / 'verl'}",
            "data.train_size=6",
            "data.val_size=2",
            "rollout.n=2",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            "rollout.response_length=192",
            "rollout.max_tokens_per_turn=48",
            "multi_turn.max_assistant_turns=3",
            "trainer.n_gpus_per_node=1",
            *tool_args,
        ],
    )
    vcfg = compose_verl_config(cfg)
    validate_verl_config(vcfg)

    from transformers import AutoTokenizer

    manager = HFServerManager(policy, AutoTokenizer.from_pretrained(policy), questions={})
    manager.scripted = lambda request_id: False  # the policy itself, sampled by the HF engine

    out = run_agent_loop(vcfg, manager)
    if route == "stateful_yaml":
        _check_one_session_per_trajectory(_sessions(log), 4)
    else:  # the installed plugin's own record: 2 executed calls in each of the 4 trajectories
        by = _sessions(log)
        assert len(by) == 4 and all([e["event"] for e in ev] == ["call", "call"] for ev in by.values())
        assert {e["cls"] for ev in by.values() for e in ev} == {"Lookup"}
    info = out.non_tensor_batch
    ok, failed = np.asarray(info["tool_ok"], float), np.asarray(info["tool_failed"], float)
    assert ok.sum() == 8 and failed.sum() == 0 and np.asarray(info["tool_not_executed"], float).sum() == 4
