"""A cgroup per sandbox slot, where the host lets us make one (docs/sandbox.md: "cgroups").

rlimits bound each process of a sandbox; a cgroup bounds all of them together, kernel memory included, and is
how everything they started is found and killed, whatever uid or session it moved to. A slot's cgroup holds
one memory limit (no swap), a pids limit, a CPU quota and, where the host has the controller, a disk bandwidth
and IOPS limit, and is killed whole. Both cgroup v2 and v1 are supported; a slot's cgroups are made once, named
for the slot's uid (tasks/scoring/sandbox_uids.py: claim_uid), reused run after run, and nothing of a sandbox ever
runs outside them.

Where none can be made (not root and nothing delegated, no memory or pids controller) `Cgroup.make` says why
and the sandbox keeps its rlimits and uid sweep.
More: docs/internals.md (tasks/scoring/cgroups.py): each controller, both layouts, how a process is born inside.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from tasks.core.processes import kill_until_gone

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
IO_BPS = 64 << 20         # bytes/s read, and written, per device and sandbox: a sandbox reads a few MiB at most
IO_IOPS = 2000            # operations/s per device and sandbox


def block_devices(paths: tuple[str, ...] = ("/",)) -> list[str]:
    """`major:minor` of the disks behind `paths` (the mount holding each, from /proc/self/mountinfo; a
    partition's disk). A path on a file system without a block device of its own (overlay, a network file
    system) counts as every disk of the machine (/sys/block, RAM disks left out)."""
    mounts = []
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) > 4:
            mounts.append((parts[4], parts[2]))
    out: list[str] = []
    for path in paths:
        real = os.path.realpath(path)
        best = max((m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
                   key=lambda m: len(m[0]), default=None)
        devs = [best[1]] if best is not None and not best[1].startswith("0:") else _all_disks()
        for dev in devs:
            sysdir = Path(f"/sys/dev/block/{dev}")
            if (sysdir / "partition").exists():
                try:
                    dev = (sysdir.resolve().parent / "dev").read_text().strip()
                except OSError:
                    continue
            if dev not in out:
                out.append(dev)
    return out


def _all_disks() -> list[str]:
    out = []
    for d in sorted(Path("/sys/block").glob("*")):
        try:
            if d.name.startswith(("ram", "zram")) or (d / "size").read_text().strip() == "0":
                continue
            out.append((d / "dev").read_text().strip())
        except OSError:
            continue
    return out


def _own_v1() -> dict[str, str]:
    """controller -> our cgroup path, from /proc/self/cgroup (v1 lines: `N:ctrl1,ctrl2:/path`)."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for ctrl in ctrls.split(","):
            if ctrl:
                out[ctrl] = path
    return out


def _v1_mounts() -> dict[str, Path]:
    """controller -> where its v1 hierarchy is mounted (from /proc/self/mounts)."""
    out = {}
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup":
            for opt in parts[3].split(","):
                out.setdefault(opt, Path(parts[1]))
    return out


def _v2_root() -> Path | None:
    for root in (ROOT, ROOT / "unified"):
        if (root / "cgroup.controllers").exists():
            return root
    return None


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _under(mount: Path, own: str) -> Path:
    """Our cgroup's folder in a hierarchy; its root when our path is not visible there (a cgroup namespace)."""
    mine = mount / own.lstrip("/")
    return mine if mine.is_dir() else mount


