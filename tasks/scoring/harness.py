"""The trusted harness that runs first inside every sandbox (tasks/scoring/sandbox.py), then each test of the
model's code in a child process of its own: fork, fresh stdio (the test's input on stdin from a memfd,
stdout/stderr to pipes), rlimits, then the code. It reports what happened (stdout, exit status, the values of
expressions) on a pipe of its own; verdicts are made on the host.

A test module's test runs split in two (run_split): the test in a process that never holds the code, which it
calls in a fresh interpreter of the code's own (`serve`) through a pipe.

The host runs it as `python -I -c <the text of this file> rlflow-sandbox`: the sandbox cannot see this
checkout, so the file's text travels in argv. Standard library only, and Python 3.8+, since it runs on whatever
interpreter `reward.sandbox.python` names. The values' encodings and the split form's protocol are in
tasks/scoring/wire.py, whose text the host sends ahead of this one (sandbox.py: HARNESS).
"""
import binascii
import builtins
import ctypes
import fcntl
import io
import marshal
import os
import resource
import select
import signal
import sys
import time

if __name__ != "__main__":     # (in the sandbox, values.py's and wire.py's texts ran first, here)
    from tasks.scoring.values import encode, write_all
    from tasks.scoring.wire import WIRE, CodeSide, Gone, Solution, TestSide, Wire

PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36


def main():
    """The tests that are not split first, each in a child forked from here: this process holds only the
    request's first part then, never a split test's definitions (a test module, its expected values), which it
    reads from stdin after them (unbuffered: no read-ahead holds them either)."""
    req = marshal.loads(read_exactly(0, int.from_bytes(read_exactly(0, 8), "little")))
    deadline = time.monotonic() + req["timeout"]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)     # same uid as the code, but no /proc/<us>/{fd,mem}, no ptrace
    if not req["kill_all"]:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)   # orphans of the code come back to us, to be killed
    server = {}
    tests = list(enumerate(req["tests"]))
    for i, test in sorted(tests, key=lambda t: t[1].get("names") is not None):
        if test.get("names") is not None and "split_setup" not in req:
            req["split_setup"] = marshal.loads(read_exactly(0, None))
        if time.monotonic() >= deadline:
            send(req["fd"], "T %d 0 - - 1 0 - - -" % i)
            continue
        if test.get("names") is not None:
            send(req["fd"], run_split(i, test, req, deadline, server))
        else:
            send(req["fd"], run_test(i, test, req, deadline))
        if not server:                  # (the code's process of a test module's tests serves the next one)
            sweep(req["kill_all"])
    stop_server(server)
    sweep(req["kill_all"])              # (what the code's last process left: a daemon it started)
    send(req["fd"], "D")


def read_exactly(fd, n):
    """`n` bytes of `fd` (None: up to its end), read as they are asked for."""
    out = bytearray()
    while n is None or len(out) < n:
        chunk = os.read(fd, 65536 if n is None else min(n - len(out), 65536))
        if not chunk:
            if n is None:
                return bytes(out)
            raise EOFError("the request ended early")
        out += chunk
    return bytes(out)


def send(fd, line):
    write_all(fd, (line + "\n").encode())


def value_lines(lines):
    """The (kind, text) of each expression as the lines `ok|error <base64>` the host reads (sandbox._values)."""
    return "".join("%s %s\n" % (kind, b64(text.encode("utf-8", "backslashreplace"))) for kind, text in lines).encode()


def b64(data):
    return binascii.b2a_base64(bytes(data), newline=False).decode() if data else "-"


def run_test(i, test, req, deadline):
    """Fork a child for one test; one line back: T i ran exit signal timeout limit stdout stderr values."""
    stdin = os.memfd_create("stdin")
    write_all(stdin, (test["stdin"] or "").encode())
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


