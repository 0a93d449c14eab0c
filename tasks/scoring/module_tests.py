"""A row's test module for the code reward (a `test` column): HumanEval's `def check(candidate)` with the row's
`entry_point` (also evalplus's HumanEval+ / MBPP+), pytest-style `def test_*()` functions (KodCode, with
`@pytest.mark.parametrize` of listed cases), or asserts at its top level, read into cases that the sandbox runs
split from the code: the test in a process that never holds it, calling the code's functions in a process of
their own (tasks/scoring/harness.py: run_split). What each form becomes: docs/internals.md
(tasks/rewards/code.py); why split: docs/sandbox.md."""

from __future__ import annotations

import ast
import builtins

from tasks.core.contracts import content_text
from tasks.scoring import sandbox
from tasks.scoring.asserts import _defined_names, parsed
from tasks.scoring.cases import Case, _error_reason, explain_failure

_BUILTINS = frozenset(dir(builtins))
_PROMPT_CHARS = 100_000         # a prompt longer than this defines nothing for the tests (the host reads it)


def module_cases(src: str, entry_point, setup: str, code: str | None, first: int = 0,
                 given: list[ast.stmt] = ()) -> tuple[list[Case], str]:
    """A row's test module (a `test` column) as cases and the setup they share: HumanEval's `check(candidate)`
    called on the row's `entry_point`, pytest's `test_*()` functions (one per listed case when parametrized), or
    the statements at its top level; its other top-level statements are the setup, after `given` (the prompt's
    helpers: prompt_definitions). A test function's leading
    asserts are one case each, the rest of it one case. Each case is a function of the setup that the test's
    process calls; the names the test takes from the code (the entry point, the code's functions it names,
    `solution`'s) are the code's, through a pipe. A module that does not parse gives no cases (a broken test in
    the data is skipped)."""
    try:
        body = parsed(src.strip()).body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return [], setup
    entry = entry_point.strip() if isinstance(entry_point, str) and entry_point.strip().isidentifier() else None
    called = {n.func.id for n in ast.walk(ast.Module(body, [])) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Name)}      # (a `test*` helper the module calls itself is no test)
    if any(_unrunnable(s, entry) and getattr(s, "name", None) not in called for s in body):
        return [], setup                      # (the tests left would pay a wrong answer for what is left)
    cased = {s.name for s in body if isinstance(s, ast.FunctionDef)      # (a call of one runs it: no more case)
             and (_parametrized(s) is not None or _test_function(s, entry) is not False)}
    kept: list[ast.stmt] = list(given)        # the module's setup
    tests: list[list[ast.stmt]] = []          # one case each
    top: list[ast.stmt] = []                  # the module's top level from its first test statement on
    for s in body:
        runs = _parametrized(s) if isinstance(s, ast.FunctionDef) else None
        if isinstance(s, ast.FunctionDef) and (runs is not None or _test_function(s, entry) is not False):
            param = _test_function(s, entry) if runs is None else None
            stmts = [_renamed(t, param, entry) for t in s.body if not _inert(t)]
            kept += [t for t in stmts if isinstance(t, ast.Import | ast.ImportFrom)]
            stmts = [t for t in stmts if not isinstance(t, ast.Import | ast.ImportFrom)]
            for bind in runs if runs is not None else [[]]:
                lead = 0 if bind else next((i for i, t in enumerate(stmts) if not isinstance(t, ast.Assert)),
                                           len(stmts))
                tests += [[t] for t in stmts[:lead]] + ([bind + stmts[lead:]] if stmts[lead:] else [])
        elif _runs_the_tests(s, cased) or _inert(s):
            continue                          # `check(f)`, `if __name__ == "__main__": ...`: the cases run them
        elif isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Import | ast.ImportFrom):
            kept.append(s)                    # (hoisted: a helper defined among the tests is the module's)
        elif top or not _setup_like(s):
            top.append(s)                     # a test: an assert, MBPP+'s loop over its cases, a call
        else:
            kept.append(s)
    if top and all(isinstance(t, ast.Assert) for t in top):
        tests += [[t] for t in top]
    elif top:                                 # statements among asserts: run in order, as one test, binding
        names = sorted({n.id for t in top if isinstance(t, ast.Assign | ast.AnnAssign | ast.AugAssign)
                        for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)})
        tests.append(([ast.Global(names)] if names else []) + top)     # what the module's top level would
    # each statement guarded: a module the sandbox's Python lacks (numpy, pytest), a fixture's decorator, fail
    # only the tests that use what they would have made (`solution`'s names are the code's: not guarded)
    kept = [t if isinstance(t, ast.FunctionDef | ast.ClassDef) and not t.decorator_list or _from_solution(t)
            else _guarded(t) for t in kept]
    functions = [ast.FunctionDef(f"_rlflow_case_{k}", ast.arguments([], [], None, [], [], None, []), stmts, [],
                                 lineno=0) for k, stmts in enumerate(tests, first)]
    module = ast.fix_missing_locations(ast.Module(kept + functions, []))
    source = "\n".join(p for p in (setup, ast.unparse(module)) if p.strip())
    own = _top_names(parsed(setup).body if setup.strip() else []) | _top_names(kept)
    used = {n.id for n in ast.walk(module) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    taken = sorted((used & _defined_names(code or "")) - own - _BUILTINS - {"solution"} | ({entry} if entry else set()))
    return [Case(sandbox.Test(exprs=[f"_rlflow_case_{k}()"], names=[(n, n) for n in taken]), _split_check)
            for k in range(first, first + len(tests))], source


def _split_check(t: sandbox.TestRun, expected: sandbox.TestRun | None = None) -> str | None:
    """A split case passed when its function returned; an assert that failed is a wrong answer, an exception the
    code raised (through the pipe) or the test raised a runtime error, the code's process ending its failure."""
    if t.values is None:
        return explain_failure(t) or "exited before the tests ran"
    kind, text = t.values[0]
    if kind == "ok":
        return None
    if text.startswith("AssertionError"):
        return "wrong answer"
    if text.startswith("Gone:"):
        return explain_failure(t) or "exited before the tests ran"
    return _error_reason(text)


def _parametrized(fn: ast.FunctionDef) -> list[list[ast.stmt]] | None:
    """A test function under one `@pytest.mark.parametrize("a, b", [...])` whose parameters it names all, as the
    bindings of each listed case (`a, b = <case>`); None for any other function."""
    if len(fn.decorator_list) != 1 or not isinstance(call := fn.decorator_list[0], ast.Call):
        return None
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "parametrize" and len(call.args) == 2
            and isinstance(call.args[1], ast.List | ast.Tuple)):
        return None
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        names = [n.strip() for n in first.value.split(",") if n.strip()]
    elif isinstance(first, ast.List | ast.Tuple) and all(isinstance(e, ast.Constant) for e in first.elts):
        names = [e.value for e in first.elts]
    else:
        return None
    a = fn.args
    if not names or not all(isinstance(n, str) and n.isidentifier() for n in names) \
            or a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or [x.arg for x in a.args] != names:
        return None
    target = ast.Name(names[0], ast.Store()) if len(names) == 1 else \
        ast.Tuple([ast.Name(n, ast.Store()) for n in names], ast.Store())
    cases = []
    for e in call.args[1].elts:       # (`pytest.param(a, b, id=...)` is (a, b); one with `marks` (xfail) is left)
        if isinstance(e, ast.Call) and getattr(e.func, "attr", getattr(e.func, "id", None)) == "param":
            if any(k.arg == "marks" for k in e.keywords):
                continue
            e = e.args[0] if len(names) == 1 and len(e.args) == 1 else ast.Tuple(e.args, ast.Load())
        cases.append([ast.Assign([target], e, lineno=0)])
    return cases


