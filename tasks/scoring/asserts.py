"""An `assert` test read on the host: the parts that need the code, and the rest computed here with bounded work.

    tree = parsed(src)               # ast.parse, refused past MAX_DEPTH levels (TooDeep)
    _split(node, inside)             # the largest parts that need the code: they run in a sandbox
    _expected_side(part, ...)        # a part the row's setup computes alone: run in a sandbox without the code
    _host_eval(node, got)            # the rest, here, from the values `got` the sandbox returned for those parts

For the code reward (tasks/rewards/code.py), which makes each assert a sandbox test and its check. What the host
computes on a value the code chose, and how it reads one back, is tasks/scoring/bounded.py's (every operation
bounded before it is done); nothing the code defines changes how the host computes an assert (docs/sandbox.md).
More: docs/internals.md (tasks/scoring/asserts.py).
"""

from __future__ import annotations

import ast
import builtins
import contextvars
import functools

from tasks.scoring.bounded import (
    BIN,
    CMP,
    HOST_FUNCS,
    HOST_SIZE,
    MATH,
    METHOD_NAMES,
    TYPES,
    UNARY,
    TooCostly,
    binop,
    light,
    method,
    safe_dict,
    safe_set,
    weight,
)

MAX_DEPTH = 200              # syntax-tree depth the host walks (the recursive walks need ~3 frames a level)


class TooDeep(ValueError):
    """A syntax tree nested deeper than MAX_DEPTH: the host does not walk it (its walks are recursive)."""


def parsed(src: str, mode: str = "exec") -> ast.AST:
    """ast.parse, and a tree no deeper than MAX_DEPTH (measured without recursion): TooDeep if it is, so that no
    recursive walk of the host's meets a RecursionError half way through a batch."""
    tree = ast.parse(src, mode=mode)
    todo = [(tree, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise TooDeep(f"nested deeper than {MAX_DEPTH} levels")
        todo.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return tree


_HOST_NAMES = {*HOST_FUNCS, "math", "True", "False", "None"}
# The host's builtins the code being judged defines itself (a task "write `max`"): called on literals they are the
# code's, run in its sandbox (Python's on the expected side: _expected_side), so the code is what is tested;
# called on the code's values (isinstance(f(), int)) they check it, and stay the host's.
SHADOWED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("shadowed", default=frozenset())


def shadowing(code_names: frozenset[str]) -> frozenset[str]:
    """The host names `code_names` redefines (math stays the host's: `import math` is the module)."""
    return frozenset(code_names & (_HOST_NAMES - {"math", "True", "False", "None"}))


def _mentions_code(node: ast.AST, bound: frozenset[str] = frozenset()) -> bool:
    """Whether `node` reads anything but the host's builtins (and `bound`: the names of comprehensions around it,
    each bound on the host; a lambda's own arguments): a function or value of the code or the setup."""
    return bool(_free_names(node) - (_HOST_NAMES - SHADOWED.get()) - bound)


_HOST_NODES = (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare,
               ast.IfExp, ast.Subscript, ast.Slice, ast.Call, ast.Attribute, ast.Name, ast.keyword, ast.Lambda,
               ast.expr_context, ast.operator, ast.unaryop, ast.boolop, ast.cmpop)


def _method_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in METHOD_NAMES \
        and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "math")


def _host_computable(node: ast.AST, bound: frozenset[str] = frozenset()) -> bool:
    """Whether _host_eval computes `node` itself, given values for the names in `bound` (a literal's method
    that is not METHODS', `'{}'.format(1)`, is not: it runs in the sandbox that never holds the code)."""
    if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp):      # (no code in it: computed here)
        if (one := _one_for(node)) is None:
            return False
        gen, inner = one[0], bound | frozenset(one[1])
        return _host_computable(gen.iter, bound) and all(_host_computable(c, inner) for c in [*gen.ifs, node.elt])
    if not isinstance(node, _HOST_NODES) or (isinstance(node, ast.BinOp) and type(node.op) not in BIN):
        return False
    if isinstance(node, ast.Lambda):
        return (args := _lambda_args(node)) is not None and _host_computable(node.body, bound | frozenset(args))
    if isinstance(node, ast.Call):
        if not _plain_call(node):
            return False
        if _method_call(node):
            return all(_host_computable(n, bound) for n in [node.func.value, *node.args, *node.keywords])
        if not _host_call(node):
            return False
    elif isinstance(node, ast.Attribute):
        return isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr in MATH
    elif isinstance(node, ast.Name):
        return (node.id in _HOST_NAMES and node.id not in SHADOWED.get()) or node.id in bound
    elif isinstance(node, ast.Dict) and any(k is None for k in node.keys):
        return False
    return all(_host_computable(c, bound) for c in ast.iter_child_nodes(node))