def run_split(i, test, req, deadline, server):
    """A test of a test module (docs/sandbox.md, "a test module's tests"): the test runs in a process that never
    holds the code (`tester`), the code in a fresh interpreter of its own (`serve`: nothing of this process's
    memory, the tests included, reaches it), which the test calls through a pipe. Only plain values cross; the
    code's other objects stay its own, handed to the test as handles. The code's process serves the run's
    tests until it fails one (it ended, or the test did not end cleanly): the next starts a new one. One line
    back, as run_test's: the code's exit status if it ended first, else the test's."""
    if not server:
        start_server(req, server)
    values = os.pipe()
    test_pid = fork()
    if test_pid == 0:
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            place([(null, 0), (null, 1), (null, 2), (values[1], 3), (server["calls"], 4), (server["replies"], 5)])
            limit(req["limits"])
            tester(req["split_setup"], test)
        finally:
            os._exit(112)
    os.close(values[1])
    fds = {"stdout": server["stdout"], "stderr": server["stderr"], "values": values[0]}
    got, st = collect(test_pid, fds, req["limits"]["output"], deadline, server["pid"])
    status = st["other"] if st["other"] is not None else st["status"]
    if st["other"] is not None:         # (the code's process ended during the test: it fails, whatever the test
        got["values"] = value_lines([("error", "Gone: the code's process ended")] * len(test["exprs"]))  # caught)
    if st["other"] is not None or st["timeout"] or st["limit"] or status != 0:
        stop_server(server, ended=st["other"] is not None)
    exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else "-"
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else "-"
    return "T %d 1 %s %s %d %d %s %s %s" % (i, exit_code, sig, st["timeout"], st["limit"], b64(got["stdout"]),
                                            b64(got["stderr"][-2000:]), b64(got["values"]) or "-")


def start_server(req, server):
    code = os.memfd_create("code")
    write_all(code, req["code"].encode("utf-8", "surrogatepass"))
    os.lseek(code, 0, os.SEEK_SET)
    calls, replies, out, err = os.pipe(), os.pipe(), os.pipe(), os.pipe()
    pid = fork()
    if pid == 0:
        try:
            os.setsid()
            place([(os.open(os.devnull, os.O_RDONLY), 0), (out[1], 1), (err[1], 2), (calls[0], 3), (replies[1], 4),
                   (code, 5)])
            limit(req["limits"])
            os.execv(sys.executable, [sys.executable, "-I", "-c", req["harness"], sys.argv[1], "serve"])
        finally:
            os._exit(112)
    for fd in (code, calls[0], replies[1], out[1], err[1]):
        os.close(fd)
    for fd in (out[0], err[0]):
        os.set_blocking(fd, False)
    server.update(pid=pid, calls=calls[1], replies=replies[0], stdout=out[0], stderr=err[0])


def stop_server(server, ended=False):
    if server:
        kill_group(server["pid"])
        if not ended:
            os.waitpid(server["pid"], 0)
        for k in ("calls", "replies", "stdout", "stderr"):
            os.close(server[k])
        server.clear()


def place(pairs):
    """dup2 each (fd, target), whatever the numbers (a target may be another's fd), then close all others."""
    top = max(to for _, to in pairs) + 1
    high = [(fcntl.fcntl(fd, fcntl.F_DUPFD, top), to) for fd, to in pairs]   # (fresh numbers above every target)
    for fd, to in high:
        os.dup2(fd, to)
    os.closerange(top, 1 << 16)


def fork():
    for _ in range(50):          # the previous test's processes may still be dying (RLIMIT_NPROC)
        try:
            return os.fork()
        except BlockingIOError:
            time.sleep(0.01)
    return os.fork()


def collect(pid, fds, cap, deadline, other=None):
    """Read the child's pipes until it exits (then drain what is already there), its deadline, or a pipe
    passes `cap` bytes. Processes it left holding the pipes do not hold us up: they are killed next. `other`
    (run_split's code, whose pipes are `fds`' but "values"): st["other"] its status if it ended first."""
    got = dict((k, bytearray()) for k in fds)
    names = dict((fd, k) for k, fd in fds.items())
    pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None     # Python >= 3.9
    st = {"timeout": 0, "limit": 0, "status": None, "other": None,
          "keep": set(fd for k, fd in fds.items() if k != "values") if other is not None else set()}
    while st["status"] is None and not st["limit"]:
        left = deadline - time.monotonic()
        if left <= 0:
            st["timeout"] = 1
            break
        watch = list(names) + ([pidfd] if pidfd is not None else [])
        for fd in select.select(watch, [], [], left if pidfd is not None else min(left, 0.02))[0]:
            if fd != pidfd:
                read_into(fd, names, got, cap, st)
        if other is not None and st["other"] is None:
            done, status = os.waitpid(other, os.WNOHANG)
            if done:
                st["other"] = status
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
    if other is not None and st["other"] is None:     # (it ended first if it is a zombie now: the test saw
        done, status = os.waitpid(other, os.WNOHANG)    # its pipe close)
        st["other"] = status if done else None
    for fd, name in names.items():
        if other is None or name == "values":
            os.close(fd)
    if pidfd is not None:
        os.close(pidfd)
    return got, st