def _unrunnable(s: ast.stmt, entry: str | None) -> bool:
    """A test this reading cannot run (the row then has no tests: a score of what is left would pay an answer
    that fails it): a `test*` function with fixtures, a decorator but one listed parametrize, or a parametrize
    over a name; a `Test*` class's or a unittest.TestCase's `test*` methods."""
    if isinstance(s, ast.ClassDef):
        return (s.name.startswith("Test") or any("TestCase" in ast.unparse(b) for b in s.bases)) and any(
            isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef) and m.name.startswith("test") for m in s.body)
    return isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef) and s.name.startswith("test") and (
        isinstance(s, ast.AsyncFunctionDef) or _parametrized(s) is None and _test_function(s, entry) is False)


def _from_solution(s: ast.stmt) -> bool:
    return (isinstance(s, ast.ImportFrom) and s.module == "solution" and not s.level) or \
        (isinstance(s, ast.Import) and any(a.name == "solution" for a in s.names))


def _top_names(stmts: list[ast.stmt]) -> frozenset[str]:
    """The names a module's top-level statements bind (not their functions' locals)."""
    out: set[str] = set()
    for t in stmts:
        if isinstance(t, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(t.name)
        elif isinstance(t, ast.Import | ast.ImportFrom):
            out.update((a.asname or a.name).split(".")[0] for a in t.names if a.name != "*")
        elif isinstance(t, ast.If | ast.Try):
            out |= _top_names(t.body + t.orelse + (t.finalbody + [x for h in t.handlers for x in h.body]
                                                   if isinstance(t, ast.Try) else []))
        else:
            out.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    return frozenset(out)


def _guarded(s: ast.stmt) -> ast.Try:
    """`s` in a try: an import this Python lacks binds its names to the harness's stand-in (`missing`), any other
    failure leaves what `s` would have bound unbound."""
    otherwise: list[ast.stmt] = [ast.Pass()]
    if isinstance(s, ast.Import | ast.ImportFrom):
        source = getattr(s, "module", None)
        otherwise = [ast.parse(f"{a.asname or a.name.split('.')[0]} = _rlflow_missing({(source or a.name)!r})"
                               + (f".{a.name}" if source else "")).body[0]
                     for a in s.names if a.name != "*"] or otherwise
    return ast.Try([s], [ast.ExceptHandler(ast.Name("Exception", ast.Load()), None, otherwise)], [], [])


def _setup_like(s: ast.stmt) -> bool:
    """A top-level statement that only binds names (an assignment; an if/try of such, as `try: import numpy`)."""
    if isinstance(s, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.Import | ast.ImportFrom | ast.Pass):
        return True
    if isinstance(s, ast.If | ast.Try):
        inner = s.body + s.orelse + (s.finalbody + [t for h in s.handlers for t in h.body]
                                     if isinstance(s, ast.Try) else [])
        return all(_setup_like(t) for t in inner)
    return False


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


def _runs_the_tests(s: ast.stmt, cased: set[str]) -> bool:
    """`if __name__ == ...`, `check(f)`, `main()`, or a call of a test function the cases run (`test_a()`)."""
    if isinstance(s, ast.If):
        t = s.test
        return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__")
    call = s.value if isinstance(s, ast.Expr) else None
    return isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", "")) in (
        "check", "main", *cased)


