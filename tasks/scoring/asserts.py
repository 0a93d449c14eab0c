"""An `assert` test read on the host: the parts that need the code, and the rest computed here with bounded work.

    tree = parsed(src)               # ast.parse, refused past MAX_DEPTH levels (TooDeep)
    _split(node, inside)             # the largest parts that need the code: they run in a sandbox
    _expected_side(part, ...)        # a part the row's setup computes alone: run in a sandbox without the code
    _host_eval(node, got)            # the rest, here, from the values `got` the sandbox returned for those parts
    bounded_literal(text)            # such a value, read from the literal the sandbox wrote, with bounded work

For the code reward (tasks/rewards/code.py), which makes each assert a sandbox test and its check. Every operation
on a value the code chose is bounded before it is done (HOST_SIZE, INT_BITS, BUCKET_MAX; past them: TooCostly),
and nothing the code defines changes how the host computes an assert (docs/sandbox.md).
One concept: the host's own small evaluator of an assert, every operation bounded (it grows with the shapes
it computes rather than hands to the code). More: docs/internals.md (tasks/scoring/asserts.py).
"""

from __future__ import annotations

import ast
import builtins
import contextvars
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
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.BitAnd: operator.and_,
        ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.LShift: operator.lshift, ast.RShift: operator.rshift}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_, ast.Invert: operator.invert}
# Every host-side operation on a value the code chose is bounded before it is done (docs/sandbox.md):
HOST_SIZE = 1_000_000       # elements, characters or bytes of any host-side result (a sequence, a formatted str)
INT_BITS = 1 << 16          # bits of any int parsed or computed here (the harness's repr stops at 4300 digits)
BUCKET_MAX = 8              # distinct values of one hash a set or dict may hold (more: a collision attack)
LITERAL_CHARS = 1 << 22     # characters of one value's literal
FORMAT_CHARS = 20_000      # characters of a string the host %-formats
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
        if len(a) > FORMAT_CHARS:               # (reading its specs is quadratic in `%(`s: a real format is short)
            raise TooCostly("%-format too long")
        _format_size(a, b)
    elif kind is ast.LShift and isinstance(a, int) and isinstance(b, int) and b > 0 and \
            a.bit_length() + b > INT_BITS:
        raise TooCostly("shift too large")
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
               "repr": _safe_text(repr), "ord": ord, "chr": chr, "type": type}
_TYPES = {"int": int, "str": str, "float": float, "bool": bool, "complex": complex, "list": list, "tuple": tuple,
          "dict": dict, "set": set, "frozenset": frozenset}      # (a value the sandbox returns is of these exactly)


def _isinstance(value, kinds) -> bool:
    if not all(k in _TYPES.values() or k is type(None) for k in (kinds if isinstance(kinds, tuple) else (kinds,))):
        raise ValueError("not computable on the host: isinstance of another type")
    return isinstance(value, kinds)


_HOST_FUNCS["isinstance"] = _isinstance
_MATH = {name: getattr(math, name) for name in ("isclose", "sqrt", "floor", "ceil", "fabs", "log", "log2", "log10",
                                                "exp", "isnan", "isinf", "isfinite", "gcd", "pi", "e", "inf", "nan")}
_HOST_NAMES = {*_HOST_FUNCS, "math", "True", "False", "None"}
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


# Methods computed here on a value the sandbox returned (exact built-in types: no method of the code's runs),
# each bounded before it is done (_method); the code's own `startswith` cannot decide an assert.
_METHODS = {str: {"startswith", "endswith", "upper", "lower", "strip", "lstrip", "rstrip", "split", "rsplit",
                  "splitlines", "count", "find", "rfind", "index", "rindex", "isdigit", "isalpha", "isalnum",
                  "isspace", "islower", "isupper", "isnumeric", "isdecimal", "istitle", "title", "capitalize",
                  "swapcase", "casefold", "partition", "rpartition", "removeprefix", "removesuffix", "join",
                  "replace"},
            list: {"count", "index"}, tuple: {"count", "index"}, dict: {"get"},
            set: {"issubset", "issuperset", "isdisjoint"}, frozenset: {"issubset", "issuperset", "isdisjoint"}}
_METHOD_NAMES = frozenset().union(*_METHODS.values())
_HOST_NODES = (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare,
               ast.IfExp, ast.Subscript, ast.Slice, ast.Call, ast.Attribute, ast.Name, ast.keyword, ast.Lambda,
               ast.expr_context, ast.operator, ast.unaryop, ast.boolop, ast.cmpop)


def _method_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _METHOD_NAMES \
        and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "math")


