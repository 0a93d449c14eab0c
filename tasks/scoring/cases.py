"""A test of the code reward (tasks/rewards/code.py) as the sandbox runs it and the host decides it: `Case` (its
sandbox test, the host's check of what came back, the expected side's own run), the cases of assert statements
(the parts that need the code cut by tasks/scoring/asserts.py, the rest computed on the host), and why a test's
process did not end normally, said printably."""

from __future__ import annotations

import ast
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass

from tasks.scoring import sandbox
from tasks.scoring.asserts import (
    _BUILTIN_NAMES,
    SHADOWED,
    _closed,
    _defined_names,
    _expected_positions,
    _expected_side,
    _free_names,
    _host_eval,
    _split,
    _unroll,
    parsed,
    shadowing,
)
from tasks.scoring.bounded import TooCostly, bounded_literal


@dataclass
class Case:
    test: sandbox.Test
    check: Callable[..., str | None]      # check(test's run, its expected side's run or None): None = passed
    expected: sandbox.Test | None = None  # the expected side's expressions, run with the setup only (no code)
    expected_setup: str = ""              # the setup that run gets (none when the setup reads the code's names)
    weak: str = ""                        # an assert whose part that needs the code compares or decides inside
    #                                       (a lambda, a comprehension): its source, run split instead


def assert_cases(src: str, setup: str = "", code: str | None = None) -> list[Case]:
    """One case per assert statement in `src`; a string that does not parse, or holds anything but
    asserts, gives none (a broken test in the data is skipped, not scored against the model). `setup` (the
    row's test_setup_code) and `code` tell the expected side of an assert from the actual one."""
    try:
        body = parsed(src.strip()).body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    if not body or not all(isinstance(s, ast.Assert) for s in body):
        return []
    closed = _closed(setup)     # a setup that reads names it does not define calls the code: not run without it
    names = _defined_names(setup) if closed else frozenset(), _defined_names(code or "")
    cases = [_assert_case(s.test, *names) for s in body]
    for c in cases:
        c.expected_setup = setup if closed else ""
    return cases


def _assert_case(node: ast.expr, setup_names: frozenset[str] = frozenset(),
                 code_names: frozenset[str] = frozenset()) -> Case:
    token = SHADOWED.set(shadowing(code_names))            # (a task "write `max`": max is the code's here)
    try:
        node = _unroll(node)
        inside: list[ast.expr] = []
        _split(node, inside, (setup_names, code_names))
    finally:
        SHADOWED.reset(token)
    if not inside:                    # an assert about literals only: decided here, the code still has to run
        return Case(sandbox.Test(exprs=["None"]), _values_check(lambda v, w: bool(_host_eval(node, {}))))
    at_expected = _expected_positions(node)
    # a part that reads only builtins (and the setup) is Python's wherever another part tests one of the code's own
    # functions: `sorted([3, 1, 2]) == g([3, 1, 2])` with the code's `sorted` and `g` paid `return 0` for both
    tests = [bool((_free_names(n) - setup_names - _BUILTIN_NAMES) & code_names) for n in inside]
    is_expected = [getattr(n, "expected", False) or _expected_side(
        n, setup_names, code_names, id(n) in at_expected or any(t for m, t in zip(inside, tests) if m is not n))
        for n in inside]
    if all(is_expected):      # (`assert 5 == max([1, 5])`, the code's `max`: a builtin it redefines on the
        # expected side is the builtin only where another part tests the code; else nothing would)
        is_expected = [getattr(n, "expected", False) or not (_free_names(n) - setup_names) & code_names
                       for n in inside]
    actual = [n for n, e in zip(inside, is_expected, strict=True) if not e]
    expected = [n for n, e in zip(inside, is_expected, strict=True) if e]

    def passes(v: list, w: list) -> bool:
        got = {id(n): x for n, x in zip(actual, v, strict=False)}
        got.update({id(n): x for n, x in zip(expected, w, strict=True)})
        return bool(_host_eval(node, got))
    mine = {id(n) for n in actual}      # (an iterator the code returns, `list(f(x))`, is read where the test runs)
    weak = any(isinstance(x, _DECIDES) for n in actual for x in ast.walk(n)) or any(
        isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in _CONSUMERS
        and any(id(a) in mine for a in c.args) for c in ast.walk(node))
    return Case(sandbox.Test(exprs=[ast.unparse(n) for n in actual] or ["None"]), _values_check(passes),
                sandbox.Test(exprs=[ast.unparse(n) for n in expected]) if expected else None,
                weak=f"assert {ast.unparse(node)}" if weak else "")


# builtins that consume an iterable: around a part that needs the code, the assert runs split (the part may be a
# generator, a map, a dict view: no plain value crosses, where the test's process reads it through its handle)
_CONSUMERS = frozenset({"list", "set", "frozenset", "tuple", "sorted", "dict", "len", "sum", "min", "max", "any",
                        "all", "enumerate", "zip", "reversed", "iter", "next"})
# what, inside a part that needs the code, would compare or decide there, among the code's objects
_DECIDES = (ast.Compare, ast.BoolOp, ast.IfExp, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
            ast.GeneratorExp)


def _values_check(passes: Callable[[list, list], bool]) -> Callable[..., str | None]:
    """Decode the harness's literals into plain values here (the actual side from the code's run, the expected
    side from its own run, which never held the code), then apply the host-side comparison."""
    def read(t: sandbox.TestRun) -> list | str:
        if t.values is None:
            fail = explain_failure(t)
            return fail if fail is not None else "exited before the tests ran"
        values = []
        for kind, text in t.values:
            if kind != "ok":
                return _error_reason(text)
            try:
                values.append(bounded_literal(text))
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return "unreadable value"
        return values

    def check(t: sandbox.TestRun, e: sandbox.TestRun | None = None) -> str | None:
        values = read(t)
        if isinstance(values, str):
            return values
        wanted = []
        if e is not None:
            wanted = read(e)
            if isinstance(wanted, str):
                return f"test error: its expected side: {wanted}"
        try:
            return None if passes(values, wanted) else "wrong answer"
        except TooCostly as e:            # refused before it was computed: the code chose a value too costly
            return f"too costly to judge: {e}"
        except Exception:                 # e.g. comparing a str with an int by <
            return "wrong answer"
    return check


def explain_failure(t: sandbox.TestRun) -> str | None:
    """Why a test's process did not end normally, or None if it did (exit status 0)."""
    if not t.ran:
        return "timeout" if t.timed_out else "not run"
    if t.output_limit:
        return "output limit"
    if t.timed_out:
        return "timeout"
    if t.memory_limit:
        return "memory limit"
    if t.signal is not None:
        name = {signal.SIGXCPU: "cpu limit", signal.SIGXFSZ: "file size limit", signal.SIGKILL: "killed"}
        return name.get(t.signal, f"crashed ({_signal_name(t.signal)})")
    if t.exit_code:
        return _error_reason(t.stderr, t.exit_code)
    return None


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """Text from the sandbox as it may be shown: terminal control characters (escape sequences, carriage
    returns, bidi overrides) become '?' (a reason lands in consoles, logs and tables)."""
    return _CONTROL.sub("?", text)


def _error_reason(stderr: str, exit_code: int | None = None) -> str:
    last = next((printable(line.strip()) for line in reversed(stderr.strip().splitlines()) if line.strip()), "")
    if "MemoryError" in last:
        return "memory limit"
    if last.startswith(("SyntaxError", "IndentationError", "TabError")):
        return f"syntax error: {last[:120]}"
    if last:
        return f"runtime error: {last[:160]}"
    return f"exit status {exit_code}" if exit_code is not None else "runtime error"


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
