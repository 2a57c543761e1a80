"""The ``calculator`` tool: exact arithmetic and simple algebra with sympy, never Python's ``eval``.

How an expression is evaluated:

1. sympy's tokenizer-level transformations (``stringify_expr``: numbers → ``Integer``/``Float``,
   unknown names → ``Symbol``, ``^`` → ``**``, ``2x`` → ``2*x``, ``5!`` → ``factorial(5)``) turn
   the text into Python source, which is *parsed* (``ast.parse``), never executed.
2. A small interpreter walks that syntax tree and builds sympy objects itself. It accepts only
   numbers, symbols, arithmetic operators, comparisons (``=`` is an equation), lists/tuples and
   calls of whitelisted functions by name. Attribute access, subscripts, strings, lambdas,
   comprehensions, keyword arguments and any name with ``__`` are refused (``ErrorKind.BLOCKED``).
3. Evaluation runs in a child process forked per call from a long-lived worker that has sympy
   preloaded (~3 ms per fork), under a wall-clock timeout (the child is SIGKILLed: sympy can hang
   in C/bigint code where a thread could not be stopped), an address-space limit and a CPU limit.
   Results are capped in size.

Answers are compact: ``3/4``, ``2*sqrt(2) ≈ 2.82842712``, ``120``, ``x = -2, x = 2``; integers
with more than 1000 digits are given as a digit count and a 9-digit approximation.
"""

from __future__ import annotations

import ast
import asyncio
import atexit
import collections
import functools
import itertools
import json
import logging
import math
import operator
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from tools.base import ErrorKind, Tool, ToolError, ToolResult

__all__ = ["CalculatorTool", "calculate", "FUNCTIONS", "shutdown_worker"]

logger = logging.getLogger(__name__)

APPROX_DIGITS = 9  # significant digits of the "≈" approximation
MAX_INTEGER_DIGITS = 1000  # longer integers are reported as a digit count and an approximation


# ======================================================================= pure evaluation (child side)

class CalcError(Exception):
    """An expression the calculator refuses or cannot evaluate; ``kind`` is an ErrorKind."""

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
        "pi": sp.pi, "E": sp.E, "e": sp.E, "I": sp.I, "oo": sp.oo, "inf": sp.oo, "infinity": sp.oo,
        # arithmetic, number theory
        "sqrt": sp.sqrt, "cbrt": sp.cbrt, "root": sp.root, "Abs": sp.Abs, "abs": sp.Abs, "sign": sp.sign,
        "factorial": sp.factorial, "binomial": sp.binomial, "comb": sp.binomial, "gcd": gcd, "lcm": lcm,
        "Mod": sp.Mod, "mod": sp.Mod, "floor": sp.floor, "ceiling": sp.ceiling, "ceil": sp.ceiling,
        "Min": sp.Min, "min": sp.Min, "Max": sp.Max, "max": sp.Max, "round": _round,
        "isprime": sp.isprime, "prime": sp.prime, "nextprime": sp.nextprime, "primefactors": sp.primefactors,
        "factorint": sp.factorint, "divisors": sp.divisors, "totient": sp.totient, "fibonacci": sp.fibonacci,
        "re": sp.re, "im": sp.im, "conjugate": sp.conjugate, "arg": sp.arg,
        # elementary functions
        "exp": sp.exp, "log": log, "ln": sp.log, "log10": lambda x: sp.log(x, 10), "log2": lambda x: sp.log(x, 2),
        "sin": sp.sin, "cos": sp.cos, "tan": sp.tan, "cot": sp.cot, "sec": sp.sec, "csc": sp.csc,
        "asin": sp.asin, "acos": sp.acos, "atan": sp.atan, "atan2": sp.atan2,
        "arcsin": sp.asin, "arccos": sp.acos, "arctan": sp.atan,
        "sinh": sp.sinh, "cosh": sp.cosh, "tanh": sp.tanh,
        # algebra and calculus
        "simplify": sp.simplify, "expand": sp.expand, "factor": sp.factor, "cancel": sp.cancel,
        "apart": sp.apart, "together": sp.together, "nsimplify": sp.nsimplify, "N": sp.N,
        "diff": sp.diff, "integrate": sp.integrate, "limit": sp.limit, "summation": sp.summation,
        "product": sp.product, "Eq": sp.Eq, "solve": _solve,
        # what sympy's tokenizer emits
        "Integer": sp.Integer, "Float": sp.Float, "Rational": sp.Rational, "Symbol": sp.Symbol,
    }
    return names


