"""The protocol between a test module's test and the code it calls, inside the sandbox (`Wire`, JSON lines on
pipes). Plain values cross; the code's other objects stay in its process and reach the test as handles
(`Remote`), whose reads are asked of the code and never with the test's values to compare; functions of the
test's are called back (`Callback`); the code's exception classes get twins. The processes at both ends are
harness.py's (`serve`, `tester`); what a plain value is: values.py.

It travels with values.py and harness.py: the host sends their texts as one program (sandbox.py: HARNESS). So:
standard library only, Python 3.8+, and nothing imported from harness.py (which imports from here). What
crosses and why: docs/sandbox.md, "a test module's tests".
"""
import binascii
import builtins
import io
import sys

if __name__ != "__main__":     # (in the sandbox, values.py's text ran first, in this same namespace)
    from tasks.scoring.values import AS_PLAIN, PLAIN, encode, write_all


class Gone(BaseException):
    """The code's process ended (or sent what is not a message): the test cannot go on (no `except Exception` of
    the test's catches it: an ended process is no exception the code raised)."""


def snapshot(x):
    try:
        return repr(to_json(x, 0))
    except Exception:
        return None


def to_json(x, depth):
    """A plain value (markers included) as JSON: a list as it is, a tuple, set, frozenset, dict, bytes or complex
    tagged ({"t": [...]}, ...). JSON, not a literal: a million-item list parses in a tenth of a second and a few
    tens of MB (ast.parse took 1 GB), and nesting is not the parser's."""
    t = type(x)
    if depth > DEPTH + 4:
        raise ValueError("value nested too deeply")
    if t in (type(None), bool, int, float, str):
        return x
    if t is list:
        return [to_json(v, depth + 1) for v in x]
    if t in (tuple, set, frozenset):
        return {TAGS[t]: [to_json(v, depth + 1) for v in x]}
    if t is dict:
        return {"d": [[to_json(k, depth + 1), to_json(v, depth + 1)] for k, v in x.items()]}
    if t is bytes:
        return {"b": binascii.b2a_base64(x, newline=False).decode()}
    if t is complex:
        return {"c": [x.real, x.imag]}
    raise TypeError("not a plain value: %s" % t.__name__)


TAGS = {tuple: "t", set: "s", frozenset: "f"}


def from_json(x):
    t = type(x)
    if t is list:
        return [from_json(v) for v in x]
    if t is not dict:
        return x
    (tag, v), = x.items()
    if tag == "t":
        return tuple(from_json(e) for e in v)
    if tag in ("s", "f"):
        return (set if tag == "s" else frozenset)(from_json(e) for e in v)
    if tag == "d":
        return dict((from_json(k), from_json(e)) for k, e in v)
    if tag == "b":
        return binascii.a2b_base64(v)
    if tag == "c":
        return complex(v[0], v[1])
    raise ValueError("unknown tag")


HANDLE, RICH, CALLBACK = "\x00rlflow-handle", "\x00rlflow-rich", "\x00rlflow-callback"
DEPTH = 150                 # nesting a value may have on the wire
# requests that change nothing: the test's side keeps their answers until a call
READS = ("get", "len", "list", "bool", "str", "repr", "item", "int", "float", "index", "isinstance", "issubclass",
         "mapping", "iterator", "format")