class Cgroup:
    """One slot's cgroup (v2) or cgroups (v1: memory, pids, cpu)."""

    def __init__(self, version: int, dirs: dict[str, Path]):
        self.version, self.dirs = version, dirs     # v2: {"unified": dir}; v1: controller -> dir
        self.io_devices: list[str] = []             # the devices whose bandwidth is limited (set_io)
        self.io_limits: tuple[int, int] = (IO_BPS, IO_IOPS)
        self.why_no_io = ""

    # ------------------------------------------------------------------ making one
    @classmethod
    def make(cls, name: str, memory_bytes: int, pids: int, cpus: float,
             devices: list[str] | None = None) -> tuple[Cgroup | None, str]:
        """(the cgroup, "") or (None, why not): v2 where memory and pids can be delegated to a child of ours,
        else v1 where the memory and pids hierarchies are mounted and writable."""
        why = []
        for attempt in (cls._make_v2, cls._make_v1):
            try:
                made = attempt(name)
            except OSError as e:
                why.append(f"{attempt.__name__[-2:]}: {e.strerror or e} ({e.filename or ''})".replace(" ()", ""))
                continue
            if isinstance(made, str):
                why.append(made)
                continue
            try:
                made.set_limits(memory_bytes, pids, cpus)
            except OSError as e:
                made.remove()
                why.append(f"{attempt.__name__[-2:]}: cannot set limits: {e.strerror or e} ({e.filename})")
                continue
            made.set_io(block_devices() if devices is None else devices)
            return made, ""
        return None, "; ".join(why)

    @classmethod
    def _make_v2(cls, name: str) -> Cgroup | str:
        root = _v2_root()
        if root is None:
            return "v2: not mounted"
        own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.startswith("0::")), "/")
        parent = _under(root, own)
        have = (parent / "cgroup.controllers").read_text().split()
        if not {"memory", "pids"} <= set(have):
            return f"v2: {parent} offers {have or 'no controllers'}, not memory and pids"
        wanted = [c for c in ("memory", "pids", "cpu") if c in have]
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        if not set(wanted) <= enabled:
            try:
                _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
            except OSError as e:
                if e.errno == errno.EBUSY:      # "no internal processes": our cgroup is not a delegated one
                    return (f"v2: {parent} holds processes, so its controllers cannot be given to a child; run "
                            f"under a delegated cgroup (systemd-run --scope -p Delegate=yes ...)")
                raise
        if "io" in have and "io" not in enabled:
            try:                                # optional: without it the sandbox has no bandwidth limit
                _write(parent / "cgroup.subtree_control", "+io")
            except OSError:
                pass
        leaf = parent / name
        leaf.mkdir(exist_ok=True)
        return cls(2, {"unified": leaf})

    @classmethod
    def _make_v1(cls, name: str) -> Cgroup | str:
        mounts, own = _v1_mounts(), _own_v1()
        if not {"memory", "pids"} <= set(mounts):
            return "v1: no memory or pids hierarchy mounted"
        dirs = {}
        for ctrl in ("memory", "pids", "cpu", "blkio"):
            if ctrl in mounts:
                d = _under(mounts[ctrl], own.get(ctrl, "/")) / name
                try:
                    d.mkdir(exist_ok=True)
                except OSError:
                    if ctrl == "blkio":         # optional: without it the sandbox has no bandwidth limit
                        continue
                    raise
                dirs[ctrl] = d
        return cls(1, dirs)

    def set_limits(self, memory_bytes: int, pids: int, cpus: float) -> None:
        quota = int(cpus * PERIOD_US) if cpus > 0 else 0
        if self.version == 2:
            d = self.dirs["unified"]
            _write(d / "memory.max", str(memory_bytes))
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(pids))
            if (d / "cpu.max").exists():
                _write(d / "cpu.max", f"{quota} {PERIOD_US}" if quota else f"max {PERIOD_US}")
            return
        mem = self.dirs["memory"]
        if (mem / "memory.memsw.limit_in_bytes").exists():   # memsw >= limit at all times: lower it last
            _write(mem / "memory.memsw.limit_in_bytes", "-1")
        _write(mem / "memory.limit_in_bytes", str(memory_bytes))
        if (mem / "memory.memsw.limit_in_bytes").exists():
            _write(mem / "memory.memsw.limit_in_bytes", str(memory_bytes))
        if (mem / "memory.swappiness").exists():
            try:
                _write(mem / "memory.swappiness", "0")
            except OSError:
                pass
        _write(self.dirs["pids"] / "pids.max", str(pids))
        if "cpu" in self.dirs and (self.dirs["cpu"] / "cpu.cfs_quota_us").exists():
            _write(self.dirs["cpu"] / "cpu.cfs_period_us", str(PERIOD_US))
            _write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(quota) if quota else "-1")

    def set_io(self, devices: list[str], bps: int = IO_BPS, iops: int = IO_IOPS) -> None:
        """Limit read/write bandwidth and IOPS on each device; what cannot be limited is said in why_no_io."""
        d = self.dirs.get("unified") if self.version == 2 else self.dirs.get("blkio")
        if d is None or not ((d / "io.max").exists() if self.version == 2
                             else (d / "blkio.throttle.read_bps_device").exists()):
            self.why_no_io = ("no io controller in the sandbox's cgroup" if self.version == 2
                              else "no blkio hierarchy with throttling mounted")
            return
        if not devices:
            self.why_no_io = "no block device found behind the sandbox's file systems"
            return
        failed = []
        self.io_limits = (bps, iops)
        for dev in devices:
            try:
                if self.version == 2:
                    _write(d / "io.max", f"{dev} rbps={bps} wbps={bps} riops={iops} wiops={iops}")
                else:
                    for what, value in (("read_bps", bps), ("write_bps", bps), ("read_iops", iops),
                                        ("write_iops", iops)):
                        _write(d / f"blkio.throttle.{what}_device", f"{dev} {value}")
                if dev not in self.io_devices:
                    self.io_devices.append(dev)
            except OSError as e:
                failed.append(f"{dev}: {e.strerror or e}")
        if failed:
            self.why_no_io = "cannot limit " + ", ".join(failed)

    # ------------------------------------------------------------------ using it
    def open_procs(self) -> list[int]:
        """Descriptors of every `cgroup.procs` to write "0" into from the child between fork and exec
        (`joiner`); opened here, so the kernel checks our permission, not the child's (it may be another uid)."""
        return [os.open(d / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) for d in self.dirs.values()]

    @staticmethod
    def joiner(fds: list[int]):
        """A preexec_fn that moves the new process into the cgroup before it execs anything."""
        def join() -> None:
            for fd in fds:
                os.write(fd, b"0")
        return join

    def pids(self) -> list[int]:
        """The processes in the cgroup, this one (a spawner thread of ours sits there on v1) left out."""
        d = self.dirs.get("unified") or self.dirs["pids"]
        try:
            return [int(p) for p in (d / "cgroup.procs").read_text().split() if int(p) != os.getpid()]
        except OSError:
            return []

    def oom_kills(self) -> int:
        """How many processes the kernel killed here for memory so far."""
        d = self.dirs.get("unified") or self.dirs["memory"]
        try:
            text = (d / ("memory.events" if self.version == 2 else "memory.oom_control")).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def unthrottle(self) -> None:
        """Lift the disk limits (set_io): what the processes still have queued behind them completes at the disk's
        own pace, so none stays in uninterruptible sleep, which SIGKILL cannot end, waiting for its turn."""
        d = self.dirs.get("unified") if self.version == 2 else self.dirs.get("blkio")
        for dev in self.io_devices if d is not None else []:
            try:
                if self.version == 2:
                    _write(d / "io.max", f"{dev} rbps=max wbps=max riops=max wiops=max")
                else:
                    for what in ("read_bps", "write_bps", "read_iops", "write_iops"):
                        _write(d / f"blkio.throttle.{what}_device", f"{dev} 0")
            except OSError:
                pass

    def kill(self, timeout: float = 5.0) -> bool:
        """Kill everything in the cgroup and wait until it is empty; False if something is left after
        `timeout` (a process in uninterruptible sleep). The disk limits are lifted first (unthrottle), and
        set again by the next set_io."""
        self.unthrottle()
        try:
            deadline = time.monotonic() + timeout
            if self.version == 2 and (self.dirs["unified"] / "cgroup.kill").exists():
                _write(self.dirs["unified"] / "cgroup.kill", "1")
            elif not kill_until_gone(self.pids, deadline):
                return False
            while self.pids():
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.002)
            return True
        finally:
            if self.io_devices:           # (the slot's next sandbox is limited again)
                self.set_io(list(self.io_devices), *self.io_limits)

    def spawner(self) -> Spawner | None:
        """v1: a thread of ours inside the cgroup, to fork the sandbox's first process there; v2: None (use
        open_procs and joiner)."""
        return Spawner(self) if self.version == 1 else None

    def remove_stale(self, prefix: str, stale) -> int:
        """rmdir the siblings named `prefix...` that `stale(name)` says no living process owns (a process
        killed before its exit handlers ran leaves its slots' cgroups behind). One that still holds a process
        is not removed: the kernel refuses. Returns how many went."""
        gone = 0
        for d in self.dirs.values():
            for sibling in d.parent.glob(prefix + "*"):
                if sibling.name != d.name and sibling.is_dir() and stale(sibling.name):
                    try:
                        sibling.rmdir()
                        gone += 1
                    except OSError:
                        pass
        return gone

    def remove(self) -> None:
        for d in self.dirs.values():
            try:
                d.rmdir()
            except OSError:
                pass


class Spawner:
    """A daemon thread that moved itself into a v1 cgroup; `call(fn)` runs fn there (a Popen: the child is
    born in the cgroup). The thread counts as one task in the cgroup's pids.max."""

    def __init__(self, cgroup: Cgroup):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._entered: Future = Future()
        threading.Thread(target=self._loop, args=(cgroup,), daemon=True, name="sandbox-spawner").start()
        self._entered.result()          # (raises what entering raised)

    def _loop(self, cgroup: Cgroup) -> None:
        try:
            for d in cgroup.dirs.values():
                _write(d / "tasks", str(threading.get_native_id()))
        except OSError as e:
            self._entered.set_exception(e)
            return
        self._entered.set_result(None)
        while True:
            fn, done = self._calls.get()
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)

    def leave(self, cgroup: Cgroup) -> None:
        """Move the thread back to the cgroups it came from (the parents): an empty cgroup can be removed."""
        def back() -> None:
            for d in cgroup.dirs.values():
                _write(d.parent / "tasks", str(threading.get_native_id()))
        try:
            self.call(back)
        except OSError:
            pass

    def call(self, fn):
        done: Future = Future()
        self._calls.put((fn, done))
        return done.result()
