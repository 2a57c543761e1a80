"""The calculator's evaluator: text → sympy objects → a compact answer, never Python's ``eval``.

This module is the whole of what runs for one calculator call, and it runs *inside the python
tool's sandbox*: ``tools/calculator.py`` sends its source, with the expression, to a
``PythonTool`` worker as a snippet, so a calculation gets the sandbox's wall-clock limit, memory
limit and crash isolation. It therefore imports only the standard library and sympy (the sandbox
cannot see the otb-tir packages); error kinds are the *names* of ``tools.base.ErrorKind``
attributes (``"BLOCKED"``), mapped to their values by the host. Calling :func:`calculate` here
directly has no bounds at all.

1. sympy's tokenizer-level transformations (``stringify_expr``: numbers → ``Integer``/``Float``,
   unknown names → ``Symbol``, ``^`` → ``**``, ``2x`` → ``2*x``, ``5!`` → ``factorial(5)``) turn
   the text into Python source, which is *parsed* (``ast.parse``), never executed.
2. A small interpreter walks that syntax tree and builds sympy objects itself. It accepts only
   numbers, symbols, arithmetic operators, comparisons (``=`` is an equation), lists/tuples and
   calls of whitelisted functions by name. Attribute access, subscripts, strings, lambdas,
   comprehensions, keyword arguments and any name with ``__`` are refused (``BLOCKED``).

Answers are compact: ``3/4``, ``2*sqrt(2) ≈ 2.82842712``, ``120``, ``x = -2, x = 2``; integers
with more than 1000 digits are given as a digit count and a 9-digit approximation.
"""

from __future__ import annotations

import ast
import functools
import json
import operator
import re
from typing import Any

APPROX_DIGITS = 9  # significant digits of the "≈" approximation
MAX_INTEGER_DIGITS = 1000  # longer integers are reported as a digit count and an approximation