class Wire(object):
    """One end of the pipes between the test's process and the code's: messages are base64 lines of `encode`d
    values, ("req", kind, target, args, kwargs) or an answer ("ok", value, after) / ("raise", class, args). A
    side waiting for its answer serves the other's requests meanwhile (a callback, and calls made inside it)."""

    def __init__(self, fd_in, fd_out, side):
        import json
        import threading
        self.lines, self.out, self.side = io.BufferedReader(io.FileIO(fd_in, "r")), fd_out, side
        self.json, self.lock = json, threading.RLock()      # (one exchange at a time: the code's threads call back)
        if sys.getrecursionlimit() < 4000:      # (a recursion through callbacks nests both sides' frames)
            sys.setrecursionlimit(4000)

    def send(self, message):
        data = (self.json.dumps(to_json(message, 0), ensure_ascii=True) + "\n").encode()
        with self.lock:
            try:
                write_all(self.out, data)
            except OSError:
                raise Gone("the code's process ended") from None

    def receive(self):
        line = self.lines.readline(256 << 20)
        if not line:
            raise Gone("the code's process ended")
        try:
            message = from_json(self.json.loads(line))
        except Exception:
            message = None
        if type(message) is not tuple or not message or message[0] not in ("req", "ok", "raise"):
            raise Gone("what came through the pipe is not a message")
        return message

    def serve(self):
        while True:
            with self.lock:
                message = self.receive()
            self.answer(message)

    def answer(self, message):
        if message[0] != "req" or len(message) != 5:
            raise ValueError("not a request")
        side, (_, kind, target, args, kwargs) = self.side, message
        args, kwargs = side.unwire(args), side.unwire(kwargs)
        before = [(k, snapshot(a)) for k, a in list(enumerate(args)) + list(kwargs.items())
                  if type(a) in (list, dict, set)] if kind not in READS else []
        try:
            value, result = side.do(kind, target, args, kwargs), "ok"
        except (SystemExit, Gone):
            raise
        except BaseException as e:
            value, result = (side.error_class(e), tuple(e.args), wireable(side, e)), "raise"
        after = []
        for k, text in before:     # (a list, dict or set the call changed in place: sent back)
            a = args[k] if type(k) is int else kwargs[k]
            if text is not None and snapshot(a) != text:
                after.append((k, a))
        try:
            self.send((result, side.wire(value), side.wire(after)))
        except Gone:
            raise
        except Exception as e:
            self.send(("raise", "TypeError", ("a value the other side cannot take: %s" % (e,),)))

    def ask(self, kind, target, args=(), kwargs=None):
        with self.lock:
            return self.exchange(kind, target, args, kwargs)

    def exchange(self, kind, target, args, kwargs):
        self.send(("req", kind, target, self.side.wire(tuple(args)), self.side.wire(dict(kwargs or {}))))
        while True:
            message = self.receive()
            if message[0] == "req":
                self.answer(message)
                continue
            if len(message) != 3:
                raise Gone("what came through the pipe is not an answer")
            result, value, after = message
            value, after = self.side.unwire(value), self.side.unwire(after)
            for k, v in after:
                a = args[k] if type(k) is int and 0 <= k < len(args) else (kwargs or {}).get(k)
                if type(a) is list and type(v) is list:
                    a[:] = v
                elif type(a) in (dict, set) and type(v) is type(a):
                    a.clear()
                    a.update(v)
            if result == "raise":
                cls, eargs, attrs = (tuple(value) + (None,))[:3] if type(value) is tuple else (value, (), None)
                cls = getattr(builtins, cls, None) if type(cls) is str else cls
                if not (isinstance(cls, type) and issubclass(cls, Exception)) or (
                        issubclass(cls, (StopIteration, StopAsyncIteration)) and kind != "next"):
                    cls = RuntimeError          # (a StopIteration from a call would end the test's map(): PEP 479)
                error = cls(*(eargs if type(eargs) is tuple else (eargs,)))
                for k, v in (attrs.items() if type(attrs) is dict else ()):     # (`e.code`: the code's values)
                    if type(k) is str and not k.startswith("_"):
                        try:
                            setattr(error, k, v)
                        except Exception:
                            pass
                raise error
            return value


def wireable(side, e):
    """An exception's own attributes (`e.code`) that can cross, for its twin on the other side."""
    out = {}
    for k, v in list(getattr(e, "__dict__", {}).items()):
        try:
            if type(k) is str and not k.startswith("_"):
                side.wire(v)
                out[k] = v
        except Exception:
            pass
    return out


def rich(x, depth, wire):
    """A standard library value that is not plain, as (RICH, kind, payload), or None."""
    if isinstance(x, type) and getattr(builtins, x.__name__, None) is x:     # (int, ValueError: by name)
        return (RICH, "builtin", x.__name__)
    if type(x) is float:                 # (nan)
        return (RICH, "nan", None)
    if type(x) is range:
        return (RICH, "range", (x.start, x.stop, x.step))
    if type(x) is bytearray:
        return (RICH, "bytearray", bytes(x))
    import collections
    if type(x) is collections.deque:
        return (RICH, "deque", (wire(list(x), depth + 1), x.maxlen))
    if type(x) is collections.Counter:
        return (RICH, "Counter", wire(dict(x), depth + 1))
    if type(x) is collections.OrderedDict:
        return (RICH, "OrderedDict", wire(list(x.items()), depth + 1))
    if type(x) is collections.defaultdict:
        factory = x.default_factory
        name = factory.__name__ if getattr(builtins, getattr(factory, "__name__", ""), None) is factory else None
        return (RICH, "defaultdict", (name, wire(dict(x), depth + 1)))
    return None


