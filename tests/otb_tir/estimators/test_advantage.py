"""Advantage estimators against verl 0.9.1 (the oracle) on property-based multi-turn batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otb_tir import ConfigError
from otb_tir.advantage import (
    get_estimator,
    grpo,
    list_estimators,
    optimal_token_baseline,
    place_reward_on_last_policy_token,
    register_estimator,
    rloo,
    tir_optimal_token_baseline,
)
from otb_tir.layout import pack_policy_tokens, unpack_policy_tokens
from tests.support.optional import need

SETTINGS = settings(deadline=None, max_examples=120, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def verl_algos():
    core_algos = need("verl.trainer.ppo.core_algos", reason="verl==0.9.1 is the test oracle")
    return core_algos


# --------------------------------------------------------------------------------------------
# batch generation


@st.composite
def batches(draw, dense_rewards: bool = True):
    """A multi-turn batch: groups of 1..16 rows in shuffled order, tool spans, empty rows, ties."""
    n_groups = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(1, 16), min_size=n_groups, max_size=n_groups))
    resp = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**32 - 1))
    tie_longest = draw(st.booleans())
    empty_rate = draw(st.sampled_from([0.0, 0.15, 0.5]))
    tool_spans = draw(st.integers(0, 3))
    reward_mode = draw(
        st.sampled_from(
            ["last_policy", "last_token", "random_tokens"] if dense_rewards else ["last_policy", "last_token"]
        )
    )
    rng = np.random.default_rng(seed)

    blocks = draw(st.booleans())  # verl's layout: equal groups of adjacent rows (the estimators' fast path)
    if blocks:
        sizes = [sizes[0]] * n_groups
    batch = sum(sizes)
    group_of_row = np.repeat(rng.permutation(n_groups), sizes)
    if not blocks:
        group_of_row = group_of_row[rng.permutation(batch)]  # rows of one group are not adjacent

    lengths = rng.integers(0, resp + 1, size=batch)
    lengths[rng.random(batch) < empty_rate] = 0
    if tie_longest:
        for g in range(n_groups):  # test-side construction: a loop is fine here
            rows = np.flatnonzero(group_of_row == g)
            if len(rows) >= 2:
                top = lengths[rows].max()
                lengths[rows[:2]] = top
    col = np.arange(resp)
    mask = col[None, :] < lengths[:, None]
    for _ in range(tool_spans):  # environment tokens inside the rows
        start = rng.integers(0, resp, size=(batch, 1))
        width = rng.integers(1, max(2, resp // 4), size=(batch, 1))
        mask &= ~((col >= start) & (col < start + width))

    # Dyadic rewards (multiples of 1/8): sums of them are exact in float32.
    rewards = np.zeros((batch, resp), dtype=np.float32)
    values = rng.integers(-16, 17, size=batch) / 8.0
    if reward_mode == "last_policy":
        has = mask.any(axis=1)
        last = resp - 1 - np.argmax(mask[:, ::-1], axis=1)
        rewards[np.flatnonzero(has), last[has]] = values[has]
    elif reward_mode == "last_token":  # often a mask-0 token: verl drops these
        rows = np.flatnonzero(lengths > 0)
        rewards[rows, lengths[rows] - 1] = values[rows]
    else:
        sparse = rng.random((batch, resp)) < 0.2
        rewards[sparse] = rng.integers(-8, 9, size=sparse.sum()) / 8.0

    pi = rng.uniform(0.01, 1.0, size=(batch, resp))
    sum_pi_sq = pi**2 + rng.uniform(0.0, 1.0, size=(batch, resp)) * (1 - pi**2)  # Σπ² ∈ [π², 1]
    uid_kind = draw(st.sampled_from(["str", "int"]))
    if uid_kind == "str":
        index = np.array([f"prompt-{g}" for g in group_of_row], dtype=object)
    else:
        index = np.array([int(g) * 7 + 3 for g in group_of_row], dtype=object)
    return {
        "token_level_rewards": torch.from_numpy(rewards),
        "response_mask": torch.from_numpy(mask.astype(np.float32)),
        "index": index,
        "old_log_probs": torch.from_numpy(np.log(pi).astype(np.float32)),
        "sum_pi_squared": torch.from_numpy(sum_pi_sq.astype(np.float32)),
        "rollout_is_weights": torch.from_numpy(rng.uniform(0.0, 2.0, size=(batch, resp)).astype(np.float32)),
    }


def _with_options(data: dict, use_is: bool, mask_dtype: torch.dtype) -> dict:
    data = dict(data)
    if not use_is:
        data["rollout_is_weights"] = None
    data["response_mask"] = data["response_mask"].to(mask_dtype)
    return data


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = 1e-6) -> None:
    assert ours.shape == ref.shape
    diff = (ours.double() - ref.double()).abs().max().item() if ours.numel() else 0.0
    assert diff <= atol, f"max abs diff {diff} > {atol}"


#: mask dtypes a caller may pass (verl's float, bool, int): every estimator treats nonzero as policy
MASK_DTYPES = st.sampled_from([torch.float32, torch.bool, torch.int64])

OTB_PAIRS = [
    ("optimal_token_baseline", "compute_optimal_token_baseline_advantage"),
    ("tir_optimal_token_baseline", "compute_multi_turn_optimal_token_baseline_advantage"),
]


# --------------------------------------------------------------------------------------------
# exactness vs verl


@pytest.mark.parametrize("ours_name,verl_name", OTB_PAIRS)
@SETTINGS
@given(
    data=batches(),
    use_is=st.booleans(),
    handle_zero_tail=st.booleans(),
    mask_dtype=MASK_DTYPES,
)
def test_otb_equals_verl_float32(verl_algos, ours_name, verl_name, data, use_is, handle_zero_tail, mask_dtype):
    data = _with_options(data, use_is, mask_dtype)
    adv, ret = get_estimator(ours_name)(**data, handle_zero_tail=handle_zero_tail)
    ref_adv, ref_ret = getattr(verl_algos, verl_name)(**data, handle_zero_tail=handle_zero_tail)
    assert adv.dtype == ref_adv.dtype and ret.dtype == ref_ret.dtype
    _assert_close(adv, ref_adv)
    _assert_close(ret, ref_ret)


@pytest.mark.parametrize("ours_name,verl_name", OTB_PAIRS)
@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(data=batches(), use_is=st.booleans(), handle_zero_tail=st.booleans(), bf16_mask=st.booleans())
def test_otb_bfloat16_inputs(verl_algos, ours_name, verl_name, data, use_is, handle_zero_tail, bf16_mask):
    """bf16 inputs: we compute in float32, so we equal verl run on the same values in float32.

    verl computes in the input dtype (cumulative sums with an 8-bit mantissa). Our result comes
    back in verl's output dtype: bf16 when rewards and mask are bf16 (then equal up to the final
    rounding to bf16), float32 when the mask is float32 (then equal to 1e-6).
    """
    data = _with_options(data, use_is, torch.float32)
    bf16 = {k: (v.to(torch.bfloat16) if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
    if not bf16_mask:
        bf16["response_mask"] = data["response_mask"]
    upcast = {k: (v.to(torch.float32) if isinstance(v, torch.Tensor) else v) for k, v in bf16.items()}
    adv, ret = get_estimator(ours_name)(**bf16, handle_zero_tail=handle_zero_tail)
    ref_adv, ref_ret = getattr(verl_algos, verl_name)(**upcast, handle_zero_tail=handle_zero_tail)
    verl_bf16_adv, _ = getattr(verl_algos, verl_name)(**bf16, handle_zero_tail=handle_zero_tail)
    assert adv.dtype == verl_bf16_adv.dtype  # same output dtype as verl on these inputs
    if adv.dtype == torch.bfloat16:
        # Both round the same float32 value (up to float32 noise) to bf16: at most one bf16 ulp apart.
        for ours, ref in ((adv, ref_adv), (ret, ref_ret)):
            tol = ref.abs() * 2.0**-8 + 1e-6
            assert bool(((ours.float() - ref).abs() <= tol).all())
    else:
        _assert_close(adv, ref_adv)
        _assert_close(ret, ref_ret)


def test_bfloat16_is_more_accurate_than_verl_in_bfloat16(verl_algos):
    """Long rows in bf16: our float32 accumulation beats verl's bf16 cumulative sums."""
    gen = torch.Generator().manual_seed(0)
    batch, resp = 16, 2048
    mask = torch.ones(batch, resp)
    rewards = torch.zeros(batch, resp)
    rewards[:, -1] = (torch.rand(batch, generator=gen) < 0.5).float()
    pi = torch.rand(batch, resp, generator=gen) * 0.98 + 0.01
    data = {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "index": np.array([i // 8 for i in range(batch)], dtype=object),
        "old_log_probs": pi.log(),
        "sum_pi_squared": pi.square() + torch.rand(batch, resp, generator=gen) * (1 - pi.square()),
    }
    f64 = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
    bf16 = {k: (v.bfloat16() if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
    truth, _ = verl_algos.compute_optimal_token_baseline_advantage(
        **{k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in bf16.items()}
    )
    ours, _ = optimal_token_baseline(**bf16)
    theirs, _ = verl_algos.compute_optimal_token_baseline_advantage(**bf16)
    err_ours = (ours.double() - truth).abs().max().item()
    err_verl = (theirs.double() - truth).abs().max().item()
    assert err_ours <= 2.0**-8  # one bf16 rounding of values ≤ 1
    assert err_ours < err_verl
    # float64 inputs are computed in float64
    adv64, _ = optimal_token_baseline(**f64)
    assert adv64.dtype == torch.float64


@pytest.mark.parametrize(
    "ours,verl_name", [(grpo, "compute_grpo_outcome_advantage"), (rloo, "compute_rloo_outcome_advantage")]
)
@settings(deadline=None, max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(data=batches(), norm=st.booleans())
def test_grpo_rloo_equal_verl(verl_algos, ours, verl_name, data, norm):
    kwargs = {"norm_adv_by_std_in_grpo": norm} if ours is grpo else {}
    core = {k: data[k] for k in ("token_level_rewards", "response_mask", "index")}
    adv, ret = ours(**data, **kwargs)  # OTB-only arguments are accepted and ignored
    ref_adv, ref_ret = getattr(verl_algos, verl_name)(**core, **kwargs)
    _assert_close(adv, ref_adv)
    _assert_close(ret, ref_ret)


# --------------------------------------------------------------------------------------------
# properties that need no oracle


@SETTINGS
@given(data=batches(), use_is=st.booleans(), handle_zero_tail=st.booleans())
def test_tir_is_dense_otb_on_packed_rows(data, use_is, handle_zero_tail):
    """TIR-OTB == pack each row to its policy tokens, dense OTB on the compact rows, unpack.

    Empty rows are dropped first (the TIR variant does not count them as group members).
    """
    data = _with_options(data, use_is, torch.float32)
    keep = data["response_mask"].sum(-1) > 0
    if not bool(keep.any()):
        return
    data = {
        k: (v[keep] if isinstance(v, torch.Tensor) else (v[keep.numpy()] if v is not None else None))
        for k, v in data.items()
    }
    mask = data["response_mask"]
    adv, _ = tir_optimal_token_baseline(**data, handle_zero_tail=handle_zero_tail)
    packed = {}
    for key in ("token_level_rewards", "old_log_probs", "sum_pi_squared", "rollout_is_weights"):
        if data[key] is not None:
            packed[key], layout = pack_policy_tokens(data[key] * mask, mask)
    compact_adv, _ = optimal_token_baseline(
        packed["token_level_rewards"],
        layout.compact_mask.float(),
        data["index"],
        packed["old_log_probs"],
        packed["sum_pi_squared"],
        packed.get("rollout_is_weights"),
        handle_zero_tail=handle_zero_tail,
    )
    _assert_close(adv, unpack_policy_tokens(compact_adv, layout))


def test_single_sample_groups_and_empty_rows():
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 1], [1, 1, 1, 0]], dtype=torch.float32)
    rewards = torch.zeros(4, 4)
    rewards[0, 3] = 1.0
    rewards[2, 3] = 0.5
    rewards[3, 2] = -1.0
    index = np.array(["a", "b", "c", "c"], dtype=object)
    lp = torch.full((4, 4), -0.5)
    sp = torch.full((4, 4), 0.5)
    for est in (optimal_token_baseline, tir_optimal_token_baseline):
        adv, ret = est(rewards, mask, index, lp, sp)
        # group "a" has one sample: advantage = return on its policy tokens
        assert torch.equal(adv[0], ret[0] * mask[0])
        assert torch.equal(adv[0], torch.tensor([1.0, 1.0, 0.0, 1.0]))
        # the empty row stays zero
        assert torch.equal(adv[1], torch.zeros(4)) and torch.equal(ret[1], torch.zeros(4))


def test_inputs_are_not_modified():
    data = {
        "token_level_rewards": torch.tensor([[0.0, 1.0], [0.5, 0.0]]),
        "response_mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        "index": np.array(["u", "u"], dtype=object),
        "old_log_probs": torch.tensor([[-0.1, -0.2], [-0.3, -0.4]]),
        "sum_pi_squared": torch.tensor([[0.9, 0.8], [0.7, 0.6]]),
        "rollout_is_weights": torch.tensor([[1.0, 0.5], [2.0, 1.0]]),
    }
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v.copy()) for k, v in data.items()}
    for name in list_estimators():
        get_estimator(name)(**data)
        for k, v in data.items():
            assert torch.equal(v, before[k]) if isinstance(v, torch.Tensor) else (v == before[k]).all(), (name, k)


