"""The dtype rules decided at start: ``model.dtype=auto`` (the actor's bfloat16 autocast) and
``rollout.dtype=auto`` (the hf engine's bfloat16 copy), each from the CPU's native bfloat16 and the
policy's parameter count, with the choice logged."""

from __future__ import annotations

import logging

import pytest
import torch
from omegaconf import OmegaConf

from otb_tir.trainer import parts
from otb_tir.trainer.config import load_config


class _Counted(torch.nn.Module):
    """A policy of exactly ``n`` parameters that takes no memory (meta tensors): the rules count, they
    never compute."""

    def __init__(self, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(n, device="meta"))


def _cfg(**keys):
    return load_config(None, [f"{k}={v}" for k, v in keys.items()])


@pytest.mark.parametrize(
    ("native", "params", "device", "shard", "want"),
    [
        ("avx512_bf16", parts.BF16_AUTOCAST_MIN_PARAMS, "cpu", False, "bfloat16"),
        ("avx512_bf16", parts.BF16_AUTOCAST_MIN_PARAMS - 1, "cpu", False, "float32"),
        ("amx_bf16", 596_049_920, "cpu", False, "bfloat16"),
        ("", 596_049_920, "cpu", False, "float32"),  # emulated bfloat16 is slower: AVX2-only VMs
        ("avx512_bf16", 596_049_920, "cpu", True, "float32"),  # FSDP2-sharded: no CPU autocast
        ("avx512_bf16", 596_049_920, "meta", False, "float32"),  # not a CPU: set model.dtype there
    ],
)
def test_model_dtype_auto_follows_the_cpu_and_the_policy_size(monkeypatch, caplog, native, params, device, shard, want):
    monkeypatch.setattr("otb_tir.machine.native_bf16", lambda: native)
    cfg = _cfg(**{"model.dtype": "auto"})
    with caplog.at_level(logging.INFO, logger=parts.log.name):
        got = parts.model_dtype_for(cfg, _Counted(params), torch.device(device), shard=shard)
    assert got == want
    if device == "cpu" and not shard:  # the decision is logged with what it was made from
        assert f"model.dtype auto -> {want}" in caplog.text and f"{params / 1e6:.1f}M parameters" in caplog.text


@pytest.mark.parametrize("given", ["float32", "bfloat16", "float16"])
def test_a_given_model_dtype_is_kept(monkeypatch, given):
    monkeypatch.setattr("otb_tir.machine.native_bf16", lambda: "")
    cfg = _cfg(**{"model.dtype": given})
    assert parts.model_dtype_for(cfg, _Counted(10**9), torch.device("cpu")) == given


def test_the_default_is_auto_and_the_rollout_rule_has_its_own_threshold(monkeypatch):
    """The shipped default is auto for both; between 20M and 100M parameters the engine samples in
    bfloat16 while the actor stays float32 (its update measured 0.86x at 30M with autocast)."""
    cfg = _cfg()
    assert cfg.model.dtype == "auto" and cfg.rollout.dtype == "auto"
    monkeypatch.setattr("otb_tir.machine.native_bf16", lambda: "avx512_bf16")
    mid = _Counted(30_000_000)
    assert parts.rollout_dtype_for(cfg, mid, torch.device("cpu")) == "bfloat16"
    assert parts.model_dtype_for(cfg, mid, torch.device("cpu")) == "float32"


def test_the_built_in_policy_trains_in_float32_under_auto(tiny_model_factory):
    """README command 1's policy (1.3M parameters) is below both thresholds on every machine: its
    held-out figure does not move with this rule."""
    model = tiny_model_factory()
    cfg = _cfg()
    assert parts.model_dtype_for(cfg, model, torch.device("cpu")) == "float32"
    assert parts.rollout_dtype_for(cfg, model, torch.device("cpu")) == "float32"


def test_an_unknown_model_dtype_is_refused_at_start():
    from otb_tir import ConfigError

    with pytest.raises(ConfigError, match="model.dtype"):
        load_config(None, ["model.dtype=bf16"])
    assert OmegaConf.select(load_config(None, ["model.dtype=auto"]), "model.dtype") == "auto"


@pytest.mark.parametrize(
    ("shape", "native", "want"),
    [("qwen3-0.6b", "avx512_bf16", "bfloat16"), ("qwen3-0.6b", "", "float32"), ("30m", "avx512_bf16", "float32")],
)
def test_the_folder_rule_counts_the_config_without_weights(tmp_path, monkeypatch, shape, native, want):
    """A run that does not build the actor here (the cold start, trainer=verl) decides from the folder's
    config.json alone: the same rule on a meta-device copy, no weights read or allocated."""
    from otb_tir.defaults.shapes import shape_config

    shape_config(shape).save_pretrained(tmp_path)  # a config.json and nothing else
    monkeypatch.setattr("otb_tir.machine.native_bf16", lambda: native)
    assert parts.model_dtype_for_folder(_cfg(), tmp_path) == want
    assert parts.model_dtype_for_folder(_cfg(**{"model.dtype": "float16"}), tmp_path) == "float16"
