"""The sympy calculator: canonical answers checked against independent oracles (fractions,
math, brute force), pathological input stopped by the sandbox's time/memory limits, injection
attempts refused, and a crash or a killed sandbox process answered with an error while the
caller goes on."""

from __future__ import annotations

import ast
import asyncio
import builtins
import json
import math
import os
import signal
import subprocess
import sys
import time
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tools.calculator
from tools import ErrorKind, ToolError, calculator_eval, get_tool
from tools.calculator import CalculatorTool, calculate, snippet
from tools.sandbox.host_worker import descendants

# one event loop for the module: the sandbox workers a tool started stay usable between calls
RUNNER = asyncio.Runner()


def run(coro):
    return RUNNER.run(coro)


@pytest.fixture(scope="module", autouse=True)
def _close_runner():
    yield
    RUNNER.close()


@pytest.fixture(scope="module")
def calc() -> CalculatorTool:
    tool = get_tool("calculator", timeout=3)
    run(tool.start())
    yield tool
    run(tool.close())


@pytest.fixture
def make_tool():
    """CalculatorTool(**config), closed after the test."""
    made = []

    def make(**config):
        made.append(CalculatorTool(**config))
        return made[-1]

    yield make
    for tool in made:
        run(tool.close())


def ask(tool, expression: str):
    return run(tool.invoke({"expression": expression}))


def sandbox_processes() -> set[int]:
    """Pids of this process's descendants that run the sandbox worker (from /proc)."""
    found = set()
    for pid in descendants(os.getpid())[1:]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"worker.py" in f.read():
                    found.add(pid)
        except OSError:
            pass
    return found


# ------------------------------------------------------------------------ canonical answers

CASES = [
    ("3/4", "3/4"),
    ("1/2 + 1/4", "3/4"),
    ("10/4", "5/2"),
    ("3 * (2 + 5) / 7", "3"),
    ("2^10", "1024"),
    ("2**-2", "1/4"),
    ("-7 // 2", "-4"),
    ("17 % 5", "2"),
    ("mod(17, 5)", "2"),
    ("Mod(-7, 3)", "2"),
    ("sqrt(16)", "4"),
    ("sqrt(8)", "2*sqrt(2) ≈ 2.82842712"),
    ("sqrt(2)", "sqrt(2) ≈ 1.41421356"),
    ("sqrt(2)*sqrt(8)", "4"),
    ("cbrt(27)", "3"),
    ("root(32, 5)", "2"),
    ("8**(1/3)", "2"),
    ("5!", "120"),
    ("factorial(20)", "2432902008176640000"),
    ("binomial(10, 3)", "120"),
    ("comb(52, 5)", "2598960"),
    ("gcd(12, 18)", "6"),
    ("gcd(12, 18, 8)", "2"),
    ("lcm(4, 6, 10)", "60"),
    ("abs(-3/2)", "3/2"),
    ("floor(7/2)", "3"),
    ("ceiling(7/2)", "4"),
    ("max(3, 7/2, 2)", "7/2"),
    ("round(2.567, 2)", "2.57"),
    ("round(7/2)", "4"),
    ("0.1 + 0.2", "0.3"),
    ("2.5 * 2", "5"),
    ("1.5e-7 * 2", "3e-7"),
    ("1e10", "10000000000"),
    ("pi", "pi ≈ 3.14159265"),
    ("e^2", "exp(2) ≈ 7.3890561"),
    ("log(8, 2)", "3"),
    ("log10(1000)", "3"),
    ("sin(pi/6)", "1/2"),
    ("cos(pi/4)", "sqrt(2)/2 ≈ 0.707106781"),
    ("2x + 3x", "5*x"),
    ("(1+2*I)*(3-I)", "5 + 5*I"),
    ("sqrt(-4)", "2*I"),
    ("1/(1+I)", "1/2 - I/2"),
    ("1/0", "zoo (complex infinity, e.g. a division by zero)"),
    ("0/0", "nan (undefined)"),
    ("x^2 + 2x + 1", "x**2 + 2*x + 1"),
    ("expand((x+1)**3)", "x**3 + 3*x**2 + 3*x + 1"),
    ("factor(x**2 - 1)", "(x - 1)*(x + 1)"),
    ("simplify(sin(x)**2 + cos(x)**2)", "1"),
    ("diff(x**3, x)", "3*x**2"),
    ("integrate(x**2, (x, 0, 1))", "1/3"),
    ("limit(sin(x)/x, x, 0)", "1"),
    ("2x + 3 = 7", "x = 2"),
    ("x**2 - 4 = 0", "x = -2, x = 2"),
    ("solve(2*x+3=7, x)", "x = 2"),
    ("solve(x**2 - 4, x)", "x = -2, x = 2"),
    ("solve(x**2 + 1, x)", "x = -I, x = I"),
    ("x**2 = 2", "x = -sqrt(2) ≈ -1.41421356, x = sqrt(2) ≈ 1.41421356"),
    ("solve([x + y = 10, x - y = 2], [x, y])", "x = 6, y = 4"),
    ("x + y = 3", "x = 3 - y"),
    ("x = x + 1", "no solution"),
    ("x = x", "True (for every value of x)"),
    ("2 + 2 = 4", "True"),
    ("2 + 2 = 5", "False"),
    ("isprime(97)", "True"),
    ("divisors(12)", "[1, 2, 3, 4, 6, 12]"),
    ("factorint(360)", "{2: 3, 3: 2, 5: 1}"),
    ("2**10000", f"≈ 1.99506312e3010 (an integer with {len(str(2**10000))} digits)"),
    ("0.[3]", "1/3"),
    ("x(x+1)", "x*(x + 1)"),
]


