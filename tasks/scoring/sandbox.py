"""Running untrusted Python (code a model wrote) with the strongest isolation this machine offers.

    from tasks.scoring import sandbox
    sandbox.configure(cfg.reward.sandbox)            # once per process (the reward stage does it)
    runner = sandbox.runner()                        # probes bubblewrap once, then reuses the answer
    run = runner.run("print(int(input()) * 2)", [sandbox.Test(stdin="21\\n")])
    run.isolation, run.tests[0].stdout               # ('bubblewrap', '42\\n')
    runs = runner.map([(code, tests, setup), ...])   # a bounded pool of sandboxes, results in order

    python -m tasks.scoring.sandbox                  # which isolation is active here, and why

Isolation (`reward.sandbox.isolation`, reported in every Run and as `code/isolation_*`): `bubblewrap` (namespaces,
no network, a read-only root with /usr only), else `rlimits` (the same limits; files and network reachable).
A trusted harness (tasks/scoring/harness.py) runs each test in a child of its own; verdicts are made on the host.
More: docs/internals.md (tasks/scoring/sandbox.py): both levels, the harness, the kill. Threat model: docs/sandbox.md.
"""

from __future__ import annotations

import atexit
import binascii
import logging
import marshal
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.errors import UserError
from tasks.core.processes import kill_group, run, spawn
from tasks.scoring.cgroups import IO_BPS, IO_IOPS, Cgroup, Spawner, block_devices
from tasks.scoring.sandbox_uids import (
    DEFAULT_UID_RANGE,
    _clean_env,
    _count_processes,
    _nproc_counts_per_userns,
    _private_dir,
    _remove_cgroup,
    _remove_tree,
    _stale_cgroup,
    claim_uid,
    sweep_uid,
)

if TYPE_CHECKING:
    from tasks.core.config import SandboxConfig

log = logging.getLogger(__name__)

GRACE_SECONDS = 2.0           # host deadline = timeout + this: the harness reports its own timeouts first
MARKER = "rlflow-sandbox"     # argv[1] of every harness (and of its forked children): how leftovers are found
_STDERR_KEEP = 8192           # bytes of the sandbox's own stderr kept for error messages (bwrap, harness)
_MAX_WORKERS = 256
_CGROUP_OVERHEAD_MB = 64      # a sandbox's cgroup: memory_mb + its tmpfs + this (bwrap and the harness)


@dataclass
class Test:
    """One test: a program fed `stdin` (stdout is the answer), or expressions evaluated after the code ran."""

    stdin: str | None = None
    exprs: list[str] | None = None
    names: list[tuple[str, str]] | None = None    # a test module's: run split from the code (harness.run_split)
    setup: str | None = None      # a split test's definitions (the harness reads them after the unsplit tests ran)


@dataclass
class TestRun:
    """What one test's process did. `values` holds, per expression, ("ok", repr-of-a-plain-value) or
    ("error", message); None when the process ended before it evaluated them."""

    ran: bool = False
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    output_limit: bool = False
    values: list[tuple[str, str]] | None = None
    memory_limit: bool = False       # killed by the kernel for the sandbox's memory (its cgroup)


@dataclass
class Run:
    isolation: str
    tests: list[TestRun]
    seconds: float = 0.0
    timed_out: bool = False          # the wall clock ran out (some tests may not have run)
    output_limit: bool = False
    error: str | None = None         # the sandbox itself failed (not the code): bwrap error, harness crash


@dataclass
class Limits:
    timeout_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_processes: int = 32
    max_open_files: int = 64
    max_output_kb: int = 256
    tmpfs_mb: int = 64
    cpus: float = 1.0
    cgroup: str = "auto"

    @classmethod
    def of(cls, cfg: SandboxConfig) -> Limits:
        return cls(**{k: getattr(cfg, k) for k in cls.__dataclass_fields__})


# ------------ the harness: harness.py after values.py and wire.py (whose names it uses), sent as one text
HARNESS = "".join((Path(__file__).parent / name).read_text() for name in ("values.py", "wire.py", "harness.py"))


