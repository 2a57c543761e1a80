"""Optional dependencies the tests need: a skip on a developer's machine, an error under CI.

``.ci/run`` installs every optional dependency the suite uses (verl as the estimators' oracle, TRL,
openai-harmony, …); if one of them failed to install or import there, a skip would turn every check
that needs it green. So under ``CI`` (set by ``.ci/run``) :func:`need` and :func:`unavailable` fail
the test, naming the module and the import error, instead of skipping it.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

__all__ = ["in_ci", "need", "unavailable"]


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def unavailable(reason: str) -> None:
    """Skip with ``reason``; under CI, fail with it (at module level this fails the collection)."""
    if in_ci():
        pytest.fail(f"{reason} (CI must not skip this)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)  # also at a module's top, as importorskip


def need(module: str, reason: str = "") -> ModuleType:
    """``import module`` or skip (fail under CI) saying why: the drop-in for ``pytest.importorskip``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        why = f"{module} cannot be imported ({type(exc).__name__}: {exc})"
        unavailable(f"{why}: {reason}" if reason else why)
        raise  # not reached: unavailable() raises pytest's Skipped/Failed
