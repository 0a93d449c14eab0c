"""Code rewards: run the completion's Python against the row's tests in the sandbox, score the tests passed.

    reward.functions: [{fn: "tasks.rewards.code:code_reward", weight: 1.0}]        # share of tests passed
    reward.functions: [{fn: "tasks.rewards.code:code_reward_all", weight: 1.0}]    # 1 only if all pass
                                                       # (the same: code_reward with kwargs: {mode: all})

    >>> code_reward(["```python\\nprint(sum(map(int, input().split())))\\n```"],
    ...             verification_info=[{"test_cases": [{"type": "stdin_stdout", "input": "1 2\\n", "output": "3\\n"}]}])
    [1.0]

The code is the completion's last ```python block, else its last ``` block (after any <think>...</think>);
none scores 0 ("no code block"). Tests come from the row, in the formats of real datasets:
- `verification_info` (open-r1/verifiable-coding-problems-python, PrimeIntellect/verifiable-coding-problems),
  a dict or its JSON: {"language": "python", "test_cases": [{"type": "stdin_stdout", "input", "output"} or
  {"type": "function_call", "fn_name", "input": JSON args, "output": JSON result}]}.
- `test_list` (MBPP, HumanEval-style): assert statements, with an optional `test_setup_code`.
A row with neither scores None (not applicable).

Verdicts are made here, on the host; expected outputs never enter the sandbox:
- stdin/stdout: the program runs once per test with the input on stdin; its stdout is compared here with the
  expected output (trailing whitespace per line and trailing blank lines ignored) and it must exit with 0.
- asserts are parsed with `ast`. `assert A <op> B` with B a literal (or set/tuple/sorted/... of literals)
  sends only A into the sandbox; the harness returns A's value as a literal made of exact built-in types
  (an object with its own __eq__, or an int subclass, is refused), and B is computed and compared here.
  With B not a literal, A and B are both evaluated inside and compared here. `math.isclose(A, B, ...)` the
  same. `assert E` / `assert not E` for any other E: E's value must be truthy / falsy here. That last form is
  weaker: the code runs before E is evaluated, so it can patch what E calls (e.g. math.isclose) to return
  True. MBPP's asserts are almost all of the first kind.
So printing "all tests passed", exiting with 0 before the tests, patching the harness, writing fake results
into its pipe or returning an always-equal object all score 0: the only thing that counts is a plain value
or stdout judged here. Each test runs in a process of its own; see tasks/scoring/sandbox.py and docs/sandbox.md.

Per completion a reason is recorded (TRL's `log_extra("code_reason", ...)`): "passed 3/3", "wrong answer
(passed 1/3)", "timeout (passed 0/3)", "memory limit ...", "runtime error: ZeroDivisionError: ... ",
"no code block", ...; metrics through `log_metric`: code/isolation_bubblewrap, code/pass_rate,
code/all_passed, code/timeouts, code/no_code_block, code/seconds.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from tasks.rewards import text_of
from tasks.scoring import sandbox


@dataclass
class Verdict:
    score: float | None
    reason: str
    passed: int = 0
    total: int = 0
    isolation: str | None = None
    timed_out: bool = False
    seconds: float = 0.0                                   # wall clock of its sandbox
    outputs: list[str] = field(default_factory=list)     # what each test printed (capped by the sandbox)


@dataclass
class Case:
    test: sandbox.Test
    check: Callable[[sandbox.TestRun], str | None]        # None = passed, else why not


def code_reward(completions: list, verification_info: list | None = None, test_list: list | None = None,
                test_setup_code: list | None = None, mode: str = "fraction", log_extra=None, log_metric=None,
                **kwargs) -> list[float | None]:
    """Share of the row's tests the completion's code passes (mode="all": 1.0 only when all pass)."""
    verdicts = judge(completions, verification_info, test_list, test_setup_code, mode)
    log_verdicts(verdicts, log_extra, log_metric)
    return [v.score for v in verdicts]


def code_reward_all(completions: list, **kwargs) -> list[float | None]:
    """1.0 when the code passes every test of its row, else 0.0 (binary: no credit for a constant that
    happens to satisfy some asserts)."""
    return code_reward(completions, **{**kwargs, "mode": "all"})


def code_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when the answer (after any <think>...</think>) holds exactly one ```python block, else 0.0."""
    return [1.0 if len(_PYTHON_BLOCK.findall(_answer(text_of(c)))) == 1 else 0.0 for c in completions]


