"""Config: defaults, YAML + overrides, and a clear ConfigError for every kind of bad key."""

import pytest

from otb_tir import ConfigError
from otb_tir.advantage import ESTIMATORS
from otb_tir.trainer.config import load_config


def test_defaults_and_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("rollout:\n  n: 4\nactor:\n  optim:\n    lr: 0.001\n")
    cfg = load_config(y, ["rollout.n=2", "data.train_files=[a.parquet,b.parquet]", "trainer=verl"])
    assert cfg.rollout.n == 2 and cfg.actor.optim.lr == 0.001
    assert list(cfg.data.train_files) == ["a.parquet", "b.parquet"]
    assert cfg.trainer.name == "verl"
    assert cfg.algorithm.adv_estimator == "tir_optimal_token_baseline"


@pytest.mark.parametrize(
    "override, fragment",
    [
        (["rollout.nn=3"], "did you mean 'rollout.n'"),
        (["actor.optim.lrr=1"], "valid keys under 'actor.optim': lr"),
        (["foo=1"], "valid keys at the top level: model, data"),
        # verl's spelling of a key that lives in a section here: the error names where it is
        (["custom_reward_function.path=r.py"], "did you mean 'reward.custom_reward_function'?"),
        (["rollout.n=abc"], "bad value for 'rollout.n'"),
        (["algorithm.adv_estimator=gae"], "unknown advantage estimator 'gae'; available advantage estimators: grpo"),
        (["data.task=quiz"], "data.task: unknown task 'quiz'; available tasks: arith, chain"),
        (["multi_turn.format=xml"], "multi_turn.format: unknown tool-call format 'xml'"),
        (["reward.name=nope.py:score"], "reward (default): reward 'nope.py:score': file not found"),
        (["rollout"], "key=value"),
        (["rollout.n=0"], "'rollout.n' must be > 0"),
        (["data.train_batch_size=6", "actor.ppo_mini_batch_size=4"], "multiple of"),
    ],
)
def test_bad_config_fails_with_name_and_choices(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("rollout.n=0", "'rollout.n' must be > 0"),
        ("rollout.response_length=0", "'rollout.response_length' must be a positive integer"),
        ("rollout.top_p=1.5", "'rollout.top_p' must be in (0, 1]"),
        ("rollout.top_k=0", "'rollout.top_k' must be -1 (disabled) or >= 1"),
        ("rollout.temperature=-1", "'rollout.temperature' must be >= 0"),
        ("multi_turn.max_parallel_calls=0", "'multi_turn.max_parallel_calls' must be a positive integer"),
        ("multi_turn.tool_timeout=0", "'multi_turn.tool_timeout' must be positive"),
    ],
)
def test_training_and_eval_share_one_check_per_key(override, fragment):
    """The keys training and eval share are checked once (EpisodeConfig's validator, through
    otb_tir.builders.check_sections): the same value fails the same way in both loaders, and an
    EpisodeConfig built directly refuses it too."""
    from agent_env import EnvError, EpisodeConfig
    from otb_tir.evaluation import load_eval_config
    from otb_tir.evaluation.config import DEFAULT_CONFIG

    messages = []
    for load in (lambda o: load_config(None, o), lambda o: load_eval_config(DEFAULT_CONFIG, o)):
        with pytest.raises(ConfigError) as e:
            load([override])
        messages.append(str(e.value))
    assert all(fragment in m for m in messages), messages
    assert messages[0] == messages[1]
    key, value = override.split("=")
    if key != "rollout.n":
        with pytest.raises(EnvError, match=key.replace(".", r"\.")):
            EpisodeConfig(**{key.split(".")[1]: yaml_value(value)})


def test_eval_takes_the_training_choices_of_the_keys_they_share():
    """EVAL_CHOICES is built from the training's CHOICES (the same tuples, not copies that can drift);
    eval narrows rollout.name (no trainer to pick an engine for) and widens nothing but its own keys."""
    from otb_tir.evaluation import load_eval_config
    from otb_tir.evaluation.config import DEFAULT_CONFIG, EVAL_CHOICES
    from otb_tir.trainer.config import CHOICES

    shared = set(EVAL_CHOICES) & set(CHOICES)
    assert shared == {
        "model.dtype",
        "rollout.name",
        "rollout.dtype",
        "rollout.decode_step",
        "multi_turn.tool_response_truncate_side",
    }
    assert all(EVAL_CHOICES[k] is CHOICES[k] for k in shared - {"rollout.name"})
    assert EVAL_CHOICES["rollout.name"] == tuple(c for c in CHOICES["rollout.name"] if c != "auto")
    assert EVAL_CHOICES["rollout.device"] is CHOICES["trainer.device"]
    for load in (lambda o: load_config(None, o), lambda o: load_eval_config(DEFAULT_CONFIG, o)):
        with pytest.raises(ConfigError, match="'rollout.decode_step' must be one of auto, model, fused, compiled"):
            load(["rollout.decode_step=fast"])


def yaml_value(text):
    import yaml

    return yaml.safe_load(text)


def test_episode_config_is_frozen():
    import dataclasses

    from agent_env import EpisodeConfig

    cfg = EpisodeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.top_p = 0.5  # type: ignore[misc]
    assert dataclasses.replace(cfg, top_p=0.5).top_p == 0.5
    with pytest.raises(Exception, match="top_p"):
        dataclasses.replace(cfg, top_p=0)


