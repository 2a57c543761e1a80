"""benchmarks/bench_scale.py: the shapes have the parameters their names say, each shape's tokenizer has
its config's vocabulary and renders tool calls, the reward both trainers read is deterministic and
differs per sample, both trainers render the same prompt and TRL is set up for the budget's length, the
table and growth figures from a hand-made results.json, and a --quick run of ours as a user runs it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.optional import need

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_scale.py"

import bench_scale as bs  # noqa: E402 - benchmarks/ is on pytest's pythonpath (pyproject.toml)
import scale_reward  # noqa: E402

CALL = [
    {"role": "user", "content": "What is 585 times 93?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "585*93"}}}],
    },
    {"role": "tool", "content": "54405"},
]


def test_the_scale_shapes_have_the_parameters_their_names_say():
    """Every parameter counted once (tied embeddings), on the meta device: the counts the names, the
    docstrings and bench_scale's table give."""
    from transformers import AutoModelForCausalLM

    from otb_tir.defaults.shapes import shape_config

    sizes = {}
    for name in bs.SHAPE_NAMES:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(shape_config(name))
        sizes[name] = (round(sum(p.numel() for p in model.parameters()) / 1e6, 1), model.config.vocab_size)
    assert sizes == {"tiny": (1.3, 2125), "30m": (29.9, 49152), "150m": (151.0, 49152), "qwen3-0.6b": (596.0, 151936)}


@pytest.mark.slow
def test_a_shapes_tokenizer_has_its_vocabulary_and_renders_tool_calls(tiny_tokenizer):
    from otb_tir import ConfigError
    from otb_tir.defaults.shapes import SHAPES, shape_tokenizer

    vocab = SHAPES["30m"]["vocab_size"]
    tok = shape_tokenizer(vocab)
    assert len(tok) == vocab and len(tok.get_vocab()) == vocab
    # the special and markup tokens keep their ids, text encodes as with the tiny policy's tokenizer
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 2, 0)
    assert tok.get_added_vocab() == tiny_tokenizer.get_added_vocab()
    text = tok.apply_chat_template(CALL, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "585*93"}}\n</tool_call>' in text
    assert "<tool_response>\n54405\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.encode(text) == tiny_tokenizer.encode(text)
    # every id up to the vocabulary's end is a token a model can sample and the tokenizer decodes
    assert tok.decode([len(tiny_tokenizer), vocab - 1]) == f"<filler_{len(tiny_tokenizer)}><filler_{vocab - 1}>"
    with pytest.raises(ConfigError, match="below the tiny tokenizer"):
        shape_tokenizer(100)


@pytest.mark.slow
def test_a_config_json_becomes_a_model_folder_of_its_shape(tmp_path):
    """``--shape config.json``: any architecture, random weights (seed 0), a tokenizer of its vocabulary,
    the tokenizer's end-of-turn and padding ids; saved again only when the shape changes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from otb_tir import ConfigError
    from otb_tir.defaults.shapes import save_shape

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=3000, tie_word_embeddings=True, eos_token_id=7)  # fmt: skip
    cfg.save_pretrained(tmp_path / "llama-mini")
    config_json = tmp_path / "llama-mini" / "config.json"
    assert bs.shape_label(str(config_json)) == "llama-mini" and bs.shape_label("30m") == "30m"
    folder = save_shape(str(config_json), tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert model.config.model_type == "llama" and len(tok) == 3000 == model.config.vocab_size
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id) == (2, 0)
    marker = json.loads((folder / "otb_tir_shape.json").read_text())
    assert marker["parameters"] == sum(p.numel() for p in model.parameters())
    before = (folder / "model.safetensors").stat().st_mtime_ns
    save_shape(str(config_json), folder)
    assert (folder / "model.safetensors").stat().st_mtime_ns == before  # kept: same shape and seed
    with pytest.raises(ConfigError, match="unknown shape"):
        save_shape("no-such-shape", tmp_path / "x")


def test_the_random_reward_is_deterministic_and_differs_per_sample(monkeypatch):
    monkeypatch.delenv(scale_reward.SEED_ENV, raising=False)
    texts = [f"sample {i}" for i in range(200)]
    values = [scale_reward.random_reward("arith", t, "42") for t in texts]
    assert values == [scale_reward.random_reward("arith", t, "42", {"num_turns": 1}) for t in texts]
    assert len(set(values)) == len(values) and all(0.0 <= v < 1.0 for v in values)
    assert 0.4 < sum(values) / len(values) < 0.6  # uniform: mean 1/2 (sd of the mean 0.02)
    assert scale_reward.random_reward("arith", "sample 0", "43") != values[0]  # another prompt's answer
    monkeypatch.setenv(scale_reward.SEED_ENV, "1")
    assert scale_reward.random_reward("arith", "sample 0", "42") != values[0]


def test_both_trainers_render_the_same_one_tool_prompt(tiny_tokenizer):
    """Ours lists ``calculator`` from its tool set; TRL gets bench_peers' function for it: the prompt
    TRL renders (``apply_chat_template(tools=[fn])``) is token for token our episode's."""
    import bench_peers as bp

    from agent_env.template import ChatTemplate
    from tools import build_tool_set

    tool_set = build_tool_set(["calculator"])
    fns = bp.make_trl_tools(tiny_tokenizer, tool_set, 48, 5.0, {}, names=("calculator",))
    assert [f.__name__ for f in fns] == ["calculator"]
    ours = ChatTemplate(tiny_tokenizer, [tool_set["calculator"].schema()]).prompt_ids(CALL[:1])
    theirs = tiny_tokenizer.apply_chat_template(CALL[:1], tools=fns, add_generation_prompt=True, tokenize=False)
    assert tiny_tokenizer.encode(theirs) == ours and '"name": "calculator"' in theirs