@pytest.mark.parametrize("expression, expected", CASES)
def test_canonical_answers(expression, expected):
    assert calculate(expression) == (True, None, expected)


def test_evaluation_never_uses_eval_or_exec(monkeypatch):
    """After warm-up (first use imports sympy modules, and imports use exec), evaluating any
    expression must not reach Python's eval/exec."""
    for expression, _ in CASES:
        calculate(expression)

    def forbidden(*args, **kwargs):
        raise AssertionError("eval/exec was called")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    for expression, expected in CASES:
        assert calculate(expression) == (True, None, expected), expression


def test_through_the_tool(calc):
    for expression, expected in CASES[:12] + [("x**2 - 4 = 0", "x = -2, x = 2")]:
        result = ask(calc, expression)
        assert (result.ok, result.error, result.text) == (True, None, expected)
        assert result.metrics["latency_ms"] > 0


# ------------------------------------------------------------------------ oracles


@st.composite
def rational_expressions(draw, depth=0):
    """(expression text, exact Fraction value or None when it divides by zero)."""
    if depth >= 3 or draw(st.booleans()):
        if draw(st.booleans()):
            n = draw(st.integers(-(10**12), 10**12))
            return (f"({n})" if n < 0 else str(n)), Fraction(n)
        p, q = draw(st.integers(-1000, 1000)), draw(st.integers(1, 1000))
        return f"({p}/{q})", Fraction(p, q)
    op = draw(st.sampled_from(["+", "-", "*", "/", "^"]))
    left_text, left = draw(rational_expressions(depth=depth + 1))
    if op == "^":
        k = draw(st.integers(-3, 4))
        if left is None or (left == 0 and k < 0):
            return f"({left_text})^({k})", None
        return f"({left_text})^({k})", left**k
    right_text, right = draw(rational_expressions(depth=depth + 1))
    text = f"({left_text} {op} {right_text})"
    if left is None or right is None:
        return text, None
    if op == "/":
        return text, (None if right == 0 else left / right)
    return text, {"+": left + right, "-": left - right, "*": left * right}[op]


def fraction_text(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rational_expressions())
def test_rational_arithmetic_matches_fractions(case):
    text, value = case
    assume(value is not None and len(str(value.numerator)) < 900)
    assert calculate(text) == (True, None, fraction_text(value))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(case=rational_expressions())