def judge(completions: list, verification_info: list | None = None, test_list: list | None = None,
          test_setup_code: list | None = None, mode: str = "fraction") -> list[Verdict]:
    """One Verdict per completion; the completions with code and tests run in parallel sandboxes."""
    if mode not in ("fraction", "all"):
        raise ValueError(f"code_reward: mode must be 'fraction' or 'all', got {mode!r}")
    n = len(completions)
    verdicts: list[Verdict | None] = [None] * n
    jobs, pending = [], []
    for j, completion in enumerate(completions):
        code = extract_code(text_of(completion))
        cases, setup = parse_tests(_at(verification_info, j), _at(test_list, j), _at(test_setup_code, j), code)
        if not cases:
            verdicts[j] = Verdict(None, "no tests")
        elif code is None:
            verdicts[j] = Verdict(0.0, "no code block", total=len(cases))
        else:
            jobs.append((code, [c.test for c in cases], setup))
            pending.append((j, cases))
    if jobs:
        runner = sandbox.runner()
        runs = runner.map(jobs)
        _check_sandbox_alive(runner, runs)
        for (j, cases), run in zip(pending, runs):
            verdicts[j] = decide(cases, run, mode)
    return verdicts


def decide(cases: list[Case], run: sandbox.Run, mode: str) -> Verdict:
    reasons = [case.check(t) for case, t in zip(cases, run.tests)]
    passed = sum(r is None for r in reasons)
    total = len(cases)
    first = next((r for r in reasons if r is not None), None)
    if run.output_limit and first is None:
        first, passed = "output limit", 0
    if run.error and passed < total:
        first = f"sandbox ended early: {printable(run.error)}" if first in (None, "not run") else first
    score = passed / total if mode == "fraction" else float(passed == total)
    reason = f"passed {passed}/{total}" if first is None else f"{first} (passed {passed}/{total})"
    return Verdict(score, reason, passed, total, run.isolation, run.timed_out, run.seconds,
                   [t.stdout for t in run.tests])


def log_verdicts(verdicts: list[Verdict], log_extra=None, log_metric=None) -> None:
    """Reasons as the `code_reason` column of TRL's completions table; batch metrics."""
    if log_extra is not None:
        log_extra("code_reason", [v.reason for v in verdicts])
    if log_metric is None:
        return
    scored = [v for v in verdicts if v.score is not None]
    ran = [v for v in scored if v.isolation is not None]
    if ran:
        log_metric("code/isolation_bubblewrap", 1.0 if ran[0].isolation == "bubblewrap" else 0.0)
        log_metric("code/seconds", sum(v.seconds for v in ran) / len(ran))
    if scored:
        log_metric("code/pass_rate", sum(v.passed / max(v.total, 1) for v in scored) / len(scored))
        log_metric("code/all_passed", sum(v.passed == v.total for v in scored) / len(scored))
        log_metric("code/no_code_block", sum(v.reason == "no code block" for v in scored) / len(scored))
    log_metric("code/timeouts", float(sum(v.timed_out for v in verdicts)))


def _check_sandbox_alive(runner: sandbox.Runner, runs: list[sandbox.Run]) -> None:
    """A whole batch with no test run is more likely a broken sandbox than a batch of hostile programs:
    probe it again and fail the stage (an infrastructure error, retried) if it no longer works."""
    if len(runs) > 1 and all(r.error and not any(t.ran for t in r.tests) for r in runs):
        problem = sandbox.probe(runner)
        if problem is not None:
            raise RuntimeError(f"code sandbox ({runner.isolation}) stopped working: {problem}")