def _host_computable(node: ast.AST, bound: frozenset[str] = frozenset()) -> bool:
    """Whether _host_eval computes `node` itself, given values for the names in `bound` (a literal's method
    that is not _METHODS', `'{}'.format(1)`, is not: it runs in the sandbox that never holds the code)."""
    if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp):      # (no code in it: computed here)
        gen = node.generators[0]
        if len(node.generators) != 1 or gen.is_async or (targets := _targets(gen.target)) is None:
            return False
        inner = bound | frozenset(targets)
        return _host_computable(gen.iter, bound) and all(_host_computable(c, inner) for c in [*gen.ifs, node.elt])
    if not isinstance(node, _HOST_NODES) or (isinstance(node, ast.BinOp) and type(node.op) not in _BIN):
        return False
    if isinstance(node, ast.Lambda):
        a = node.args
        if a.vararg or a.kwarg or a.kwonlyargs or a.defaults or a.posonlyargs:
            return False
        return _host_computable(node.body, bound | {x.arg for x in a.args})
    if isinstance(node, ast.Call):
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return False
        if _method_call(node):
            return all(_host_computable(n, bound) for n in [node.func.value, *node.args, *node.keywords])
        if not _host_call(node):
            return False
    elif isinstance(node, ast.Attribute):
        return isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr in _MATH
    elif isinstance(node, ast.Name):
        return (node.id in _HOST_NAMES and node.id not in SHADOWED.get()) or node.id in bound
    elif isinstance(node, ast.Dict) and any(k is None for k in node.keys):
        return False
    return all(_host_computable(c, bound) for c in ast.iter_child_nodes(node))


def _method(value, name: str, args: list, kwargs: dict):
    """value.name(*args) for a value of an exact built-in type and one of its _METHODS, bounded before it is done."""
    if name not in _METHODS.get(type(value), ()):
        raise ValueError(f"not computable on the host: {type(value).__name__}.{name}")
    if type(value) in (set, frozenset):            # (a list argument is made a set here: its hashes checked first)
        args = [a if type(a) in (set, frozenset) else _safe_set(a) for a in args]
    if name == "join":
        items = list(args[0]) if len(args) == 1 else []
        if len(args) != 1 or not all(type(x) is str for x in items):
            raise TypeError("join takes one sequence of text")
        if len(value) * len(items) + sum(map(len, items)) > HOST_SIZE:
            raise TooCostly("join too large")
        args = [items]
    if name == "replace" and len(args) >= 2 and type(args[0]) is str and type(args[1]) is str and \
            len(value) + (value.count(args[0]) + 1) * len(args[1]) > HOST_SIZE:
        raise TooCostly("replace too large")
    return _light(getattr(value, name)(*args, **kwargs))


def _host_call(node: ast.Call) -> bool:
    f = node.func
    if isinstance(f, ast.Name) and f.id in SHADOWED.get():       # (the code's `max` on literals; ours as a checker)
        return any(_free_names(a) - _HOST_NAMES for a in [*node.args, *(k.value for k in node.keywords)])
    return ((isinstance(f, ast.Name) and f.id in _HOST_FUNCS)
            or (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "math"
                and f.attr in _MATH))


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
                      _host_call(node) or _method_call(node)) and not any(isinstance(a, ast.Starred) for a in node.args)
                      and all(k.arg is not None for k in node.keywords)):
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
        if not bound and (gen := _as_generator(node)) is not None and _inside_comprehension(gen, names) is not None:
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
    if node.keywords or not its or (keep and len(its) != 1) or any(isinstance(a, ast.Starred) for a in node.args):
        return None
    if isinstance(fn, ast.Lambda):
        a = fn.args
        if a.vararg or a.kwarg or a.kwonlyargs or a.defaults or a.posonlyargs or len(a.args) != len(its):
            return None
        xs, body = [p.arg for p in a.args], fn.body
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