def test_rational_arithmetic_through_the_worker(calc, case):
    text, value = case
    assume(value is not None and len(str(value.numerator)) < 900)
    result = ask(calc, text)
    assert (result.ok, result.text) == (True, fraction_text(value))


@settings(max_examples=150, deadline=None)
@given(a=st.integers(0, 10**6), b=st.integers(1, 10**6), n=st.integers(0, 60), k=st.integers(0, 60))
def test_number_theory_matches_math(a, b, n, k):
    assert calculate(f"gcd({a}, {b})")[2] == str(math.gcd(a, b))
    assert calculate(f"lcm({a}, {b})")[2] == str(math.lcm(a, b))
    assert calculate(f"{a} mod {b}".replace(" mod ", " % "))[2] == str(a % b)
    assert calculate(f"factorial({n})")[2] == str(math.factorial(n))
    assert calculate(f"binomial({n}, {k})")[2] == str(math.comb(n, k))


@settings(max_examples=60, deadline=None)
@given(
    r1=st.integers(-50, 50),
    r2=st.integers(-50, 50),
    a=st.integers(1, 9),
    b=st.integers(-99, 99),
    c=st.integers(-99, 99),
)
def test_solve_matches_brute_force(r1, r2, a, b, c):
    expanded = f"x**2 - ({r1 + r2})*x + ({r1 * r2}) = 0"
    roots = sorted({r1, r2})
    assert calculate(expanded)[2] == ", ".join(f"x = {r}" for r in roots)
    assert [r for r in range(-50, 51) if r * r - (r1 + r2) * r + r1 * r2 == 0] == roots
    assert calculate(f"solve({a}*x + ({b}) = {c}, x)")[2] == f"x = {fraction_text(Fraction(c - b, a))}"


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 10**6))
def test_irrational_roots_come_with_an_approximation(n):
    assume(math.isqrt(n) ** 2 != n)
    ok, error, text = calculate(f"sqrt({n})")
    exact, _, approx = text.partition(" ≈ ")
    assert ok and error is None and "sqrt(" in exact
    assert math.isclose(float(approx), math.sqrt(n), rel_tol=5e-9)


# ------------------------------------------------------------------------ limits and faults


@pytest.mark.parametrize(
    "expression", ["9**9**9**9", "factorial(10**10)", "factorint(nextprime(10**60) * nextprime(10**70))"]
)
@pytest.mark.slow
def test_pathological_input_times_out_and_the_tool_recovers(make_tool, expression):
    tool = make_tool(timeout=1)
    run(tool.start())
    started = time.monotonic()
    result = ask(tool, expression)
    assert (result.ok, result.error) == (False, ErrorKind.TIMEOUT)
    assert "took longer than 1 s" in result.text
    assert time.monotonic() - started < 6  # stopped at the timeout, not whenever sympy finishes
    assert ask(tool, "1 + 1").text == "2"


def test_memory_limit(make_tool):
    result = ask(make_tool(timeout=20, memory_mb=256), "N(1/3, 10**10)")  # a 4 GB mantissa
    assert (result.ok, result.error) == (False, ErrorKind.MEMORY), result


def test_result_size_cap(make_tool):
    result = ask(make_tool(max_result_chars=200), "expand((x+1)**60)")
    assert result.ok and result.error == ErrorKind.OUTPUT_CUT
    assert "[result cut:" in result.text and len(result.text) < 260
    assert ask(make_tool(max_expression_chars=10), "1+1+1+1+1+1+1").error == ErrorKind.BAD_ARGUMENTS


INJECTIONS = [
    "__import__('os').system('touch /tmp/h3_pwned')",
    "().__class__.__bases__[0].__subclasses__()",
    "lambda: __import__('os')",
    "lambda x: x",
    "x.__class__",
    "Symbol('x').func",
    "(1).real",
    "sqrt.__globals__",
    "open('/etc/passwd')",
    "exec('1')",
    "eval('1')",
    "getattr(x, 'func')",
    "[c for c in (1, 2)]",
    "x[0]",
    "{1: 2}",
    "f'{1}'",
    "x if 1 else 2",
    "(y := 3)",
    "Integer('1'*10)",
    "Symbol('__class__')",
    "Function('f')(x)",
    "solve(x, dict=True)",
    "globals()",
    "__builtins__",
    "x; import os",
    "1 and 2",
    "~x",
]


