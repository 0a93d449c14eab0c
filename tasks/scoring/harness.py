"""The trusted harness that runs first inside every sandbox (tasks/scoring/sandbox.py), then each test of the
model's code in a child process of its own: fork, fresh stdio (the test's input on stdin from a memfd,
stdout/stderr to pipes), rlimits, then the code. It reports what happened (stdout, exit status, the values of
expressions) on a pipe of its own; verdicts are made on the host.

The host runs it as `python -I -c <the text of this file> rlflow-sandbox`: the sandbox cannot see this
checkout, so the file's text travels in argv. Standard library only, and Python 3.8+, since it runs on whatever
interpreter `reward.sandbox.python` names.
"""
import binascii
import builtins
import ctypes
import io
import marshal
import os
import resource
import select
import signal
import sys
import time

PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36


def main():
    req = marshal.loads(sys.stdin.buffer.read())
    deadline = time.monotonic() + req["timeout"]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)     # same uid as the code, but no /proc/<us>/{fd,mem}, no ptrace
    if not req["kill_all"]:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)   # orphans of the code come back to us, to be killed
    for i, test in enumerate(req["tests"]):
        if time.monotonic() >= deadline:
            send(req["fd"], "T %d 0 - - 1 0 - - -" % i)
            continue
        send(req["fd"], run_test(i, test, req, deadline))
        sweep(req["kill_all"])
    send(req["fd"], "D")


def send(fd, line):
    data = (line + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def b64(data):
    return binascii.b2a_base64(bytes(data), newline=False).decode() if data else "-"


def run_test(i, test, req, deadline):
    """Fork a child for one test; one line back: T i ran exit signal timeout limit stdout stderr values."""
    stdin = os.memfd_create("stdin")
    data = (test["stdin"] or "").encode()
    while data:
        data = data[os.write(stdin, data):]
    os.lseek(stdin, 0, os.SEEK_SET)
    pipes = {"stdout": os.pipe(), "stderr": os.pipe()}
    if test["exprs"] is not None:
        pipes["values"] = os.pipe()
    pid = fork()
    if pid == 0:
        try:
            os.setsid()
            os.dup2(stdin, 0)
            os.dup2(pipes["stdout"][1], 1)
            os.dup2(pipes["stderr"][1], 2)
            if "values" in pipes:
                os.dup2(pipes["values"][1], 3)
            os.closerange(4 if "values" in pipes else 3, 1 << 16)   # our result pipe too
            limit(req["limits"])
            child(req["code"], req["setup"], test["exprs"])
        finally:
            os._exit(112)
    os.close(stdin)
    for _, w in pipes.values():
        os.close(w)
    got, st = collect(pid, dict((k, r) for k, (r, w) in pipes.items()), req["limits"]["output"], deadline)
    exit_code = os.WEXITSTATUS(st["status"]) if os.WIFEXITED(st["status"]) else "-"
    sig = os.WTERMSIG(st["status"]) if os.WIFSIGNALED(st["status"]) else "-"
    values = b64(got["values"]) if "values" in got else "-"
    return "T %d 1 %s %s %d %d %s %s %s" % (i, exit_code, sig, st["timeout"], st["limit"], b64(got["stdout"]),
                                            b64(got["stderr"][-2000:]), values)


def fork():
    for _ in range(50):          # the previous test's processes may still be dying (RLIMIT_NPROC)
        try:
            return os.fork()
        except BlockingIOError:
            time.sleep(0.01)
    return os.fork()


def collect(pid, fds, cap, deadline):
    """Read the child's pipes until it exits (then drain what is already there), its deadline, or a pipe
    passes `cap` bytes. Processes it left holding the pipes do not hold us up: they are killed next."""
    got = dict((k, bytearray()) for k in fds)
    names = dict((fd, k) for k, fd in fds.items())
    pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None     # Python >= 3.9
    st = {"timeout": 0, "limit": 0, "status": None}
    while st["status"] is None and not st["limit"]:
        left = deadline - time.monotonic()
        if left <= 0:
            st["timeout"] = 1
            break
        watch = list(names) + ([pidfd] if pidfd is not None else [])
        for fd in select.select(watch, [], [], left if pidfd is not None else min(left, 0.02))[0]:
            if fd != pidfd:
                read_into(fd, names, got, cap, st)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            st["status"] = status
    for fd in list(names):
        os.set_blocking(fd, False)
        try:
            while fd in names and not st["limit"]:
                read_into(fd, names, got, cap, st)
        except BlockingIOError:
            pass
    kill_group(pid)
    if st["status"] is None:
        st["status"] = os.waitpid(pid, 0)[1]
    for fd in names:
        os.close(fd)
    if pidfd is not None:
        os.close(pidfd)
    return got, st


def read_into(fd, names, got, cap, st):
    chunk = os.read(fd, 65536)
    if not chunk:
        os.close(fd)
        del names[fd]
        return
    buf = got[names[fd]]
    buf += chunk
    if len(buf) > cap:
        del buf[cap:]
        st["limit"] = 1


def kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def sweep(kill_all):
    """Kill everything the test left behind (daemons included) before the next test starts."""
    if kill_all:   # our own pid namespace, or a uid of our own: -1 is every process but us (and pid 1)
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    else:          # same uid as the host: only our descendants (we are their subreaper)
        for _ in range(100):
            kids = descendants(os.getpid())
            if not kids:
                break
            for p in kids:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            reap()
    reap()


def descendants(root):
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parent[int(name)] = int(fields[1])
            except (OSError, ValueError, IndexError):
                pass
    out, frontier = [], {root}
    while frontier:
        frontier = set(p for p, pp in parent.items() if pp in frontier and p != root)
        out += frontier
    return out


def reap():
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def limit(lim):
    mb = 1 << 20
    try:    # over the sandbox's memory (its cgroup), the kernel kills the code's processes first, not us
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu"], lim["cpu"] + 1))      # SIGXCPU, then SIGKILL
    resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_size_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"],) * 2)


def child(code, setup, exprs):
    """Become `python solution.py`: fresh stdio, a __main__ namespace, the code; then the expressions, whose
    values go to fd 3 as lines `ok|error <base64>`."""
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding="utf-8", newline="\n")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                   encoding="utf-8", errors="backslashreplace", newline="\n")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                                   errors="backslashreplace", newline="\n", write_through=True)
    sys.argv = ["solution.py"]
    ns = {"__name__": "__main__", "__builtins__": builtins}
    pristine, modules = dict(builtins.__dict__), dict(sys.modules)
    status = 0
    try:
        exec(compile(code, "solution.py", "exec"), ns)
        if exprs is not None:
            # the tests' own functions and expressions see the builtins as they were before the code ran (a
            # `range` or `zip` the code patched would empty a test's loop); the code's functions keep theirs
            ns["__builtins__"] = pristine
            for name in [m for m in sys.modules if m not in modules]:
                del sys.modules[name]           # (a fake `numpy` the code put there is not what the tests import)
            sys.modules.update(modules)
            ns["_rlflow_plain"], ns["_rlflow_missing"] = plain, missing
            if setup:
                exec(compile(setup, "test_setup.py", "exec"), ns)
            lines = [evaluate(e, ns) for e in exprs]
            data = "".join("%s %s\n" % (kind, b64(text.encode("utf-8", "backslashreplace")))
                           for kind, text in lines).encode()
            while data:
                data = data[os.write(3, data):]
    except SystemExit as e:
        status = exit_status(e.code)
    except BaseException:
        import traceback
        traceback.print_exc()
        status = 1
    try:
        sys.stdout.flush()
    except BaseException:
        status = status or 120
    os._exit(status)