def _lambda_args(fn: ast.Lambda) -> list[str] | None:
    """A lambda's argument names, when it takes positional arguments only (no defaults, *args, **kw)."""
    a = fn.args
    return None if a.vararg or a.kwarg or a.kwonlyargs or a.defaults or a.posonlyargs else [x.arg for x in a.args]


def _plain_call(node: ast.Call) -> bool:
    """A call without *args or **kwargs: its arguments are the nodes it shows."""
    return not any(isinstance(a, ast.Starred) for a in node.args) and all(k.arg is not None for k in node.keywords)


def _host_call(node: ast.Call) -> bool:
    f = node.func
    if isinstance(f, ast.Name) and f.id in SHADOWED.get():       # (the code's `max` on literals; ours as a checker)
        return any(_free_names(a) - _HOST_NAMES for a in [*node.args, *(k.value for k in node.keywords)])
    return ((isinstance(f, ast.Name) and f.id in HOST_FUNCS)
            or (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "math"
                and f.attr in MATH))


def _split(node: ast.expr, inside: list[ast.expr], names=(frozenset(), frozenset()), bound=frozenset()) -> None:
    """Collect in `inside` the largest parts of an assert that need the code (f(1), Solution().g(x), a setup
    variable); around them, comparisons, arithmetic, boolean logic and builtin calls are computed on the host.
    So nothing the code defines (a shadowed `abs`, a patched `builtins`) changes how the assert is computed,
    and the expected side, a literal or a computation on literals, never enters the sandbox. A comprehension
    over the code's values, or the setup's, is a part that returns its bindings and parts (_inside_comprehension);
    `names`: the setup's and the code's (a setup table a comprehension iterates is checked; the code's own `map`
    is not Python's)."""
    if not _mentions_code(node, bound):
        if not _host_computable(node, bound):
            _take(inside, node, bound)            # (no code, but not the host's to compute: the no-code sandbox's)
        return
    if isinstance(node, ast.Compare | ast.BinOp | ast.UnaryOp | ast.BoolOp | ast.IfExp | ast.List | ast.Tuple
                  | ast.Set | ast.Dict | ast.Subscript | ast.Slice) or (isinstance(node, ast.Call) and (
                      _host_call(node) or _method_call(node)) and _plain_call(node)):
        for child in [node.func.value] if _method_call(node) else []:
            _split(child, inside, names, bound)             # (the receiver: its method is computed here)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr) and not (isinstance(node, ast.Call) and child is node.func):
                _split(child, inside, names, bound)
            elif isinstance(child, ast.keyword):
                _split(child.value, inside, names, bound)
        return
    if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp) and not bound and \
            (part := _inside_comprehension(node, names, inside)) is not None:
        inside.append(part)
        node.host_iter = _host_computable(node.generators[0].iter)     # (decided here: SHADOWED is this assert's)
        if not node.host_iter and _expected_side(node.generators[0].iter, *names, False):
            it = node.generators[0].iter           # (the setup's table: its own value, checked; zip(...), d.items())
            kinds = ast.Tuple([ast.Name("set", ast.Load()), ast.Name("frozenset", ast.Load())], ast.Load())
            node.checked_iter = ast.fix_missing_locations(ast.Tuple([
                ast.Call(ast.Name("isinstance", ast.Load()), [it, kinds], []),
                ast.Call(ast.Name("list", ast.Load()), [it], [])], ast.Load()))
            node.checked_iter.expected = True          # (run without the code, whatever names the code defines)
            inside.append(node.checked_iter)
        return
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("map", "filter") and \
            node.func.id not in names[1]:
        if not bound and (gen := _as_generator(node)) is not None:
            node.as_generator = gen                 # (map(lambda x: f(x) == y, xs): the lambda's body on the host)
            _split(gen, inside, names, bound)
            return
    _take(inside, node, bound)


