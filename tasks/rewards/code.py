"""Code rewards: run the completion's Python against the row's tests in the sandbox, score the tests passed.

    reward.functions: [{fn: "tasks.rewards.code:code_reward", weight: 1.0}]        # share of tests passed
    reward.functions: [{fn: "tasks.rewards.code:code_reward_all", weight: 1.0}]    # 1 only if all pass

    >>> code_reward(["```python\\nprint(sum(map(int, input().split())))\\n```"],
    ...             verification_info=[{"test_cases": [{"type": "stdin_stdout", "input": "1 2\\n", "output": "3\\n"}]}])
    [1.0]

The code is the completion's last ```python block, else its last ``` block; the tests come from the row
(`verification_info`, `test_list`, or a `test` module: HumanEval's check(candidate) with `entry_point`, pytest's
test_* functions; none: None). Verdicts are made on the host (asserts: tasks/scoring/asserts.py)
and expected outputs never enter the sandbox (tasks/scoring/sandbox.py, docs/sandbox.md): only a plain value or
stdout judged here counts. Each completion gets a reason ("passed 3/3", "wrong answer (passed 1/3)"...), code/* metrics.
More: docs/internals.md (tasks/rewards/code.py): test formats, how each verdict is made, reasons and metrics.
"""

from __future__ import annotations

import ast
import json
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from tasks.rewards import after_reasoning, text_of
from tasks.scoring import sandbox
from tasks.scoring.asserts import (
    SHADOWED,
    TooDeep,
    _closed,
    _defined_names,
    _expected_positions,
    _expected_side,
    _host_eval,
    _split,
    _unroll,
    parsed,
    shadowing,
)
from tasks.scoring.bounded import TooCostly, bounded_literal


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
    check: Callable[..., str | None]      # check(test's run, its expected side's run or None): None = passed
    expected: sandbox.Test | None = None  # the expected side's expressions, run with the setup only (no code)
    expected_setup: str = ""              # the setup that run gets (none when the setup reads the code's names)


def code_reward(completions: list, verification_info: list | None = None, test_list: list | None = None,
                test_setup_code: list | None = None, mode: str = "fraction", log_extra=None, log_metric=None,
                test: list | None = None, entry_point: list | None = None, **kwargs) -> list[float | None]:
    """Share of the row's tests the completion's code passes (mode="all": 1.0 only when all pass)."""
    verdicts = judge(completions, verification_info, test_list, test_setup_code, mode, test, entry_point)
    log_verdicts(verdicts, log_extra, log_metric)
    return [v.score for v in verdicts]


def code_reward_all(completions: list, **kwargs) -> list[float | None]:
    """1.0 when the code passes every test of its row, else 0.0 (binary: no credit for a constant that
    happens to satisfy some asserts)."""
    return code_reward(completions, **{**kwargs, "mode": "all"})


