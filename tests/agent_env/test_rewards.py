"""Rewards by name (agent_env.rewards): verl's compute_score contract, per data source, bounded.

The user's functions live in a file outside the project (tests/data/plugins/quiz_task.py, copied
to a temporary folder and named by path); the episode runs for real (a scripted engine, the real
chat template of the tiny tokenizer).
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_env import AgentEnv, EnvError, EpisodeConfig
from agent_env.math_task.reward import RewardConfig
from agent_env.rewards import REWARDS, RewardScorer, exact_match, f1, reward_error_counts
from agent_env.rollout import run_sync
from tests.agent_env.test_episode import ScriptedEngine

PLUGINS = Path(__file__).resolve().parents[1] / "data" / "plugins"


@pytest.fixture
def quiz(tmp_path, monkeypatch):
    """The user's task file in a folder of its own, and its call log."""
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(PLUGINS / "quiz_task.py", code / "quiz_task.py")
    log = tmp_path / "quiz.jsonl"
    monkeypatch.setenv("QUIZ_LOG", str(log))
    return code / "quiz_task.py", log


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


class _Traj:
    """The fields RewardScorer.score reads from a trajectory."""

    def __init__(self, data_source=None, ground_truth="Lima", extra_info=None):
        self.data_source = data_source
        self.ground_truth = ground_truth
        self.extra_info = extra_info or {}
        self.turns = []
        self.num_turns = 1
        self.num_tool_calls = 0


def _score(scorer: RewardScorer, text: str, **traj) -> object:
    return asyncio.run(scorer.score(text, _Traj(**traj)))


def test_builtins_and_paths_resolve_and_say_where_from(quiz):
    path, _ = quiz
    assert {"math", "exact_match", "f1"} <= set(REWARDS.names())
    assert REWARDS.source("math").startswith("built-in (agent_env.rewards:")
    fn = REWARDS.resolve(f"{path}:compute_score")
    assert fn.__name__ == "compute_score" and REWARDS.resolve(f"{path}:compute_score") is fn  # imported once
    assert REWARDS.source(f"{path}:compute_score") == f"file {path}"
    with pytest.raises(EnvError, match=r"unknown reward 'nope'; available rewards: exact_match, f1, math"):
        REWARDS.resolve("nope")
    with pytest.raises(EnvError, match=f"file not found: {path.parent / 'missing.py'}"):
        REWARDS.resolve(f"{path.parent / 'missing.py'}:compute_score")
    with pytest.raises(EnvError, match="has no attribute 'score_it'"):
        REWARDS.resolve(f"{path}:score_it")