def unrich(kind, payload):
    import collections
    if kind == "nan":
        return float("nan")
    if kind == "range":
        return range(*payload)
    if kind == "bytearray":
        return bytearray(payload)
    if kind == "deque":
        return collections.deque(payload[0], payload[1])
    if kind in ("Counter", "OrderedDict"):
        return getattr(collections, kind)(payload)
    if kind == "defaultdict":
        factory = getattr(builtins, payload[0]) if payload[0] in ("int", "list", "set", "dict", "str", "float",
                                                                    "tuple", "frozenset", "bool") else None
        return collections.defaultdict(factory, payload[1])
    if kind == "iter":
        return iter(payload)
    if kind == "builtin" and isinstance(getattr(builtins, payload, None), type):
        return getattr(builtins, payload)
    if kind == "module" and type(payload) is str:
        import importlib
        return importlib.import_module(payload)
    raise ValueError("unknown value %r" % (kind,))


class Side(object):
    """What one side sends as values (`wire`) and makes of what it receives (`unwire`)."""

    def wire(self, x, depth=0):
        t = type(x)
        if depth > DEPTH:
            raise ValueError("value nested too deeply")
        if t in (list, tuple, set, frozenset):
            return t(self.wire(v, depth + 1) for v in x)
        if t is dict:
            return dict((self.wire(k, depth + 1), self.wire(v, depth + 1)) for k, v in x.items())
        if t in PLAIN and not (t is float and x != x):
            return x
        out = rich(x, depth, self.wire)
        if out is not None:
            return out
        read = next((read for base, read in AS_PLAIN if issubclass(t, base)), None)
        if read is not None and self.own(t):      # (the code's own Stack(list), LRUCache(OrderedDict): an object
            read = None                           # with methods, a handle; a namedtuple stays a tuple)
        return self.wire(read(x), depth) if read is not None else self.other(x, depth)

    def own(self, t):
        return False

    def unwire(self, x):
        t = type(x)
        if t is tuple and len(x) >= 2 and x[0] in (HANDLE, RICH, CALLBACK):
            if x[0] == RICH and x[1] == "exc" and len(x) == 3 and type(x[2]) is tuple and len(x[2]) == 4:
                return self.exception_class(*(x[2][:3] + (self.unwire(x[2][3]),)))
            if x[0] == RICH and len(x) == 3:
                return unrich(x[1], self.unwire(x[2]))
            if type(x[1]) is int and len(x) == 2:
                return self.handle(x[0], x[1])
        if t in (list, tuple, set, frozenset):
            return t(self.unwire(v) for v in x)
        if t is dict:
            return dict((self.unwire(k), self.unwire(v)) for k, v in x.items())
        return x


class CodeSide(Side):
    """The code's process: its objects stay here (`objects`, one index each) and cross as handles."""

    def __init__(self, ns):
        self.ns, self.objects, self.index, self.wire_ = ns, [], {}, None

    def other(self, x, depth):
        if id(x) not in self.index:
            self.index[id(x)] = len(self.objects)
            self.objects.append(x)
        i = self.index[id(x)]
        if type(x) is type(sys):           # (a module: the test imports its own, never the code's, patched)
            return (RICH, "module", x.__name__)
        if isinstance(x, type) and issubclass(x, BaseException):     # (its nearest exception class of the code's
            parent = next((k for k in x.__mro__[1:] if getattr(builtins, k.__name__, None) is not k), None)  # too)
            return (RICH, "exc", (x.__name__[:100], self.error_class(x), i,
                                  self.wire(parent) if parent is not None else None))
        return (HANDLE, i)

    def handle(self, kind, i):
        if kind == CALLBACK:
            return Callback(i)
        return self.objects[i]

    def own(self, t):
        return getattr(t, "__module__", None) == "__main__" and issubclass(t, (list, dict, set))

    def exception_class(self, name, base, i, parent):
        return self.objects[i]

    def error_class(self, e):
        cls = e if isinstance(e, type) else type(e)
        if getattr(builtins, cls.__name__, None) is cls:
            return cls.__name__
        if isinstance(e, type):          # (the builtin an exception class of the code's derives from)
            return next((k.__name__ for k in cls.__mro__ if getattr(builtins, k.__name__, None) is k), "Exception")
        return self.wire(cls)

    def do(self, kind, target, args, kwargs):
        if kind == "resolve":
            return [(1, self.ns[n]) if n in self.ns else (0, None) for n in args]
        obj = self.objects[target] if type(target) is int else self.ns[target]
        if kind == "call":
            return obj(*args, **kwargs)
        if kind == "get":
            return getattr(obj, args[0])
        if kind == "set":
            return setattr(obj, args[0], args[1])
        if kind in ("isinstance", "issubclass"):
            return getattr(builtins, kind)(args[0], obj)
        if kind in ("next", "len", "bool", "str", "repr", "int", "float", "list"):
            return getattr(builtins, kind)(obj)
        if kind == "format":
            return format(obj, args[0])
        if kind == "index":
            return obj.__index__()
        if kind == "item":
            return obj[args[0]]
        if kind == "mapping":            # (a dict, a Counter, a Mapping: indexed by key)
            return hasattr(type(obj), "keys")
        if kind == "iterator":           # (a generator: read as the test takes it, `take`)
            return iter(obj) is obj
        if kind == "take":
            import itertools
            return list(itertools.islice(obj, args[0]))
        if kind == "setitem":
            obj[args[0]] = args[1]
            return None
        if kind == "op":                 # ("add", other): obj + other; ("radd", other): other + obj
            import operator
            name, rest = args[0], tuple(args[1:])
            if name in ("radd", "rsub", "rmul"):
                return getattr(operator, name[1:])(*(rest + (obj,)))
            return getattr(operator, name)(obj, *rest)
        if kind == "method":
            return getattr(obj, args[0])(*args[1:])
        raise ValueError("unknown request %r" % (kind,))


