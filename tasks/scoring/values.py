"""Plain values inside the sandbox: what counts as one (PLAIN, a subclass read as its base: AS_PLAIN) and
`encode`, the Python literal of a test expression's value that the host reads back (tasks/scoring/sandbox.py:
_values, with ast.literal_eval); `write_all` for the pipes. It travels first in the one program the host sends
(sandbox.py: HARNESS: this file, wire.py, harness.py), so: standard library only, Python 3.8+, no imports of
the other two (which import from here on the host)."""
import os


def write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


PLAIN = (type(None), bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict)


# A subclass of a built-in container, text or number (a Counter, a namedtuple, an OrderedDict) is read as that
# type through the type's own methods, never the subclass's: its contents, not what its __eq__ or __iter__ says.
AS_PLAIN = ((dict, lambda v: dict(dict.items(v))), (list, lambda v: list(list.__iter__(v))),
            (tuple, lambda v: tuple(tuple.__iter__(v))), (frozenset, lambda v: frozenset(frozenset.__iter__(v))),
            (set, lambda v: set(set.__iter__(v))), (str, str.__str__), (int, int.__int__),
            (float, float.__float__))


def encode(x, depth, limit=50, _type=type, _repr=repr, _float=float, _subclass=issubclass):
    """A Python literal for a value made only of built-in types (a subclass of one read as it: AS_PLAIN); anything
    else (an object with its own __eq__) is an error. The host parses it back with ast.literal_eval."""
    t = _type(x)
    if depth > limit:
        raise ValueError("value nested too deeply")
    if t not in PLAIN:
        read = next((read for base, read in AS_PLAIN if _subclass(t, base)), None)
        if read is None:
            raise TypeError("returned a %s, not a built-in value" % t.__name__)
        x = read(x)
        t = _type(x)
    if t is float:
        if x != x:
            raise ValueError("returned nan")
        return _repr(x) if x not in (_float("inf"), _float("-inf")) else ("1e999" if x > 0 else "-1e999")
    if t in (list, tuple):
        inner = ", ".join(encode(v, depth + 1, limit) for v in x)
        return "[%s]" % inner if t is list else "(%s%s)" % (inner, "," if len(x) == 1 else "")
    if t in (set, frozenset):       # (a frozenset as a call, bounded_literal's and `literal`'s: an element of a set)
        inner = "{%s}" % ", ".join(encode(v, depth + 1, limit) for v in x) if x else ""
        return inner or "set()" if t is set else "frozenset(%s)" % inner
    if t is dict:
        return "{%s}" % ", ".join("%s: %s" % (encode(k, depth + 1, limit), encode(v, depth + 1, limit))
                                  for k, v in x.items())
    return _repr(x)