def prompt_definitions(prompt, entry_point) -> list[ast.stmt]:
    """The helpers a row's prompt defines whole, for its tests (HumanEval/50's `encode_shift`, /32's `poly`): the
    prompt's top-level functions with a body (not a stub the model is to write, not the entry point) and its
    imports. They are the tests' own: taken from the code, an answer that redefined `encode_shift` as the identity
    passed `decode_shift`'s tests, and one that did not repeat it failed them. Read from each message's text (or
    the prompt string) as a whole when it parses, else each `def`/`import` at a line's start with its indented
    body: prose, a system prompt, fences or a chat template around the code do not hide it. Only with an
    entry point (HumanEval's form: the prompt is the code's start; elsewhere a prompt's function may be the buggy
    one to mend), and not an assistant turn's."""
    entry = entry_point.strip() if isinstance(entry_point, str) and entry_point.strip() else None
    texts = [content_text(m.get("content")) for m in prompt if isinstance(m, dict) and m.get("role") != "assistant"] \
        if isinstance(prompt, list) else [prompt] if isinstance(prompt, str) else []
    if entry is None or sum(len(t) for t in texts) > _PROMPT_CHARS:
        return []
    out: list[ast.stmt] = []
    for text in texts:
        for source in _code_blocks(text):
            try:
                body = parsed(source).body
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                continue
            out += [s for s in body if isinstance(s, ast.Import | ast.ImportFrom) and not _from_solution(s)
                    or isinstance(s, ast.FunctionDef) and not s.decorator_list and s.name != entry
                    and not all(_inert(t) or _raises_not_implemented(t) for t in s.body)]
    return out


def _code_blocks(text: str) -> list[str]:
    """`text` whole if it parses as Python, else each top-level `def` (with the indented or blank lines after it)
    and each `import`/`from` line found at a line's start."""
    try:
        parsed(text.strip())
        return [text.strip()] if text.strip() else []
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        pass
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(("def ", "async def ")):
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or lines[j][:1] in (" ", "\t")):
                j += 1
            out.append("\n".join(lines[i:j]))
            i = j
            continue
        if line.startswith(("import ", "from ")):
            out.append(line)
        i += 1
    return out


def _raises_not_implemented(s: ast.stmt) -> bool:
    """`raise NotImplementedError` (or a call of it): a stub's body, left for the model to write."""
    exc = s.exc.func if isinstance(s, ast.Raise) and isinstance(s.exc, ast.Call) else getattr(s, "exc", None)
    return isinstance(s, ast.Raise) and isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