def test_trl_is_set_for_the_budgets_length_and_one_turn(tmp_path):
    need("trl", reason="TRL is not installed: pip install -e '.[peers]'")
    import bench_peers as bp

    b = bs.BATCH
    s = bs.settings(b, 3, 60.0)
    spec = bs.trl_spec(b, s)
    args = bp.grpo_args(s, 0, tmp_path, **spec["grpo_args"])
    assert args.generation_kwargs["min_new_tokens"] == args.max_completion_length == b.response_length == 128
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == b.samples == 16
    assert args.max_tool_calling_iterations == 0 and args.num_iterations == 1 and args.num_generations == b.n
    assert spec["reward"].endswith("scale_reward.py:random_reward") and spec["tools"] == ["calculator"]
    overrides = bs.ours_overrides(b)
    assert "actor.ppo_micro_batch_size=8" in overrides and f"reward.name={bs.REWARD}" in overrides
    assert (s.max_assistant_turns, s.max_tokens_per_turn) == (1, 128)


def test_ours_ends_no_turn_on_a_token(monkeypatch, tiny_tokenizer):
    """The worker's episode config, from the run's own config, has no stop token, so every turn runs to
    its budget (the engine already ignores eos in the local trainer)."""
    from agent_env.episode_config import EpisodeConfig
    from agent_env.template import ChatTemplate
    from otb_tir.builders import episode_config
    from otb_tir.configs import CONFIG_DIR
    from otb_tir.trainer.config import load_config

    monkeypatch.setattr(EpisodeConfig, "from_sections", EpisodeConfig.from_sections)  # restored after the test
    cfg = load_config(CONFIG_DIR / "tir_math_cpu.yaml", ["model.path=unused", *bs.ours_overrides(bs.BATCH)])
    assert episode_config(cfg).stop_token_ids is None  # the tokenizer's eos ends a turn
    bs.no_stop_tokens()
    ep = episode_config(cfg)
    assert ep.stop_token_ids == [] and ChatTemplate(tiny_tokenizer, stop_token_ids=ep.stop_token_ids).stop_ids == []
    assert episode_config(cfg, temperature=0.0).temperature == 0.0  # other overrides still apply


def _run(shape, trainer, params, step_s, rss_mb, generation, update, old=0.0):
    figures = {"step_s": step_s, "samples_per_s": 16 / step_s, "sampled_tokens_per_s": 2048 / step_s,
               "peak_rss_mb": rss_mb}  # fmt: skip
    return {
        "shape": shape,
        "trainer": trainer,
        "parameters": params,
        "vocab_size": 49152,
        "batch": bs.BATCH.label(),
        "figures": figures,
        "phases": {"generation": generation, "old_log_prob": old, "update": update, "other": 0.0},
        "equal_work": "",
        "run": {},
    }


