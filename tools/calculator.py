"""The ``calculator`` tool: exact arithmetic and simple algebra with sympy, never Python's ``eval``.

The evaluator is :mod:`tools.calculator_eval` (an AST interpreter over sympy: see its doc for what
an expression may contain and how answers look). The tool runs it where the ``python`` tool runs
snippets: each call sends the evaluator's modules (their bytecode, or source) plus
``print(reply(<expression>))`` to a pool of sandbox workers (:class:`tools.sandbox.PythonTool`), so
a calculation gets the same bounds as a Python snippet: a wall-clock timeout (the child is
SIGKILLed: sympy can hang in C/bigint code, e.g. ``9**9**9**9`` or ``factorint`` of a huge number),
a CPU-time backstop, an address-space limit (``memory_mb``), and isolation (bubblewrap by default:
a crash or a kill of the evaluating process is an error result, never the caller's death). There is
no second worker mechanism and no unbounded in-process path: :func:`calculate` evaluates in this
process only for tests and tooling that want the bare evaluator.
"""

from __future__ import annotations

import base64
import json
import marshal
import zlib
from importlib.util import MAGIC_NUMBER
from pathlib import Path
from typing import Any

from tools import calculator_eval, calculator_format, calculator_names, calculator_parse
from tools.base import ErrorKind, Tool, ToolError, ToolResult
from tools.calculator_names import FUNCTIONS
from tools.sandbox import Backend, PythonTool

__all__ = ["CalculatorTool", "calculate", "FUNCTIONS"]

#: the evaluator's modules, each after the ones it imports: the order the snippet defines them in
EVALUATOR_MODULES = (calculator_names, calculator_parse, calculator_format, calculator_eval)


def _pack(data: bytes) -> str:
    return repr(base64.b64encode(zlib.compress(data, 9)))


def _program() -> str:
    """The snippet's first lines: they define the evaluator's modules from their bytecode when the
    sandbox's interpreter reads this one's (compiling ~550 lines would cost ~10 ms per call), else
    from their source (e.g. a docker image with another Python), and bind ``reply``. The modules
    import each other by name, so each is in ``sys.modules`` while they load; afterwards
    ``sys.modules`` is as it was (a snippet run in this process leaves the real modules there)."""
    entries = ""
    for module in EVALUATOR_MODULES:
        text = Path(module.__file__).read_text(encoding="utf-8")
        bytecode = _pack(marshal.dumps(compile(text, module.__name__.rpartition(".")[2], "exec")))
        entries += f"    ({module.__name__!r}, {bytecode}, {_pack(text.encode('utf-8'))}),\n"
    names = tuple(m.__name__ for m in EVALUATOR_MODULES)
    return (
        "import base64, marshal, sys, types, zlib\nfrom importlib.util import MAGIC_NUMBER\n"
        f"_same = MAGIC_NUMBER == {MAGIC_NUMBER!r}\n"
        f"_saved = {{_name: sys.modules.pop(_name, None) for _name in {names!r}}}\n"
        "try:\n"
        "    for _name, _code, _text in (\n" + entries + "    ):\n"
        "        _module = sys.modules[_name] = types.ModuleType(_name)\n"
        "        exec(marshal.loads(zlib.decompress(base64.b64decode(_code))) if _same\n"
        "             else zlib.decompress(base64.b64decode(_text)).decode(), _module.__dict__)\n"
        "    reply = _module.reply\n"
        "finally:\n"
        "    for _name, _old in _saved.items():\n"
        "        sys.modules.pop(_name, None)\n"
        "        if _old is not None:\n"
        "            sys.modules[_name] = _old\n"
    )


_PROGRAM = _program()
_MEMORY_TEXT = "Error: the calculation ran out of memory; the numbers are too large"


def _kind(name: str | None) -> str | None:
    return None if name is None else getattr(ErrorKind, name)


def calculate(expression: str, *, max_chars: int = 2000) -> tuple[bool, str | None, str]:
    """Evaluate ``expression`` in *this* process, without any bound (the tool never does: it
    runs the evaluator in the sandbox). Returns ``(ok, error_kind, text)``."""
    ok, kind, text = calculator_eval.calculate(expression, max_chars=max_chars)
    return ok, _kind(kind), text


def snippet(expression: str, max_chars: int) -> str:
    """The Python snippet that evaluates ``expression`` in a sandbox worker and prints the
    ``(ok, kind name, text)`` triple as one JSON line."""
    return f"{_PROGRAM}print(reply({expression!r}, {int(max_chars)}))\n"