def exit_status(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def evaluate(expr, ns):
    try:
        return "ok", encode(eval(compile(expr, "test.py", "eval"), ns), 0)
    except Exception as e:
        return "error", ("%s: %s" % (type(e).__name__, e))[:300]


PLAIN = (type(None), bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict)


# A subclass of a built-in container, text or number (a Counter, a namedtuple, an OrderedDict) is read as that
# type through the type's own methods, never the subclass's: its contents, not what its __eq__ or __iter__ says.
AS_PLAIN = ((dict, lambda v: dict(dict.items(v))), (list, lambda v: list(list.__iter__(v))),
            (tuple, lambda v: tuple(tuple.__iter__(v))), (frozenset, lambda v: frozenset(frozenset.__iter__(v))),
            (set, lambda v: set(set.__iter__(v))), (str, str.__str__), (int, int.__int__),
            (float, float.__float__))


def plain(x, depth=0, _type=type, _subclass=issubclass, _object=object,
          _mro=type.__dict__["__mro__"].__get__, _vars=type.__dict__["__dict__"].__get__):
    """`x` as built-in values (a subclass read as its type: AS_PLAIN), what a test module's helper is handed in
    place of the code's value (tasks/scoring/module_tests.py: _Recorded); an object with an __eq__ of its own is a
    TypeError (it could equal anything), one without (a tree node: compared by what it holds) passes as it is."""
    if depth > 50:
        raise ValueError("value nested too deeply")
    t = _type(x)
    if t not in PLAIN:
        read = next((read for base, read in AS_PLAIN if _subclass(t, base)), None)
        if read is None:
            # (read through type's own descriptors: a metaclass cannot answer for the class)
            if any("__eq__" in _vars(k) or "__ne__" in _vars(k) for k in _mro(t) if k is not _object):
                raise TypeError("returned a %s, not a built-in value" % _type.__dict__["__name__"].__get__(t))
            return x
        x = read(x)
        t = _type(x)
    if t in (list, tuple, set, frozenset):
        return t(plain(v, depth + 1) for v in x)
    if t is dict:
        return {plain(k, depth + 1): plain(v, depth + 1) for k, v in x.items()}
    return x


def missing(name):
    """A stand-in for a module a test module imports that this Python lacks (numpy, pytest): each attribute a
    class nothing is an instance of, whose call raises ImportError. `isinstance(x, np.ndarray)` is False; a test
    that calls `np.allclose` or `pytest.raises` fails, saying why; the others run."""
    class Absent(object):
        def __init__(self, *args, **kwargs):
            raise ImportError("No module named %r in the sandbox's Python (reward.sandbox.python)" % name)

    class Module(object):
        def __getattr__(self, attr):
            return Absent
    return Module()


def encode(x, depth, _type=type, _repr=repr, _float=float, _subclass=issubclass):
    """A Python literal for a value made only of built-in types (a subclass of one read as it: AS_PLAIN); anything
    else (an object with its own __eq__) is an error. The host parses it back with ast.literal_eval."""
    t = _type(x)
    if depth > 50:
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
        inner = ", ".join(encode(v, depth + 1) for v in x)
        return "[%s]" % inner if t is list else "(%s%s)" % (inner, "," if len(x) == 1 else "")
    if t in (set, frozenset):
        return "{%s}" % ", ".join(encode(v, depth + 1) for v in x) if x else "set()"
    if t is dict:
        return "{%s}" % ", ".join("%s: %s" % (encode(k, depth + 1), encode(v, depth + 1)) for k, v in x.items())
    return _repr(x)


if __name__ == "__main__":     # `python -I -c <this file> rlflow-sandbox` runs as __main__
    main()