@pytest.mark.parametrize("expression", INJECTIONS)
def test_injection_attempts_are_refused(expression):
    ok, error, text = calculate(expression)
    assert not ok and error in (ErrorKind.BLOCKED, ErrorKind.SYNTAX), (expression, error, text)
    assert text.startswith("Error:")
    assert not os.path.exists("/tmp/h3_pwned")


def test_injections_through_the_tool(calc):
    for expression in INJECTIONS[:6]:
        result = ask(calc, expression)
        assert not result.ok and result.error in (ErrorKind.BLOCKED, ErrorKind.SYNTAX), (expression, result)
    assert not os.path.exists("/tmp/h3_pwned")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789xyzabc_.,+-*/^%()[]{}=<>!~ '\"\\:;@#&|?", max_size=40))
def test_fuzzed_text_never_raises(expression):
    ok, error, text = calculate(expression)
    assert isinstance(text, str) and text
    assert error is None or error in ErrorKind.ALL
    assert ok or text.startswith("Error:")


def test_bad_arguments_and_config(calc):
    assert ask(calc, "").error == ErrorKind.BAD_ARGUMENTS
    wrong_key = run(calc.invoke({"expr": "1+1"}))
    assert wrong_key.error == ErrorKind.BAD_ARGUMENTS and "missing required argument 'expression'" in wrong_key.text
    assert run(calc.invoke({"expression": 5})).error == ErrorKind.BAD_ARGUMENTS
    with pytest.raises(ToolError, match="valid keys: timeout, max_result_chars, max_expression_chars, memory_mb"):
        get_tool("calculator", precision=3)
    assert calc.schema()["function"]["parameters"]["required"] == ["expression"]


def test_concurrent_calls(calc):
    async def many():
        return await asyncio.gather(*[calc.invoke({"expression": f"{i}/7 + {i}/3"}) for i in range(48)])

    results = run(many())
    assert [r.text for r in results] == [fraction_text(Fraction(i, 7) + Fraction(i, 3)) for i in range(48)]


def test_waiting_for_a_free_worker_is_not_counted_in_an_episodes_tool_timeout(make_tool):
    """An episode's tool_timeout bounds the evaluation, not the queue in front of it (the python
    tool's contract): with one worker busy on a slow expansion, a quick call given 0.2 s waits for
    the worker and then answers, instead of timing out as if its own expression had hung. (The verl
    path's held-out evaluation under CI load timed 41 % of its calculator calls out this way.)"""
    tool = make_tool(workers=1)
    run(tool.start())

    async def scenario():
        slow = asyncio.ensure_future(tool.invoke({"expression": "expand((x + y + 2)**60)"}))
        await asyncio.sleep(0.05)  # the slow one holds the only worker
        quick = await tool.invoke({"expression": "6*7"}, timeout=0.2)
        return quick, await slow

    quick, slow = run(scenario())
    assert slow.ok, slow
    assert (quick.ok, quick.text) == (True, "42"), quick
    assert quick.metrics["latency_ms"] > 200  # it did wait longer than its own bound, for the worker
    # its own bound still holds: an evaluation that runs past it is a timeout
    assert ask_bounded(tool, "expand((x + y + 3)**60)", 0.2).error == ErrorKind.TIMEOUT


def ask_bounded(tool, expression: str, timeout: float):
    return run(tool.invoke({"expression": expression}, timeout=timeout))


def test_evaluation_runs_in_the_sandbox(calc):
    """The tool does not evaluate in this process: the sandbox's process ids answer."""
    assert ask(calc, "1+1").text == "2"
    assert sandbox_processes()
    assert "bubblewrap" in calc.isolation