# --------------------------------------------------------------------------------------------
# reward placement


def test_verl_loses_reward_on_mask0_token_and_placement_keeps_it(verl_algos):
    # Two samples of one prompt; each row ends with a tool response (mask 0) carrying the reward.
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    rewards = torch.zeros(2, 7)
    rewards[0, 6] = 1.0  # on a mask-0 token
    rewards[1, 3] = 0.0
    index = np.array(["p", "p"], dtype=object)
    lp = torch.full((2, 7), -0.7)
    sp = torch.full((2, 7), 0.4)
    _, verl_returns = verl_algos.compute_multi_turn_optimal_token_baseline_advantage(rewards, mask, index, lp, sp)
    assert float((verl_returns * mask).abs().sum()) == 0.0  # the success of row 0 is gone

    placed = place_reward_on_last_policy_token(rewards, mask)
    assert placed[0, 5] == 1.0 and float(placed.sum()) == 1.0
    adv, ret = tir_optimal_token_baseline(placed, mask, index, lp, sp)
    ref_adv, _ = verl_algos.compute_multi_turn_optimal_token_baseline_advantage(placed, mask, index, lp, sp)
    _assert_close(adv, ref_adv)
    assert torch.equal(ret[0] * mask[0], mask[0])  # every policy token of row 0 sees the reward
    assert float(adv[0].sum()) > 0 > float(adv[1].sum())  # the successful sample is reinforced


