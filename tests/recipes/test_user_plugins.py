"""A user's own task, reward, estimator and tool-call parser, walked the way a user walks it: plugin
files that live outside the project (tests/data/plugins/, copied to a temporary folder), named by
path on the command line of the console scripts run as subprocesses from that folder, and through
verl's real agent-loop worker, reward-function loader and advantage computation.

- ``quiz_task.py``: lookup questions ("capital of Peru?") with the task's own tool (``lookup``),
  its own exact-match reward ``compute_score`` (verl's contract) and its own answer extraction;
- ``loo_estimator.py``: a leave-one-out advantage estimator;
- ``logging_parser.py``: a Hermes-style parser of the user's own.

Each logs its calls to a file named by an environment variable; every assertion is on such a
record, on the run's ``metrics.jsonl`` / ``summary.json`` or on the eval report. The policy is the
tiny model SFT'd to call ``lookup`` on every turn (tests/support/tool_caller.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.support.optional import need
from tests.support.user_runs import TRAIN, read_log

PLUGINS = Path(__file__).resolve().parents[1] / "data" / "plugins"
BIN = Path(sys.executable).parent
TASK = "code/quiz_task.py:task"
EST = "code/loo_estimator.py:leave_one_out"
FMT = "code/logging_parser.py:LoggingHermes"

pytestmark = pytest.mark.slow


@pytest.fixture
def user(tmp_path):
    """A user's folder outside the project: their plugin files under code/, their logs and runs."""
    home = tmp_path / "user"
    (home / "code").mkdir(parents=True)
    for name in ("quiz_task.py", "loo_estimator.py", "logging_parser.py"):
        shutil.copy(PLUGINS / name, home / "code" / name)
    return home


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # the plugins are reached by their paths only
    env.update(
        QUIZ_LOG=str(home / "quiz.jsonl"), EST_LOG=str(home / "est.jsonl"), PARSER_LOG=str(home / "parser.jsonl")
    )
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == rc, f"{cmd[:3]} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


