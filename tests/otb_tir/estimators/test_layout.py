"""Pack a multi-turn [B, R] batch to its policy tokens and back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otb_tir import ConfigError
from otb_tir.layout import (
    PolicyLayout,
    mask_in_unit_interval,
    pack_policy_tokens,
    policy_counts,
    policy_counts_into,
    unpack_policy_tokens,
)


@st.composite
def masked_batches(draw):
    batch = draw(st.integers(0, 12))
    resp = draw(st.integers(0, 30))
    seed = draw(st.integers(0, 2**32 - 1))
    density = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    rng = np.random.default_rng(seed)
    mask = rng.random((batch, resp)) < density
    x = rng.standard_normal((batch, resp)).astype(np.float32)
    mask_dtype = draw(st.sampled_from([torch.bool, torch.float32, torch.int64]))
    return torch.from_numpy(x), torch.from_numpy(mask).to(mask_dtype)


@settings(deadline=None, max_examples=200)
@given(masked_batches())
def test_pack_matches_per_row_reference_and_round_trips(case):
    x, mask = case
    compact, layout = pack_policy_tokens(x, mask)
    keep = mask.bool()
    lengths = keep.sum(-1)
    assert compact.shape == (x.shape[0], int(lengths.max()) if x.shape[0] else 0)
    assert torch.equal(layout.lengths, lengths)
    for b in range(x.shape[0]):  # test-side reference
        row = x[b][keep[b]]
        assert torch.equal(compact[b, : len(row)], row)
        assert torch.equal(compact[b, len(row) :], torch.zeros(compact.shape[1] - len(row)))
    # round trip: policy positions come back, the rest is the fill value
    restored = unpack_policy_tokens(compact, layout)
    assert torch.equal(restored, torch.where(keep, x, 0.0))
    assert torch.equal(unpack_policy_tokens(compact, mask, fill_value=-1.0), torch.where(keep, x, -1.0))
    # pack(unpack(c)) == c on the compact mask
    assert torch.equal(layout.pack(restored), compact)


@settings(deadline=None, max_examples=100)
@given(masked_batches())
def test_policy_counts_is_the_running_count(case):
    _, mask = case
    expected = np.cumsum(mask.bool().numpy(), axis=-1)
    assert np.array_equal(policy_counts(mask).numpy(), expected)
    scratch = torch.empty(mask.shape, dtype=torch.float32)
    counts = policy_counts_into(mask.float(), scratch)
    assert counts.dtype == torch.int32 and counts.data_ptr() == scratch.data_ptr()  # no new buffer
    assert np.array_equal(counts.numpy(), expected)


def test_trailing_dims_and_pad_value():
    x = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    mask = torch.tensor([[0, 1, 0, 1], [1, 1, 1, 0]])
    compact, layout = pack_policy_tokens(x, mask, pad_value=7.0)
    assert compact.shape == (2, 3, 3)
    assert torch.equal(compact[0, 0], x[0, 1]) and torch.equal(compact[0, 1], x[0, 3])
    assert torch.equal(compact[0, 2], torch.full((3,), 7.0))
    back = layout.unpack(compact)
    assert torch.equal(back[0, 1], x[0, 1]) and torch.equal(back[0, 0], torch.zeros(3))


def test_errors():
    with pytest.raises(ConfigError):
        PolicyLayout.from_mask(torch.ones(3))
    layout = PolicyLayout.from_mask(torch.ones(2, 3))
    with pytest.raises(ConfigError):
        layout.pack(torch.ones(2, 4))
    with pytest.raises(ConfigError):
        layout.unpack(torch.ones(2, 2))
    with pytest.raises(ConfigError):
        policy_counts(torch.ones(3))


def test_mask_in_unit_interval():
    assert mask_in_unit_interval(torch.tensor([[0.0, 1.0]]))
    assert mask_in_unit_interval(torch.tensor([[True, False]]))
    assert not mask_in_unit_interval(torch.tensor([[0, 2]]))
    assert not mask_in_unit_interval(torch.tensor([[-1.0, 1.0]]))
    assert not mask_in_unit_interval(torch.tensor([[float("nan"), 1.0]]))
