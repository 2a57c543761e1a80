"""The calculator's parser and interpreter: text → a vetted syntax tree → sympy objects.

Part of the calculator's evaluator, which runs inside the python tool's sandbox (see
:mod:`tools.calculator_eval`): standard library, sympy and the sibling
:mod:`tools.calculator_names` only. :func:`to_tree` refuses what can never be an expression (``__``
names, quotes, backslashes, ``lambda``, an unknown function name), lets sympy's tokenizer-level
transformations rewrite the text into Python source and *parses* it (``ast.parse``), never executes
it. :class:`Interpreter` walks that tree and builds sympy objects itself, accepting only numbers,
symbols, arithmetic operators, comparisons (``=`` is an equation), lists/tuples and calls of the
whitelisted functions (:func:`tools.calculator_names.namespace`) by name; anything else is
``BLOCKED``.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from tools.calculator_names import FUNCTIONS, CalcError, namespace

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


class Interpreter:
    """Builds sympy objects from a vetted syntax tree (the only 'evaluator'; no eval/exec)."""

    def __init__(self) -> None:
        self.names = namespace()
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


def to_tree(expression: str) -> ast.Expression:
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
        if len(match.group(1)) > 1 and match.group(1) not in namespace():
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
    names = dict(namespace())
    names["Function"] = object  # marks unknown calls; never evaluated (rejected by the interpreter)
    try:
        code = stringify_expr(text, {}, names, transformations)
        return ast.parse(code.strip(), mode="eval")
    except (SyntaxError, TypeError, ValueError, IndexError) as exc:
        detail = getattr(exc, "msg", None) or str(exc)
        raise CalcError("SYNTAX", f"cannot parse {expression!r}: {detail}") from None
    except Exception as exc:  # tokenize.TokenError and friends
        raise CalcError("SYNTAX", f"cannot parse {expression!r}: {exc}") from None
