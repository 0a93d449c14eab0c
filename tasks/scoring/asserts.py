"""An `assert` test read on the host: the parts that need the code, and the rest computed here with bounded work.

    tree = parsed(src)               # ast.parse, refused past MAX_DEPTH levels (TooDeep)
    _split(node, inside)             # the largest parts that need the code: they run in a sandbox
    _expected_side(part, ...)        # a part the row's setup computes alone: run in a sandbox without the code
    _host_eval(node, got)            # the rest, here, from the values `got` the sandbox returned for those parts
    bounded_literal(text)            # such a value, read from the literal the sandbox wrote, with bounded work

For the code reward (tasks/rewards/code.py), which makes each assert a sandbox test and its check. Every operation
on a value the code chose is bounded before it is done (HOST_SIZE, INT_BITS, BUCKET_MAX; past them: TooCostly),
and nothing the code defines changes how the host computes an assert (docs/sandbox.md).
More: docs/internals.md (tasks/scoring/asserts.py): the sides of an assert, what is computed here, the bounds.
"""

from __future__ import annotations

import ast
import builtins
import functools
import math
import operator
import re

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


_CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
        ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}
_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_, ast.Invert: operator.invert}
# Every host-side operation on a value the code chose is bounded before it is done (docs/sandbox.md):
HOST_SIZE = 1_000_000       # elements, characters or bytes of any host-side result (a sequence, a formatted str)
INT_BITS = 1 << 16          # bits of any int parsed or computed here (the harness's repr stops at 4300 digits)
BUCKET_MAX = 8              # distinct values of one hash a set or dict may hold (more: a collision attack)
LITERAL_CHARS = 1 << 22     # characters of one value's literal
LITERAL_DEPTH = 64          # nesting of one value's literal (the harness writes at most 51 levels)
_SEQUENCE = (str, bytes, list, tuple)
_NUMBER = (int, float, complex)


class TooCostly(ValueError):
    """A host-side evaluation refused before it was done: its result or its work would pass a bound."""


def _weight(x, limit: int = HOST_SIZE) -> int:
    """What a value costs to print, compare or copy: characters, bytes, bytes of ints and one per container
    item, shared references counted each time they occur (`[s] * n` weighs n times s). Stops past `limit`."""
    total, stack = 0, [x]
    while stack:
        v = stack.pop()
        if isinstance(v, str | bytes):
            total += len(v) + 1
        elif isinstance(v, int):
            total += v.bit_length() // 8 + 1
        elif isinstance(v, list | tuple | set | frozenset):
            total += len(v) + 1
            stack.extend(v)
        elif isinstance(v, dict):
            total += len(v) + 1
            stack.extend(v.keys())
            stack.extend(v.values())
        else:
            total += 1
        if total > limit:
            return total
    return total


def _light(x):
    """x, when its weight is within HOST_SIZE; else refused."""
    if _weight(x) > HOST_SIZE:
        raise TooCostly("value too large")
    return x


def _safe_text(fn):
    def call(*args, **kw):
        for a in args:
            _light(a)                 # str/repr cost what they write: the weight of what they are given
        return fn(*args, **kw)
    return call


def _check_hashes(items: list) -> list:
    """Refuse to hash `items` into one set or dict when more than BUCKET_MAX distinct ones share a hash: every
    insertion and lookup compares with each of them, so a crafted set of colliding big values costs its size
    squared times their length. Equal values (duplicates) are fine: one comparison each."""
    if len(items) > HOST_SIZE:
        raise TooCostly("too large to hash on the host")
    buckets: dict[int, list] = {}
    for x in items:
        buckets.setdefault(hash(x), []).append(x)
    for bucket in buckets.values():
        if len(bucket) > BUCKET_MAX and len({(type(x), repr(x)) for x in bucket}) > BUCKET_MAX:
            raise TooCostly(f"too large to compare safely: {len(bucket)} values share one hash")
    return items


def _safe_set(items=(), kind=set):
    return kind(_check_hashes(list(items)))


def _safe_frozenset(items=()):
    return _safe_set(items, frozenset)


def _safe_dict(items=(), **kw):
    pairs = list(items.items() if isinstance(items, dict) else items) + list(kw.items())
    if any(not isinstance(p, list | tuple) or len(p) != 2 for p in pairs):
        raise TypeError("dict() wants pairs")
    _check_hashes([k for k, _ in pairs])
    return dict(pairs)


def _small_range(*args):
    r = range(*args)
    if len(r) > HOST_SIZE:
        raise TooCostly("range too long")
    return list(r)