# --------------------------------------------------------------------------------------------- the code

_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
_PYTHON_BLOCK = re.compile(r"```(?:python|py|python3)[ \t]*\n.*?```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str | None:
    """The last ```python block of the answer, else its last ``` block, else None."""
    blocks = _FENCE.findall(_answer(completion))
    python = [body for lang, body in blocks if lang.strip().lower() in ("python", "py", "python3")]
    return python[-1] if python else (blocks[-1][1] if blocks else None)


def _answer(text: str) -> str:
    """What follows the reasoning: after the last </think>; an unclosed <think> has no answer yet."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    return text.split("<think>", 1)[0]


def _at(column: list | None, j: int):
    return column[j] if column is not None and j < len(column) else None


# --------------------------------------------------------------------------------------------- the tests

def parse_tests(verification_info, test_list, test_setup_code, code: str | None) -> tuple[list[Case], str]:
    """The row's tests as sandbox tests plus host-side checks, and the setup code run before asserts."""
    cases: list[Case] = []
    info = _as_json(verification_info)
    if isinstance(info, dict) and str(info.get("language") or "python").lower().startswith("python"):
        for tc in info.get("test_cases") or []:
            case = _verification_case(tc, code) if isinstance(tc, dict) else None
            if case is not None:
                cases.append(case)
    tests = _as_json(test_list)
    if isinstance(tests, str):
        tests = [tests]
    for src in tests or []:
        if isinstance(src, str):
            cases += assert_cases(src)
    return cases, test_setup_code if isinstance(test_setup_code, str) else ""


def _as_json(value):
    if isinstance(value, str) and value.strip()[:1] in ("{", "["):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def _verification_case(tc: dict, code: str | None) -> Case | None:
    kind = tc.get("type") or "stdin_stdout"
    if kind == "stdin_stdout":
        inp = tc.get("input")
        inp = "\n".join(map(str, inp)) if isinstance(inp, list) else str(inp or "")
        return Case(sandbox.Test(stdin=inp), _stdout_check(str(tc.get("output") or "")))
    if kind == "function_call" and tc.get("fn_name"):
        try:
            args, want = (json.loads(v) if isinstance(v, str) else v for v in (tc["input"], tc["output"]))
        except (TypeError, ValueError, KeyError):
            return None
        args = args if isinstance(args, list) else [args]
        fn = str(tc["fn_name"])
        if not fn.isidentifier():
            return None
        call = f"Solution().{fn}" if code and re.search(r"^class\s+Solution\b", code, re.M) else fn
        # APPS-derived rows wrap the return value in a list: accept the value or [value], as APPS does.
        return Case(sandbox.Test(exprs=[f"{call}(*{args!r})"]),
                    _values_check(lambda v: v[0] == want or [v[0]] == want))
    return None


def _stdout_check(expected: str) -> Callable[[sandbox.TestRun], str | None]:
    want = normalise_output(expected)

    def check(t: sandbox.TestRun) -> str | None:
        if (fail := explain_failure(t)) is not None:
            return fail
        return None if normalise_output(t.stdout) == want else "wrong answer"
    return check


def normalise_output(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def assert_cases(src: str) -> list[Case]:
    """One case per assert statement in `src`; a string that does not parse, or holds anything but
    asserts, gives none (a broken test in the data is skipped, not scored against the model)."""
    try:
        body = ast.parse(src.strip()).body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    if not body or not all(isinstance(s, ast.Assert) for s in body):
        return []
    return [_assert_case(s.test) for s in body]


_OPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
        ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}


def _assert_case(node: ast.expr) -> Case:
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _OPS:
        op = _OPS[type(node.ops[0])]
        return _binary_case(node.left, node.comparators[0], op)
    if _is_isclose(node):
        kw = {k.arg: evaluate_on_host(k.value) for k in node.keywords}
        if all(k in ("rel_tol", "abs_tol") and isinstance(v, (int, float)) for k, v in kw.items()):
            return _binary_case(node.args[0], node.args[1], lambda a, b: _isclose(a, b, **kw))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return Case(sandbox.Test(exprs=[ast.unparse(node.operand)]), _values_check(lambda v: not v[0]))
    return Case(sandbox.Test(exprs=[ast.unparse(node)]), _values_check(lambda v: bool(v[0])))   # weaker form


def _binary_case(left: ast.expr, right: ast.expr, op: Callable) -> Case:
    """A op B: what is a literal is computed here; only the rest is evaluated inside."""
    a, b = evaluate_on_host(left), evaluate_on_host(right)
    if b is not _INSIDE:
        return Case(sandbox.Test(exprs=[ast.unparse(left)]), _values_check(lambda v: op(v[0], b)))
    if a is not _INSIDE:
        return Case(sandbox.Test(exprs=[ast.unparse(right)]), _values_check(lambda v: op(a, v[0])))
    return Case(sandbox.Test(exprs=[ast.unparse(left), ast.unparse(right)]), _values_check(lambda v: op(v[0], v[1])))


def _is_isclose(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and len(node.args) == 2 and isinstance(node.func, ast.Attribute)
            and node.func.attr == "isclose" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "math")


def _isclose(a, b, **kw) -> bool:
    numbers = (int, float)
    return type(a) in numbers and type(b) in numbers and math.isclose(a, b, **kw)


_INSIDE = object()   # "not computable on the host"
_HOST_CALLS = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "dict": dict, "sorted": sorted,
               "float": float, "int": int, "str": str, "bool": bool, "abs": abs, "complex": complex}


