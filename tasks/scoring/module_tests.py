"""A row's test module for the code reward (a `test` column): HumanEval's `def check(candidate)` with the row's
`entry_point` (also evalplus's HumanEval+ / MBPP+), pytest-style `def test_*()` functions (KodCode), or asserts
at its top level, read into the cases tasks/scoring/cases.py decides. What each form becomes, and how weak
each is: docs/internals.md (tasks/rewards/code.py), docs/sandbox.md."""

from __future__ import annotations

import ast

from tasks.scoring import sandbox
from tasks.scoring.asserts import (
    SHADOWED,
    _closed,
    _defined_names,
    _free_names,
    _host_eval,
    _split,
    _unroll,
    parsed,
    shadowing,
)
from tasks.scoring.cases import Case, _values_check, assert_cases


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
        elif _runs_the_tests(s) or _inert(s):
            continue                          # `check(f)`, `if __name__ == "__main__": ...`: the cases run them
        elif isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Import | ast.ImportFrom):
            kept.append(s)                    # (hoisted: a helper defined among the tests is the module's)
        elif top or not _setup_like(s):
            top.append(s)                     # a test: an assert, MBPP+'s loop over its cases, a call
        else:
            kept.append(s)
    if top and all(isinstance(t, ast.Assert) for t in top):
        strong += top
    elif top:                                 # asserts among statements: run in order, as one test
        # (what its plain assignments bind stays the module's; a loop's names stay the test's own: declared
        # global they were the code's to read, `return exp`, and shadowed its `exp` from math)
        names = sorted({n.id for t in top if isinstance(t, ast.Assign | ast.AnnAssign | ast.AugAssign)
                        for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)})
        recorded.append(([ast.Global(names)] if names else []) + top)
    helpers = frozenset(t.name for t in kept if isinstance(t, ast.FunctionDef)
                        and any(isinstance(n, ast.Assert) for n in ast.walk(t)))
    # each statement guarded: a module the sandbox's Python lacks (numpy, pytest), a fixture's decorator, fail
    # only the tests that use what they would have made
    kept = [t if isinstance(t, ast.FunctionDef | ast.ClassDef) and not t.decorator_list else _guarded(t) for t in kept]
    module_setup = ast.unparse(ast.fix_missing_locations(ast.Module(kept, [])))
    setup = "\n".join(p for p in (setup, module_setup) if p.strip())
    cases = assert_cases("\n".join(ast.unparse(a) for a in strong), setup, code) if strong else []
    names = (_defined_names(setup) if _closed(setup) else frozenset(),
             _defined_names(code or "") | ({entry} if entry else frozenset()))
    functions = []
    for i, stmts in enumerate(recorded):
        r = _Recorded(f"_rlflow_test_{i}", stmts, names, helpers)
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

    def __init__(self, name: str, stmts: list[ast.stmt], names, helpers: frozenset[str] = frozenset()):
        self.name, self.names, self.asserts, self.parts, self.depth = name, names, [], [], 0
        self.helpers = helpers                # the module's functions that assert: handed plain values (below)
        # a name the body binds is its own, not the host's builtin (HumanEval/38: `str = ...; assert f(x) == str`)
        self.shadowed = shadowing(names[1] | _bound_names(stmts))
        self.required: set[int] = set()       # asserts that run whenever the body does (in loops: at least once)
        self.branches, self.jumped = 0, False   # (after a return, break, continue or raise: none required)
        body = [self.visit(t) for t in stmts]
        fn = ast.parse(f"def {name}():\n    _rlflow_seen = []\n    return _rlflow_seen").body[0]
        fn.body[1:1] = body
        if isinstance(body[0] if body else None, ast.Global):      # (a global statement comes first)
            fn.body.insert(0, fn.body.pop(1))
        self.source = ast.unparse(ast.fix_missing_locations(fn))

    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        token = SHADOWED.set(self.shadowed)
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

    visit_Try = visit_TryStar = visit_Match = visit_With = visit_AsyncWith = visit_If   # (suppress, raises)

    def visit_Call(self, node: ast.Call) -> ast.expr:
        """A call of the module's asserting helper (evalplus's `assertion(candidate(*inp), exp, 0)`) is handed
        the code's values as plain values (the harness's `plain`): an object with an __eq__ of its own is refused
        before the helper compares it."""
        node = self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in self.helpers:
            def wrap(a: ast.expr) -> ast.expr:
                return ast.Call(ast.Name("_rlflow_plain", ast.Load()), [a], []) if _free_names(a) & self.names[1] \
                    else a
            node.args = [a if isinstance(a, ast.Starred) else wrap(a) for a in node.args]
            for k in node.keywords:
                k.value = wrap(k.value) if k.arg is not None else k.value
        return node

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


def _bound_names(stmts: list[ast.stmt]) -> frozenset[str]:
    """The names statements bind (assignments, loop and with targets, imports, defs, except clauses)."""
    out: set[str] = set()
    for n in (n for t in stmts for n in ast.walk(t)):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Import | ast.ImportFrom):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(n.name)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            out.add(n.name)
    return frozenset(out)


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