def _safe_sum(items, start=0):
    """sum(): numbers as Python adds them; sequences (sum(lists, [])) only while their repeated concatenation,
    quadratic, stays bounded."""
    items = list(items)
    if all(isinstance(x, _NUMBER) for x in [*items, start]):
        if any(isinstance(x, int) and x.bit_length() > INT_BITS for x in items):
            raise TooCostly("int too large")
        return sum(items, start)
    total, work = _weight(start), 0
    for x in items:
        total += _weight(x)
        work += total
        if total > HOST_SIZE or work > 10 * HOST_SIZE:
            raise TooCostly("sum too large")
    return sum(items, start)


def _safe_round(x, ndigits=None):
    if ndigits is not None and isinstance(ndigits, int) and abs(ndigits) > 1000:   # round(5, -10**9): 10**10**9
        raise TooCostly("round: too many digits")
    return round(x) if ndigits is None else round(x, ndigits)


def _safe_int(*args):
    value = int(*args)
    if value.bit_length() > INT_BITS:           # (int(str) in base 2, 4, 16... is linear: bounded after)
        raise TooCostly("int too large")
    return value


_FORMAT_SPEC = re.compile(rb"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.DOTALL)


def _format_size(fmt: str | bytes, args) -> int:
    """An upper bound of the length of `fmt % args`, found before formatting: the format's own length, its
    widths and precisions, and the text of every argument. A width or precision taken from the arguments (*)
    is refused."""
    raw = fmt.encode("utf-8", "surrogatepass") if isinstance(fmt, str) else fmt
    size = len(raw)
    for m in _FORMAT_SPEC.finditer(raw):
        if b"*" in (m.group(1) or b"") + (m.group(2) or b""):
            raise TooCostly("%-format with * width")
        size += sum(int(g) for g in (m.group(1), m.group(2)) if g and g.isdigit())
        if size > HOST_SIZE:
            raise TooCostly("%-format too large")
    values = args.values() if isinstance(args, dict) else (args if isinstance(args, tuple) else (args,))
    for v in values:
        size += 400 + 8 * _weight(v)          # %s of a container: its repr; a float's %f: up to 309 digits
        if size > HOST_SIZE:
            raise TooCostly("%-format too large")
    return size


def _binop(op: ast.operator, a, b):
    """a <op> b on the host, refused before it is done when its result would pass HOST_SIZE or INT_BITS."""
    kind = type(op)
    if kind is ast.Mult:
        for seq, n in ((a, b), (b, a)):
            if isinstance(seq, _SEQUENCE) and isinstance(n, int) and n > 0 and _weight(seq) * n > HOST_SIZE:
                raise TooCostly("repetition too large")
        if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > INT_BITS:
            raise TooCostly("product too large")
    elif kind is ast.Add:
        if isinstance(a, _SEQUENCE) and isinstance(b, _SEQUENCE) and _weight(a) + _weight(b) > HOST_SIZE:
            raise TooCostly("concatenation too large")
    elif kind is ast.Pow:
        if isinstance(b, int) and abs(b) > 10_000:
            raise TooCostly("exponent too large")
        if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 and a.bit_length() * b > INT_BITS:
            raise TooCostly("power too large")
    elif kind is ast.Mod and isinstance(a, str | bytes):
        _format_size(a, b)
    result = _BIN[kind](a, b)
    if isinstance(result, int) and result.bit_length() > INT_BITS:
        raise TooCostly("int too large")
    return _light(result)


# What an assert may compute on the host, around what the code returns: Python's own builtins, never the code's.
_HOST_FUNCS = {"abs": abs, "len": len, "sorted": sorted, "list": list, "tuple": tuple, "str": _safe_text(str),
               "int": _safe_int, "float": float, "bool": bool, "complex": complex, "round": _safe_round, "min": min,
               "max": max, "sum": _safe_sum, "all": all, "any": any, "set": _safe_set, "frozenset": _safe_frozenset,
               "dict": _safe_dict, "reversed": lambda x: list(reversed(x)), "range": _small_range,
               "enumerate": lambda *a: list(enumerate(*a)), "zip": lambda *a: list(zip(*a, strict=False)),
               "repr": _safe_text(repr), "ord": ord, "chr": chr}
_MATH = {name: getattr(math, name) for name in ("isclose", "sqrt", "floor", "ceil", "fabs", "log", "log2", "log10",
                                                "exp", "isnan", "isinf", "isfinite", "gcd", "pi", "e", "inf", "nan")}
_HOST_NAMES = {*_HOST_FUNCS, "math", "True", "False", "None"}


def _mentions_code(node: ast.AST) -> bool:
    """Whether `node` names anything but the host's builtins: a function or value of the code or the setup."""
    return any(isinstance(n, ast.Name) and n.id not in _HOST_NAMES for n in ast.walk(node))


def _host_call(node: ast.Call) -> bool:
    f = node.func
    return ((isinstance(f, ast.Name) and f.id in _HOST_FUNCS)
            or (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "math"
                and f.attr in _MATH))


def _split(node: ast.expr, inside: list[ast.expr]) -> None:
    """Collect in `inside` the largest parts of an assert that need the code (f(1), Solution().g(x), a setup
    variable); around them, comparisons, arithmetic, boolean logic and builtin calls are computed on the host.
    So nothing the code defines (a shadowed `abs`, a patched `builtins`) changes how the assert is computed,
    and the expected side, a literal or a computation on literals, never enters the sandbox."""
    if not _mentions_code(node):
        return
    if isinstance(node, ast.Compare | ast.BinOp | ast.UnaryOp | ast.BoolOp | ast.IfExp | ast.List | ast.Tuple
                  | ast.Set | ast.Dict) or (isinstance(node, ast.Call) and _host_call(node)):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                _split(child, inside)
            elif isinstance(child, ast.keyword):
                _split(child.value, inside)
        return
    inside.append(node)


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
        return _safe_set([ev(e) for e in node.elts])
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("not computable on the host: **")
        return _safe_dict(list(zip([ev(k) for k in node.keys], [ev(v) for v in node.values], strict=True)))
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](ev(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        return _binop(node.op, ev(node.left), ev(node.right))
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
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return ev(node.body) if ev(node.test) else ev(node.orelse)
    if isinstance(node, ast.Call) and _host_call(node):
        fn = _HOST_FUNCS[node.func.id] if isinstance(node.func, ast.Name) else _MATH[node.func.attr]
        return _light(fn(*[ev(a) for a in node.args], **{k.arg: ev(k.value) for k in node.keywords}))
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math":
        return _MATH[node.attr]
    if isinstance(node, ast.Name) and node.id in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[node.id]
    raise ValueError(f"not computable on the host: {type(node).__name__}")


def _unroll(node: ast.expr) -> ast.expr:
    """all(<test> for x in <literal>) / any(...): one test per element, so each is split like a plain assert
    (the expected values of such tables stay on the host too)."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("all", "any")
            and len(node.args) == 1 and isinstance(node.args[0], ast.GeneratorExp)
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


def bounded_literal(text: str):
    """A literal written by the sandboxed code, read with bounded work: at most LITERAL_CHARS characters and
    LITERAL_DEPTH levels, ints of at most INT_BITS bits, and sets and dicts whose values do not collide in
    their hashes (_check_hashes: more than BUCKET_MAX distinct values of one hash make every insertion and
    comparison quadratic), all checked while it is built, before any set or dict is. The same bounds hold for
    what the host computes from it (_binop, the _safe_* builtins)."""
    if len(text) > LITERAL_CHARS:
        raise TooCostly("value too large")
    return _literal(ast.parse(text.strip(), mode="eval").body, 0)


def _literal(node: ast.AST, depth: int):
    if depth > LITERAL_DEPTH:
        raise TooCostly("value nested too deeply")
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, int) and value.bit_length() > INT_BITS:
            raise TooCostly("int too large")
        if value is Ellipsis:
            raise ValueError("not a literal")
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in _NUMBER:
        return _UNARY[type(node.op)](node.operand.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub) \
            and isinstance(node.right, ast.Constant) and type(node.right.value) is complex:   # (1+2j)
        left = _literal(node.left, depth + 1)
        if type(left) not in (int, float) or (isinstance(left, int) and left.bit_length() > 64):
            raise ValueError("not a literal")
        return _BIN[type(node.op)](left, node.right.value)
    if isinstance(node, ast.List | ast.Tuple):
        items = [_literal(e, depth + 1) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.Set):
        return set(_check_hashes([_literal(e, depth + 1) for e in node.elts]))
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("not a literal")
        keys = _check_hashes([_literal(k, depth + 1) for k in node.keys])
        return dict(zip(keys, [_literal(v, depth + 1) for v in node.values], strict=True))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "set" \
            and not node.args and not node.keywords:
        return set()
    raise ValueError(f"not a literal: {type(node).__name__}")