def test_missing_file_and_bad_yaml_key(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    y = tmp_path / "bad.yaml"
    y.write_text("actor:\n  clip_ratio: 0.2\n")
    with pytest.raises(ConfigError, match="unknown config key 'actor.clip_ratio'"):
        load_config(y)


def test_shipped_configs_are_valid():

    from otb_tir.configs import CONFIG_DIR

    paths = sorted(CONFIG_DIR.glob("*.yaml"))
    # tir_math_qwen3_8b_gpu is also checked key by key against verl's config: tests/otb_tir/verl/test_seed_gpu_config.py
    assert {p.stem for p in paths} == {"tir_math_cpu", "eval_tool_use", "tir_math_qwen3_8b_gpu", "tir_math_smollm2"}
    for path in paths:
        if path.name.startswith("eval_"):  # evaluation configs have their own schema
            from otb_tir.evaluation import load_eval_config

            load_eval_config(path)
            continue
        cfg = load_config(path)  # raises ConfigError on any unknown / ill-typed key
        assert cfg.algorithm.adv_estimator in ESTIMATORS.builtins


@pytest.mark.slow
def test_configuration_reference_is_current_and_lists_every_key():
    """docs/configuration.md is generated from the schemas; the page a user reads is never stale."""
    import subprocess
    import sys
    from dataclasses import fields, is_dataclass
    from pathlib import Path

    from otb_tir.evaluation.config import EvalConfig
    from otb_tir.trainer.config import Config

    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, str(root / "scripts/gen_config_reference.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    page = (root / "docs/configuration.md").read_text()

    def keys(obj, prefix=""):
        for f in fields(obj):
            value = getattr(obj, f.name)
            yield from keys(value, f"{prefix}{f.name}.") if is_dataclass(value) else [f"{prefix}{f.name}"]

    for schema in (Config, EvalConfig):
        for key in keys(schema()):
            assert f"| `{key}` |" in page, key


def test_a_default_that_depends_on_another_key_follows_it_unless_the_user_set_it(tmp_path):
    """`data.train_batch_size=2` alone is valid: the default mini-batch (8) follows the batch; a
    mini-batch the user gave is kept and checked (above). The shipped config's values are defaults
    too; a user's own YAML file counts as given."""
    assert load_config(None, ["data.train_batch_size=2"]).actor.ppo_mini_batch_size == 2
    assert load_config(None, ["data.train_batch_size=6"]).actor.ppo_mini_batch_size == 6
    assert load_config(None, ["data.train_batch_size=12"]).actor.ppo_mini_batch_size == 6  # largest divisor <= 8
    from otb_tir.configs import resolve_config

    assert load_config(resolve_config("tir_math_cpu"), ["data.train_batch_size=3"]).actor.ppo_mini_batch_size == 3
    mine = tmp_path / "mine.yaml"
    mine.write_text("actor:\n  ppo_mini_batch_size: 4\n")
    with pytest.raises(ConfigError, match="multiple of"):
        load_config(mine, ["data.train_batch_size=6"])


def test_the_evals_default_pass_k_follows_rollout_n():
    from otb_tir.evaluation import load_eval_config

    assert list(load_eval_config(overrides=["rollout.n=1"]).eval.pass_k) == [1]
    assert list(load_eval_config(overrides=["rollout.n=3"]).eval.pass_k) == [1, 2]
    assert list(load_eval_config(overrides=[]).eval.pass_k) == [1, 2, 4]
    with pytest.raises(ConfigError, match=r"every k must be in 1..rollout.n \(1\)"):
        load_eval_config(overrides=["rollout.n=1", "eval.pass_k=[1,2]"])


def test_a_tasks_settings_are_defaults_a_user_value_wins():
    """data.task=multistep brings its turns and token budget (agent_env.tasks.Task.settings) to
    training and eval alike; a value the user gives wins; other tasks keep the shipped values."""
    from otb_tir.evaluation import load_eval_config
    from otb_tir.evaluation.config import DEFAULT_CONFIG

    for load in (lambda o: load_config(None, o), lambda o: load_eval_config(DEFAULT_CONFIG, o)):
        plain = load([])
        cfg = load(["data.task=multistep"])
        assert (cfg.multi_turn.max_assistant_turns, cfg.rollout.response_length) == (6, 320)
        assert (plain.multi_turn.max_assistant_turns, plain.rollout.response_length) != (6, 320)
        cfg = load(["data.task=multistep", "rollout.response_length=200"])
        assert (cfg.multi_turn.max_assistant_turns, cfg.rollout.response_length) == (6, 200)


def test_a_task_setting_that_is_not_a_config_key_is_refused(tmp_path):
    (tmp_path / "odd_task.py").write_text(
        "from agent_env.tasks import Task\n"
        "task = Task(name='odd', data_source='odd', make_split=lambda s, n, seed: [],\n"
        "            settings={'rollout.response_lenght': 10})\n"
    )
    with pytest.raises(ConfigError, match="its setting 'rollout.response_lenght' is not a config key"):
        load_config(None, [f"data.task={tmp_path / 'odd_task.py'}:task"])