def test_a_crash_of_the_evaluating_process_is_an_error_and_the_caller_goes_on(calc, monkeypatch):
    monkeypatch.setattr(
        tools.calculator,
        "snippet",
        lambda expression, max_chars: "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n",
    )
    result = ask(calc, "2+2")
    assert (result.ok, result.error) == (False, ErrorKind.RUNTIME), result
    assert result.text.startswith("Error: the evaluation crashed") and "SIGSEGV" in result.text
    monkeypatch.undo()
    assert ask(calc, "6*7").text == "42"


@pytest.mark.slow
def test_sandbox_killed_mid_call_gives_a_timely_answer_then_recovers(make_tool):
    tool = make_tool(timeout=2, workers=1)
    run(tool.start())
    ours = {w.proc.pid for w in tool.sandbox.pool.workers if w.proc}  # this tool's worker, no other's
    assert ours and ours <= sandbox_processes()

    async def scenario():
        slow = asyncio.ensure_future(tool.invoke({"expression": "factorial(10**10)"}))
        await asyncio.sleep(0.5)
        for pid in ours:
            os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(slow, 30)

    started = time.monotonic()
    result = run(scenario())
    # the sandbox runs the call again on a fresh worker, where it times out as it should
    assert (result.ok, result.error) in ((False, ErrorKind.TIMEOUT), (False, ErrorKind.SANDBOX)), result
    assert time.monotonic() - started < 20
    assert ask(tool, "6*7").text == "42"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z"


def test_close_leaves_no_process(make_tool):
    tool = make_tool()
    assert ask(tool, "1+2").text == "3"
    # the tool's own processes (other tools of this test session have sandbox workers too)
    own = {pid for w in tool.sandbox.pool.workers if w.proc for pid in descendants(w.proc.pid)}
    assert own
    run(tool.close())
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in own) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in own if _alive(pid)]
    assert not [w for w in tool.sandbox.pool.workers if w.proc and _alive(w.proc.pid)]
    assert ask(tool, "2+2").error == ErrorKind.SANDBOX  # closed: an error, no hang, no new process
    run(tool.start())
    assert ask(tool, "2+2").text == "4"


def test_evaluator_is_runnable_inside_the_sandbox():
    """The evaluator's modules (tools/calculator_eval.py and the siblings it imports) run where the
    otb-tir packages are not importable: stdlib, sympy and each other only (the snippet defines
    every one of them, each after those it imports); their error kinds are ErrorKind names."""
    modules = tools.calculator.EVALUATOR_MODULES
    assert modules[-1] is tools.calculator.calculator_eval
    kinds = set()
    for i, module in enumerate(modules):
        source = open(module.__file__, encoding="utf-8").read()
        imported, siblings = set(), set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tools."):
                siblings.add(node.module)
            elif isinstance(node, ast.ImportFrom):
                imported.add((node.module or "").split(".")[0])
        allowed = {"__future__", "ast", "functools", "json", "operator", "re", "typing", "sympy"}
        assert imported <= allowed, (module.__name__, imported)
        assert siblings <= {m.__name__ for m in modules[:i]}, (module.__name__, siblings)
        kinds |= {
            n.args[0].value
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call)
            and getattr(n.func, "id", None) == "CalcError"
            and isinstance(n.args[0], ast.Constant)
        }
    assert kinds and all(isinstance(getattr(ErrorKind, k, None), str) for k in kinds), kinds


def test_prelude_and_snippet_run_where_the_packages_are_not_importable(tmp_path):
    """What a calculator worker runs — the prelude once, then a call's snippet — in a fresh
    interpreter that cannot import otb-tir (isolated mode, another folder): the prelude defines the
    evaluator and warms it up, the snippet prints the triple."""
    program = tools.calculator.PRELUDE + snippet("x**2 - 4 = 0", 2000)
    done = subprocess.run(
        [sys.executable, "-I", "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [True, None, "x = -2, x = 2"]
    warm = [json.loads(calculator_eval.reply(e, 2000)) for e in tools.calculator.WARMUP_EXPRESSIONS]
    assert all(ok for ok, _, _ in warm), warm  # the warm-up takes the paths real calls take, not errors