def test_a_reward_file_that_fails_to_import_stops_the_scorer_naming_file_and_error(tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("import json\nraise RuntimeError('no checker configured')\n")
    cfg = RewardConfig(custom_reward_function={"path": str(bad), "name": "compute_score"})
    with pytest.raises(EnvError, match=rf"importing {bad} failed: RuntimeError: no checker configured"):
        RewardScorer(cfg)


def test_verls_custom_reward_function_scores_with_extra_info_and_the_tasks_extraction(quiz):
    path, log = quiz
    cfg = RewardConfig(custom_reward_function={"path": str(path), "name": "compute_score"})
    scorer = RewardScorer(cfg, extract=lambda text: text.rpartition("Answer:")[2].strip() or None)
    res = _score(scorer, "I looked it up.\nAnswer: Lima", data_source="quiz/capitals", extra_info={"country": "Peru"})
    assert res.reward == 1.0 and res.correct and res.details["acc"] == 1.0
    res = _score(scorer, "Answer: Quito", data_source="quiz/capitals", extra_info={"country": "Peru"})
    assert res.reward == 0.0 and not res.correct
    calls = _records(log)
    assert [c["answer"] for c in calls] == ["Lima", "Quito"]
    assert all(
        c["country"] == "Peru" and c["num_tool_calls"] == 0 and c["data_source"] == "quiz/capitals" for c in calls
    )
    assert scorer.resolved["default"] == {"reward": f"{path}:compute_score", "source": f"file {path}"}


def test_per_data_source_wins_and_the_rest_get_the_default(quiz):
    path, log = quiz
    cfg = RewardConfig(name="exact_match", per_data_source={"quiz/capitals": f"{path}:compute_score"})
    scorer = RewardScorer(cfg)
    assert _score(scorer, "\\boxed{Lima}", data_source="other").details["reward_fn"] == "exact_match"
    assert _score(scorer, "\\boxed{Lima}", data_source="other").reward == 1.0
    assert _score(scorer, "\\boxed{Lima}", data_source="quiz/capitals").details["reward_fn"].endswith("compute_score")
    assert len(_records(log)) == 1
    # and the math default for rows without a data source, with its own settings
    math_scorer = RewardScorer(RewardConfig(correct_reward=2.0))
    assert _score(math_scorer, "\\boxed{4}", ground_truth="4").reward == 2.0


@pytest.mark.parametrize(
    "name, kind, message",
    [
        ("boom", "exception", "raised ValueError: the checker crashed"),
        ("nan", "nan", "returned nan"),
        ("text", "not_a_number", "returned str 'correct!', not a number"),
    ],
)
def test_a_reward_that_raises_or_returns_garbage_gives_a_per_sample_error(quiz, name, kind, message):
    path, _ = quiz
    scorer = RewardScorer(RewardConfig(name=f"{path}:{name}", incorrect_reward=-0.5))
    res = _score(scorer, "Answer: Lima")
    assert res.reward == -0.5 and not res.correct
    assert res.details["reward_error"] == kind and message in res.details["reward_error_message"]


def test_a_hanging_reward_times_out_and_after_a_few_it_is_not_called_again(quiz, monkeypatch):
    import agent_env.rewards as rewards

    path, log = quiz
    monkeypatch.setattr(rewards, "MAX_ABANDONED", 2)
    scorer = RewardScorer(RewardConfig(name=f"{path}:hang", timeout_seconds=1))

    async def three():
        t0 = time.perf_counter()
        out = await asyncio.gather(*(scorer.score("Answer: Lima", _Traj()) for _ in range(2)))
        mid = time.perf_counter() - t0
        out.append(await scorer.score("Answer: Lima", _Traj()))
        return out, mid

    (a, b, c), elapsed = asyncio.run(three())
    assert elapsed < 30  # two concurrent hangs: abandoned after their bound, not after the hour
    assert [r.details["reward_error"] for r in (a, b, c)] == ["timeout", "timeout", "stuck"]
    assert len([r for r in _records(log) if r["event"] == "hang"]) == 2  # the third was never started
    assert reward_error_counts([_Traj_with(r) for r in (a, b, c)]) == {
        "reward/errors/timeout": 2.0,
        "reward/errors/exception": 0.0,
        "reward/errors/nan": 0.0,
        "reward/errors/not_a_number": 0.0,
        "reward/errors/stuck": 1.0,
    }


def _Traj_with(result):
    t = _Traj()
    t.reward_details = result.details
    return t


def test_an_async_reward_is_awaited_with_the_same_bound(tmp_path):
    f = tmp_path / "async_reward.py"
    f.write_text(
        "import asyncio\n"
        "async def quick(ds, s, gt, extra_info=None):\n    return {'score': 0.25, 'lookups': 3}\n"
        "async def slow(ds, s, gt, extra_info=None):\n    await asyncio.sleep(60)\n"
    )
    res = _score(RewardScorer(RewardConfig(name=f"{f}:quick")), "x")
    assert res.reward == 0.25 and res.details["lookups"] == 3.0 and not res.correct
    res = _score(RewardScorer(RewardConfig(name=f"{f}:slow", timeout_seconds=1)), "x")
    assert res.details["reward_error"] == "timeout"


def test_the_episode_scores_with_the_tasks_reward_and_its_answer_extraction(quiz, tiny_tokenizer):
    """A whole episode: the task (by path) gives the reward, the answer extraction and the tool."""
    path, log = quiz
    from agent_env.tasks import get_task
    from tools import build_tool_set

    task = get_task(f"{path}:task")
    item = task.make_split("train", 1, 0)[0]
    tools = build_tool_set(list(task.tools))
    cfg = EpisodeConfig(task=f"{path}:task", response_length=512, max_tokens_per_turn=128, max_tool_response_length=64)
    env = AgentEnv(tiny_tokenizer, tools, cfg)
    country, city = item["extra_info"]["country"], item["reward_model"]["ground_truth"]
    call = '<tool_call>\n{"name": "lookup", "arguments": {"query": "%s"}}\n</tool_call>' % country
    eng = ScriptedEngine(tiny_tokenizer, [call, f"Answer: {city}"])
    traj = run_sync(
        env.run(
            eng,
            item["prompt"],
            ground_truth=city,
            data_source=item["data_source"],
            extra_info=item["extra_info"],
        )
    )
    assert traj.finish_reason == "answer" and traj.reward == 1.0 and traj.reward_details["correct"]
    events = _records(log)
    assert [e["event"] for e in events] == ["tool", "reward"]
    assert events[0]["args"] == {"query": country}
    assert events[1]["answer"] == city and events[1]["num_tool_calls"] == 1 and events[1]["country"] == country
    run_sync(tools.close())


def test_a_users_extractor_that_raises_counts_as_no_answer(quiz, tiny_tokenizer, tmp_path):
    f = tmp_path / "bad_task.py"
    f.write_text(
        "from agent_env.tasks import Task\n"
        "def extract(text):\n    raise KeyError('oops')\n"
        "task = Task(name='bad', data_source='bad', make_split=lambda s, n, seed: [], reward='exact_match',"
        " extract_answer=extract)\n"
    )
    env = AgentEnv(tiny_tokenizer, {}, EpisodeConfig(task=f"{f}:task"))
    traj = run_sync(env.run(ScriptedEngine(tiny_tokenizer, ["Answer: 4"]), "q", ground_truth="4"))
    assert traj.finish_reason == "void_turn" and traj.reward == 0.0


words = st.lists(st.sampled_from(["Lima", "the", "new", "York", "a", "City", "of", "x1"]), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(words, words)
def test_exact_match_and_f1_against_a_brute_force_oracle(pred, gold):
    """exact_match and f1 on the extracted answer equal SQuAD's definitions computed by hand."""
    p, g = " ".join(pred), " ".join(gold)
    norm = lambda ws: [w.lower() for w in ws if w.lower() not in ("a", "an", "the")]  # noqa: E731
    pn, gn = norm(pred), norm(gold)
    em = exact_match(None, f"\\boxed{{{p}}}", g)
    assert em["score"] == float(bool(pn) and pn == gn)
    common = sum(min(pn.count(w), gn.count(w)) for w in set(pn))
    expected = (
        0.0 if not common else 2 * (common / len(pn)) * (common / len(gn)) / (common / len(pn) + common / len(gn))
    )
    assert math.isclose(f1(None, f"\\boxed{{{p}}}", g)["score"], expected)
    assert f1(None, f"\\boxed{{{p}}}", [g, p])["score"] == (1.0 if pn else 0.0)  # the best of several golds


def test_the_built_in_math_reward_does_not_stop_the_event_loop_while_it_compares():
    """The math-verify comparison runs on the scorer's own thread: other coroutines (the local
    trainer's engine, the other episodes) run while an episode awaits it. Before, the call blocked
    the loop until the helper process answered (0.2 s for some model-written junk)."""
    scorer = RewardScorer(RewardConfig())

    async def main():
        ticks, done = 0, False

        async def ticker():
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        res = await scorer.score_row(None, "so \\boxed{\\frac{2}{4}}", "\\sqrt{1/4}")
        during = ticks - before
        done = True
        await task
        return res, during

    res, during = asyncio.run(main())
    assert res.reward == 1.0 and res.details["comparison"] == "math_verify"
    assert during > 0  # the loop ran the ticker while the comparison was in flight


def test_an_episode_starts_the_math_helper_before_any_answer_needs_it(tiny_tokenizer):
    """The helper process (~0.6 s to import math-verify) starts when an episode starts, on the
    scorer's thread, even when no answer of the episode needs it (a plain number is compared
    without it): the first answer that does need it, perhaps steps later, does not wait for it."""
    import tools
    from agent_env.math_task import verify
    from agent_env.rewards import math_thread

    def drop_helper():
        child = getattr(verify._LOCAL, "child", None)
        if child is not None:
            child.kill()

    def helper():
        child = getattr(verify._LOCAL, "child", None)
        return None if child is None or child.proc is None or child.proc.poll() is not None else child.proc.pid

    math_thread().submit(drop_helper).result()
    assert math_thread().submit(helper).result() is None
    calc = tools.get_tool("calculator")
    env = AgentEnv(tiny_tokenizer, {"calculator": calc}, EpisodeConfig(response_length=64, max_tokens_per_turn=32))
    traj = run_sync(env.run(ScriptedEngine(tiny_tokenizer, ["\\boxed{12}"]), "What is 3*4?", ground_truth="12"))
    assert traj.reward_details["comparison"] == "fraction"  # no math-verify needed
    pid = math_thread().submit(helper).result()
    assert pid is not None  # yet the helper runs
    res = run_sync(RewardScorer(RewardConfig()).score_row(None, "\\boxed{\\frac{2}{4}}", "\\sqrt{1/4}"))
    assert res.details["comparison"] == "math_verify" and math_thread().submit(helper).result() == pid
    run_sync(calc.close())
