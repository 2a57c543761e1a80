"""The calculator's answers: sympy objects → compact text.

Part of the calculator's evaluator, which runs inside the python tool's sandbox (see
:mod:`tools.calculator_eval`): standard library, sympy and the sibling
:mod:`tools.calculator_names` only. Exact values come first, with a 9-significant-digit
approximation where it adds something (``2*sqrt(2) ≈ 2.82842712``); floats lose trailing zeros;
integers with more than :data:`MAX_INTEGER_DIGITS` digits are given as a digit count and an
approximation; ``solve`` results and equations read ``x = -2, x = 2``, an identity ``True (for
every value of x)``, an equation without solutions ``no solution``.
"""

from __future__ import annotations

from typing import Any

from tools.calculator_names import Solutions, solve

APPROX_DIGITS = 9  # significant digits of the "≈" approximation
MAX_INTEGER_DIGITS = 1000  # longer integers are reported as a digit count and an approximation


def _strip_float(text: str) -> str:
    mantissa, sep, exponent = text.partition("e")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    if mantissa in ("-0", ""):
        mantissa = "0"
    return mantissa + (sep + exponent.lstrip("+") if sep else "")


def _format_float(value: Any, digits: int = 15) -> str:
    import sympy as sp

    return _strip_float(sp.sstr(sp.Float(value, digits)))


def _approx(value: Any) -> str:
    import sympy as sp

    approx = sp.N(value, APPROX_DIGITS)
    if approx.is_real and approx.is_Float:
        return _strip_float(sp.sstr(approx))
    re_part, im_part = approx.as_real_imag()
    if re_part.is_Number and im_part.is_Number:
        re_text, im_text = (
            _strip_float(sp.sstr(sp.Float(re_part, APPROX_DIGITS))),
            _strip_float(sp.sstr(sp.Float(abs(im_part), APPROX_DIGITS))),
        )
        sign = "-" if im_part < 0 else "+"
        imaginary = "I" if im_text == "1" else f"{im_text}*I"
        if re_part == 0:
            return f"{'-' if im_part < 0 else ''}{imaginary}"
        return f"{re_text} {sign} {imaginary}"
    return sp.sstr(approx)


def _format_integer(value: Any) -> str:
    import sympy as sp

    n = int(value)
    if abs(n).bit_length() <= MAX_INTEGER_DIGITS * 3.3219:
        text = str(n)
        if len(text) <= MAX_INTEGER_DIGITS:
            return text
    approx = sp.sstr(sp.N(value, APPROX_DIGITS))
    exponent = int(approx.rpartition("e")[2]) if "e" in approx else len(str(abs(n))) - 1
    return f"≈ {_strip_float(approx)} (an integer with {exponent + 1} digits)"


def _format(value: Any) -> str:
    import sympy as sp

    if isinstance(value, bool) or value is sp.true or value is sp.false:
        return str(bool(value))
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_format(k)}: {_format(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple, set, frozenset, sp.Tuple)):
        return "[" + ", ".join(_format(v) for v in value) + "]"
    if isinstance(value, int):
        return _format_integer(sp.Integer(value))
    if not isinstance(value, sp.Basic):
        return str(value)
    if value is sp.zoo:
        return "zoo (complex infinity, e.g. a division by zero)"
    if value is sp.nan:
        return "nan (undefined)"
    if value.is_Integer:
        return _format_integer(value)
    if value.is_Rational:
        return sp.sstr(value)
    if value.is_Float:
        return _format_float(value)
    if isinstance(value, sp.Expr) and value.is_number and not value.has(sp.oo, -sp.oo):
        if value.has(sp.I):
            value = sp.expand(value)
            if value.is_Integer or value.is_Rational:
                return _format(value)
        exact = sp.sstr(value)
        re_part, im_part = value.as_real_imag()
        if re_part.is_Rational and im_part.is_Rational:  # Gaussian rational: already exact and simple
            return exact
        if value.has(sp.Float):
            return _approx(value)
        approx = _approx(value)
        return exact if approx == exact else f"{exact} ≈ {approx}"
    return sp.sstr(value)


def _format_solutions(solutions: list[Any]) -> str:
    import sympy as sp

    if not solutions:
        return "no solution"
    parts = []
    for solution in solutions:
        if isinstance(solution, dict):
            if not solution:
                parts.append("any value (the equation always holds)")
                continue
            parts.append(
                ", ".join(
                    f"{sp.sstr(k)} = {_format(v)}" for k, v in sorted(solution.items(), key=lambda kv: sp.sstr(kv[0]))
                )
            )
        else:
            parts.append(_format(solution))
    single = all(isinstance(s, dict) and len(s) == 1 for s in solutions)
    return (", " if single else "; ").join(parts)


def format_top(value: Any) -> str:
    import sympy as sp

    if isinstance(value, Solutions):
        return _format_solutions(list(value))
    if isinstance(value, sp.Rel):
        evaluated = value.func(*value.args)  # evaluate=True
        names = ", ".join(sorted(map(str, value.free_symbols)))
        if evaluated is sp.true:
            return f"True (for every value of {names})" if names else "True"
        if evaluated is sp.false:
            return "no solution" if names else "False"
        return _format_solutions(solve(evaluated))
    return _format(value)