def read_into(fd, names, got, cap, st):
    chunk = os.read(fd, 65536)
    if not chunk:
        if fd not in st["keep"]:
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
    ns = stdio_and_namespace()
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
            if setup:
                exec(compile(setup, "test_setup.py", "exec"), ns)
            write_all(3, value_lines([evaluate(e, ns) for e in exprs]))
    except SystemExit as e:
        status = exit_status(e.code)
    except BaseException as e:
        status = report(e)
    flush_and_exit(status)


def report(e):
    """The code's exception on stderr, as Python prints it (a MemoryError without the memory that takes); 1."""
    if isinstance(e, MemoryError):
        os.write(2, b"\nMemoryError\n")
    else:
        import traceback
        traceback.print_exc()
    return 1


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


# ---------------------------------------------------------------------- a test module's test, split in two

def serve():
    """The code's process of run_split: a fresh `python solution.py` (fd 5 holds the code) that then answers
    the test's requests (fd 3 in, fd 4 out: `Wire`). Its objects that are not plain values stay here and cross
    as handles; a function of the test's it is handed is called back through the same pipes."""
    with io.FileIO(5, "r") as f:
        code = f.readall().decode("utf-8", "surrogatepass")
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)
    ns = stdio_and_namespace()
    try:
        exec(compile(code, "solution.py", "exec"), ns)
    except SystemExit as e:
        flush_and_exit(exit_status(e.code))
    except BaseException as e:
        flush_and_exit(report(e))
    wire = Wire(3, 4, CodeSide(ns))
    WIRE.append(wire)
    try:
        wire.serve()
    except SystemExit as e:
        flush_and_exit(exit_status(e.code))
    flush_and_exit(0)


def stdio_and_namespace():
    """Fresh stdio on fds 0-2 and a __main__ namespace, as `python solution.py` has."""
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding="utf-8", newline="\n")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                   encoding="utf-8", errors="backslashreplace", newline="\n")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                                   errors="backslashreplace", newline="\n", write_through=True)
    sys.argv = ["solution.py"]
    return {"__name__": "__main__", "__builtins__": builtins}


def flush_and_exit(status):
    try:
        sys.stdout.flush()
    except BaseException:
        status = status or 120
    os._exit(status)


def tester(setup, test):
    """The test's process of run_split: the module `solution` and the names the test takes from the code
    (test["names"]: (name here, the code's name)) are the code's, through the pipe; then the setup (the test
    module's own definitions) and the test's expressions, whose values go to fd 3 as child's do."""
    stdio_and_namespace()
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)
    WIRE.append(Wire(5, 4, TestSide()))
    ns = {"__name__": "__main__", "__builtins__": builtins, "_rlflow_missing": missing}
    try:
        found = WIRE[0].ask("resolve", None, [code for _, code in test["names"]])
        ns.update((name, v) for (name, _), (ok, v) in zip(test["names"], found) if ok)
        sys.modules["solution"] = Solution("solution")
        if setup:
            exec(compile(setup, "test_setup.py", "exec"), ns)
        lines = [evaluate(e, ns) for e in test["exprs"]]
    except Gone as e:
        lines = [("error", "Gone: %s" % e)] * len(test["exprs"])
    except Exception as e:
        lines = [("error", ("%s: %s" % (type(e).__name__, e))[:300])] * len(test["exprs"])
    write_all(3, value_lines(lines))
    os._exit(0)


if __name__ == "__main__":     # `python -I -c <this file> rlflow-sandbox [serve]` runs as __main__
    serve() if sys.argv[2:] == ["serve"] else main()