class _Parts(list):
    """The parts of a comprehension's element (evaluated per row, in the comprehension) and, `outer`, the assert's
    own parts: where a setup's value the element reads apart from the item goes (computed without the code)."""

    def __init__(self, outer: list, names):
        super().__init__()
        self.outer, self.names = outer, names


def _take(inside: list, node: ast.expr, bound: frozenset) -> None:
    if isinstance(inside, _Parts) and not _free_names(node) & bound and _expected_side(node, *inside.names, False) \
            and not any(isinstance(n, ast.Lambda | ast.comprehension | ast.NamedExpr) for n in ast.walk(node)):
        node.expected = True                    # (a setup value: one, read without the code)
        inside.outer.append(node)
    else:
        inside.append(node)


def _as_generator(node: ast.Call) -> ast.GeneratorExp | None:
    """map(f, xs) as (f(x) for x in xs), map(f, xs, ys) over zip(xs, ys), map(lambda x: E, xs) as (E for x in
    xs); filter(f, xs) as (x for x in xs if f(x)); else None."""
    keep = node.func.id == "filter"
    fn, its = (node.args[0], node.args[1:]) if node.args else (None, [])
    if node.keywords or not its or (keep and len(its) != 1) or not _plain_call(node):
        return None
    if isinstance(fn, ast.Lambda):
        if (xs := _lambda_args(fn)) is None or len(xs) != len(its):
            return None
        body = fn.body
    else:
        xs = [f"_rlflow_item{k}" for k in range(len(its))]
        body = ast.Name(xs[0], ast.Load()) if keep and isinstance(fn, ast.Constant) and fn.value is None else \
            ast.Call(fn, [ast.Name(x, ast.Load()) for x in xs], [])
    target = ast.Name(xs[0], ast.Store()) if len(xs) == 1 else ast.Tuple([ast.Name(x, ast.Store()) for x in xs],
                                                                           ast.Store())
    it = its[0] if len(its) == 1 else ast.Call(ast.Name("zip", ast.Load()), list(its), [])
    gen = ast.GeneratorExp(ast.Name(xs[0], ast.Load()) if keep else body,
                           [ast.comprehension(target, it, [body] if keep else [], 0)])
    return ast.fix_missing_locations(gen)


def _targets(target: ast.expr) -> list[str] | None:
    """The names a comprehension's `for` binds (x, or x, y), or None for other shapes."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts):
        return [t.id for t in target.elts]
    return None


def _one_for(node) -> tuple[ast.comprehension, list[str]] | None:
    """A comprehension's one `for` and the distinct names it binds; None for more `for`s, async, other targets."""
    gen = node.generators[0]
    targets = _targets(gen.target)
    if len(node.generators) != 1 or gen.is_async or targets is None or len(set(targets)) != len(targets):
        return None
    return gen, targets