@settings(deadline=None, max_examples=100)
@given(data=batches())
def test_place_reward_properties(data):
    rewards, mask = data["token_level_rewards"], data["response_mask"]
    placed = place_reward_on_last_policy_token(rewards, mask)
    has = mask.bool().any(-1)
    # totals are kept; rows without policy tokens are unchanged
    assert torch.allclose(placed.sum(-1), rewards.sum(-1), atol=1e-6)
    assert torch.equal(placed[~has], rewards[~has])
    # each row's reward sits on its last policy token, and only there
    for b in torch.nonzero(has).squeeze(1).tolist():
        last = int(torch.nonzero(mask[b]).max())
        expected = torch.zeros_like(rewards[b])
        expected[last] = rewards[b].sum()
        assert torch.equal(placed[b], expected)


# --------------------------------------------------------------------------------------------
# registry and errors


def test_registry_names_and_uniform_calls():
    assert {"optimal_token_baseline", "tir_optimal_token_baseline", "grpo", "rloo"} <= set(list_estimators())
    data = {
        "token_level_rewards": torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]),
        "response_mask": torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]),
        "index": np.array([1, 1, 2], dtype=object),
        "old_log_probs": torch.full((3, 2), -0.3),
        "sum_pi_squared": torch.full((3, 2), 0.6),
        "rollout_is_weights": None,
        "handle_zero_tail": True,
        "norm_adv_by_std_in_grpo": True,
        "config": None,  # verl passes its config; accepted and ignored
    }
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline", "grpo", "rloo"):
        adv, ret = get_estimator(name)(**data)
        assert adv.shape == ret.shape == (3, 2)
        assert float(adv[0, 1]) > 0 > float(adv[1, 1])  # success reinforced, failure penalized


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ConfigError) as err:
        get_estimator("gae_typo")
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline", "grpo", "rloo"):
        assert name in str(err.value)