FUNCTIONS: tuple[str, ...] = (
    "sqrt cbrt root abs factorial binomial gcd lcm mod floor ceiling min max round isprime prime "
    "nextprime primefactors factorint divisors totient fibonacci re im conjugate exp log ln log10 "
    "log2 sin cos tan asin acos atan atan2 sinh cosh tanh simplify expand factor cancel apart "
    "together nsimplify N diff integrate limit summation product Eq solve").split()


def _round(x: Any, digits: Any = None) -> Any:
    """Round half away from zero; ``round(2.567, 2)`` → 2.57, ``round(7/2)`` → 4."""
    import sympy as sp

    x = sp.sympify(x)
    if not (x.is_number and x.is_real):
        raise CalcError(ErrorKind.RUNTIME, "round() needs a real number")
    scale = sp.Integer(10) ** (0 if digits is None else int(digits))
    magnitude = sp.floor(abs(x) * scale + sp.Rational(1, 2))
    value = sp.sign(x) * magnitude / scale
    return value if digits is None or value.is_Integer else sp.Float(value, 15)


class _Solutions(list):
    """Marks a solve() result for formatting as ``x = ...``."""


def _solve(*args: Any) -> _Solutions:
    import sympy as sp

    if not args:
        raise CalcError(ErrorKind.BAD_ARGUMENTS, "solve needs an equation, e.g. solve(2*x + 3 = 7, x)")
    found = sp.solve(*args, dict=True)
    if not isinstance(found, list):  # inequalities give a relational
        return _Solutions([found])
    return _Solutions(found)


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow, ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv}
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
            raise CalcError(ErrorKind.BLOCKED, f"{_describe(node)} is not allowed in a calculator expression")
        return method(node)

    def _Expression(self, node: ast.Expression) -> Any:
        return self.run(node.body)

    def _Constant(self, node: ast.Constant) -> Any:
        import sympy as sp

        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalcError(ErrorKind.BLOCKED, f"the literal {value!r} is not allowed (numbers only)")
        return sp.Integer(value) if isinstance(value, int) else sp.Float(value)

    def _Name(self, node: ast.Name) -> Any:
        if "__" in node.id:
            raise CalcError(ErrorKind.BLOCKED, f"the name {node.id!r} is not allowed")
        value = self.names.get(node.id)
        if value is None:
            raise CalcError(ErrorKind.SYNTAX, f"unknown name {node.id!r}")
        if callable(value):
            raise CalcError(ErrorKind.SYNTAX, f"{node.id} is a function: call it with arguments, e.g. {node.id}(...)")
        return value

    def _BinOp(self, node: ast.BinOp) -> Any:
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise CalcError(ErrorKind.BLOCKED, f"the operator {type(node.op).__name__} is not allowed")
        return op(self.run(node.left), self.run(node.right))

    def _UnaryOp(self, node: ast.UnaryOp) -> Any:
        if isinstance(node.op, ast.USub):
            return -self.run(node.operand)
        if isinstance(node.op, ast.UAdd):
            return self.run(node.operand)
        raise CalcError(ErrorKind.BLOCKED, f"the operator {type(node.op).__name__} is not allowed")

    def _Compare(self, node: ast.Compare) -> Any:
        if len(node.ops) != 1:
            raise CalcError(ErrorKind.SYNTAX, "chained comparisons are not supported; write one equation at a time")
        relation = self.relations.get(type(node.ops[0]))
        if relation is None:
            raise CalcError(ErrorKind.BLOCKED, f"the comparison {type(node.ops[0]).__name__} is not allowed")
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
            kind = ErrorKind.BLOCKED if "__" in name else ErrorKind.SYNTAX
            raise CalcError(kind, f"unknown function {name!r}; available: {', '.join(FUNCTIONS)}")
        if not isinstance(func, ast.Name):
            raise CalcError(ErrorKind.BLOCKED, f"calling {_describe(func)} is not allowed; call functions by name")
        if node.keywords:
            raise CalcError(ErrorKind.BLOCKED, f"keyword arguments are not supported ({func.id}(...))")
        if any(isinstance(a, ast.Starred) for a in node.args):
            raise CalcError(ErrorKind.BLOCKED, "starred arguments are not allowed")
        if "__" in func.id or func.id not in self.names:
            kind = ErrorKind.BLOCKED if "__" in func.id else ErrorKind.SYNTAX
            raise CalcError(kind, f"unknown function {func.id!r}; available: {', '.join(FUNCTIONS)}")
        if func.id in _CONSTRUCTORS:
            return self._construct(func.id, node.args)
        target = self.names[func.id]
        if not callable(target):
            raise CalcError(ErrorKind.SYNTAX, f"{func.id} is a constant, not a function")
        return target(*[self.run(a) for a in node.args])

    def _construct(self, name: str, args: list[ast.expr]) -> Any:
        import sympy as sp

        if name == "Rational":
            return sp.Rational(*[self.run(a) for a in args])
        if name in ("Integer", "Float") and len(args) == 1 and isinstance(args[0], ast.Call):
            inner = self.run(args[0])  # repeated decimals: Integer(Integer(0))
            return sp.Integer(inner) if name == "Integer" else sp.Float(inner)
        if len(args) != 1 or not isinstance(args[0], ast.Constant) or isinstance(args[0].value, bool) \
                or not isinstance(args[0].value, (int, str, float)):
            raise CalcError(ErrorKind.BLOCKED, f"{name}(...) takes a single literal")
        value = args[0].value
        if name == "Symbol":
            if not isinstance(value, str) or not _IDENT.match(value) or "__" in value:
                raise CalcError(ErrorKind.BLOCKED, f"the name {value!r} is not allowed")
            return sp.Symbol(value)
        if isinstance(value, str) and not re.fullmatch(r"[0-9.eE+\-_]+", value):
            raise CalcError(ErrorKind.BLOCKED, f"{name}({value!r}) is not a number")
        return sp.Integer(value) if name == "Integer" else sp.Float(value)