def test_the_table_ratios_and_growth_from_a_results_json(tmp_path):
    runs = {
        "30m/ours": _run("30m", "ours", 30e6, 2.0, 1024.0, 1.0, 0.5, 0.5),
        "30m/trl": _run("30m", "trl", 30e6, 4.0, 2048.0, 3.0, 1.0),
        "150m/ours": _run("150m", "ours", 150e6, 10.0, 3072.0, 5.0, 3.0, 2.0),
        "150m/trl": _run("150m", "trl", 150e6, 25.0, 4096.0, 15.0, 10.0),
        "150m/trl_bf16": _run("150m", "trl_bf16", 150e6, 20.0, 4096.0, 12.0, 8.0),
    }
    runs["150m/trl"]["equal_work"] = "step 2: 2000 policy tokens (want 2048)"
    results = {"runs": runs}
    table = bs.render_table(results).splitlines()
    assert table[0].startswith("| shape | params | vocab | batch | trainer |")
    trainers = [line.split(" | ")[4] for line in table[2:]]
    assert trainers[:3] == ["ours", "trl", "ours"] and sorted(trainers[3:]) == ["trl ⚠ unequal work", "trl_bf16"]
    # step s, samples/s, tokens/s, generation, old log-probs, update, GiB, ours/TRL samples/s and peak RSS,
    # ours/TRL-bf16 samples/s (– where TRL-bf16 was not run)
    assert table[2].startswith("| 30m | 30.0M | 49,152 | 4×4, R=128, micro 8 | ours |")
    assert table[2].endswith("| ours | 2.00 | 8.00 | 1024 | 1.00 | 0.50 | 0.50 | 1.00 | 2.00× | 0.50× | – |")
    assert table[3].endswith("| trl | 4.00 | 4.00 | 512 | 3.00 | 0.00 | 1.00 | 2.00 | – | – | – |")
    assert table[4].endswith("| 2.50× | 0.75× | 2.00× |")
    assert all(line.endswith("| 4.00 | – | – | – |") for line in table[5:])
    lines = bs.growth(results)
    # ours: 5×, 4× and 6× the seconds at 5× the parameters; TRL: 5× and 10× (it computes no old log-probs)
    assert lines[0] == "ours: seconds ∝ params^slope — generation 1.00, old_log_prob 0.86, update 1.11; fastest: update"
    trl = dict(kv.split(" ") for kv in lines[1].split("— ")[1].split(";")[0].split(", "))
    assert math.isclose(float(trl["update"]), math.log(10) / math.log(5), abs_tol=0.01) and "old_log_prob" not in trl
    assert lines[1].endswith("fastest: update")


def test_unequal_work_is_named():
    b = bs.QUICK  # 4 samples × 16 tokens
    ok = {"steps": [{"policy_tokens": 64.0, "log/completions/min_length": 16.0, "log/completions/max_length": 16.0}]}
    assert bs.equal_work(ok, b) == ""
    short = {"steps": [{"policy_tokens": 64.0}, {"policy_tokens": 60.0}]}
    assert bs.equal_work(short, b) == "step 2: 60.0 policy tokens (want 64), completion min/max [None, None]"
    early = {"steps": [{"policy_tokens": 64.0, "log/completions/min_length": 12.0, "log/frac_reward_zero_std": 0.5}]}
    assert "completion min/max [12.0, None]" in bs.equal_work(early, b)
    assert "a share 0.5 of groups had equal rewards" in bs.equal_work(early, b)


@pytest.mark.slow
def test_quick_run_of_ours_from_another_folder_and_its_resume(tmp_path):
    """As a user runs it: the tiny shape's folder is built, ours trains 2 steps of exactly the budget's
    tokens, the table and the figure come out; run again, the pair in results.json is not rerun."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--trainers", "ours", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())["runs"]["tiny/ours"]
    assert res["equal_work"] == "" and len(res["run"]["steps"]) == 2
    assert all(x["policy_tokens"] == 4 * 16 for x in res["run"]["steps"])
    assert res["figures"]["samples_per_s"] > 0 and res["figures"]["peak_rss_mb"] > 50
    assert res["phases"]["generation"] > 0 and res["phases"]["update"] > 0
    assert (out / "scale.png").stat().st_size > 10_000 and not (out / "runs" / "tiny" / "ours" / "final").exists()
    assert "| tiny | 1.3M | 2,125 | 2×2, R=16, micro 4 | ours |" in proc.stdout
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "# tiny/ours: in results.json already" in again.stdout
