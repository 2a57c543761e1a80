"""SGLangEngine without an sglang start: the pure request/response translation, the CPU
environment's pieces (the sgl_kernel stand-in, the torchvision patch, the start-up check) and the
errors when sglang is absent.

The engine itself, run for real on sglang's CPU backend, is tested by
tests/agent_env/test_engine_contract.py (the suite VLLMEngine runs too). The recorded outputs below
have the shape sglang 0.5.23 returns there.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_env.engines import EngineError, GenerationOutput, SamplingParams
from agent_env.engines.sglang import SGLangEngine, build_sglang_request, parse_sglang_output

REPO = Path(__file__).resolve().parents[2]

# Recorded shape of one sglang offline-engine result (return_logprob=True, tokenizer initialised,
# no_stop_trim=True): a stop token (<|im_end|> = 151645) matched and kept.
RECORDED_STOP_TOKEN = {
    "text": "The answer is \\boxed{4}.<|im_end|>",
    "output_ids": [785, 4226, 374, 1124, 151645],
    "meta_info": {
        "id": "5b8f0c1e2a",
        "finish_reason": {"type": "stop", "matched": 151645},
        "prompt_tokens": 12,
        "completion_tokens": 5,
        "cached_tokens": 0,
        "e2e_latency": 0.05,
        "output_token_logprobs": [
            [-0.51, 785, None],
            [-1.25, 4226, None],
            [-0.03, 374, None],
            [-2.75, 1124, None],
            [-0.0004, 151645, None],
        ],
    },
}

RECORDED_STOP_STR = {
    "text": "x = 1\n</tool_call>",
    "meta_info": {
        "finish_reason": {"type": "stop", "matched": "</tool_call>"},
        "completion_tokens": 3,
        "output_token_logprobs": [(-0.7, 87, "x"), (-0.2, 284, " ="), (-0.9, 522, "</tool_call>")],
    },
}

RECORDED_LENGTH = {
    "text": "abc",
    "output_ids": [64, 65],
    "meta_info": {
        "finish_reason": {"type": "length", "length": 2},
        "output_token_logprobs": [[-3.0, 64, None], [-4.5, 65, None]],
    },
}

RECORDED_ABORT = {
    "text": "",
    "output_ids": [],
    "meta_info": {"finish_reason": {"type": "abort", "message": "Abort before prefill"}, "output_token_logprobs": []},
}


def test_construction_without_sglang_on_a_cpu_names_the_install_script() -> None:
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here: the missing-install path cannot be exercised")
    import torch

    if torch.cuda.is_available():
        with pytest.raises(EngineError, match=r"pip install -e '\.\[sglang\]' in the otb-tir checkout"):
            SGLangEngine("/nonexistent/model")
    else:
        with pytest.raises(EngineError, match=r"sglang is not installed.*bash scripts/install_sglang_env.sh"):
            SGLangEngine("/nonexistent/model")


def test_truncated_sampling_is_refused_unless_accepted() -> None:
    for params in (SamplingParams(top_p=0.9), SamplingParams(top_k=20)):
        with pytest.raises(EngineError, match="allow_truncated_logprobs"):
            build_sglang_request([1, 2], params)
    assert build_sglang_request([1, 2], SamplingParams(top_k=-1))["sampling_params"]["top_k"] == -1


def test_request_carries_ids_logprobs_and_contract_flags() -> None:
    params = SamplingParams(
        max_tokens=7, temperature=0.7, top_p=0.9, top_k=20, stop=["</tool_call>"], stop_token_ids=[151645], seed=3
    )
    req = build_sglang_request([1, 2, 3], params, allow_truncated_logprobs=True)
    assert req["input_ids"] == [1, 2, 3]
    assert req["return_logprob"] is True
    assert req["logprob_start_len"] == -1
    sp = req["sampling_params"]
    assert sp == {
        "max_new_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "stop": ["</tool_call>"],
        "stop_token_ids": [151645],
        "sampling_seed": 3,
    }
    # Nothing optional leaks in when unset.
    plain = build_sglang_request([5], SamplingParams())["sampling_params"]
    assert "stop" not in plain and "stop_token_ids" not in plain and "sampling_seed" not in plain


@pytest.mark.parametrize(
    "ids,params,match",
    [
        ([], SamplingParams(), "prompt_ids is empty"),
        ([1], SamplingParams(max_tokens=0), "max_tokens"),
        ([1], SamplingParams(temperature=-1.0), "temperature"),
    ],
)
def test_request_rejects_bad_input(ids: list[int], params: SamplingParams, match: str) -> None:
    with pytest.raises(EngineError, match=match):
        build_sglang_request(ids, params)


def test_parse_stop_token_keeps_the_stop_token() -> None:
    out = parse_sglang_output(RECORDED_STOP_TOKEN)
    assert out == GenerationOutput([785, 4226, 374, 1124, 151645], [-0.51, -1.25, -0.03, -2.75, -0.0004], "stop")


def test_parse_stop_string_length_abort() -> None:
    assert parse_sglang_output(RECORDED_STOP_STR) == GenerationOutput([87, 284, 522], [-0.7, -0.2, -0.9], "stop")
    assert parse_sglang_output(RECORDED_LENGTH) == GenerationOutput([64, 65], [-3.0, -4.5], "length")
    assert parse_sglang_output(RECORDED_ABORT) == GenerationOutput([], [], "abort")


def test_parse_rejects_inconsistent_or_incomplete_outputs() -> None:
    bad_ids = {**RECORDED_LENGTH, "output_ids": [64, 66]}
    with pytest.raises(EngineError, match="disagree"):
        parse_sglang_output(bad_ids)
    with pytest.raises(EngineError, match="return_logprob"):
        parse_sglang_output({"text": "", "meta_info": {"finish_reason": {"type": "stop"}}})
    with pytest.raises(EngineError, match="meta_info"):
        parse_sglang_output({"text": ""})
    with pytest.raises(EngineError, match="finish_reason"):
        parse_sglang_output({"meta_info": {"finish_reason": {"type": "weird"}, "output_token_logprobs": []}})
    with pytest.raises(EngineError, match="no log-prob"):
        parse_sglang_output(
            {"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[None, 3, None]]}}
        )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(max_value=0.0, allow_nan=False, allow_infinity=False, width=32),
            st.integers(min_value=0, max_value=200_000),
        ),
        max_size=40,
    ),
    st.sampled_from(["stop", "length", "abort"]),
    st.booleans(),
)
def test_parse_round_trips_any_shaped_output(pairs: list[tuple[float, int]], kind: str, with_ids: bool) -> None:
    raw = {
        "text": "ignored",
        "meta_info": {"finish_reason": {"type": kind}, "output_token_logprobs": [[lp, tid, None] for lp, tid in pairs]},
    }
    if with_ids:
        raw["output_ids"] = [tid for _, tid in pairs]
    out = parse_sglang_output(raw)
    assert out.token_ids == [tid for _, tid in pairs]
    assert all(math.isclose(a, b) for a, b in zip(out.logprobs, [lp for lp, _ in pairs]))
    assert len(out.logprobs) == len(out.token_ids)
    assert out.finish_reason == kind


# --- the CPU environment's pieces (agent_env/engines/sglang_cpu) ------------------------------------


def _stand_in():
    import importlib.util as iu

    path = REPO / "agent_env" / "engines" / "sglang_cpu" / "stand_in" / "sgl_kernel" / "__init__.py"
    spec = iu.spec_from_file_location("otb_sgl_kernel_stand_in_under_test", path)
    module = iu.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_stand_in_assign_req_to_token_pool_matches_a_brute_force_loop(data) -> None:
    """The one kernel the stand-in implements (every decode step calls it), against the semantics of
    sglang's triton kernel written as a plain loop."""
    import torch

    k = _stand_in()
    rows, width = 6, 24
    n = data.draw(st.integers(1, 5))
    pool_rows = data.draw(st.lists(st.integers(0, rows - 1), min_size=n, max_size=n, unique=True))
    starts, ends = [], []
    for _ in range(n):
        s0 = data.draw(st.integers(0, width - 1))
        starts.append(s0)
        ends.append(data.draw(st.integers(s0, width)))
    total = sum(e - s0 for s0, e in zip(starts, ends))
    out_cache_loc = torch.arange(1000, 1000 + total, dtype=torch.int64)
    got = torch.full((rows, width), -1, dtype=torch.int32)
    k.assign_req_to_token_pool_cpu(
        torch.tensor(pool_rows), got, torch.tensor(starts), torch.tensor(ends), out_cache_loc, width
    )
    want = torch.full((rows, width), -1, dtype=torch.int32)
    o = 0
    for r, s0, e in zip(pool_rows, starts, ends):
        for j in range(s0, e):
            want[r, j] = int(out_cache_loc[o])
            o += 1
    assert torch.equal(got, want)


