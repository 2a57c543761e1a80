"""The calculator's vocabulary: the functions and constants an expression may use, by name.

Part of the calculator's evaluator, which runs inside the python tool's sandbox (see
:mod:`tools.calculator_eval`): standard library and sympy only. :func:`namespace` is the whitelist
the interpreter (:mod:`tools.calculator_parse`) looks every name up in: sympy's functions and
constants under their usual spellings and aliases (``ln``, ``arcsin``, ``comb``, ``inf``), with a
few wrappers of our own: variadic ``gcd`` / ``lcm``, ``round`` half away from zero, and ``solve``
whose :class:`Solutions` are formatted as ``x = ...``. :class:`CalcError` is the error of every
evaluator module; its ``kind`` names a ``tools.base.ErrorKind`` attribute.
"""

from __future__ import annotations

import functools
from typing import Any


class CalcError(Exception):
    """An expression the calculator refuses or cannot evaluate; ``kind`` names an ErrorKind attribute."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@functools.lru_cache(maxsize=1)
def namespace() -> dict[str, Any]:
    """Whitelisted functions and constants, by the names an expression may use."""
    import sympy as sp

    def gcd(*args: Any) -> Any:
        return functools.reduce(sp.gcd, args)

    def lcm(*args: Any) -> Any:
        return functools.reduce(sp.lcm, args)

    def log(x: Any, base: Any = None) -> Any:
        return sp.log(x) if base is None else sp.log(x, base)

    names: dict[str, Any] = {
        # constants
        "pi": sp.pi,
        "E": sp.E,
        "e": sp.E,
        "I": sp.I,
        "oo": sp.oo,
        "inf": sp.oo,
        "infinity": sp.oo,
        # arithmetic, number theory
        "sqrt": sp.sqrt,
        "cbrt": sp.cbrt,
        "root": sp.root,
        "Abs": sp.Abs,
        "abs": sp.Abs,
        "sign": sp.sign,
        "factorial": sp.factorial,
        "binomial": sp.binomial,
        "comb": sp.binomial,
        "gcd": gcd,
        "lcm": lcm,
        "Mod": sp.Mod,
        "mod": sp.Mod,
        "floor": sp.floor,
        "ceiling": sp.ceiling,
        "ceil": sp.ceiling,
        "Min": sp.Min,
        "min": sp.Min,
        "Max": sp.Max,
        "max": sp.Max,
        "round": _round,
        "isprime": sp.isprime,
        "prime": sp.prime,
        "nextprime": sp.nextprime,
        "primefactors": sp.primefactors,
        "factorint": sp.factorint,
        "divisors": sp.divisors,
        "totient": sp.totient,
        "fibonacci": sp.fibonacci,
        "re": sp.re,
        "im": sp.im,
        "conjugate": sp.conjugate,
        "arg": sp.arg,
        # elementary functions
        "exp": sp.exp,
        "log": log,
        "ln": sp.log,
        "log10": lambda x: sp.log(x, 10),
        "log2": lambda x: sp.log(x, 2),
        "sin": sp.sin,
        "cos": sp.cos,
        "tan": sp.tan,
        "cot": sp.cot,
        "sec": sp.sec,
        "csc": sp.csc,
        "asin": sp.asin,
        "acos": sp.acos,
        "atan": sp.atan,
        "atan2": sp.atan2,
        "arcsin": sp.asin,
        "arccos": sp.acos,
        "arctan": sp.atan,
        "sinh": sp.sinh,
        "cosh": sp.cosh,
        "tanh": sp.tanh,
        # algebra and calculus
        "simplify": sp.simplify,
        "expand": sp.expand,
        "factor": sp.factor,
        "cancel": sp.cancel,
        "apart": sp.apart,
        "together": sp.together,
        "nsimplify": sp.nsimplify,
        "N": sp.N,
        "diff": sp.diff,
        "integrate": sp.integrate,
        "limit": sp.limit,
        "summation": sp.summation,
        "product": sp.product,
        "Eq": sp.Eq,
        "solve": solve,
        # what sympy's tokenizer emits
        "Integer": sp.Integer,
        "Float": sp.Float,
        "Rational": sp.Rational,
        "Symbol": sp.Symbol,
    }
    return names


FUNCTIONS: tuple[str, ...] = (
    "sqrt cbrt root abs factorial binomial gcd lcm mod floor ceiling min max round isprime prime "
    "nextprime primefactors factorint divisors totient fibonacci re im conjugate exp log ln log10 "
    "log2 sin cos tan asin acos atan atan2 sinh cosh tanh simplify expand factor cancel apart "
    "together nsimplify N diff integrate limit summation product Eq solve"
).split()


def _round(x: Any, digits: Any = None) -> Any:
    """Round half away from zero; ``round(2.567, 2)`` → 2.57, ``round(7/2)`` → 4."""
    import sympy as sp

    x = sp.sympify(x)
    if not (x.is_number and x.is_real):
        raise CalcError("RUNTIME", "round() needs a real number")
    scale = sp.Integer(10) ** (0 if digits is None else int(digits))
    magnitude = sp.floor(abs(x) * scale + sp.Rational(1, 2))
    value = sp.sign(x) * magnitude / scale
    return value if digits is None or value.is_Integer else sp.Float(value, 15)


class Solutions(list):
    """Marks a solve() result for formatting as ``x = ...``."""


def solve(*args: Any) -> Solutions:
    import sympy as sp

    if not args:
        raise CalcError("BAD_ARGUMENTS", "solve needs an equation, e.g. solve(2*x + 3 = 7, x)")
    found = sp.solve(*args, dict=True)
    if not isinstance(found, list):  # inequalities give a relational
        return Solutions([found])
    return Solutions(found)