def test_register_custom_estimator_and_duplicate_name():
    @register_estimator("test_only_zero")
    def zero(token_level_rewards, response_mask, index, **kwargs):
        z = torch.zeros_like(token_level_rewards)
        return z, z

    assert get_estimator("test_only_zero") is zero
    with pytest.raises(ConfigError, match="already registered"):
        register_estimator("test_only_zero")(lambda *a, **k: None)


@pytest.mark.parametrize("estimator", [optimal_token_baseline, tir_optimal_token_baseline])
def test_bad_inputs_raise_config_error(estimator):
    r = torch.zeros(2, 3)
    m = torch.ones(2, 3)
    idx = np.array(["a", "a"], dtype=object)
    lp = torch.zeros(2, 3)
    with pytest.raises(ConfigError, match="old_log_probs is required"):
        estimator(r, m, idx)
    with pytest.raises(ConfigError, match="shape"):
        estimator(r, m, idx, lp, torch.zeros(2, 4))
    with pytest.raises(ConfigError, match="one entry per row"):
        estimator(r, m, np.array(["a"], dtype=object), lp, lp)
    with pytest.raises(ConfigError, match="0/1"):
        estimator(r, m * 2, idx, lp, lp)
    with pytest.raises(ConfigError, match="comparable"):
        estimator(r, m, np.array(["a", 1], dtype=object), lp, lp)
    with pytest.raises(ConfigError, match="2-D"):
        estimator(torch.zeros(3), m, idx, lp, lp)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_batches(shape):
    z = torch.zeros(shape)
    index = np.array(["a"] * shape[0], dtype=object)
    for name in list_estimators():
        if name.startswith("test_only"):
            continue
        adv, ret = get_estimator(name)(z, torch.ones(shape), index, z, z)
        assert adv.shape == ret.shape == shape
    assert place_reward_on_last_policy_token(z, z).shape == shape