def _inside_comprehension(node, names, outer: list | None = None) -> ast.expr | None:
    """What the sandbox evaluates for `[elt for x in it if c]`: `[((x,), (q1, ...), (p1, ...) if c else None) for x
    in it]`, the bindings, the parts of c and of elt that need the code (plain values; elt's only where c holds);
    the host then computes c and elt from them, so the code's __eq__, a patched builtin, cannot decide it. None (run
    whole, the weaker form): more than one `for`, targets other than names, an `if` that needs the code and may
    stop half way (and/or, a conditional)."""
    if len(node.generators) != 1 or node.generators[0].is_async:
        return None
    gen = node.generators[0]
    targets = _targets(gen.target)
    if targets is None or len(set(targets)) != len(targets):
        return None
    bound = frozenset(targets)
    if any(isinstance(n, ast.NamedExpr) for n in ast.walk(node)):
        return None
    asks = _Parts(outer if outer is not None else [], names)
    for c in gen.ifs:
        if _mentions_code(c, bound) and not any(isinstance(n, ast.BoolOp | ast.IfExp) for n in ast.walk(c)):
            _split(c, asks, names, bound)            # (an `if` is asked of every item: its parts too)
        elif _mentions_code(c, bound) or not _host_computable(c, bound):
            return None
    parts = _Parts(outer if outer is not None else [], names)
    _split(node.elt, parts, names, bound)
    node.parts, node.asks, node.names = parts, asks, targets
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
    if isinstance(node, ast.Subscript):
        return _light(ev(node.value)[ev(node.slice)])
    if isinstance(node, ast.Slice):
        return slice(*(None if p is None else ev(p) for p in (node.lower, node.upper, node.step)))
    if isinstance(node, ast.Lambda):                                  # (a key= of sorted, min, max)
        names = [a.arg for a in node.args.args]
        return lambda *a: _host_eval(node.body, {**got, **{("name", n): v for n, v in zip(names, a, strict=True)}})
    if _method_call(node):
        return _method(ev(node.func.value), node.func.attr, [ev(a) for a in node.args],
                       {k.arg: ev(k.value) for k in node.keywords})
    if isinstance(node, ast.Call) and _host_call(node):
        fn = _HOST_FUNCS[node.func.id] if isinstance(node.func, ast.Name) else _MATH[node.func.attr]
        return _light(fn(*[ev(a) for a in node.args], **{k.arg: ev(k.value) for k in node.keywords}))
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math":
        return _MATH[node.attr]
    if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp):
        if hasattr(node, "inside") and id(node.inside) in got:
            return _host_comprehension(node, got)
        gen = node.generators[0]                  # (one of literals, computed here: _host_computable)
        names = _targets(gen.target)
        rows = [((item,) if isinstance(gen.target, ast.Name) else tuple(item), (), ()) for item in ev(gen.iter)]
        if any(len(binding) != len(names) for binding, _, _ in rows):
            raise ValueError("not as many values as names to bind")
        return _host_rows(node, rows, got)
    if isinstance(node, ast.Name) and ("name", node.id) in got:          # (a comprehension's binding)
        return got[("name", node.id)]
    if isinstance(node, ast.Name) and node.id in _TYPES:
        return _TYPES[node.id]
    if isinstance(node, ast.Name) and node.id in _HOST_FUNCS:          # (key=len)
        return _HOST_FUNCS[node.id]
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
                                             and len(r[0]) == len(node.names) and isinstance(r[1], tuple)
                                             and len(r[1]) == len(node.asks) for r in rows):
        raise ValueError("not the rows of a comprehension")
    if hasattr(node, "checked_iter") or getattr(node, "host_iter", False):
        # (the setup's table: its value from the no-code run; a set's order is each process's own: as a multiset)
        if hasattr(node, "checked_iter"):
            unordered, items = _host_eval(node.checked_iter, got)
        else:
            items = _host_eval(gen.iter, got)
            unordered = isinstance(items, set | frozenset)
        want = [(item,) if isinstance(gen.target, ast.Name) else tuple(item) for item in items]
        have = [row[0] for row in rows]
        if want != have and not (unordered and sorted(map(repr, want)) == sorted(map(repr, have))):
            raise ValueError("a comprehension's rows are not its iterable's")
    return _host_rows(node, rows, got)


def _host_rows(node, rows: list, got: dict):
    """The comprehension's value from its rows (bindings, the if-parts' values, the element-parts' values),
    each element and all of them bounded."""
    gen = node.generators[0]
    names, asks, parts = _targets(gen.target), getattr(node, "asks", []), getattr(node, "parts", [])
    out, weight = [], 0
    for binding, asked, values in rows:
        env = {**got, **{("name", n): v for n, v in zip(names, binding, strict=True)}}
        env.update({id(q): v for q, v in zip(asks, asked, strict=True)})
        if not all(_host_eval(c, env) for c in gen.ifs):
            continue
        if not isinstance(values, tuple) or len(values) != len(parts):
            raise ValueError("a row the sandbox skipped")
        env.update({id(p): v for p, v in zip(parts, values, strict=True)})
        out.append(_host_eval(node.elt, env))
        weight += _weight(out[-1])
        if weight > HOST_SIZE:                          # (each element bounded, and all of them together)
            raise TooCostly("comprehension too large")
    return _safe_set(out) if isinstance(node, ast.SetComp) else out


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