def evaluate_on_host(node: ast.expr):
    """The value of a literal, or of pure built-in calls on literals (set([1, 2]), float('inf')), computed
    here without running any of the row's or the model's code; _INSIDE for anything else."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _HOST_CALLS
            and not node.keywords and len(node.args) <= 2):
        args = [evaluate_on_host(a) for a in node.args]
        if all(a is not _INSIDE for a in args):
            try:
                return _HOST_CALLS[node.func.id](*args)
            except Exception:
                return _INSIDE
    return _INSIDE


def _values_check(passes: Callable[[list], bool]) -> Callable[[sandbox.TestRun], str | None]:
    """Decode the harness's literals into plain values here, then apply the host-side comparison."""
    def check(t: sandbox.TestRun) -> str | None:
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
        try:
            return None if passes(values) else "wrong answer"
        except Exception:                 # e.g. comparing a str with an int by <
            return "wrong answer"
    return check


HASHED_WORK = 4_000_000     # sum over the value's sets and dicts of their sizes squared: their worst-case cost


def bounded_literal(text: str):
    """A literal written by the sandboxed code, read with bounded work. Building a set or dict costs up to its
    size squared when the code chose keys whose hashes collide (3-5 s of the reward process per completion at
    the default output cap): values whose sets and dicts could cost more than HASHED_WORK are refused, before
    anything is built. Parsing itself is linear (the text is capped by the sandbox's output limit)."""
    tree = ast.parse(text.strip(), mode="eval")
    work = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Set | ast.Dict):
            work += len(node.elts if isinstance(node, ast.Set) else node.keys) ** 2
    if work > HASHED_WORK:
        raise ValueError("sets or dicts too large to compare safely")
    return ast.literal_eval(tree)


def explain_failure(t: sandbox.TestRun) -> str | None:
    """Why a test's process did not end normally, or None if it did (exit status 0)."""
    if not t.ran:
        return "timeout" if t.timed_out else "not run"
    if t.output_limit:
        return "output limit"
    if t.timed_out:
        return "timeout"
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