def test_outside_task_reward_estimator_and_parser_in_training_and_eval(policy, user):
    env = _env(user)
    code = user / "code"
    _run(
        [
            str(BIN / "otb-tir-train"),
            "--model",
            str(policy),
            f"data.task={TASK}",
            f"algorithm.adv_estimator={EST}",
            f"multi_turn.format={FMT}",
            "trainer.output_dir=runs/train",
            *TRAIN,
        ],
        user,
        env,
    )
    out = user / "runs" / "train"
    summary = json.loads((out / "summary.json").read_text())
    plugins = summary["plugins"]
    assert plugins["task"] == {"name": TASK, "source": f"file {code / 'quiz_task.py'}"}
    assert plugins["estimator"] == {"name": EST, "source": f"file {code / 'loo_estimator.py'}"}
    assert plugins["format"] == {"name": FMT, "source": f"file {code / 'logging_parser.py'}"}
    assert plugins["reward"]["default"] == {
        "reward": f"{code / 'quiz_task.py'}:compute_score",
        "source": f"file {code / 'quiz_task.py'}",
    }
    assert plugins["tools"] == {"lookup": f"file {code / 'quiz_task.py'}"}  # the task's own tool
    # what the held-out figures measured: the task's held-out split, greedy, one sample each
    assert summary["held_out"]["source"] == f"data.task={TASK}: its generator's held-out split (seed 0)"
    assert summary["held_out"]["decoding"] == "greedy" and summary["held_out"]["samples_per_problem"] == 1
    assert summary["held_out"]["problems"] >= 1
    # the plugins' own records: 4 training episodes + 2 held-out ones, each scored once by the
    # user's reward, on the task's questions; the estimator called once on the step's 4 rows
    events = read_log(user / "quiz.jsonl")
    rewards = [e for e in events if e["event"] == "reward"]
    assert len(rewards) == 6 and {e["data_source"] for e in rewards} == {"quiz/capitals"}
    from tests.data.plugins.quiz_task import CAPITALS

    assert all(CAPITALS[e["country"]] == e["ground_truth"] for e in rewards)
    assert all(e["num_tool_calls"] == 3 for e in rewards)  # the policy calls lookup on every turn
    assert [e["args"] for e in events if e["event"] == "tool"] == [{"query": "otb"}] * 12  # 2 executed per episode
    est = read_log(user / "est.jsonl")
    assert len(est) == 1 and est[0]["shape"] == [4, 192]
    assert {"sum_pi_squared", "old_log_probs"} <= set(est[0]["keys"])  # local training hands Σπ² to any estimator
    parses = read_log(user / "parser.jsonl")
    assert len(parses) == 18 and all(p["calls"] == 1 for p in parses)  # 6 episodes × 3 turns, one call each
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward/mean"] == 0.0 and row["reward/errors/exception"] == 0.0 and row["tools/ok"] == 8.0

    # the eval: the same task, reward and parser, in the report
    before = len(rewards)
    _run(
        [
            str(BIN / "otb-tir-eval"),
            "--model",
            str(policy),
            f"data.task={TASK}",
            f"multi_turn.format={FMT}",
            "data.size=2",
            "rollout.n=2",
            "eval.pass_k=[1,2]",
            "eval.without_tools=false",
            "rollout.response_length=192",
            "rollout.max_tokens_per_turn=48",
            "multi_turn.max_assistant_turns=3",
            "output.progress=false",
            "output.dir=runs/eval",
        ],
        user,
        env,
    )
    report = json.loads((user / "runs" / "eval" / "eval.json").read_text())
    assert report["meta"]["plugins"]["task"]["source"] == f"file {code / 'quiz_task.py'}"
    assert report["meta"]["plugins"]["format"]["source"] == f"file {code / 'logging_parser.py'}"
    assert report["meta"]["plugins"]["reward"]["default"]["source"] == f"file {code / 'quiz_task.py'}"
    new = [e for e in read_log(user / "quiz.jsonl") if e["event"] == "reward"][before:]
    assert len(new) == 4 and {e["data_source"] for e in new} == {"quiz/capitals"}
    assert {e["country"] for e in new} <= {c for c in CAPITALS}
    assert report["with_tools"]["overall"]["reward/errors/timeout"] == 0.0