@pytest.mark.parametrize("ours_name,verl_name", OTB_PAIRS)
def test_otb_equals_verl_on_dense_gaussian_rewards(verl_algos, ours_name, verl_name):
    """Non-dyadic rewards on many tokens: returns keep verl's summation order, so still ≤ 1e-6."""
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        batch, resp = 32, 256
        mask = (torch.rand(batch, resp, generator=gen) < 0.8).float()
        rewards = torch.randn(batch, resp, generator=gen) * (torch.rand(batch, resp, generator=gen) < 0.2)
        pi = torch.rand(batch, resp, generator=gen) * 0.98 + 0.01
        sp = pi.square() + torch.rand(batch, resp, generator=gen) * (1 - pi.square())
        rho = torch.rand(batch, resp, generator=gen) * 2
        index = np.array([i % 4 for i in range(batch)], dtype=object)
        adv, ret = get_estimator(ours_name)(rewards, mask, index, pi.log(), sp, rho)
        ref_adv, ref_ret = getattr(verl_algos, verl_name)(rewards, mask, index, pi.log(), sp, rho)
        _assert_close(adv, ref_adv)
        _assert_close(ret, ref_ret)


# --------------------------------------------------------------------------------------------
# the fused CPU kernel (otb_tir/fused_otb.c) against the PyTorch estimators


