"""What the host computes on a value the code chose, and how it reads one back: every operation bounded before
it is done (HOST_SIZE, INT_BITS, BUCKET_MAX; past them: TooCostly), with Python's own builtins, never the code's.

    bounded_literal(text)            # a value the sandbox wrote as a literal, read with bounded work
    binop(op, a, b)                  # a + b, a * n, a % args, a ** b, a << b: refused before a result too big
    HOST_FUNCS, METHODS, MATH        # the builtins, methods of plain values and math functions an assert may use here
    weight(x), light(x)              # what a value costs to print, compare or copy; a value within HOST_SIZE

For tasks/scoring/asserts.py, which decides which parts of an assert are computed here (docs/sandbox.md).
"""

from __future__ import annotations

import ast
import math
import operator
import re

CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
        ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}
BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.BitAnd: operator.and_,
        ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.LShift: operator.lshift, ast.RShift: operator.rshift}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_, ast.Invert: operator.invert}
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


def weight(x, limit: int = HOST_SIZE) -> int:
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


def light(x):
    """x, when its weight is within HOST_SIZE; else refused."""
    if weight(x) > HOST_SIZE:
        raise TooCostly("value too large")
    return x


def _safe_text(fn):
    def call(*args, **kw):
        for a in args:
            light(a)                 # str/repr cost what they write: the weight of what they are given
        return fn(*args, **kw)
    return call


def check_hashes(items: list) -> list:
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


def safe_set(items=(), kind=set):
    return kind(check_hashes(list(items)))


def _safe_frozenset(items=()):
    return safe_set(items, frozenset)


def safe_dict(items=(), **kw):
    pairs = list(items.items() if isinstance(items, dict) else items) + list(kw.items())
    if any(not isinstance(p, list | tuple) or len(p) != 2 for p in pairs):
        raise TypeError("dict() wants pairs")
    check_hashes([k for k, _ in pairs])
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
    total, work = weight(start), 0
    for x in items:
        total += weight(x)
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
        size += 400 + 8 * weight(v)          # %s of a container: its repr; a float's %f: up to 309 digits
        if size > HOST_SIZE:
            raise TooCostly("%-format too large")
    return size


def binop(op: ast.operator, a, b):
    """a <op> b on the host, refused before it is done when its result would pass HOST_SIZE or INT_BITS."""
    kind = type(op)
    if kind is ast.Mult:
        for seq, n in ((a, b), (b, a)):
            if isinstance(seq, _SEQUENCE) and isinstance(n, int) and n > 0 and weight(seq) * n > HOST_SIZE:
                raise TooCostly("repetition too large")
        if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > INT_BITS:
            raise TooCostly("product too large")
    elif kind is ast.Add:
        if isinstance(a, _SEQUENCE) and isinstance(b, _SEQUENCE) and weight(a) + weight(b) > HOST_SIZE:
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
    result = BIN[kind](a, b)
    if isinstance(result, int) and result.bit_length() > INT_BITS:
        raise TooCostly("int too large")
    return light(result)


# What an assert may compute on the host, around what the code returns: Python's own builtins, never the code's.
HOST_FUNCS = {"abs": abs, "len": len, "sorted": sorted, "list": list, "tuple": tuple, "str": _safe_text(str),
               "int": _safe_int, "float": float, "bool": bool, "complex": complex, "round": _safe_round, "min": min,
               "max": max, "sum": _safe_sum, "all": all, "any": any, "set": safe_set, "frozenset": _safe_frozenset,
               "dict": safe_dict, "reversed": lambda x: list(reversed(x)), "range": _small_range,
               "enumerate": lambda *a: list(enumerate(*a)), "zip": lambda *a: list(zip(*a, strict=False)),
               "repr": _safe_text(repr), "ord": ord, "chr": chr, "type": type}
TYPES = {"int": int, "str": str, "float": float, "bool": bool, "complex": complex, "list": list, "tuple": tuple,
          "dict": dict, "set": set, "frozenset": frozenset}      # (a value the sandbox returns is of these exactly)


def _isinstance(value, kinds) -> bool:
    if not all(k in TYPES.values() or k is type(None) for k in (kinds if isinstance(kinds, tuple) else (kinds,))):
        raise ValueError("not computable on the host: isinstance of another type")
    return isinstance(value, kinds)


HOST_FUNCS["isinstance"] = _isinstance
MATH = {name: getattr(math, name) for name in ("isclose", "sqrt", "floor", "ceil", "fabs", "log", "log2", "log10",
                                                "exp", "isnan", "isinf", "isfinite", "gcd", "pi", "e", "inf", "nan")}
# Methods computed here on a value the sandbox returned (exact built-in types: no method of the code's runs),
# each bounded before it is done (method); the code's own `startswith` cannot decide an assert.
METHODS = {str: {"startswith", "endswith", "upper", "lower", "strip", "lstrip", "rstrip", "split", "rsplit",
                  "splitlines", "count", "find", "rfind", "index", "rindex", "isdigit", "isalpha", "isalnum",
                  "isspace", "islower", "isupper", "isnumeric", "isdecimal", "istitle", "title", "capitalize",
                  "swapcase", "casefold", "partition", "rpartition", "removeprefix", "removesuffix", "join",
                  "replace"},
            list: {"count", "index"}, tuple: {"count", "index"}, dict: {"get"},
            set: {"issubset", "issuperset", "isdisjoint"}, frozenset: {"issubset", "issuperset", "isdisjoint"}}
METHOD_NAMES = frozenset().union(*METHODS.values())


def method(value, name: str, args: list, kwargs: dict):
    """value.name(*args) for a value of an exact built-in type and one of its METHODS, bounded before it is done."""
    if name not in METHODS.get(type(value), ()):
        raise ValueError(f"not computable on the host: {type(value).__name__}.{name}")
    if type(value) in (set, frozenset):            # (a list argument is made a set here: its hashes checked first)
        args = [a if type(a) in (set, frozenset) else safe_set(a) for a in args]
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
    return light(getattr(value, name)(*args, **kwargs))


def bounded_literal(text: str):
    """A literal written by the sandboxed code, read with bounded work: at most LITERAL_CHARS characters and
    LITERAL_DEPTH levels, ints of at most INT_BITS bits, and sets and dicts whose values do not collide in
    their hashes (check_hashes: more than BUCKET_MAX distinct values of one hash make every insertion and
    comparison quadratic), all checked while it is built, before any set or dict is. The same bounds hold for
    what the host computes from it (binop, the _safe_* builtins)."""
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
        return UNARY[type(node.op)](node.operand.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub) \
            and isinstance(node.right, ast.Constant) and type(node.right.value) is complex:   # (1+2j)
        left = _literal(node.left, depth + 1)
        if type(left) not in (int, float) or (isinstance(left, int) and left.bit_length() > 64):
            raise ValueError("not a literal")
        return BIN[type(node.op)](left, node.right.value)
    if isinstance(node, ast.List | ast.Tuple):
        items = [_literal(e, depth + 1) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.Set):
        return set(check_hashes([_literal(e, depth + 1) for e in node.elts]))
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("not a literal")
        keys = check_hashes([_literal(k, depth + 1) for k in node.keys])
        return dict(zip(keys, [_literal(v, depth + 1) for v in node.values], strict=True))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "set" \
            and not node.args and not node.keywords:
        return set()
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "frozenset" \
            and not node.keywords and (not node.args or len(node.args) == 1 and isinstance(node.args[0], ast.Set)):
        return frozenset(_literal(node.args[0], depth + 1) if node.args else ())     # (as the harness writes one)
    raise ValueError(f"not a literal: {type(node).__name__}")
