"""The ``calculator`` tool: exact arithmetic and simple algebra with sympy, never Python's ``eval``.

The evaluator is :mod:`tools.calculator_eval` (an AST interpreter over sympy: see its doc for what
an expression may contain and how answers look). The tool runs it where the ``python`` tool runs
snippets: its workers (:class:`tools.sandbox.PythonTool`) define the evaluator's modules once at
start (:data:`PRELUDE`) and each call sends ``print(reply(<expression>))`` to one of them, so
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
import zlib
from pathlib import Path
from typing import Any

from tools import calculator_eval, calculator_format, calculator_names, calculator_parse
from tools.base import ErrorKind, Tool, ToolError, ToolResult
from tools.calculator_names import FUNCTIONS
from tools.sandbox import Backend, PythonTool

__all__ = ["CalculatorTool", "calculate", "FUNCTIONS"]

#: the evaluator's modules, each after the ones it imports: the order the snippet defines them in
EVALUATOR_MODULES = (calculator_names, calculator_parse, calculator_format, calculator_eval)


#: expressions the prelude evaluates once per worker: the first equation solved, the first
#: polynomial simplified in a process cost 30-35 ms each, ~2 ms afterwards
WARMUP_EXPRESSIONS = (
    "12*7 - 5",
    "3/4 + 1/6",
    "2^10 + sqrt(8)",
    "60*x - 3090 = 17130",
    "x**2 + 1*x - 2",
    "x**2 - 5*x + 6 = 0",
    "solve(2*x + 3 = 7, x)",
    "gcd(12, 18) + factorial(5) + binomial(10, 3)",
    "expand((x + 1)**3)",
    "factor(x**2 - 4)",
)


def _pack(data: bytes) -> str:
    return repr(base64.b64encode(zlib.compress(data, 9)))


def _prelude() -> str:
    """The code each calculator sandbox worker runs once at start (``PythonTool``'s ``prelude``):
    it defines the evaluator's modules from their source, each after the ones it imports (they
    import each other by full name, so each is in ``sys.modules`` while the next loads, and they
    stay there: the calls' snippets import ``reply`` from them), then evaluates
    :data:`WARMUP_EXPRESSIONS` so sympy's lazily built paths exist before any spare is forked.
    Sending the modules with every call instead cost ~3 ms and ~470 page faults a call in the
    forked child, and the cold paths another 5-30 ms (measured in a forked child, 2026-12-06)."""
    entries = "".join(f"    ({m.__name__!r}, {_pack(Path(m.__file__).read_bytes())}),\n" for m in EVALUATOR_MODULES)
    return (
        "import base64, sys, types, zlib\n"
        "for _name, _text in (\n" + entries + "):\n"
        "    _module = sys.modules[_name] = types.ModuleType(_name)\n"
        "    _code = compile(zlib.decompress(base64.b64decode(_text)).decode('utf-8'), _name, 'exec')\n"
        "    exec(_code, _module.__dict__)\n"
        f"for _expression in {WARMUP_EXPRESSIONS!r}:\n"
        "    _module.reply(_expression, 2000)\n"
    )


PRELUDE = _prelude()
_MEMORY_TEXT = "Error: the calculation ran out of memory; the numbers are too large"


def _kind(name: str | None) -> str | None:
    return None if name is None else getattr(ErrorKind, name)


def calculate(expression: str, *, max_chars: int = 2000) -> tuple[bool, str | None, str]:
    """Evaluate ``expression`` in *this* process, without any bound (the tool never does: it
    runs the evaluator in the sandbox). Returns ``(ok, error_kind, text)``."""
    ok, kind, text = calculator_eval.calculate(expression, max_chars=max_chars)
    return ok, _kind(kind), text


def snippet(expression: str, max_chars: int) -> str:
    """The Python snippet that evaluates ``expression`` in a sandbox worker (one that ran
    :data:`PRELUDE`) and prints the ``(ok, kind name, text)`` triple as one JSON line."""
    return f"from tools.calculator_eval import reply\nprint(reply({expression!r}, {int(max_chars)}))\n"


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
    # the sandbox kills an evaluation at its limit; waiting for a free worker is not its time (as the
    # python tool's): an episode's tool_timeout bounds the evaluation, not the queue in front of it
    bounds_itself = True
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
                prelude=PRELUDE,
                max_output_chars=6 * self.max_result_chars + 1024,
                max_code_chars=10 * self.max_expression_chars + 1024,
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

    @property
    def capacity_wait_s(self) -> float:  # type: ignore[override]
        """Seconds a call may wait for a free sandbox worker (the sandbox's ``queue_timeout``)."""
        return self.sandbox.capacity_wait_s

    async def call(self, args: dict[str, Any], *, session_id: str | None = None) -> ToolResult:
        return await self.call_bounded(args, session_id=session_id)

    async def call_bounded(
        self, args: dict[str, Any], *, session_id: str | None = None, timeout: float | None = None
    ) -> ToolResult:
        """The evaluation runs for at most ``min(self.timeout, timeout)`` once a worker has it."""
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
        ran = await self.sandbox.call_bounded({"code": snippet(expression, self.max_result_chars)}, timeout=timeout)
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