class CalculatorTool(Tool):
    """``calculator``: exact arithmetic and simple algebra with sympy (see the module doc).

    Config: ``timeout`` seconds per expression, ``max_result_chars`` (longer results are cut and
    flagged ``ErrorKind.OUTPUT_CUT``), ``max_expression_chars``, ``memory_mb`` (address space a
    calculation may use on top of the sandbox's preloaded interpreter), ``workers`` (sandbox
    processes evaluating at once; more calls wait for one, and the wait is not counted in their
    timeout), ``backend`` (the python tool's: ``auto`` = bubblewrap, or a ToolError saying why
    not; ``docker``; ``unisolated`` as an explicit opt-in).
    """

    name = "calculator"
    description = (
        "Evaluate a math expression exactly with sympy: arithmetic with fractions, powers (** or ^), "
        "sqrt, factorial, binomial, gcd, lcm, mod, log/exp/trig, simplify/expand/factor, and solving "
        "equations such as 'x**2 - 4 = 0' or 'solve(2*x + 3 = 7, x)'."
    )
    parameters = {
        "type": "object",
        "properties": {
            "expression": {
                "type": "string",
                "description": "The expression or equation, e.g. '3/4 + 1/6' or '2*x + 3 = 7'.",
            }
        },
        "required": ["expression"],
        "additionalProperties": False,
    }

    def __init__(
        self,
        timeout: float = 5.0,
        max_result_chars: int = 2000,
        max_expression_chars: int = 2000,
        memory_mb: int = 1024,
        workers: int = 2,
        backend: str | Backend = "auto",
    ) -> None:
        for key, value in (
            ("timeout", timeout),
            ("max_result_chars", max_result_chars),
            ("max_expression_chars", max_expression_chars),
            ("memory_mb", memory_mb),
            ("workers", workers),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ToolError(f"calculator: {key} must be a positive number, got {value!r}")
        self.timeout = float(timeout)
        self.max_result_chars = int(max_result_chars)
        self.max_expression_chars = int(max_expression_chars)
        self.memory_mb = int(memory_mb)
        try:
            # the reply is JSON (non-ASCII escaped, at most 6 characters per character) of a
            # result already cut to max_result_chars, plus a short suffix
            self.sandbox = PythonTool(
                timeout=self.timeout,
                workers=workers,
                backend=backend,
                memory_mb=self.memory_mb,
                preload=("math", "sympy"),
                max_output_chars=6 * self.max_result_chars + 1024,
                max_code_chars=len(_PROGRAM) + 10 * self.max_expression_chars + 1024,
            )
        except ToolError as e:
            raise ToolError(f"calculator: {e}") from e

    @property
    def isolation(self) -> str:
        """The isolation level calculations run under (the sandbox's)."""
        return self.sandbox.isolation

    async def start(self) -> None:
        """Start the sandbox workers now (otherwise the first call does, ~1-2 s)."""
        await self.sandbox.start()

    async def close(self) -> None:
        """Stop the sandbox workers; calls then answer an error until :meth:`start`."""
        await self.sandbox.close()

    async def call(self, args: dict[str, Any], *, session_id: str | None = None) -> ToolResult:
        expression = args.get("expression")
        if not isinstance(expression, str):
            return ToolResult(
                text="Error: 'expression' must be a string, e.g. {\"expression\": \"2+2\"}",
                ok=False,
                error=ErrorKind.BAD_ARGUMENTS,
            )
        if len(expression) > self.max_expression_chars:
            return ToolResult(
                text=f"Error: the expression is too long ({len(expression)} characters; "
                f"at most {self.max_expression_chars})",
                ok=False,
                error=ErrorKind.BAD_ARGUMENTS,
            )
        ran = await self.sandbox.call({"code": snippet(expression, self.max_result_chars)})
        metrics = {k: v for k, v in ran.metrics.items() if k in ("exec_ms", "cache_hit")}
        if ran.ok and ran.error is None:
            try:
                ok, kind, text = json.loads(ran.text.rstrip("\n").rpartition("\n")[2])
                return ToolResult(text=text, ok=bool(ok), error=_kind(kind), metrics=metrics)
            except (ValueError, TypeError, AttributeError):
                pass  # not the evaluator's reply: reported below as a crash
        return ToolResult(
            text=self._failure_text(ran),
            ok=False,
            metrics=metrics,
            error=ran.error
            if ran.error in (ErrorKind.TIMEOUT, ErrorKind.MEMORY, ErrorKind.SANDBOX)
            else ErrorKind.RUNTIME,
        )

    def _failure_text(self, ran: ToolResult) -> str:
        """The model's message when the sandboxed evaluation did not print its answer."""
        if ran.error == ErrorKind.TIMEOUT:
            return (
                f"Error: the calculation took longer than {self.timeout:g} s and was stopped; "
                "the numbers are probably too large, try a smaller or simpler expression"
            )
        if ran.error == ErrorKind.MEMORY:
            return _MEMORY_TEXT
        if ran.error == ErrorKind.SANDBOX:
            return f"Error: the calculator's sandbox failed ({ran.text.strip()[-300:]}); please retry"
        if ran.error == ErrorKind.OUTPUT_CUT:
            return "Error: the result is too large to return"
        last = ran.text.strip().rpartition("\n")[2][-300:]
        return f"Error: the evaluation crashed ({last or 'no output'})"
