"""The package's error and its install hints, at the bottom of ``agent_env``: every module imports
them from here (``agent_env`` re-exports both), so none imports the package's ``__init__``."""

from __future__ import annotations

__all__ = ["EnvError", "install_hint"]


class EnvError(Exception):
    """Bad episode configuration or an unusable chat template (never raised for model mistakes)."""


# extras with an install script of their own on a machine without a GPU (their pins differ)
_CPU_SCRIPTS = {"verl": "scripts/install_verl_env.sh", "vllm": "scripts/install_test_env.sh (.venv-vllm)"}


def install_hint(extra: str) -> str:
    """How to install the optional extra ``extra``: otb-tir is installed from its checkout (it is not
    on the package index), so the hint is the command that works there."""
    script = _CPU_SCRIPTS.get(extra.removesuffix("-cpu"))
    cpu = f"; on a machine without a GPU: bash {script}" if script else ""
    return f"pip install -e '.[{extra}]' in the otb-tir checkout{cpu}"
