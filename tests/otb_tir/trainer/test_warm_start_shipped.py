"""The shipped warm start (otb_tir.defaults.ship): it is the current code's (its key matches), a
cache miss copies it instead of training, a rebuild on one machine is bit for bit the same, and the
key follows the code that builds it, not its prose."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from agent_env.cache import code_fingerprint
from otb_tir.defaults import reship, ship, warm_start


def test_the_shipped_warm_start_is_the_current_codes_and_loads():
    record = ship.shipped_record()
    assert record is not None, "nothing shipped: run python -m otb_tir.defaults.reship"
    assert ship.shipped_digest() == ship.portable_digest(reship.default_key()), (
        "the shipped warm start is stale: the code or settings that build it changed (key digest now "
        + ship.portable_digest(reship.default_key())
        + "); run python -m otb_tir.defaults.reship"
    )
    now = json.loads(json.dumps(reship.default_key()))
    assert {k: v for k, v in record["key"].items() if k != "libraries"} == {
        k: v for k, v in now.items() if k != "libraries"
    }
    assert record["built_on"] and record["date"] and record["speed_reference"]["matmul_gflops"] > 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ship.SHIPPED)
    model = AutoModelForCausalLM.from_pretrained(ship.SHIPPED)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False)
    assert "<|im_start|>" in text and model.config.vocab_size == len(tok)


def test_a_cache_miss_copies_the_shipped_files_without_training(tmp_path, monkeypatch):
    fail = lambda *a, **k: pytest.fail("trained although the shipped warm start matches")  # noqa: E731
    monkeypatch.setattr(warm_start, "sft_train", fail)
    monkeypatch.setattr(warm_start, "make_traces", fail)
    path = warm_start.task_warm_start("arith", tmp_path, steps=400, copy_steps=800, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # not even the tiny base was built
    for name in ship.FILES:
        assert (path / name).read_bytes() == (ship.SHIPPED / name).read_bytes(), name
    marker = json.loads((path / "otb_tir_warm_start.json").read_text())
    assert marker["source"] == "shipped" and marker["shipped"]["digest"] == ship.portable_digest(reship.default_key())

    # opting out trains here, into a folder of its own (the stub stops it before any work)
    monkeypatch.setattr(warm_start, "_train", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("training")))
    with pytest.raises(RuntimeError, match="training"):
        warm_start.task_warm_start("arith", tmp_path, steps=400, copy_steps=800, shipped=False, progress=False)
    assert [p.name for p in tmp_path.glob("warm-*")] == [path.name]  # the failed build published nothing


@pytest.mark.slow
def test_a_rebuild_on_one_machine_is_bit_for_bit_the_same(tmp_path):
    """Two builds in two cache roots (the tiny base built in each): the same folder name (the key
    holds no path) and the same bytes."""
    kw = dict(steps=3, copy_steps=2, n_traces=12, batch_size=4, warmup_steps=1, shipped=False, progress=False)
    a = warm_start.warm_start_policy(tmp_path / "a", **kw)
    b = warm_start.warm_start_policy(tmp_path / "b", **kw)
    assert a.name == b.name
    for name in ship.FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert json.loads((a / "otb_tir_warm_start.json").read_text())["source"] == "built here"


def test_the_key_follows_the_code_not_its_prose(tmp_path, monkeypatch):
    pkg = tmp_path / "fp_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    src = '''
        """Module prose."""
        RATE = 3  # a comment

        def f(x):
            """Function prose."""
            return x * RATE
    '''

    def fingerprint(text: str) -> str:
        (pkg / "mod.py").write_text(textwrap.dedent(text))
        return code_fingerprint(["fp_pkg.mod"])

    first = fingerprint(src)
    reworded = src.replace("Module prose.", "Other words.").replace("# a comment", "").replace("x * RATE", "x*RATE")
    assert fingerprint(reworded) == first
    assert fingerprint(src.replace("RATE = 3", "RATE = 4")) != first
    assert fingerprint(src.replace('"""Function prose."""', "y = 1")) != first
    sys.modules.pop("fp_pkg", None)
    with pytest.raises(ValueError, match="no Python source"):
        code_fingerprint(["fp_pkg.missing"])


def test_the_key_names_cached_bases_portably(tmp_path):
    """The built-in base by its folder name, not the cache root; a user's folder by its path."""
    settings = warm_start.WarmStartSettings()
    key = warm_start.warm_start_key(settings)
    assert key["base"].startswith("tiny-qwen3-") and "/" not in key["base"] and key["base_config"] is None
    assert key["libraries"]["torch"] and len(key["code"]) == 64
    user = tmp_path / "my-model"
    user.mkdir()
    (user / "config.json").write_text("{}")
    key = warm_start.warm_start_key(settings, user)
    assert key["base"] == str(user.resolve()) and key["base_config"] == "{}"


def test_the_fingerprint_is_thread_safe():
    """CPython 3.11's ast.parse is not: two threads fingerprinting at once raised SystemError in CI."""
    from concurrent.futures import ThreadPoolExecutor

    from agent_env import cache

    cache._FINGERPRINTS.clear()
    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(lambda _: code_fingerprint(warm_start.BUILD_MODULES), range(16)))
    assert len(set(out)) == 1 and out[0] == warm_start.warm_start_key(warm_start.WarmStartSettings())["code"]