class CalcError(Exception):
    """An expression the calculator refuses or cannot evaluate; ``kind`` names an ErrorKind attribute."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@functools.lru_cache(maxsize=1)
def _namespace() -> dict[str, Any]:
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
        "solve": _solve,
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


class _Solutions(list):
    """Marks a solve() result for formatting as ``x = ...``."""


def _solve(*args: Any) -> _Solutions:
    import sympy as sp

    if not args:
        raise CalcError("BAD_ARGUMENTS", "solve needs an equation, e.g. solve(2*x + 3 = 7, x)")
    found = sp.solve(*args, dict=True)
    if not isinstance(found, list):  # inequalities give a relational
        return _Solutions([found])
    return _Solutions(found)


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
    ast.FloorDiv: operator.floordiv,
}
_CONSTRUCTORS = {"Integer", "Float", "Rational", "Symbol"}
_IDENT = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def _relations() -> dict[type, Any]:
    import sympy as sp

    return {ast.Eq: sp.Eq, ast.NotEq: sp.Ne, ast.Lt: sp.Lt, ast.LtE: sp.Le, ast.Gt: sp.Gt, ast.GtE: sp.Ge}


class _Interpreter:
    """Builds sympy objects from a vetted syntax tree (the only 'evaluator'; no eval/exec)."""

    def __init__(self) -> None:
        self.names = _namespace()
        self.relations = _relations()

    def run(self, node: ast.AST) -> Any:
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            raise CalcError("BLOCKED", f"{_describe(node)} is not allowed in a calculator expression")
        return method(node)

    def _Expression(self, node: ast.Expression) -> Any:
        return self.run(node.body)

    def _Constant(self, node: ast.Constant) -> Any:
        import sympy as sp

        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalcError("BLOCKED", f"the literal {value!r} is not allowed (numbers only)")
        return sp.Integer(value) if isinstance(value, int) else sp.Float(value)

    def _Name(self, node: ast.Name) -> Any:
        if "__" in node.id:
            raise CalcError("BLOCKED", f"the name {node.id!r} is not allowed")
        value = self.names.get(node.id)
        if value is None:
            raise CalcError("SYNTAX", f"unknown name {node.id!r}")
        if callable(value):
            raise CalcError("SYNTAX", f"{node.id} is a function: call it with arguments, e.g. {node.id}(...)")
        return value

    def _BinOp(self, node: ast.BinOp) -> Any:
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise CalcError("BLOCKED", f"the operator {type(node.op).__name__} is not allowed")
        return op(self.run(node.left), self.run(node.right))

    def _UnaryOp(self, node: ast.UnaryOp) -> Any:
        if isinstance(node.op, ast.USub):
            return -self.run(node.operand)
        if isinstance(node.op, ast.UAdd):
            return self.run(node.operand)
        raise CalcError("BLOCKED", f"the operator {type(node.op).__name__} is not allowed")

    def _Compare(self, node: ast.Compare) -> Any:
        if len(node.ops) != 1:
            raise CalcError("SYNTAX", "chained comparisons are not supported; write each equation separately")
        relation = self.relations.get(type(node.ops[0]))
        if relation is None:
            raise CalcError("BLOCKED", f"the comparison {type(node.ops[0]).__name__} is not allowed")
        # unevaluated, so `x = x + 1` is still an equation (with no solution) rather than False
        return relation(self.run(node.left), self.run(node.comparators[0]), evaluate=False)

    def _List(self, node: ast.List) -> Any:
        return [self.run(e) for e in node.elts]

    def _Tuple(self, node: ast.Tuple) -> Any:
        return tuple(self.run(e) for e in node.elts)

    def _Call(self, node: ast.Call) -> Any:
        func = node.func
        if isinstance(func, ast.Call) and isinstance(func.func, ast.Name) and func.func.id == "Function":
            # sympy's tokenizer turns an unknown `foo(...)` into Function('foo')(...)
            arg = func.args[0] if func.args else None
            name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else "?"
            kind = "BLOCKED" if "__" in name else "SYNTAX"
            raise CalcError(kind, f"unknown function {name!r}; available: {', '.join(FUNCTIONS)}")
        if not isinstance(func, ast.Name):
            raise CalcError("BLOCKED", f"calling {_describe(func)} is not allowed; call functions by name")
        if node.keywords:
            raise CalcError("BLOCKED", f"keyword arguments are not supported ({func.id}(...))")
        if any(isinstance(a, ast.Starred) for a in node.args):
            raise CalcError("BLOCKED", "starred arguments are not allowed")
        if "__" in func.id or func.id not in self.names:
            kind = "BLOCKED" if "__" in func.id else "SYNTAX"
            raise CalcError(kind, f"unknown function {func.id!r}; available: {', '.join(FUNCTIONS)}")
        if func.id in _CONSTRUCTORS:
            return self._construct(func.id, node.args)
        target = self.names[func.id]
        if not callable(target):
            raise CalcError("SYNTAX", f"{func.id} is a constant, not a function")
        return target(*[self.run(a) for a in node.args])

    def _construct(self, name: str, args: list[ast.expr]) -> Any:
        import sympy as sp

        if name == "Rational":
            return sp.Rational(*[self.run(a) for a in args])
        if name in ("Integer", "Float") and len(args) == 1 and isinstance(args[0], ast.Call):
            inner = self.run(args[0])  # repeated decimals: Integer(Integer(0))
            return sp.Integer(inner) if name == "Integer" else sp.Float(inner)
        if (
            len(args) != 1
            or not isinstance(args[0], ast.Constant)
            or isinstance(args[0].value, bool)
            or not isinstance(args[0].value, (int, str, float))
        ):
            raise CalcError("BLOCKED", f"{name}(...) takes a single literal")
        value = args[0].value
        if name == "Symbol":
            if not isinstance(value, str) or not _IDENT.match(value) or "__" in value:
                raise CalcError("BLOCKED", f"the name {value!r} is not allowed")
            return sp.Symbol(value)
        if isinstance(value, str) and not re.fullmatch(r"[0-9.eE+\-_]+", value):
            raise CalcError("BLOCKED", f"{name}({value!r}) is not a number")
        return sp.Integer(value) if name == "Integer" else sp.Float(value)


def _describe(node: ast.AST) -> str:
    labels = {
        "Attribute": "attribute access (.)",
        "Subscript": "indexing ([])",
        "Lambda": "lambda",
        "ListComp": "a comprehension",
        "GeneratorExp": "a comprehension",
        "SetComp": "a comprehension",
        "DictComp": "a comprehension",
        "NamedExpr": "assignment (:=)",
        "IfExp": "if/else",
        "BoolOp": "and/or",
        "Dict": "a dict",
        "Set": "a set",
        "JoinedStr": "an f-string",
        "Await": "await",
        "Yield": "yield",
        "Starred": "*",
    }
    return labels.get(type(node).__name__, type(node).__name__)


_LONE_EQUALS = re.compile(r"(?<![=<>!])=(?!=)")


def _to_tree(expression: str) -> ast.Expression:
    from sympy.parsing.sympy_parser import (
        auto_number,
        auto_symbol,
        convert_xor,
        factorial_notation,
        implicit_multiplication,
        repeated_decimals,
        stringify_expr,
    )

    text = _LONE_EQUALS.sub("==", expression.strip())
    if not text:
        raise CalcError("BAD_ARGUMENTS", "empty expression")
    if "__" in text:
        raise CalcError("BLOCKED", "names containing '__' are not allowed")
    if any(q in text for q in ("'", '"', "`", "\\")):
        raise CalcError("BLOCKED", "quotes and backslashes are not allowed in a calculator expression")
    if re.search(r"\blambda\b", text):
        raise CalcError("BLOCKED", "lambda is not allowed in a calculator expression")
    for match in re.finditer(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(", text):
        # `x(x+1)` is a product, but a longer unknown name before '(' is a function the model expects
        if len(match.group(1)) > 1 and match.group(1) not in _namespace():
            raise CalcError("SYNTAX", f"unknown function {match.group(1)!r}; available: {', '.join(FUNCTIONS)}")
    transformations = (
        auto_symbol,
        repeated_decimals,
        auto_number,
        factorial_notation,
        implicit_multiplication,
        convert_xor,
    )
    # stringify_expr only rewrites tokens (no evaluation); its namespace tells which names are functions
    names = dict(_namespace())
    names["Function"] = object  # marks unknown calls; never evaluated (rejected by the interpreter)
    try:
        code = stringify_expr(text, {}, names, transformations)
        return ast.parse(code.strip(), mode="eval")
    except (SyntaxError, TypeError, ValueError, IndexError) as exc:
        detail = getattr(exc, "msg", None) or str(exc)
        raise CalcError("SYNTAX", f"cannot parse {expression!r}: {detail}") from None
    except Exception as exc:  # tokenize.TokenError and friends
        raise CalcError("SYNTAX", f"cannot parse {expression!r}: {exc}") from None


def calculate(expression: str, *, max_chars: int = 2000) -> tuple[bool, str | None, str]:
    """Evaluate ``expression`` in this process, unbounded (the tool runs it in the sandbox).
    Returns ``(ok, error_kind_name, text)``."""
    try:
        tree = _to_tree(expression)
        value = _Interpreter().run(tree)
        text = _format_top(value)
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


# ----------------------------------------------------------------------- formatting


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


def _format_top(value: Any) -> str:
    import sympy as sp

    if isinstance(value, _Solutions):
        return _format_solutions(list(value))
    if isinstance(value, sp.Rel):
        evaluated = value.func(*value.args)  # evaluate=True
        names = ", ".join(sorted(map(str, value.free_symbols)))
        if evaluated is sp.true:
            return f"True (for every value of {names})" if names else "True"
        if evaluated is sp.false:
            return "no solution" if names else "False"
        return _format_solutions(_solve(evaluated))
    return _format(value)


def reply(expression: str, max_chars: int) -> str:
    """What the sandboxed snippet prints: ``calculate``'s triple as one JSON line."""
    return json.dumps(calculate(expression, max_chars=max_chars))