def test_stand_in_kernels_it_lacks_raise_naming_themselves() -> None:
    k = _stand_in()
    assert k.STAND_IN is True
    assert "copy_all_layer_kv_cache_cpu" in k.MISSING
    for name in k.MISSING:
        with pytest.raises(NotImplementedError, match=rf"sgl_kernel\.{name} is not available.*stand-in"):
            getattr(k, name)()


TORCHVISION_META = """import functools
import torch

@functools.lru_cache(None)
def get_meta_lib():
    return torch.library.Library("torchvision", "IMPL", "Meta")


@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    return dets


@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    return dets
"""


def test_torchvision_patch_guards_the_two_fake_kernels_idempotently(tmp_path: Path) -> None:
    """Without the patch the file dies at import (no torchvision::nms operator next to the CPU torch);
    with it, it imports, and a second run changes nothing. A file it was not written for is refused."""
    import runpy

    from agent_env.engines.sglang_cpu.patch_torchvision import MARK, patch

    f = tmp_path / "_meta_registrations.py"
    f.write_text(TORCHVISION_META)
    with pytest.raises(RuntimeError, match="torchvision::nms"):
        runpy.run_path(str(f))
    assert patch(f) == "guarded nms and qnms"
    once = f.read_text()
    assert MARK in once
    runpy.run_path(str(f))  # imports now
    assert patch(f) == "already guarded" and f.read_text() == once
    other = tmp_path / "other.py"
    other.write_text("import torch\n")
    with pytest.raises(SystemExit, match="not the one the patch was written for"):
        patch(other)
