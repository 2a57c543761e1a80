"""The calculator's evaluator: text → sympy objects → a compact answer, never Python's ``eval``.

This module and its three siblings below are the whole of what runs for one calculator call, and
they run *inside the python tool's sandbox*: ``tools/calculator.py`` sends their code, with the
expression, to a ``PythonTool`` worker as a snippet, so a calculation gets the sandbox's
wall-clock limit, memory limit and crash isolation. They therefore import only the standard
library, sympy and each other, by their full names (the sandbox cannot see the otb-tir packages:
the snippet defines these four modules itself); error kinds are the *names* of
``tools.base.ErrorKind`` attributes (``"BLOCKED"``), mapped to their values by the host. Calling
:func:`calculate` here directly has no bounds at all.

1. :mod:`tools.calculator_parse`: sympy's tokenizer-level transformations (``stringify_expr``:
   numbers → ``Integer``/``Float``, unknown names → ``Symbol``, ``^`` → ``**``, ``2x`` → ``2*x``,
   ``5!`` → ``factorial(5)``) turn the text into Python source, which is *parsed*
   (``ast.parse``), never executed.
2. :mod:`tools.calculator_parse` again: a small interpreter walks that syntax tree and builds
   sympy objects itself. It accepts only numbers, symbols, arithmetic operators, comparisons
   (``=`` is an equation), lists/tuples and calls of whitelisted functions
   (:mod:`tools.calculator_names`) by name. Attribute access, subscripts, strings, lambdas,
   comprehensions, keyword arguments and any name with ``__`` are refused (``BLOCKED``).
3. :mod:`tools.calculator_format`: answers are compact: ``3/4``, ``2*sqrt(2) ≈ 2.82842712``,
   ``120``, ``x = -2, x = 2``; integers with more than 1000 digits are given as a digit count
   and a 9-digit approximation.
"""

from __future__ import annotations

import json

from tools.calculator_format import format_top
from tools.calculator_names import CalcError
from tools.calculator_parse import Interpreter, to_tree


def calculate(expression: str, *, max_chars: int = 2000) -> tuple[bool, str | None, str]:
    """Evaluate ``expression`` in this process, unbounded (the tool runs it in the sandbox).
    Returns ``(ok, error_kind_name, text)``."""
    try:
        tree = to_tree(expression)
        value = Interpreter().run(tree)
        text = format_top(value)
    except CalcError as exc:
        return False, exc.kind, f"Error: {exc}"
    except MemoryError:
        return False, "MEMORY", "Error: the calculation ran out of memory; the numbers are too large"
    except RecursionError:
        return False, "RUNTIME", "Error: the expression is nested too deeply"
    except ZeroDivisionError:
        return False, "RUNTIME", "Error: division by zero"
    except Exception as exc:  # noqa: BLE001 - sympy raises many kinds; the model reads the message
        message = " ".join(str(exc).split())[:300]
        return False, "RUNTIME", f"Error: {type(exc).__name__}: {message}"
    if len(text) > max_chars:
        return True, "OUTPUT_CUT", text[:max_chars] + f" … [result cut: {len(text)} characters in all]"
    return True, None, text


def reply(expression: str, max_chars: int) -> str:
    """What the sandboxed snippet prints: ``calculate``'s triple as one JSON line."""
    return json.dumps(calculate(expression, max_chars=max_chars))