def test_the_same_plugins_under_torchrun_with_two_ranks(policy, user):
    """`torchrun` runs one process per rank: each resolves the task, reward, parser and estimator
    by the same paths and scores its own episodes with the user's reward."""
    env = _env(user)
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
            f"data.task={TASK}",
            f"algorithm.adv_estimator={EST}",
            f"multi_turn.format={FMT}",
            "trainer.output_dir=runs/ddp",
            *TRAIN,
        ],
        user,
        env,
    )
    rewards = [e for e in read_log(user / "quiz.jsonl") if e["event"] == "reward"]
    assert len(rewards) == 6 and len({e["pid"] for e in rewards}) == 2  # both ranks scored with the user's reward
    assert len({p["pid"] for p in read_log(user / "parser.jsonl")}) == 2
    est = read_log(user / "est.jsonl")
    assert est and sum(e["shape"][0] for e in est) >= 4  # the step's 4 rows went through the user's estimator
    summary = json.loads((user / "runs" / "ddp" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["plugins"]["estimator"]["name"] == EST


def test_a_hanging_reward_is_counted_per_sample_and_the_run_goes_on(policy, user):
    """The quiz rows' reward hangs (per data source); every sample gets reward 0 with the error
    counted in metrics.jsonl, and the run finishes."""
    env = _env(user)
    _run(
        [
            sys.executable,
            "-m",
            "otb_tir.train",
            "--model",
            str(policy),
            f"data.task={TASK}",
            "reward.per_data_source={quiz/capitals: code/quiz_task.py:hang}",
            "reward.timeout_seconds=1",
            "trainer.output_dir=runs/hang",
            *TRAIN,
        ],
        user,
        env,
    )
    row = json.loads((user / "runs" / "hang" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward/errors/timeout"] == 4.0 and row["reward/mean"] == 0.0
    summary = json.loads((user / "runs" / "hang" / "summary.json").read_text())
    assert summary["after"]["n"] == 2  # the held-out pass ran after the hung training rewards
    assert summary["plugins"]["reward"]["data_source quiz/capitals"]["reward"] == "code/quiz_task.py:hang"
    assert Counter(e["event"] for e in read_log(user / "quiz.jsonl"))["hang"] == 6


def test_plugins_that_do_not_load_stop_the_run_at_start_naming_the_file_and_error(policy, user):
    env = _env(user)
    code = user / "code"
    (code / "broken_reward.py").write_text("import json\nraise RuntimeError('checker not configured')\n")
    cases = [
        (
            ["reward.custom_reward_function.path=code/broken_reward.py"],
            rf"importing {code / 'broken_reward.py'} failed: RuntimeError: checker not configured",
        ),
        ([f"algorithm.adv_estimator={EST}x"], r"has no attribute 'leave_one_outx'"),
        (["data.task=code/missing.py:task"], rf"data.task: task 'code/missing.py:task': file not found: {code}"),
        (["multi_turn.format=acme_parsers:Fancy"], r"cannot import module 'acme_parsers'"),
        (["reward.name=nope"], r"unknown reward 'nope'; available rewards: exact_match, f1, math"),
    ]
    for script in ("otb-tir-train", "otb-tir-eval"):
        for extra, match in cases:
            if script == "otb-tir-eval" and extra[0].startswith("algorithm."):
                continue  # the eval has no estimator
            out = "runs/bad"
            dest = [f"trainer.output_dir={out}"] if script == "otb-tir-train" else [f"output.dir={out}"]
            proc = _run([str(BIN / script), "--model", str(policy), *extra, *dest], user, env, rc=2)
            import re

            assert re.search(match, proc.stderr), (script, extra, proc.stderr[-2000:])
    assert not (user / "runs" / "bad").exists()  # nothing ran, nothing was written


def test_list_shows_every_extension_point_with_where_it_comes_from(user, tmp_path):
    site = tmp_path / "site"
    dist = site / "acme-1.0.dist-info"
    dist.mkdir(parents=True)
    (site / "acme.py").write_text("def score(*a):\n    return 1.0\n")
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[otb_tir.rewards]\nacme_score = acme:score\n")
    env = dict(_env(user), PYTHONPATH=str(site))
    text = _run([str(BIN / "otb-tir-eval"), "--list"], user, env).stdout
    for title in ("tools", "rewards", "advantage estimators", "tool-call formats", "tasks"):
        assert f"\n{title} (entry-point group" in "\n" + text
    import re

    assert re.search(
        r"\n  acme_score +entry point otb_tir.rewards:acme_score = acme:score \(distribution acme\)\n", text
    )
    for name in ("python", "calculator", "math", "exact_match", "tir_optimal_token_baseline", "hermes", "arith"):
        assert f"  {name} " in text
    # `--list | head`: the reader closing the pipe early is no error
    piped = subprocess.run(
        f"'{BIN / 'otb-tir-train'}' --list | head -2", shell=True, cwd=user, env=env, capture_output=True, text=True
    )
    assert piped.stdout.startswith("tools (entry-point group") and "Traceback" not in piped.stderr, piped.stderr


def test_the_task_reward_and_estimator_through_verls_real_workers(policy, user, monkeypatch, tmp_path):
    """verl's AgentLoopWorker runs our agent loop on the user's task (its parquet written by the
    launcher): the user's reward scores each trajectory there. verl's reward-function loader
    (what its reward workers call) gets the same function through our reward_fn, and verl's own
    compute_advantage calls the user's estimator registered in verl's registry by the plugin."""
    need("verl")
    import asyncio

    import numpy as np
    import torch

    from otb_tir.trainer.config import load_config
    from otb_tir.verl.compose import compose_verl_config, validate_verl_config
    from tests.support.verl_agent_loop import HFServerManager, run_agent_loop

    for key, value in _env(user).items():
        if key in ("QUIZ_LOG", "EST_LOG", "PARSER_LOG"):
            monkeypatch.setenv(key, value)
    monkeypatch.chdir(user)  # relative plugin paths, as the user typed them
    cfg = load_config(
        None,
        [
            f"model.path={policy}",
            "trainer=verl",
            "rollout.name=vllm",
            f"trainer.output_dir={tmp_path / 'verl'}",
            f"data.task={TASK}",
            f"algorithm.adv_estimator={EST}",
            f"multi_turn.format={FMT}",
            "data.train_size=6",
            "data.val_size=2",
            "rollout.n=2",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            "rollout.response_length=192",
            "rollout.max_tokens_per_turn=48",
            "multi_turn.max_assistant_turns=3",
            "trainer.n_gpus_per_node=1",
        ],
    )
    vcfg = compose_verl_config(cfg)
    validate_verl_config(vcfg)
    runtime_env = vcfg.ray_kwargs.ray_init.runtime_env.env_vars
    assert vcfg.algorithm.adv_estimator == "otb_user_leave_one_out"
    for key in ("OTB_TIR_REWARD", "OTB_TIR_USER_ESTIMATOR"):  # what every Ray worker gets
        monkeypatch.setenv(key, runtime_env[key])

    from transformers import AutoTokenizer

    manager = HFServerManager(policy, AutoTokenizer.from_pretrained(policy), questions={})
    manager.scripted = lambda request_id: False

    out = run_agent_loop(vcfg, manager)
    rewards = [e for e in read_log(user / "quiz.jsonl") if e["event"] == "reward"]
    assert len(rewards) == 4 and {e["pid"] for e in rewards} == {os.getpid()}
    assert {e["data_source"] for e in rewards} == {"quiz/capitals"} and all(e["num_tool_calls"] == 3 for e in rewards)
    assert len(read_log(user / "parser.jsonl")) == 4 * 3  # the user's parser read every turn
    assert np.asarray(out.non_tensor_batch["reward_error_timeout"], float).sum() == 0

    # verl's reward workers: verl loads our reward_fn from the composed config; it scores with the user's function
    from verl.trainer.ppo.reward import get_custom_reward_fn

    fn = get_custom_reward_fn(vcfg)
    scored = asyncio.run(fn("quiz/capitals", "Answer: Lima", "Lima", {"country": "Peru"}))
    assert scored["score"] == 1.0 and scored["acc"] == 1.0 and scored["reward_error_exception"] == 0.0
    last = [e for e in read_log(user / "quiz.jsonl") if e["event"] == "reward"][-1]
    assert (last["answer"], last["country"]) == ("Lima", "Peru")  # the task's extraction, then the user's function

    # verl's compute_advantage, after the plugin registered the user's estimator in verl's registry
    from verl import DataProto
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from otb_tir.verl import plugin

    plugin.install()
    try:
        rows = 4
        scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
        mask = torch.ones(rows, 5)
        rewards_t = torch.zeros(rows, 5)
        rewards_t[:, -1] = scores
        data = DataProto.from_dict(
            tensors={"token_level_rewards": rewards_t, "response_mask": mask},
            non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)},
        )
        data = compute_advantage(data, vcfg.algorithm.adv_estimator, config=vcfg.algorithm)
        expected = torch.tensor([1.0, -1.0, 0.0, 0.0]).unsqueeze(-1) * mask  # leave-one-out by hand
        assert torch.equal(data.batch["advantages"], expected)
        est = read_log(user / "est.jsonl")
        assert len(est) == 1 and est[0]["shape"] == [4, 5] and est[0]["pid"] == os.getpid()
    finally:
        core_algos.ADV_ESTIMATOR_REGISTRY.pop("otb_user_leave_one_out", None)
        plugin.uninstall()