def _pytorch_path(name: str, data: dict, **kw):
    """The estimator with the kernel turned off (``OTB_TIR_FUSED=0``): the PyTorch reference."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTB_TIR_FUSED", "0")
        return get_estimator(name)(**data, **kw)


@pytest.mark.parametrize("name", [p[0] for p in OTB_PAIRS])
@SETTINGS
@given(
    data=batches(),
    use_is=st.booleans(),
    handle_zero_tail=st.booleans(),
    mask_dtype=MASK_DTYPES,
)
def test_fused_kernel_equals_the_pytorch_path(name, data, use_is, handle_zero_tail, mask_dtype):
    from otb_tir import fused

    assert fused.fused_available(), "the test machine has a C compiler: the kernel must build"
    data = _with_options(data, use_is, mask_dtype)
    ref_adv, ref_ret = _pytorch_path(name, data, handle_zero_tail=handle_zero_tail)
    adv, ret = get_estimator(name)(**data, handle_zero_tail=handle_zero_tail)
    assert adv.dtype == ref_adv.dtype and ret.dtype == ref_ret.dtype
    assert torch.equal(ret, ref_ret)
    index = data["index"]
    blocks = len(index) > 0 and all(
        index[i] == index[i - i % n] for n in [list(index).count(index[0])] for i in range(len(index))
    )
    if name == "optimal_token_baseline" and blocks:
        # Dense OTB on equal adjacent groups: the PyTorch path sums each group with torch.sum (its
        # own summation order, as verl's); the kernel sums rows in order. Both are within 1e-6 of verl.
        _assert_close(adv, ref_adv)
    else:  # both add the group's rows in ascending order: identical bits
        assert torch.equal(adv, ref_adv)


@pytest.mark.parametrize("name", [p[0] for p in OTB_PAIRS])
def test_fused_kernel_on_strided_and_bf16_inputs(name):
    """Non-contiguous views and bf16 inputs reach the kernel (contiguous float32 copies) unchanged."""
    gen = torch.Generator().manual_seed(3)
    batch, resp = 24, 96
    big = torch.rand(batch, 2 * resp, generator=gen)
    mask = (big[:, ::2] < 0.7).float()  # a strided view
    rewards = torch.randn(batch, resp, generator=gen).t().contiguous().t()  # column-major
    pi = torch.rand(batch, resp, generator=gen) * 0.9 + 0.05
    data = {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "index": np.array([i % 5 for i in range(batch)], dtype=object),  # interleaved groups
        "old_log_probs": pi.log(),
        "sum_pi_squared": pi.square(),
    }
    for cast in (lambda t: t, lambda t: t.to(torch.bfloat16)):
        d = {k: cast(v) if isinstance(v, torch.Tensor) else v for k, v in data.items()}
        ref = _pytorch_path(name, d)
        out = get_estimator(name)(**d)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_without_a_compiler_the_estimators_warn_once_and_give_the_same_results(monkeypatch, tmp_path, caplog):
    from otb_tir import fused

    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(16, 50, generator=gen) < 0.8).float()
    pi = torch.rand(16, 50, generator=gen) * 0.9 + 0.05
    args = (torch.randn(16, 50, generator=gen), mask, np.arange(16) // 4, pi.log(), pi.square())
    expected = tir_optimal_token_baseline(*args)
    monkeypatch.setenv("OTB_TIR_CACHE", str(tmp_path))  # nothing cached: a build is needed
    monkeypatch.setattr(fused, "_lib", None)
    monkeypatch.setattr(fused, "_failed", None)
    monkeypatch.setattr(fused, "_compiler", lambda: None)
    with caplog.at_level("WARNING", logger="otb_tir.fused"):
        first = tir_optimal_token_baseline(*args)
        second = tir_optimal_token_baseline(*args)
    assert not fused.fused_available()
    warnings = [r for r in caplog.records if "fused OTB kernel unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no C compiler" in warnings[0].getMessage()
    assert all(torch.equal(a, b) for a, b in zip(first, expected))
    assert all(torch.equal(a, b) for a, b in zip(second, expected))
    assert not list(tmp_path.glob("fused_otb-*/*.so"))


def test_kernel_build_is_cached_and_a_broken_compiler_falls_back(monkeypatch, tmp_path, caplog):
    """A fresh cache builds the kernel once (a published folder with the .so); a compiler that fails
    is reported with its error and the PyTorch path is used."""
    from otb_tir import fused

    monkeypatch.setenv("OTB_TIR_CACHE", str(tmp_path))
    monkeypatch.setattr(fused, "_lib", None)
    monkeypatch.setattr(fused, "_failed", None)
    assert fused.fused_available()
    built = list(tmp_path.glob("fused_otb-*/fused_otb.so"))
    assert len(built) == 1 and (built[0].parent / "otb_tir_fused.json").is_file()

    fake = tmp_path / "bin" / "cc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'cc: fatal error: simulated' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setattr(fused, "_lib", None)
    monkeypatch.setattr(fused, "_failed", None)
    with caplog.at_level("WARNING", logger="otb_tir.fused"):
        assert not fused.fused_available()
    assert any("simulated" in r.getMessage() for r in caplog.records)


def test_fused_pools_of_other_sizes_never_shut_a_pool_a_caller_holds():
    """Two calls splitting their groups over different thread counts: the second's pool must not shut
    the first's while it maps (one replaced pool once raised "cannot schedule new futures after
    shutdown" in the first caller)."""
    from otb_tir import fused

    held = fused._executor(2)  # a call took its pool ...
    fused._executor(3)  # ... another call asks for another size ...
    assert list(held.map(lambda x: x * 2, [1, 2, 3])) == [2, 4, 6]  # ... the first still maps
    assert fused._executor(2) is held
