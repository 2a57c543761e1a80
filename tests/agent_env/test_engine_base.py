"""The weight-update argument every engine takes (vLLM and sglang share this check)."""

from __future__ import annotations

import pytest
import torch

from agent_env.engines.base import EngineError, named_tensor_list


def test_a_mapping_or_pairs_become_detached_pairs_in_order():
    w = torch.ones(2, requires_grad=True)
    b = torch.zeros(3)
    for given in ({"w": w, "b": b}, [("w", w), ("b", b)], iter([("w", w), ("b", b)])):
        out = named_tensor_list(given)
        assert [n for n, _ in out] == ["w", "b"]
        assert not out[0][1].requires_grad and out[0][1].data_ptr() == w.data_ptr()  # detached, not copied


@pytest.mark.parametrize("bad", [[("w", [1.0])], [(1, torch.ones(1))], [("w", torch.ones(1), "x")], ["w"]])
def test_anything_else_is_an_engine_error_naming_the_item(bad):
    with pytest.raises(EngineError, match="expects \\(name: str, tensor: torch.Tensor\\) pairs"):
        named_tensor_list(bad)


def test_nothing_to_load_is_an_error():
    with pytest.raises(EngineError, match="no tensors"):
        named_tensor_list({})