class Callback(object):
    """A function of the test's, in the code's process: a call is asked of the test's process."""

    def __init__(self, i):
        self.i = i

    def __call__(self, *args, **kwargs):
        return WIRE[0].ask("callback", self.i, args, kwargs)


class TestSide(Side):
    """The test's process: the code's objects are `Remote`s (one per handle), its exception classes classes of
    their own here; the test's functions it hands the code cross as callbacks; its other objects do not cross."""

    def __init__(self):
        self.remotes, self.classes, self.callables, self.cache = {}, {}, [], {}

    def other(self, x, depth):
        if type(x) is Remote:
            return (HANDLE, object.__getattribute__(x, "_ref"))
        if isinstance(x, type) and "_rlflow_ref" in x.__dict__:
            return (HANDLE, x.__dict__["_rlflow_ref"])
        if hasattr(x, "__next__") and hasattr(x, "__iter__"):      # (a generator: the items it yields)
            return (RICH, "iter", self.wire(list(x), depth + 1))
        if callable(x) and not isinstance(x, type):
            self.callables.append(x)
            return (CALLBACK, len(self.callables) - 1)
        raise TypeError("the test hands the code a %s, which its process cannot take" % type(x).__name__)

    def handle(self, kind, i):
        if kind != HANDLE:
            raise ValueError("not a handle")
        if i not in self.remotes:
            self.remotes[i] = Remote(i)
        return self.remotes[i]

    def exception_class(self, name, base, i, parent):
        if i not in self.classes:
            if not (isinstance(parent, type) and "_rlflow_ref" in parent.__dict__):
                parent = getattr(builtins, base, None) if type(base) is str else None
                parent = parent if isinstance(parent, type) and issubclass(parent, Exception) else Exception
            self.classes[i] = type(str(name), (parent,), {"_rlflow_ref": i})
        return self.classes[i]

    def do(self, kind, target, args, kwargs):
        if kind != "callback" or type(target) is not int or not 0 <= target < len(self.callables):
            raise ValueError("not a callback")
        self.cache.clear()                  # (the call it is made from is under way: what it reads may change)
        return self.callables[target](*args, **kwargs)

    def error_class(self, e):
        return type(e).__name__ if getattr(builtins, type(e).__name__, None) is type(e) else "Exception"


WIRE = []


def ask(remote, kind, args=()):
    """`kind` of a Remote asked of the code's process; what changes nothing is answered once until the next call
    (a length, its items, an attribute: the code's object holds still while the test reads it)."""
    wire, ref = WIRE[0], object.__getattribute__(remote, "_ref")
    if kind not in READS:
        wire.side.cache.clear()
        try:
            return wire.ask(kind, ref, args)
        finally:
            wire.side.cache.clear()
    key = encode((kind, ref, wire.side.wire(tuple(args))), 0, DEPTH + 2)
    if key not in wire.side.cache:
        try:
            wire.side.cache[key] = ("ok", wire.ask(kind, ref, args))
        except Exception as e:
            wire.side.cache[key] = ("raise", e)
    result, value = wire.side.cache[key]
    if result == "raise":
        raise value
    return value


def _ask(kind):
    def method(self, *args):
        return ask(self, kind, args)
    return method


