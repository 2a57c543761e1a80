"""What the worker's interpreter runs: the model's snippet (in a hardened child) and, once at
start, the imports and trusted warm-up that every child then inherits.

Part of the sandbox worker (``worker.py`` loads this file by path, next to itself, and the
backends mount it read-only beside it): standard library only.
"""

from __future__ import annotations

import ast
import linecache
import sys
import traceback

SNIPPET = "<snippet>"


def _trimmed_traceback(exc: BaseException) -> str:
    """The traceback, keeping only frames of the user's snippet (not the runner, not libraries)."""
    te = traceback.TracebackException.from_exception(exc, capture_locals=False)

    def trim(t):
        while t is not None:
            t.stack = traceback.StackSummary.from_list([fr for fr in t.stack if fr.filename == SNIPPET])
            if t.__cause__ is not None:
                trim(t.__cause__)
            t = t.__context__ if not t.__suppress_context__ else None

    trim(te)
    return "".join(te.format())


def run_snippet(code: str, g: dict) -> str:
    """Run ``code`` in globals ``g``; print the value of a final bare expression (REPL style).
    Returns the status: ok, syntax, runtime or memory."""
    try:
        tree = ast.parse(code, SNIPPET, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        body = compile(tree, SNIPPET, "exec")
        last_code = compile(last, SNIPPET, "eval") if last is not None else None
    except (SyntaxError, ValueError) as e:
        sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        return "syntax"
    linecache.cache[SNIPPET] = (len(code), None, code.splitlines(True), SNIPPET)
    try:
        exec(body, g)  # noqa: S102 - this is the sandbox
        if last_code is not None:
            value = eval(last_code, g)  # noqa: S307
            if value is not None:
                print(repr(value))
        return "ok"
    except SystemExit as e:
        if e.code in (None, 0):
            return "ok"
        if not isinstance(e.code, int):
            sys.stderr.write(f"{e.code}\n")
        sys.stderr.write(f"SystemExit: {e.code}\n")
        return "runtime"
    except MemoryError as e:
        sys.stderr.write(_trimmed_traceback(e))
        sys.stderr.write("(the snippet exceeded its memory limit)\n")
        return "memory"
    except BaseException as e:  # noqa: BLE001 - report everything to the model
        sys.stderr.write(_trimmed_traceback(e))
        return "runtime"
    finally:
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:  # noqa: BLE001
                pass


_WARMUP = {
    # first calls of common functions import their submodules lazily; doing it once here saves
    # every forked child from doing it again
    "sympy": """
import sympy as sp
x, y = sp.symbols("x y")
sp.factor(x**4 - 1); sp.expand((x + 1)**3); sp.solve(x**2 - 4, x); sp.simplify(sp.sin(x)**2 + sp.cos(x)**2)
sp.integrate(x * sp.exp(x), x); sp.diff(sp.sin(x), x); sp.limit(sp.sin(x) / x, x, 0); sp.series(sp.exp(x), x, 0, 3)
sp.Rational(1, 3) + 1; sp.nsimplify(0.5); sp.sqrt(8); sp.latex(x**2); sp.N(sp.pi, 30); sp.factorint(360)
sp.isprime(97); sp.binomial(10, 3); sp.Matrix([[1, 2], [3, 4]]).det(); sp.linsolve([x + y - 2, x - y], (x, y))
sp.summation(x, (x, 1, 10)); sp.gcd(12, 18); sp.Poly(x**2 + 1, x).all_coeffs(); sp.sympify("x + 1")
""",
    "numpy": """
import numpy as np
a = np.arange(12.0).reshape(3, 4); np.linalg.det(np.eye(3) * 2); np.linalg.solve(np.eye(2), np.ones(2))
np.linalg.inv(np.eye(2)); np.fft.fft(np.ones(4)); np.random.default_rng(0).random(3)
np.polyfit([0, 1, 2], [0, 1, 4], 2)
np.mean(a); np.std(a); np.sort(a, axis=0); np.unique(a); str(a); repr(a); np.array2string(a)
""",
    "math": "import math, fractions, decimal, itertools, functools, collections, statistics, cmath, re, "
    "json, heapq, bisect, string, random, operator, datetime\n",
}


def _warm_up(preloaded: list[str]) -> None:
    for mod in ("math", "numpy", "sympy"):
        if mod in preloaded:
            try:
                exec(compile(_WARMUP[mod], f"<warmup:{mod}>", "exec"), {})  # noqa: S102
            except Exception:  # noqa: BLE001 - warm-up is an optimisation only
                pass


def preload(modules: list[str], warmup: bool = True) -> list[str]:
    """Import ``modules`` (those missing are skipped) and warm them up; returns those imported."""
    preloaded = []
    for mod in modules:
        try:
            __import__(mod)
            preloaded.append(mod)
            if mod == "numpy":
                import numpy.random  # noqa: F401 - lazily loaded in numpy 2; seeded per child
        except Exception:  # noqa: BLE001 - a missing optional library is not fatal
            pass
    if warmup:
        _warm_up(preloaded)
    return preloaded


def prelude(code: str | None) -> str | None:
    """Run the tool's ``prelude`` once, here in the worker before any spare is forked, so every
    snippet's child starts with what it defined (modules in ``sys.modules``, warmed caches) without
    paying for it. It is the host's own trusted code, not a snippet. Returns None, or why it
    failed (the host then stops the worker's start with that message)."""
    if not code:
        return None
    try:
        exec(compile(code, "<prelude>", "exec"), {"__name__": "__prelude__"})  # noqa: S102 - the host's code
    except BaseException as e:  # noqa: BLE001 - reported to the host in the ready frame
        return "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]
    return None