def _inside_comprehension(node, names, outer: list | None = None) -> ast.expr | None:
    """What the sandbox evaluates for `[elt for x in it if c]`: `[((x,), (q1, ...), (p1, ...) if c else None) for x
    in it]`, the bindings, the parts of c and of elt that need the code (plain values; elt's only where c holds);
    the host then computes c and elt from them, so the code's __eq__, a patched builtin, cannot decide it. None (run
    whole, the weaker form): more than one `for`, targets other than names, an `if` that needs the code and may
    stop half way (and/or, a conditional)."""
    if (one := _one_for(node)) is None or any(isinstance(n, ast.NamedExpr) for n in ast.walk(node)):
        return None
    (gen, targets), outer = one, [] if outer is None else outer
    bound = frozenset(targets)
    asks = _Parts(outer, names)
    for c in gen.ifs:
        if _mentions_code(c, bound) and not any(isinstance(n, ast.BoolOp | ast.IfExp) for n in ast.walk(c)):
            _split(c, asks, names, bound)            # (an `if` is asked of every item: its parts too)
        elif _mentions_code(c, bound) or not _host_computable(c, bound):
            return None
    parts = _Parts(outer, names)
    _split(node.elt, parts, names, bound)
    node.parts, node.asks = parts, asks
    load = [ast.Name(n, ast.Load()) for n in targets]
    values = ast.Tuple(list(parts), ast.Load())
    kept = values if not gen.ifs else ast.IfExp(ast.BoolOp(ast.And(), gen.ifs) if len(gen.ifs) > 1 else gen.ifs[0],
                                                values, ast.Constant(None))
    row = ast.Tuple([ast.Tuple(load, ast.Load()), ast.Tuple(list(asks), ast.Load()), kept], ast.Load())
    part = ast.ListComp(row, [ast.comprehension(gen.target, gen.iter, [], 0)])
    node.inside = ast.fix_missing_locations(part)
    return node.inside