def _describe(node: ast.AST) -> str:
    labels = {"Attribute": "attribute access (.)", "Subscript": "indexing ([])", "Lambda": "lambda",
              "ListComp": "a comprehension", "GeneratorExp": "a comprehension", "SetComp": "a comprehension",
              "DictComp": "a comprehension", "NamedExpr": "assignment (:=)", "IfExp": "if/else",
              "BoolOp": "and/or", "Dict": "a dict", "Set": "a set", "JoinedStr": "an f-string",
              "Await": "await", "Yield": "yield", "Starred": "*"}
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
        raise CalcError(ErrorKind.BAD_ARGUMENTS, "empty expression")
    if "__" in text:
        raise CalcError(ErrorKind.BLOCKED, "names containing '__' are not allowed")
    if any(q in text for q in ("'", '"', "`", "\\")):
        raise CalcError(ErrorKind.BLOCKED, "quotes and backslashes are not allowed in a calculator expression")
    if re.search(r"\blambda\b", text):
        raise CalcError(ErrorKind.BLOCKED, "lambda is not allowed in a calculator expression")
    for match in re.finditer(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(", text):
        # `x(x+1)` is a product, but a longer unknown name before '(' is a function the model expects
        if len(match.group(1)) > 1 and match.group(1) not in _namespace():
            raise CalcError(ErrorKind.SYNTAX, f"unknown function {match.group(1)!r}; available: {', '.join(FUNCTIONS)}")
    transformations = (auto_symbol, repeated_decimals, auto_number, factorial_notation, implicit_multiplication,
                       convert_xor)
    # stringify_expr only rewrites tokens (no evaluation); its global dict tells which names are functions
    names = dict(_namespace())
    names["Function"] = object  # marks unknown calls; never evaluated (rejected by the interpreter)
    try:
        code = stringify_expr(text, {}, names, transformations)
        return ast.parse(code.strip(), mode="eval")
    except (SyntaxError, TypeError, ValueError, IndexError) as exc:
        detail = getattr(exc, "msg", None) or str(exc)
        raise CalcError(ErrorKind.SYNTAX, f"cannot parse {expression!r}: {detail}") from None
    except Exception as exc:  # tokenize.TokenError and friends
        raise CalcError(ErrorKind.SYNTAX, f"cannot parse {expression!r}: {exc}") from None


def calculate(expression: str, *, max_chars: int = 2000) -> tuple[bool, str | None, str]:
    """Evaluate ``expression`` in this process (no time limit: the tool runs it in a child).
    Returns ``(ok, error_kind, text)``."""
    try:
        tree = _to_tree(expression)
        value = _Interpreter().run(tree)
        text = _format_top(value)
    except CalcError as exc:
        return False, exc.kind, f"Error: {exc}"
    except MemoryError:
        return False, ErrorKind.MEMORY, "Error: the calculation ran out of memory; the numbers are too large"
    except RecursionError:
        return False, ErrorKind.RUNTIME, "Error: the expression is nested too deeply"
    except ZeroDivisionError:
        return False, ErrorKind.RUNTIME, "Error: division by zero"
    except Exception as exc:  # noqa: BLE001 - sympy raises many kinds; the model reads the message
        message = " ".join(str(exc).split())[:300]
        return False, ErrorKind.RUNTIME, f"Error: {type(exc).__name__}: {message}"
    if len(text) > max_chars:
        return True, ErrorKind.OUTPUT_CUT, text[:max_chars] + f" … [result cut: {len(text)} characters in all]"
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
        re_text, im_text = _strip_float(sp.sstr(sp.Float(re_part, APPROX_DIGITS))), \
            _strip_float(sp.sstr(sp.Float(abs(im_part), APPROX_DIGITS)))
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
            parts.append(", ".join(f"{sp.sstr(k)} = {_format(v)}"
                                   for k, v in sorted(solution.items(), key=lambda kv: sp.sstr(kv[0]))))
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


# ======================================================================= worker (fork per call)

def _set_death_signal() -> None:
    """Die with the parent (Linux prctl PR_SET_PDEATHSIG); best effort elsewhere."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _run_child(request: dict[str, Any], write_fd: int) -> None:
    """In the forked child: limits, evaluate, write one JSON reply, exit."""
    import resource

    status = 0
    try:
        _set_death_signal()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        memory = int(request.get("memory_mb", 1024)) * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        cpu = max(1, math.ceil(float(request.get("timeout", 5.0))) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        ok, kind, text = calculate(str(request["expr"]), max_chars=int(request.get("max_chars", 2000)))
        data = json.dumps({"id": request["id"], "ok": ok, "error": kind, "text": text}).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view):]
    except MemoryError:
        status = 3
    except BaseException:  # noqa: BLE001 - the parent reports a crash from the exit status
        status = 1
    finally:
        os._exit(status)


@dataclass
class _Child:
    request_id: Any
    pid: int
    fd: int
    deadline: float
    buffer: bytearray


def _worker_main(max_parallel: int = 2) -> None:
    """Serve JSON-line requests on stdin: fork one child per request (at most ``max_parallel``
    at a time, the rest wait in a queue), reply on stdout."""
    # No PR_SET_PDEATHSIG here: it fires when the *thread* that spawned us exits (e.g. an
    # asyncio.to_thread worker), not the process. The parent's death closes our stdin instead.
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for warm in ("1/3 + sqrt(8)", "solve(x**2 - 4 = 0, x)", "factorial(5)"):
        calculate(warm)
    reply_limit = 4 * 1024 * 1024
    out = sys.stdout.buffer

    def reply(payload: dict[str, Any]) -> None:
        out.write(json.dumps(payload).encode() + b"\n")
        out.flush()

    out.write(b"READY\n")
    out.flush()
    selector = selectors.DefaultSelector()
    stdin_fd = sys.stdin.fileno()
    selector.register(stdin_fd, selectors.EVENT_READ, None)
    children: dict[int, _Child] = {}
    pending = b""
    queue: collections.deque[dict[str, Any]] = collections.deque()

    dying: set[int] = set()  # killed children not reaped yet (tearing down a huge heap can take ~1 s)

    def finish(child: _Child, payload: dict[str, Any] | None, *, kill: bool = False) -> None:
        selector.unregister(child.fd)
        os.close(child.fd)
        del children[child.fd]
        if kill:
            try:
                os.kill(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            dying.add(child.pid)
        else:  # the pipe closed: the child has exited (its memory is already gone)
            _, status = os.waitpid(child.pid, 0)
            if payload is None:
                payload = _crash_reply(child, status)
        assert payload is not None
        reply(payload)

    def reap() -> None:
        for pid in list(dying):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                dying.discard(pid)

    while True:
        now = time.monotonic()
        timeout = min((c.deadline for c in children.values()), default=now + 1.0) - now
        if dying:
            timeout = min(timeout, 0.05)
        for key, _ in selector.select(max(0.0, min(timeout, 1.0))):
            if key.fd == stdin_fd:
                chunk = os.read(stdin_fd, 1 << 16)
                if not chunk:
                    for child in list(children.values()):
                        os.kill(child.pid, signal.SIGKILL)
                        dying.add(child.pid)
                    for pid in dying:
                        os.waitpid(pid, 0)
                    return
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    queue.append(json.loads(line))
            else:
                child = children[key.fd]
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if chunk:
                    child.buffer += chunk
                    if len(child.buffer) > reply_limit:
                        finish(child, {"id": child.request_id, "ok": False, "error": ErrorKind.OUTPUT_CUT,
                                       "text": "Error: the result is too large to return"}, kill=True)
                    continue
                try:
                    payload = json.loads(child.buffer) if child.buffer else None
                except ValueError:
                    payload = None
                finish(child, payload)
        now = time.monotonic()
        for child in [c for c in children.values() if c.deadline <= now]:
            finish(child, {"id": child.request_id, "ok": False, "error": ErrorKind.TIMEOUT, "text": ""}, kill=True)
        while queue and len(children) < max_parallel:
            # the clock of a request starts when its child starts: queued work does not eat its time
            request = queue.popleft()
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                _run_child(request, write_fd)
            os.close(write_fd)
            os.set_blocking(read_fd, False)
            child = _Child(request["id"], pid, read_fd,
                           time.monotonic() + float(request.get("timeout", 5.0)), bytearray())
            children[read_fd] = child
            selector.register(read_fd, selectors.EVENT_READ, None)
        reap()
        if os.getppid() != parent:
            return


def _crash_reply(child: _Child, status: int) -> dict[str, Any]:
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
        return {"id": child.request_id, "ok": False, "error": ErrorKind.TIMEOUT, "text": ""}
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3:
        return {"id": child.request_id, "ok": False, "error": ErrorKind.MEMORY,
                "text": "Error: the calculation ran out of memory; the numbers are too large"}
    return {"id": child.request_id, "ok": False, "error": ErrorKind.RUNTIME,
            "text": f"Error: the evaluation crashed (status {status})"}


# ======================================================================= client (tool side)

class _WorkerClient:
    """One worker process per Python process, shared by every CalculatorTool; loop-agnostic
    (a reader thread resolves asyncio futures on whichever loop awaits them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner = os.getpid()
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[dict[str, Any]]]] = {}
        self._ids = itertools.count()
        self.restarts = 0
        self.max_parallel = max(1, os.cpu_count() or 1)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._owner == os.getpid()

    def ensure_started(self) -> None:
        with self._lock:
            if self._alive():
                return
            if self._owner != os.getpid():  # forked: the parent's worker and reader thread are not ours
                self._proc, self._pending, self._owner = None, {}, os.getpid()
            if self._proc is not None:
                self.restarts += 1
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env = dict(os.environ)
            env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            proc = subprocess.Popen(
                [sys.executable, "-c", f"from tools.calculator import _worker_main; _worker_main({self.max_parallel})"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != b"READY":
                proc.kill()
                proc.wait()
                raise ToolError("the calculator worker failed to start (is sympy installed?)")
            self._proc = proc
            pending: dict[int, Any] = {}
            self._pending = pending
            threading.Thread(target=self._read, args=(proc, pending), name="calculator-reader", daemon=True).start()
            logger.debug("calculator worker started (pid %d)", proc.pid)

    def _read(self, proc: subprocess.Popen[bytes], pending: dict[int, Any]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                payload = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                entry = pending.pop(payload.get("id"), None)
            if entry is not None:
                loop, future = entry
                loop.call_soon_threadsafe(_settle, future, payload)
        proc.wait()
        with self._lock:
            lost = list(pending.items())
            pending.clear()
        for request_id, (loop, future) in lost:
            payload = {"id": request_id, "ok": False, "error": ErrorKind.SANDBOX,
                       "text": "Error: the calculator worker stopped during the call; please retry"}
            try:
                loop.call_soon_threadsafe(_settle, future, payload)
            except RuntimeError:  # that loop is closed
                pass

    async def evaluate(self, request: dict[str, Any], wait_limit: float) -> dict[str, Any]:
        if not self._alive():
            await asyncio.to_thread(self.ensure_started)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        with self._lock:
            request_id = next(self._ids)
            proc, pending = self._proc, self._pending
            pending[request_id] = (loop, future)
            # requests queue in the worker: allow for the ones ahead of this one
            wait_limit *= 1 + len(pending) // self.max_parallel
        try:
            assert proc is not None and proc.stdin is not None
            proc.stdin.write(json.dumps({**request, "id": request_id}).encode() + b"\n")
            proc.stdin.flush()
        except (OSError, ValueError, AssertionError):
            with self._lock:
                pending.pop(request_id, None)
            return {"ok": False, "error": ErrorKind.SANDBOX,
                    "text": "Error: the calculator worker is not running; please retry"}
        try:
            return await asyncio.wait_for(future, wait_limit)
        except TimeoutError:  # the worker itself is wedged: replace it
            with self._lock:
                pending.pop(request_id, None)
            self.kill()
            return {"ok": False, "error": ErrorKind.SANDBOX,
                    "text": "Error: the calculator worker did not answer; it was restarted, please retry"}
        finally:
            with self._lock:
                pending.pop(request_id, None)

    def kill(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None and self._owner == os.getpid():
            proc.kill()
            proc.wait()


def _settle(future: asyncio.Future[Any], payload: dict[str, Any]) -> None:
    if not future.done():
        future.set_result(payload)


_CLIENT = _WorkerClient()
atexit.register(_CLIENT.kill)


def shutdown_worker() -> None:
    """Stop the shared calculator worker (it restarts on the next call)."""
    _CLIENT.kill()


class CalculatorTool(Tool):
    """``calculator``: exact arithmetic and simple algebra with sympy (see the module doc).

    Config: ``timeout`` seconds per expression, ``max_result_chars`` (longer results are cut and
    flagged ``ErrorKind.OUTPUT_CUT``), ``max_expression_chars``, ``memory_mb`` (address-space
    limit of the evaluating process).
    """

    name = "calculator"
    description = ("Evaluate a math expression exactly with sympy: arithmetic with fractions, powers (** or ^), "
                   "sqrt, factorial, binomial, gcd, lcm, mod, log/exp/trig, simplify/expand/factor, and solving "
                   "equations such as 'x**2 - 4 = 0' or 'solve(2*x + 3 = 7, x)'.")
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string",
                                      "description": "The expression or equation, e.g. '3/4 + 1/6' or '2*x + 3 = 7'."}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    def __init__(self, timeout: float = 5.0, max_result_chars: int = 2000, max_expression_chars: int = 2000,
                 memory_mb: int = 1024) -> None:
        for key, value in (("timeout", timeout), ("max_result_chars", max_result_chars),
                           ("max_expression_chars", max_expression_chars), ("memory_mb", memory_mb)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ToolError(f"calculator: {key} must be a positive number, got {value!r}")
        self.timeout = float(timeout)
        self.max_result_chars = int(max_result_chars)
        self.max_expression_chars = int(max_expression_chars)
        self.memory_mb = int(memory_mb)

    async def start(self) -> None:
        """Start the worker now (otherwise the first call does, ~1 s)."""
        await asyncio.to_thread(_CLIENT.ensure_started)

    async def call(self, args: dict[str, Any], *, session_id: str | None = None) -> ToolResult:
        expression = args.get("expression")
        if not isinstance(expression, str):
            return ToolResult(text="Error: 'expression' must be a string, e.g. {\"expression\": \"2+2\"}",
                              ok=False, error=ErrorKind.BAD_ARGUMENTS)
        if len(expression) > self.max_expression_chars:
            return ToolResult(text=f"Error: the expression is too long ({len(expression)} characters; "
                                   f"at most {self.max_expression_chars})", ok=False, error=ErrorKind.BAD_ARGUMENTS)
        request = {"expr": expression, "timeout": self.timeout, "max_chars": self.max_result_chars,
                   "memory_mb": self.memory_mb}
        reply = await _CLIENT.evaluate(request, wait_limit=self.timeout + 30.0)
        kind = reply.get("error")
        text = reply.get("text") or ""
        if kind == ErrorKind.TIMEOUT:
            text = (f"Error: the calculation took longer than {self.timeout:g} s and was stopped; "
                    "the numbers are probably too large, try a smaller or simpler expression")
        return ToolResult(text=text, ok=bool(reply.get("ok")), error=kind)