def code_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when the answer (after any <think>...</think>) holds exactly one ```python block, else 0.0."""
    return [1.0 if len(_PYTHON_BLOCK.findall(after_reasoning(text_of(c)))) == 1 else 0.0 for c in completions]


def judge(completions: list, verification_info: list | None = None, test_list: list | None = None,
          test_setup_code: list | None = None, mode: str = "fraction", test: list | None = None,
          entry_point: list | None = None) -> list[Verdict]:
    """One Verdict per completion; the completions with code and tests run in parallel sandboxes."""
    if mode not in ("fraction", "all"):
        raise ValueError(f"code_reward: mode must be 'fraction' or 'all', got {mode!r}")
    n = len(completions)
    verdicts: list[Verdict | None] = [None] * n
    jobs, pending = [], []
    expected_jobs: dict[tuple, int] = {}     # (setup, expected expressions) -> its job: one per row, not per completion
    for j, completion in enumerate(completions):
        code = extract_code(text_of(completion)[:MAX_TEXT])
        try:              # (the host's own reading of the code and the row is bounded; past it: this one scores 0)
            cases, setup = parse_tests(_at(verification_info, j), _at(test_list, j), _at(test_setup_code, j), code,
                                       _at(test, j), _at(entry_point, j))
        except (RecursionError, MemoryError, TooDeep) as e:
            verdicts[j] = Verdict(0.0, f"the host cannot read this code: {e or type(e).__name__}")
            continue
        if not cases:
            verdicts[j] = Verdict(None, "no tests")
        elif code is None:
            verdicts[j] = Verdict(0.0, "no code block", total=len(cases))
        else:
            jobs.append((code, [c.test for c in cases], setup))
            key = (next((c.expected_setup for c in cases if c.expected is not None), ""),
                   tuple(tuple(c.expected.exprs) for c in cases if c.expected is not None))
            if key[1] and key not in expected_jobs:
                expected_jobs[key] = len(expected_jobs)
            pending.append((j, cases, expected_jobs.get(key)))
    if jobs:
        runner = sandbox.runner()
        # the expected sides that need the setup run in sandboxes of their own, which never hold the code
        runs = runner.map(jobs + [("", [sandbox.Test(exprs=list(e)) for e in exprs], setup)
                                  for setup, exprs in expected_jobs])
        runs, expected_runs = runs[:len(jobs)], runs[len(jobs):]
        _check_sandbox_alive(runner, runs)
        for (j, cases, e), run in zip(pending, runs):
            try:
                verdicts[j] = decide(cases, run, mode, expected_runs[e] if e is not None else None)
            except (RecursionError, MemoryError) as ex:       # (a check the host could not finish: this one only)
                verdicts[j] = Verdict(0.0, f"the host could not check this code's values: {type(ex).__name__}",
                                      total=len(cases))
    return verdicts


def decide(cases: list[Case], run: sandbox.Run, mode: str, expected: sandbox.Run | None = None) -> Verdict:
    """`expected`: the run of the cases' expected sides (in case order, only the cases that have one)."""
    wanted = iter(expected.tests if expected is not None else [])
    reasons = [case.check(t, next(wanted, None) if case.expected is not None else None)
               for case, t in zip(cases, run.tests)]
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
    blocks = _FENCE.findall(after_reasoning(completion))
    python = [body for lang, body in blocks if lang.strip().lower() in ("python", "py", "python3")]
    return python[-1] if python else (blocks[-1][1] if blocks else None)


def _at(column: list | None, j: int):
    return column[j] if column is not None and j < len(column) else None


# --------------------------------------------------------------------------------------------- the tests

def parse_tests(verification_info, test_list, test_setup_code, code: str | None, test=None,
                entry_point=None) -> tuple[list[Case], str]:
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
    setup = test_setup_code if isinstance(test_setup_code, str) else ""
    for src in tests or []:
        if isinstance(src, str):
            cases += assert_cases(src, setup, code)
    if isinstance(test, str) and test.strip():
        more, setup = module_cases(test, entry_point, setup, code)
        cases += more
    return cases, setup


def module_cases(src: str, entry_point, setup: str, code: str | None) -> tuple[list[Case], str]:
    """A row's test module (a `test` column): HumanEval's `def check(candidate)` called on the row's
    `entry_point`, pytest's `def test_*()` functions (`from solution import ...` names the code's own), or
    asserts at its top level; its other top-level statements join the setup. A test function's leading asserts
    are one case each, judged on the host as test_list's are; the rest of it (loops, locals) is one case that
    runs inside with each assert recording its parts' values, on which the host then computes the assert
    (_Recorded). A module that does not parse gives no cases (a broken test in the data is skipped)."""
    try:
        body = parsed(src.strip()).body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return [], setup
    entry = entry_point.strip() if isinstance(entry_point, str) and entry_point.strip().isidentifier() else None
    kept: list[ast.stmt] = []                 # the module's setup
    strong: list[ast.Assert] = []             # asserts judged on the host, their expected sides without the code
    recorded: list[list[ast.stmt]] = []       # test bodies run inside, their asserts recorded
    top: list[ast.stmt] = []                  # the module's top level from its first assert on
    for s in body:
        if isinstance(s, ast.ImportFrom) and s.module == "solution" and not s.level:
            kept += [ast.Assign([ast.Name(a.asname, ast.Store())], ast.Name(a.name, ast.Load()), lineno=0)
                     for a in s.names if a.asname and a.name != "*"]
        elif isinstance(s, ast.Import) and any(a.name == "solution" for a in s.names):
            kept += ast.parse("\n".join(f"{a.asname or a.name} = __import__('types').SimpleNamespace(**globals())"
                                        for a in s.names if a.name == "solution")).body
            kept += [ast.Import([a]) for a in s.names if a.name != "solution"]
        elif isinstance(s, ast.FunctionDef) and (param := _test_function(s, entry)) is not False:
            stmts = [_renamed(t, param, entry) for t in s.body if not _inert(t)]
            kept += [t for t in stmts if isinstance(t, ast.Import | ast.ImportFrom)
                     and getattr(t, "module", None) != "solution"]
            stmts = [t for t in stmts if not isinstance(t, ast.Import | ast.ImportFrom)]
            lead = next((i for i, t in enumerate(stmts) if not isinstance(t, ast.Assert)), len(stmts))
            strong += stmts[:lead]
            if stmts[lead:]:
                recorded.append(stmts[lead:])
        elif _runs_the_tests(s):
            continue                          # `check(f)`, `if __name__ == "__main__": ...`: the cases run them
        elif top or isinstance(s, ast.Assert):
            top.append(s)
        else:
            kept.append(s)
    if top and all(isinstance(t, ast.Assert) for t in top):
        strong += top
    elif top:                                 # asserts among statements: run in order, as one test
        names = sorted({n.id for t in top for n in ast.walk(t) if isinstance(n, ast.Name)
                        and isinstance(n.ctx, ast.Store)})
        recorded.append(([ast.Global(names)] if names else []) + top)
    kept = [ast.Try([t], [ast.ExceptHandler(ast.Name("ImportError", ast.Load()), None, [ast.Pass()])], [], [])
            if isinstance(t, ast.Import | ast.ImportFrom) else t for t in kept]    # (a test that needs it fails)
    module_setup = ast.unparse(ast.fix_missing_locations(ast.Module(kept, [])))
    setup = "\n".join(p for p in (setup, module_setup) if p.strip())
    cases = assert_cases("\n".join(ast.unparse(a) for a in strong), setup, code) if strong else []
    names = (_defined_names(setup) if _closed(setup) else frozenset(), _defined_names(code or ""))
    functions = []
    for i, stmts in enumerate(recorded):
        r = _Recorded(f"_rlflow_test_{i}", stmts, names)
        functions.append(r.source)
        cases.append(Case(sandbox.Test(exprs=[f"{r.name}()"]), _values_check(r.passes)))
    return cases, "\n".join(p for p in (setup, *functions) if p.strip())


class _Recorded(ast.NodeTransformer):
    """A test body that cannot be cut into single asserts (a loop, locals), as a function that runs inside: each
    assert becomes `_rlflow_seen.append((k, (part, ...)))`, its parts cut as _split cuts a test_list assert,
    and the function returns what it saw; the host computes each assert on those plain values (so an object of
    the code's never takes part in a comparison). It passes when each assert it saw held and each assert
    outside an if/try/match was seen (a loop that a `range` the code patched emptied does not pass). Its expected
    sides run with the code (a local may be anything the test computed), a weaker form than test_list's; a
    body whose asserts are all in helpers it calls (evalplus's `assertion`) passes when it does not raise."""

    def __init__(self, name: str, stmts: list[ast.stmt], names):
        self.name, self.names, self.asserts, self.parts, self.depth = name, names, [], [], 0
        self.required: set[int] = set()       # asserts that run whenever the body does (in loops: at least once)
        self.branches, self.jumped = 0, False   # (after a return, break, continue or raise: none required)
        body = [self.visit(t) for t in stmts]
        fn = ast.parse(f"def {name}():\n    _rlflow_seen = []\n    return _rlflow_seen").body[0]
        fn.body[1:1] = body
        if isinstance(body[0] if body else None, ast.Global):      # (a global statement comes first)
            fn.body.insert(0, fn.body.pop(1))
        self.source = ast.unparse(ast.fix_missing_locations(fn))

    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        token = SHADOWED.set(shadowing(self.names[1]))
        try:
            test, inside = _unroll(node.test), []
            _split(test, inside, self.names)
        finally:
            SHADOWED.reset(token)
        self.asserts.append(test)
        self.parts.append(inside)
        if not self.branches and not self.depth and not self.jumped:
            self.required.add(len(self.asserts) - 1)
        rec = ast.parse(f"_rlflow_seen.append(({len(self.asserts) - 1}, ()))").body[0]
        rec.value.args[0].elts[1].elts = list(inside)
        return ast.copy_location(rec, node)

    def visit_FunctionDef(self, node):            # (a helper defined in the test: its returns are its own)
        self.depth += 1
        try:
            return self.generic_visit(node)
        finally:
            self.depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node):                     # (an assert in a branch may rightly never run)
        self.branches += 1
        try:
            return self.generic_visit(node)
        finally:
            self.branches -= 1

    visit_Try = visit_TryStar = visit_Match = visit_If

    def visit_Return(self, node: ast.Return) -> ast.stmt:
        if self.depth:
            return self.generic_visit(node)
        self.jumped = True
        return ast.copy_location(ast.Return(ast.Name("_rlflow_seen", ast.Load())), node)

    def visit_Break(self, node):
        self.jumped = self.jumped or not self.depth
        return self.generic_visit(node)

    visit_Continue = visit_Raise = visit_Break

    def passes(self, values: list, wanted: list) -> bool:
        seen = values[0] if values else None
        if not isinstance(seen, list) or not self.required <= {r[0] for r in seen if isinstance(r, tuple) and r}:
            return False                      # (no asserts of its own: in helpers it calls; it must not raise)
        for record in seen:
            if not (isinstance(record, tuple) and len(record) == 2 and isinstance(record[0], int)
                    and 0 <= record[0] < len(self.asserts) and isinstance(record[1], tuple)
                    and len(record[1]) == len(self.parts[record[0]])):
                return False
            k, got = record
            if not _host_eval(self.asserts[k], {id(n): x for n, x in zip(self.parts[k], got, strict=True)}):
                return False
        return True


def _test_function(fn: ast.FunctionDef, entry: str | None) -> str | None | bool:
    """A test function's parameter that stands for the code's function (HumanEval's check(candidate): the
    entry point is passed), None for pytest's test_*() (no parameters), False for any other function."""
    a = fn.args
    plain = not (a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults or fn.decorator_list)
    if fn.name == "check" and entry and plain and len(a.args) == 1:
        return a.args[0].arg
    if fn.name.startswith("test") and plain and not a.args:
        return None
    return False


def _inert(s: ast.stmt) -> bool:
    """A docstring, `pass`, or HumanEval's `assert True, "..."` (which would pay any code that runs)."""
    if isinstance(s, ast.Assert):
        return isinstance(s.test, ast.Constant) and bool(s.test.value)
    return isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))


def _renamed(node: ast.stmt, param: str | None, entry: str | None) -> ast.stmt:
    """HumanEval's `candidate` as the entry point's name."""
    if param is not None and entry is not None:
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and n.id == param:
                n.id = entry
    return node


def _runs_the_tests(s: ast.stmt) -> bool:
    if isinstance(s, ast.If):
        t = s.test
        return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__")
    call = s.value if isinstance(s, ast.Expr) else None
    return isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", "")) in ("check", "main")


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
        inp, out = ("\n".join(map(str, v)) if isinstance(v, list) else str(v or "") for v in (inp, tc.get("output")))
        return Case(sandbox.Test(stdin=inp), _stdout_check(out))     # (a list of lines, as an input's)
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
                    _values_check(lambda v, w: v[0] == want or [v[0]] == want))
    return None


def _stdout_check(expected: str) -> Callable[[sandbox.TestRun], str | None]:
    want = normalise_output(expected)

    def check(t: sandbox.TestRun, e: sandbox.TestRun | None = None) -> str | None:
        if (fail := explain_failure(t)) is not None:
            return fail
        return None if normalise_output(t.stdout) == want else "wrong answer"
    return check


def normalise_output(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


MAX_TEXT = 1 << 20          # characters of a completion the host reads (a code block past them is not read)


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
    is_expected = [getattr(n, "expected", False) or _expected_side(n, setup_names, code_names, id(n) in at_expected)
                   for n in inside]
    actual = [n for n, e in zip(inside, is_expected, strict=True) if not e]
    expected = [n for n, e in zip(inside, is_expected, strict=True) if e]

    def passes(v: list, w: list) -> bool:
        got = {id(n): x for n, x in zip(actual, v, strict=False)}
        got.update({id(n): x for n, x in zip(expected, w, strict=True)})
        return bool(_host_eval(node, got))
    return Case(sandbox.Test(exprs=[ast.unparse(n) for n in actual] or ["None"]), _values_check(passes),
                sandbox.Test(exprs=[ast.unparse(n) for n in expected]) if expected else None)


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