def _op(name):
    def method(self, *args):         # (only between the code's own objects: `f(x) - exp` would hand the code the
        if any(type(a) is not Remote for a in args):      # expected value, and its answer decide the assert)
            raise TypeError("%s of the code's object with a value of the test's is not asked of the code" % name)
        out = ask(self, "op", (name,) + args)
        if type(out) is not Remote:
            raise TypeError("an operator of the code's %s object gives a plain value only as its value" % name)
        return out
    return method


def iterator(remote):
    """Whether a handle is an iterator of the code's (a generator, a map): read as taken, never whole first."""
    try:
        return ask(remote, "iterator") is True
    except Exception:
        return False


def taken(remote):
    """A generator of the code's, read as the test takes it, a few items at a time (an endless one under islice
    ends: a whole `list` of it filled the memory)."""
    n = 1
    while True:
        chunk = ask(remote, "take", (n,))
        for x in chunk:
            yield x
        if len(chunk) < n:
            return
        n = min(2 * n, 4096)


class Remote(object):
    """An object of the code's (a function, a class, an instance, a generator) in the test's process: what the
    test does with it is asked of the code's process. Equal only to itself: the code's __eq__ is never asked.
    Its length is that of its items (the same answer as iterating it), read once until the next call."""

    __slots__ = ("_ref",)

    def __init__(self, ref):
        object.__setattr__(self, "_ref", ref)

    def __call__(self, *args, **kwargs):
        WIRE[0].side.cache.clear()
        try:
            return WIRE[0].ask("call", object.__getattribute__(self, "_ref"), args, kwargs)
        finally:
            WIRE[0].side.cache.clear()

    def __getattr__(self, name):
        return ask(self, "get", (name,))

    def __setattr__(self, name, value):
        ask(self, "set", (name, value))

    def __iter__(self):
        return taken(self) if iterator(self) else iter(ask(self, "list"))

    def __len__(self):
        if iterator(self):            # (a generator has none: list() then takes it as it goes, not whole first)
            raise TypeError("object of type 'generator' has no len()")
        try:
            return len(ask(self, "list"))
        except TypeError:
            return ask(self, "len")

    def __contains__(self, x):        # (from its items: the code is never asked with the test's value)
        return x in (taken(self) if iterator(self) else ask(self, "list"))

    def __getitem__(self, key):       # (an index of an iterable from its items, as its length is; a dict's key
        if type(key) in (int, slice) and not iterator(self) and not (type(key) is int and ask(self, "mapping")):
            try:
                items = ask(self, "list")
            except TypeError:
                items = None
            if items is not None:
                return items[key]
        return ask(self, "item", (key,))

    def __bool__(self):
        if iterator(self):
            return True
        try:
            return bool(ask(self, "list"))
        except TypeError:
            return ask(self, "bool")

    def __format__(self, spec):
        return ask(self, "format", (spec,))

    def __instancecheck__(self, x):   # (a plain value is no instance of the code's classes: the code is not asked)
        return ask(self, "isinstance", (x,)) if type(x) is Remote else False

    def __subclasscheck__(self, x):
        return ask(self, "issubclass", (x,))

    def __enter__(self):
        return ask(self, "method", ("__enter__",))

    def __exit__(self, kind, exc, tb):   # (never suppresses what the test's block raised: a KeyError or TypeError
        kind = kind if kind is None or getattr(builtins, kind.__name__, None) is kind or \
            "_rlflow_ref" in kind.__dict__ else Exception     # the code's values caused would skip its asserts)
        ask(self, "method", ("__exit__", kind, None, None))
        return False

    __doc__ = property(lambda self: ask(self, "get", ("__doc__",)))
    __next__, __str__, __repr__ = _ask("next"), _ask("str"), _ask("repr")
    __int__, __float__, __index__ = _ask("int"), _ask("float"), _ask("index")
    __setitem__ = _ask("setitem")
    __add__, __sub__, __mul__, __truediv__ = _op("add"), _op("sub"), _op("mul"), _op("truediv")
    __floordiv__, __mod__, __pow__, __neg__, __abs__ = _op("floordiv"), _op("mod"), _op("pow"), _op("neg"), _op("abs")
    __radd__, __rsub__, __rmul__ = _op("radd"), _op("rsub"), _op("rmul")


class Solution(type(sys)):
    """`import solution` / `from solution import f` in a test: the code's names, through the pipe."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        ok, value = WIRE[0].ask("resolve", None, [name])[0]
        if not ok:
            raise AttributeError("module 'solution' has no attribute %r" % name)
        return value