def _host_eval(node: ast.AST, got: dict[int, object]):
    """Evaluate the host's part of an assert; `got` holds the values of the parts the sandbox evaluated."""
    if id(node) in got:
        return got[id(node)]
    ev = lambda n: _host_eval(n, got)  # noqa: E731
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List | ast.Tuple):
        items = [ev(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.Set):
        return safe_set([ev(e) for e in node.elts])
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("not computable on the host: **")
        return safe_dict(list(zip([ev(k) for k in node.keys], [ev(v) for v in node.values], strict=True)))
    if isinstance(node, ast.UnaryOp):
        return UNARY[type(node.op)](ev(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BIN:
        return binop(node.op, ev(node.left), ev(node.right))
    if isinstance(node, ast.BoolOp):
        value = None
        for v in node.values:
            value = ev(v)
            if bool(value) != isinstance(node.op, ast.And):
                return value
        return value
    if isinstance(node, ast.Compare):
        left = ev(node.left)
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = ev(comp)
            if not CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return ev(node.body) if ev(node.test) else ev(node.orelse)
    if isinstance(node, ast.Subscript):
        return light(ev(node.value)[ev(node.slice)])
    if isinstance(node, ast.Slice):
        return slice(*(None if p is None else ev(p) for p in (node.lower, node.upper, node.step)))
    if isinstance(node, ast.Lambda):                                  # (a key= of sorted, min, max)
        names = _lambda_args(node)
        return lambda *a: _host_eval(node.body, {**got, **{("name", n): v for n, v in zip(names, a, strict=True)}})
    if _method_call(node):
        return method(ev(node.func.value), node.func.attr, [ev(a) for a in node.args],
                       {k.arg: ev(k.value) for k in node.keywords})
    if isinstance(node, ast.Call) and _host_call(node):
        fn = HOST_FUNCS[node.func.id] if isinstance(node.func, ast.Name) else MATH[node.func.attr]
        return light(fn(*[ev(a) for a in node.args], **{k.arg: ev(k.value) for k in node.keywords}))
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math":
        return MATH[node.attr]
    if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp):
        if hasattr(node, "inside"):
            return _host_comprehension(node, got)
        gen = node.generators[0]                  # (one of literals, computed here: _host_computable)
        rows = [(_binding(gen.target, item), (), ()) for item in ev(gen.iter)]
        return _host_rows(node, rows, got)
    if isinstance(node, ast.Name) and ("name", node.id) in got:          # (a comprehension's binding)
        return got[("name", node.id)]
    if isinstance(node, ast.Name) and node.id in TYPES:
        return TYPES[node.id]
    if isinstance(node, ast.Name) and node.id in HOST_FUNCS:          # (key=len)
        return HOST_FUNCS[node.id]
    if hasattr(node, "as_generator"):
        return ev(node.as_generator)
    if isinstance(node, ast.Name) and node.id in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[node.id]
    raise ValueError(f"not computable on the host: {type(node).__name__}")


def _host_comprehension(node, got: dict):
    """A comprehension computed here from the rows the sandbox returned (_inside_comprehension): each row's
    bindings, its `if`s, its element; a row the sandbox left out, or skipped where the host's `if` holds, and a
    setup table iterated otherwise than its own value, are wrong answers."""
    rows = got[id(node.inside)]
    gen = node.generators[0]
    if not isinstance(rows, list) or not all(isinstance(r, tuple) and len(r) == 3 and isinstance(r[0], tuple)
                                             and isinstance(r[1], tuple) and len(r[1]) == len(node.asks)
                                             for r in rows):
        raise ValueError("not the rows of a comprehension")
    if hasattr(node, "checked_iter") or getattr(node, "host_iter", False):
        # (the setup's table: its value from the no-code run; a set's order is each process's own: as a multiset)
        if hasattr(node, "checked_iter"):
            unordered, items = _host_eval(node.checked_iter, got)
        else:
            items = _host_eval(gen.iter, got)
            unordered = isinstance(items, set | frozenset)
        want = [_binding(gen.target, item) for item in items]
        have = [row[0] for row in rows]
        if want != have and not (unordered and sorted(map(repr, want)) == sorted(map(repr, have))):
            raise ValueError("a comprehension's rows are not its iterable's")
    return _host_rows(node, rows, got)


def _host_rows(node, rows: list, got: dict):
    """The comprehension's value from its rows (bindings, the if-parts' values, the element-parts' values),
    each element and all of them bounded."""
    gen = node.generators[0]
    names, asks, parts = _targets(gen.target), getattr(node, "asks", []), getattr(node, "parts", [])
    out, total, env = [], 0, dict(got)          # (each row sets every name and if-part; element-parts where used)
    for binding, asked, values in rows:
        if len(binding) != len(names):
            raise ValueError("not as many values as names to bind")
        env.update({("name", n): v for n, v in zip(names, binding, strict=True)})
        env.update({id(q): v for q, v in zip(asks, asked, strict=True)})
        if not all(_host_eval(c, env) for c in gen.ifs):
            continue
        if not isinstance(values, tuple) or len(values) != len(parts):
            raise ValueError("a row the sandbox skipped")
        env.update({id(p): v for p, v in zip(parts, values, strict=True)})
        out.append(_host_eval(node.elt, env))
        total += weight(out[-1])
        if total > HOST_SIZE:                          # (each element bounded, and all of them together)
            raise TooCostly("comprehension too large")
    return safe_set(out) if isinstance(node, ast.SetComp) else out


def _binding(target: ast.expr, item) -> tuple:
    """What a `for` binds of one item, in its names' order (x: the item; x, y: its values)."""
    return (item,) if isinstance(target, ast.Name) else tuple(item)


def _unroll(node: ast.expr) -> ast.expr:
    """all(<test> for x in <literal>) / any(...): one test per element, so each is split like a plain assert
    (the expected values of such tables stay on the host too)."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("all", "any")
            and len(node.args) == 1 and isinstance(node.args[0], ast.GeneratorExp | ast.ListComp)
            and len(node.args[0].generators) == 1 and not node.args[0].generators[0].ifs
            and not node.args[0].generators[0].is_async):
        gen = node.args[0].generators[0]
        if not _mentions_code(gen.iter):
            try:
                items = list(_host_eval(gen.iter, {}))
            except Exception:
                return node
            if len(items) <= 1000:
                elts = [_bind(node.args[0].elt, gen.target, item) for item in items]
                if all(e is not None for e in elts) and elts:
                    return ast.BoolOp(op=ast.And() if node.func.id == "all" else ast.Or(), values=elts)
    return node


def _bind(elt: ast.expr, target: ast.expr, item) -> ast.expr | None:
    names: dict[str, object] = {}
    if isinstance(target, ast.Name):
        names[target.id] = item
    elif isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts) \
            and isinstance(item, list | tuple) and len(item) == len(target.elts):
        names.update({t.id: v for t, v in zip(target.elts, item, strict=True)})
    else:
        return None
    if any(isinstance(n, ast.arg) and n.arg in names for n in ast.walk(elt)) or \
            any(isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id in names for n in ast.walk(elt)):
        return None                        # (a lambda's or a comprehension's own `x` is not the loop's: not unrolled)

    class Sub(ast.NodeTransformer):
        def visit_Name(self, n):  # noqa: N802 - ast's visitor naming
            return ast.copy_location(ast.Constant(names[n.id]), n) if n.id in names else n
    try:
        return ast.fix_missing_locations(Sub().visit(ast.parse(ast.unparse(elt), mode="eval").body))
    except (ValueError, SyntaxError):
        return None


_BUILTIN_NAMES = frozenset(dir(builtins))


@functools.lru_cache(maxsize=256)
def _defined_names(src: str) -> frozenset[str]:
    """The names a module binds at its top level (defs, classes, imports, assignments, loop targets); not
    those local to its functions, classes or comprehensions."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return frozenset()
    out: set[str] = set()
    todo = [tree]                     # (a walk without recursion: the code may nest as deep as its parser lets it)
    while todo:
        n = todo.pop()
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(n.name)
            continue
        if isinstance(n, ast.Import | ast.ImportFrom):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
            continue
        if isinstance(n, ast.Lambda | ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
            continue
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            out.add(n.id)
        todo.extend(ast.iter_child_nodes(n))
    return frozenset(out)


@functools.lru_cache(maxsize=256)
def _closed(setup: str) -> bool:
    """Whether the setup code reads only names it defines itself and builtins (so its helpers can be run
    without the code: none of them calls a function of the code's)."""
    try:
        tree = parsed(setup)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    bound = set(_BUILTIN_NAMES)
    loads = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            (loads if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(n.name)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, ast.Import | ast.ImportFrom):
            if any(a.name == "*" for a in n.names):
                return False
            bound.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
        elif isinstance(n, ast.MatchAs | ast.MatchStar) and n.name:
            bound.add(n.name)
    return loads <= bound


def _free_names(node: ast.AST) -> set[str]:
    """Names an expression reads that it does not bind itself (comprehension targets, lambda arguments)."""
    bound = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    bound |= {a.arg for n in ast.walk(node) if isinstance(n, ast.Lambda) for a in ast.walk(n.args)
              if isinstance(a, ast.arg)}
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def _expected_positions(node: ast.AST) -> set[int]:
    """ids of the nodes on the expected side of a comparison: a Compare's right-hand operands, the second
    argument of math.isclose."""
    out: set[int] = set()
    for n in ast.walk(node):
        sides = n.comparators if isinstance(n, ast.Compare) else (
            n.args[1:] if isinstance(n, ast.Call) and _host_call(n) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "isclose" else [])
        for side in sides:
            out.update(id(m) for m in ast.walk(side))
    return out


def _expected_side(node: ast.expr, setup_names: frozenset[str], code_names: frozenset[str], at_expected: bool) -> bool:
    """Whether a part of an assert that the host cannot compute is expected rather than actual: it reads only
    what the setup defines and Python's builtins, so it can be evaluated without the code. A builtin the code
    redefines (a task "write `filter`") makes it the code's, unless it stands on the expected side."""
    names = _free_names(node)
    if not names <= setup_names | _BUILTIN_NAMES:
        return False
    return at_expected or not (names - setup_names) & code_names
