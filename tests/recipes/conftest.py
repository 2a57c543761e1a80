from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def policy() -> Path:
    """The tiny policy that calls ``lookup`` on every turn (tests/support/tool_caller.py, cached)."""
    from tests.support.tool_caller import tool_caller_policy

    return tool_caller_policy()
