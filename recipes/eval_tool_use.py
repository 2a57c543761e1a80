#!/usr/bin/env python
"""Evaluate how well a model reasons with tools (accuracy with and without tools, tool calls,
errors by kind, turns; JSON + Markdown + PNG report).

A thin wrapper of ``otb-tir-eval`` (``otb_tir/eval.py``) for a checkout; same arguments:

    python recipes/eval_tool_use.py --model runs/tir_math/final output.name=after
    python recipes/eval_tool_use.py --help
"""

import sys

from otb_tir.eval import main

if __name__ == "__main__":
    sys.exit(main())