# ------------------------------------------------------------------------------------------ the host side

class Runner:
    """Runs code in sandboxes of one isolation level, at most `workers` at a time (one slot = one uid)."""

    def __init__(self, isolation: str, python: str, limits: Limits, workers: int, bwrap: str | None = None,
                 binds: tuple[str, ...] = (), uid_range: tuple[int, int] = DEFAULT_UID_RANGE,
                 seccomp: bytes | None = None):
        self.isolation, self.python, self.limits, self.bwrap, self.binds = isolation, python, limits, bwrap, binds
        self.seccomp = seccomp if isolation == "bubblewrap" else None     # a BPF program (syscall_filter.py)
        self.disable_userns = bwrap is not None and _bwrap_has(bwrap, "--disable-userns")
        self.as_pid_1 = bwrap is not None and _bwrap_has(bwrap, "--as-pid-1")
        self.why_not_bubblewrap = ""
        self.workers = max(1, min(workers or os.cpu_count() or 1, _MAX_WORKERS))
        self.uid_range = uid_range
        self._uids: dict[int, int] = {}               # slot -> the uid this process claimed for it
        self._cgroups: dict[int, Cgroup | None] = {}  # slot -> its cgroup (tasks/scoring/cgroups.py), if any
        self._spawners: dict[int, Spawner | None] = {}  # slot -> the thread that forks into it (cgroup v1)
        self.why_no_cgroup = "reward.sandbox.cgroup is off" if limits.cgroup == "off" else ""
        self.why_no_io = ""                            # the slots' cgroups cannot limit disk bandwidth: why
        self.prlimit = shutil.which("prlimit")         # (util-linux) the limits of bwrap and the harness
        self._slots: queue.Queue[int] = queue.Queue()
        for slot in range(self.workers):
            self._slots.put(slot)

    def map(self, jobs: list[tuple[str, list[Test], str]]) -> list[Run]:
        """Run (code, tests, setup) jobs in parallel; one slow or hostile job costs only its own timeout."""
        if len(jobs) <= 1:
            return [self.run(*job) for job in jobs]
        with ThreadPoolExecutor(max_workers=min(self.workers, len(jobs)), thread_name_prefix="sandbox") as pool:
            return list(pool.map(lambda job: self.run(*job), jobs))

    def run(self, code: str, tests: list[Test], setup: str = "") -> Run:
        slot = self._slots.get()
        try:
            return self._run(code, tests, setup, slot)
        finally:
            self._slots.put(slot)

    def _run(self, code: str, tests: list[Test], setup: str, slot: int) -> Run:
        t0 = time.monotonic()
        uid = self._uid(slot) if os.geteuid() == 0 else None
        workdir = None if self.isolation == "bubblewrap" else _private_dir(uid)
        chan_r, chan_w = os.pipe()
        filter_fd = None
        if self.seccomp is not None:          # bubblewrap reads the program from this descriptor and loads it
            filter_fd = os.memfd_create("rlflow-seccomp", 0)
            os.write(filter_fd, self.seccomp)
            os.lseek(filter_fd, 0, os.SEEK_SET)
        request = marshal.dumps({       # marshal: the harness reads it without importing json
            "code": code, "setup": setup, "fd": chan_w, "timeout": float(self.limits.timeout_seconds),
            "kill_all": self.isolation == "bubblewrap" or uid is not None,
            "tests": [{"stdin": t.stdin, "exprs": t.exprs, "names": t.names} for t in tests],
            "limits": self._child_limits(uid), "harness": HARNESS}, 4)
        request = len(request).to_bytes(8, "little") + request + marshal.dumps(      # (two parts: harness.main)
            next((t.setup for t in tests if t.names is not None and t.setup), ""), 4)
        proc = None
        cgroup = self._cgroup(slot, uid)
        spawner = self._spawners.get(slot)
        joins = cgroup.open_procs() if cgroup is not None and spawner is None else []
        ooms = cgroup.oom_kills() if cgroup is not None else 0
        try:
            def start() -> subprocess.Popen:     # (the model's code: its own clean environment, never rlflow's path)
                return spawn(
                    self._command(filter_fd, uid), _clean_env(workdir), rlflow=False, stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                    pass_fds=(chan_w,) + ((filter_fd,) if filter_fd is not None else ()),
                    start_new_session=True, close_fds=True, cwd=workdir or "/",
                    preexec_fn=Cgroup.joiner(joins) if joins else None,   # v2: in its cgroup before it execs
                    **({"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}))

            proc = spawner.call(start) if spawner is not None else start()   # v1: born in the cgroup
            os.close(chan_w)
            chan_w = None
            if filter_fd is not None:
                os.close(filter_fd)
                filter_fd = None
            cap = len(tests) * (self.limits.max_output_kb * 1024 * 3 + 8192) + 65536   # 2 pipes, base64
            chan, stderr, timed_out, over = _communicate(proc, request, chan_r,
                                                         t0 + self.limits.timeout_seconds + GRACE_SECONDS, cap)
            if not (timed_out or over):
                try:                   # let bwrap reap its own: killing it now would orphan its pid 1
                    proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
            run = _assemble(self.isolation, tests, chan, stderr, timed_out, over, time.monotonic() - t0)
            if cgroup is not None and cgroup.oom_kills() > ooms:
                _memory_limit(run)
            return run
        finally:
            for fd in joins:
                os.close(fd)
            if chan_w is not None:
                os.close(chan_w)
            if filter_fd is not None:
                os.close(filter_fd)
            os.close(chan_r)
            if proc is not None:
                kill_group(proc)
            # (the verdict keeps its deadline whatever the processes are doing: the kill waits for them only until
            # timeout + GRACE_SECONDS, and with direct I/O refused and the disk limits lifted none lingers)
            wait = max(t0 + self.limits.timeout_seconds + GRACE_SECONDS - time.monotonic(), 0.5)
            if cgroup is not None and not cgroup.kill(timeout=wait):
                log.warning("code sandbox: processes of %s survived SIGKILL for %.1f s", cgroup.dirs, wait)
            if uid is not None and not (cgroup is not None and self.isolation == "bubblewrap"):
                sweep_uid(uid, processes=cgroup is None)     # (a cgroup's kill found every process)
            if workdir is not None:
                _remove_tree(workdir)

    def _uid(self, slot: int) -> int:
        if slot not in self._uids:
            self._uids[slot] = claim_uid(*self.uid_range)
        return self._uids[slot]

    def _cgroup(self, slot: int, uid: int | None) -> Cgroup | None:
        """The slot's cgroup, made on first use (None where the host allows none: why_no_cgroup says why)."""
        if self.limits.cgroup == "off":
            return None
        if slot not in self._cgroups:
            lim = self.limits
            tmpfs = 2 * lim.tmpfs_mb if self.isolation == "bubblewrap" else 0      # /tmp and /dev/shm
            name = f"rlflow-sandbox-{uid}" if uid is not None else f"rlflow-sandbox-p{os.getpid()}-{slot}"
            seen = ("/", "/usr", *self.binds) if self.isolation == "bubblewrap" else ("/", "/usr", "/tmp")
            made, why = Cgroup.make(name, (lim.memory_mb + tmpfs + _CGROUP_OVERHEAD_MB) << 20,
                                    lim.max_processes + 3, lim.cpus,      # + bwrap, the harness, a spawner
                                    block_devices(seen))
            if made is not None:
                made.remove_stale("rlflow-sandbox-", _stale_cgroup)
                try:
                    self._spawners[slot] = made.spawner()
                except OSError as e:
                    made.remove()
                    made, why = None, f"cannot place a thread in it: {e.strerror or e}"
            if made is not None and made.why_no_io and not self.why_no_io:
                self.why_no_io = made.why_no_io
                log.warning("code sandbox: no disk bandwidth limit per sandbox (%s). See docs/sandbox.md.",
                            made.why_no_io)
            if made is None:
                if self.limits.cgroup == "required":
                    raise UserError(f"reward.sandbox.cgroup: required, but no cgroup can be made here ({why}); "
                                    f"run as root or under a delegated cgroup, or set auto")
                if not self.why_no_cgroup:
                    log.warning("code sandbox: no cgroup per sandbox (%s): memory is bounded per process only, "
                                "and leftovers are found by uid. See docs/sandbox.md.", why)
                self.why_no_cgroup = why
            else:
                atexit.register(_remove_cgroup, made, self._spawners.get(slot))
            self._cgroups[slot] = made
        return self._cgroups[slot]

    def _child_limits(self, uid: int | None) -> dict:
        lim = self.limits
        processes = lim.max_processes + 2             # + the harness and bwrap
        if uid is None and not (self.isolation == "bubblewrap" and _nproc_counts_per_userns()):
            processes += _count_processes(os.getuid())  # our own uid: RLIMIT_NPROC counts all our processes
        return {"cpu": lim.cpu_seconds, "memory_mb": lim.memory_mb, "file_size_mb": lim.file_size_mb,
                "open_files": lim.max_open_files, "processes": processes, "output": lim.max_output_kb * 1024}

    def _command(self, filter_fd: int | None = None, uid: int | None = None) -> list[str]:
        harness = [self.python, "-I", "-c", HARNESS, MARKER]
        if self.isolation == "bubblewrap":
            seccomp = ["--seccomp", str(filter_fd)] if filter_fd is not None else []
            harness = [self.bwrap, *bwrap_args(self.limits.tmpfs_mb, self.binds, self.disable_userns, self.as_pid_1),
                       *seccomp,
                       "--", *harness]
        return self._outer_limits(uid) + harness

    def _outer_limits(self, uid: int | None) -> list[str]:
        """prlimit: the limits every process of the sandbox starts with, bwrap and its pid 1 (which runs as the
        code's uid) and the harness included; the harness lowers them further for each test's process (so
        none is below the tests' own). The CPU limit is the wall clock's (one thread cannot use more), the
        others the tests' own or a floor bwrap and the harness need."""
        if self.prlimit is None:
            return []
        lim, mb = self.limits, 1 << 20
        return [self.prlimit, "--core=0", f"--cpu={max(int(lim.timeout_seconds + GRACE_SECONDS), lim.cpu_seconds) + 1}",
                f"--as={max(lim.memory_mb, 256) * mb}", f"--fsize={lim.file_size_mb * mb}",
                f"--nofile={max(lim.max_open_files, 64)}", f"--nproc={self._child_limits(uid)['processes'] + 1}",
                "--"]


def _memory_limit(run: Run) -> None:
    """The kernel killed processes of this sandbox for its cgroup's memory: the tests it killed say so."""
    for t in run.tests:
        if t.signal == signal.SIGKILL and not t.timed_out:
            t.memory_limit = True
    if run.error and run.error.startswith("its harness was killed"):
        run.error = "its harness was killed: the sandbox's memory limit (cgroup)"


def bwrap_args(tmpfs_mb: int, binds: tuple[str, ...] = (), disable_userns: bool = True,
               as_pid_1: bool = True) -> list[str]:
    """Namespaces and mounts: /usr (and the interpreter's own prefix) read-only, a sized tmpfs at /tmp, the
    rest of / an empty read-only tmpfs: no /etc, /home, /root, project dir or store."""
    args = ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--uid", "65534",
            "--gid", "65534", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    if disable_userns:          # bwrap >= 0.8: no nested user namespaces (less kernel surface to attack)
        args.append("--disable-userns")
    if as_pid_1:    # bwrap >= 0.5: the harness is pid 1 (it reaps); no init of bwrap's, which ran as the code's
        args.append("--as-pid-1")     # uid, dumpable, and outlived the sandbox as the host init's zombie
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]          # merged-/usr systems: /lib -> usr/lib
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in binds:
        args += ["--ro-bind", path, path]
    size = str(tmpfs_mb << 20)
    args += ["--proc", "/proc", "--dev", "/dev",
             "--size", "4096", "--tmpfs", "/dev/pts",        # no pseudo-terminals: kernel.pty.max is machine-wide
             "--size", size, "--tmpfs", "/dev/shm",          # multiprocessing's semaphores live there
             "--remount-ro", "/dev",                         # bwrap's /dev is an unsized tmpfs otherwise
             "--size", size, "--tmpfs", "/tmp", "--chdir", "/tmp",
             "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
             "--setenv", "LANG", "C.UTF-8", "--remount-ro", "/"]
    return args


def _communicate(proc, request: bytes, chan_r: int, deadline: float, cap: int):
    """Feed the request on stdin while reading the result channel and stderr, each capped, until the
    harness closes them or the deadline. Returns (channel bytes, stderr tail, timed out, over the cap)."""
    sel = selectors.DefaultSelector()
    os.set_blocking(proc.stdin.fileno(), False)
    sel.register(proc.stdin, selectors.EVENT_WRITE)
    sel.register(chan_r, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    chan, stderr, view = bytearray(), bytearray(), memoryview(request)
    timed_out = over = False
    try:
        while len(sel.get_map()) > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                if key.fileobj is proc.stdin:
                    try:
                        view = view[os.write(proc.stdin.fileno(), view[:65536]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:          # the harness died before reading it all
                        view = view[:0]
                    if not view:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                if key.fileobj == chan_r:
                    chan += chunk
                    if len(chan) > cap:
                        over = True
                        return bytes(chan[:cap]), bytes(stderr), timed_out, over
                else:
                    stderr = (stderr + chunk)[-_STDERR_KEEP:]
        return bytes(chan), bytes(stderr), timed_out, over
    finally:
        sel.close()
        if not proc.stdin.closed:
            proc.stdin.close()


def _assemble(isolation: str, tests: list[Test], chan: bytes, stderr: bytes, timed_out: bool, over: bool,
              seconds: float) -> Run:
    """Parse the harness's lines: `T i ran exit signal timeout limit stdout stderr values` per test (the
    last three base64, `-` for none), then `D` once all tests are done."""
    runs = [TestRun() for _ in tests]
    done = False
    for line in chan.decode("ascii", "replace").splitlines():
        parts = line.split()
        if parts == ["D"]:
            done = True
        elif len(parts) == 10 and parts[0] == "T" and parts[1].isdigit() and int(parts[1]) < len(runs):
            runs[int(parts[1])] = _test_run(parts[2:], tests[int(parts[1])])
    for r in runs:
        r.timed_out = r.timed_out or (timed_out and not r.ran)      # never reached: the wall clock ran out
    run = Run(isolation, runs, seconds, timed_out=timed_out or any(r.timed_out for r in runs), output_limit=over)
    if not done and not timed_out and not over:
        tail = stderr.decode("utf-8", "replace").strip().splitlines()
        run.error = (tail[-1] if tail else "its harness was killed before the tests finished")[:300]
    return run


def _test_run(parts: list[str], test: Test) -> TestRun:
    ran, exit_code, sig, timeout, limit, out, err, values = parts
    return TestRun(ran=ran == "1", stdout=_unb64(out).decode("utf-8", "replace"),
                   stderr=_unb64(err).decode("utf-8", "replace"), exit_code=_int(exit_code), signal=_int(sig),
                   timed_out=timeout == "1", output_limit=limit == "1",
                   values=_values(_unb64(values), len(test.exprs)) if test.exprs is not None and ran == "1" else None)


def _values(raw: bytes, n: int) -> list[tuple[str, str]] | None:
    """The child's `ok|error <base64>` lines; None when it wrote none (it ended before the expressions).
    The code can write into that pipe itself: anything malformed, or a count other than the expressions',
    makes every value an error."""
    if not raw:
        return None
    out = []
    for line in raw.split(b"\n"):
        if not line:
            continue
        kind, _, text = line.partition(b" ")
        try:
            out.append((kind.decode("ascii"), _unb64(text.decode("ascii")).decode("utf-8", "replace")))
        except (ValueError, UnicodeDecodeError):
            break
    if len(out) != n or any(kind not in ("ok", "error") for kind, _ in out):
        return [("error", "unreadable values from the test process")] * n
    return out


def _unb64(text: str) -> bytes:
    return b"" if text == "-" else binascii.a2b_base64(text, strict_mode=True)


def _int(text: str) -> int | None:
    return int(text) if text.lstrip("-").isdigit() else None


# ------------------------------------------------------------------------------------------ choosing the isolation

_config = None
_runners: dict[str, Runner] = {}
_lock = threading.Lock()
_warned = False


def configure(sandbox_config: SandboxConfig) -> None:
    """Use these settings (a tasks.core.config.SandboxConfig) for every later `runner()` in this process."""
    global _config
    with _lock:
        _config = sandbox_config


def runner(sandbox_config: SandboxConfig | None = None) -> Runner:
    """The runner for the configured (or given, or default) settings; probed once per process and setting."""
    global _warned
    if sandbox_config is None:
        sandbox_config = _config
    if sandbox_config is None:
        from tasks.core.config import SandboxConfig
        sandbox_config = SandboxConfig()
    key = sandbox_config.model_dump_json()
    with _lock:
        if key not in _runners:
            built, why_not = _build(sandbox_config)
            built.why_not_bubblewrap = why_not
            if built.isolation != "bubblewrap" and not _warned:
                _warned = True
                log.warning("code sandbox: isolation is rlimits, not bubblewrap (%s): sandboxed code can read "
                            "world-readable files and reach the network%s. Install bubblewrap (apt-get install "
                            "bubblewrap) for namespaces. See docs/sandbox.md.", why_not,
                            "" if os.geteuid() == 0 else " and runs as our own user")
            _runners[key] = built
        return _runners[key]


def _build(cfg: SandboxConfig) -> tuple[Runner, str]:
    """The strongest runner that works: (runner, why bubblewrap is not used)."""
    python = resolve_python(cfg.python)
    limits = Limits.of(cfg)
    why_not = "reward.sandbox.isolation is rlimits"
    if cfg.isolation in ("auto", "bubblewrap"):
        bwrap = shutil.which(cfg.bwrap)
        if bwrap is None:
            why_not = f"{cfg.bwrap} not found"
        else:
            program, no_filter = syscall_filter()
            if program is None and cfg.isolation == "bubblewrap":
                raise UserError(f"reward.sandbox.isolation: bubblewrap needs its seccomp filter, which cannot be "
                                f"built here ({no_filter}); install python3-seccomp (apt-get install "
                                f"python3-seccomp) or set auto")
            candidate = Runner("bubblewrap", python, limits, cfg.workers, bwrap, _interpreter_binds(python),
                               uid_range=tuple(cfg.uid_range), seccomp=program)
            why_not = probe(candidate)
            if why_not is None:
                if program is None:
                    log.warning("code sandbox: bubblewrap without its seccomp filter (%s): install python3-seccomp "
                                "(apt-get install python3-seccomp). See docs/sandbox.md.", no_filter)
                return candidate, ""
        if cfg.isolation == "bubblewrap":
            raise UserError(f"reward.sandbox.isolation: bubblewrap was asked for but does not work here "
                            f"({why_not}); install it (apt-get install bubblewrap) or set auto or rlimits")
    fallback = Runner("rlimits", python, limits, cfg.workers, uid_range=tuple(cfg.uid_range))
    if (problem := probe(fallback)) is not None:
        raise UserError(f"reward.sandbox.python: {python} cannot run sandboxed code here ({problem}); it must "
                        f"be readable by an unprivileged user (e.g. /usr/bin/python3)")
    return fallback, why_not


_filter: tuple[bytes | None, str] | None = None


def syscall_filter() -> tuple[bytes | None, str]:
    """The sandbox's seccomp program (BPF), compiled once per process by libseccomp under a system Python that
    has Debian's python3-seccomp; (None, why) when none here can."""
    global _filter
    if _filter is None:
        script = Path(__file__).with_name("syscall_filter.py")
        why = "no system python3 with the seccomp module (python3-seccomp)"
        for python in dict.fromkeys(["/usr/bin/python3", shutil.which("python3") or "/usr/bin/python3"]):
            try:
                out = run([python, "-I", str(script)], rlflow=False, capture_output=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as e:
                why = f"{python}: {e}"
                continue
            if out.returncode == 0 and out.stdout:
                _filter = (out.stdout, "")
                return _filter
            why = f"{python}: {(out.stderr.decode(errors='replace').strip().splitlines() or ['failed'])[-1][:160]}"
        _filter = (None, why)
    return _filter


def _bwrap_has(bwrap: str, flag: str) -> bool:
    try:
        return flag in run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False


def resolve_python(configured: str | None) -> str:
    if configured:                  # (a name alone, such as python3, is looked up on PATH)
        return configured if os.sep in configured else shutil.which(configured) or configured
    return "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def _interpreter_binds(python: str) -> tuple[str, ...]:
    """Folders an interpreter outside /usr needs inside the sandbox (its prefix and base prefix), read-only."""
    real = os.path.realpath(python)
    if real.startswith("/usr/") and python.startswith("/usr/"):
        return ()
    try:
        asked = run([python, "-I", "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"], _clean_env(None),
                    rlflow=False, capture_output=True, text=True, timeout=30)
        out, why = asked.stdout.splitlines(), f"exit {asked.returncode}"     # (a prefix may hold spaces)
    except (OSError, subprocess.TimeoutExpired) as e:
        out, why = [], f"{type(e).__name__}: {e}"
    if len(out) != 2:     # not a Python (an empty file, another program): its folders cannot be told
        raise UserError(f"reward.sandbox.python: {python} cannot run sandboxed code here (it did not answer as a "
                        f"Python interpreter: {why}); name a python3, e.g. /usr/bin/python3")
    paths = {os.path.abspath(p) for p in [*out, os.path.dirname(os.path.dirname(real)),
                                          os.path.dirname(os.path.abspath(python))] if p}
    paths = {p for p in paths if p != "/usr" and not p.startswith("/usr/")}
    for p in paths:          # binding /, a home or the project would hand the code our files (and ~/.aws)
        for private in (os.path.expanduser("~"), os.getcwd()):
            if private == p or private.startswith(p.rstrip("/") + "/"):
                raise UserError(f"reward.sandbox.python: {python} lives under {p}, which holds {private}; "
                                f"use an interpreter outside it (e.g. /usr/bin/python3)")
    return tuple(sorted(p for p in paths if not any(p != q and p.startswith(q + "/") for q in paths)))


def probe(candidate: Runner) -> str | None:
    """Run one tiny program for real; None when it answered, else why not (one line)."""
    try:
        run = candidate.run("print(int(input()) * 2)", [Test(stdin="21\n")])
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    if run.error or not run.tests or run.tests[0].stdout.strip() != "42":
        detail = run.error or (run.tests[0].stderr.strip().splitlines() or ["no output"])[-1]
        return detail[:200]
    return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    r = runner()
    print(f"isolation: {r.isolation}  python: {r.python}  workers: {r.workers}  root: {os.geteuid() == 0}"
          + (f"  (not bubblewrap: {r.why_not_bubblewrap})" if r.why_not_bubblewrap else ""))
    cg = r._cgroup(0, r._uid(0) if os.geteuid() == 0 else None)
    print(f"cgroup per sandbox: {' '.join(map(str, cg.dirs.values())) if cg else 'none (' + r.why_no_cgroup + ')'}")
    io = (f"{' '.join(cg.io_devices)} at {IO_BPS >> 20} MiB/s, {IO_IOPS} IOPS" if cg and cg.io_devices
          else f"none ({cg.why_no_io if cg else 'no cgroup'})")
    print(f"disk bandwidth per sandbox: {io}")
