"""A sandbox on the host: the uid claimed for its slot, its folder and environment, and what it leaves, swept.

    uid = claim_uid(first, count)    # as root: a uid no other process of this machine holds (a lock file)
    sweep_uid(uid)                   # kill what runs under it; remove what it left in /tmp, /var/tmp, /dev/shm
    path = _private_dir(uid)         # rlimits: the code's own folder; _remove_tree(path), symlinks never followed
    env = _clean_env(path)           # the environment it starts with: nothing of ours (no keys, no tokens)

Used by the sandbox's runner (tasks/scoring/sandbox.py): a slot keeps its uid for this process's life, and
whatever a sandbox started or wrote is gone before its verdict is returned (docs/sandbox.md).
More: docs/internals.md (tasks/scoring/sandbox_uids.py): claims, sweeps, stale cgroups.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

from tasks.core.errors import UserError
from tasks.core.processes import kill_until_gone
from tasks.scoring.cgroups import Cgroup, Spawner

DEFAULT_UID_RANGE = (1_900_000_000, 65_536)   # reward.sandbox.uid_range: sandbox uids when we are root


_claims: dict[int, int] = {}        # uid -> the open, locked claim file (held for this process's life)
_claims_lock = threading.Lock()


def _claims_dir() -> Path:
    for base in (Path("/run/lock"), Path(tempfile.gettempdir())):
        if base.is_dir() and os.access(base, os.W_OK):
            path = base / "rlflow-sandbox-uids"
            path.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(path)               # (made by someone else first, it could hold their links, share uids)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise UserError(f"reward.sandbox: {path} is not a folder of this user's that only it may write "
                                f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): remove it")
            return path
    raise OSError("no writable /run/lock or temporary folder for the sandbox uid claims")


def _remove_cgroup(cgroup: Cgroup, spawner: Spawner | None) -> None:
    if spawner is not None:
        spawner.leave(cgroup)            # (a cgroup with our thread in it is not empty)
    cgroup.remove()


def _stale_cgroup(name: str) -> bool:
    """A slot cgroup (rlflow-sandbox-UID, or rlflow-sandbox-pPID-SLOT without root) whose owner is gone: the
    uid is claimed by no process (its lock file can be locked), or the pid no longer runs."""
    import fcntl

    rest = name.removeprefix("rlflow-sandbox-")
    if rest.startswith("p"):
        pid = rest[1:].split("-")[0]
        return pid.isdigit() and not Path(f"/proc/{pid}").exists()
    if not rest.isdigit() or int(rest) in _claims:
        return False
    try:
        fd = os.open(_claims_dir() / rest, os.O_RDWR)
    except OSError:
        return True                      # never claimed here (another claims folder): no process holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)                     # (the lock, if we took it, goes with the descriptor)


def claim_uid(first: int, count: int) -> int:
    """A uid of [first, first + count) that no other process of this machine holds: an exclusive lock on
    <claims dir>/<uid>, kept until this process ends (the kernel drops it then, also after SIGKILL). Starts
    at a random place, so processes rarely try the same uid. Whatever an earlier holder left under it (a
    process, a file) is swept first."""
    import fcntl
    import random

    start = random.randrange(count)
    folder = _claims_dir()
    with _claims_lock:
        for i in range(count):
            uid = first + (start + i) % count
            if uid in _claims:
                continue
            fd = os.open(folder / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _claims[uid] = fd
            sweep_uid(uid)
            return uid
    raise UserError(f"reward.sandbox.uid_range: every uid of [{first}, {first + count}) is held by other "
                    f"processes; widen the range")


def claimed() -> set[int]:
    """The uids this process holds (claim_uid): its sandboxes', not another process's of the same machine."""
    with _claims_lock:
        return set(_claims)


def is_sandbox_uid(uid: int, uid_range: tuple[int, int] = DEFAULT_UID_RANGE) -> bool:
    return uid_range[0] <= uid < uid_range[0] + uid_range[1]


def find_processes(uid: int) -> list[int]:
    """Live pids whose real, effective or saved uid is `uid`, read from /proc/<pid>/status (a non-dumpable
    process's /proc folder belongs to root, so its owner would hide it). Zombies are left out: they are
    dead already, and only their parent (or init) can reap them."""
    out, wanted = [], str(uid)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read(1024)
        except OSError:
            continue
        at = status.find(b"\nUid:")
        uids = status[at + 5:status.find(b"\n", at + 1)].split()[:3] if at >= 0 else []
        if wanted.encode() in uids and b"\nState:\tZ" not in status:
            out.append(int(name))
    return out


def _count_processes(uid: int) -> int:
    return len(find_processes(uid))


def _nproc_counts_per_userns() -> bool:
    """Since Linux 5.14 RLIMIT_NPROC counts per user namespace: inside bubblewrap's, only the sandbox's own."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")    # where any uid may write (/var/lock is /run/lock)
SWEEP_ENTRIES = 100_000


def sweep_uid(uid: int, processes: bool = True) -> None:
    """Kill every process left under a sandbox uid (a daemon that called setsid() left our process group).
    Rounds until none is left: RLIMIT_NPROC bounds how many can appear while we kill. Then remove the files
    it left in world-writable places."""
    if processes:
        kill_until_gone(lambda: find_processes(uid), time.monotonic() + 0.25, pause=0.005)
    # rlimits mode: files it left in world-writable places, and in world-writable folders below them (a /tmp/x
    # of mode 1777 someone made), never following a link, at most SWEEP_ENTRIES entries looked at
    todo, looked = [(tmp, 0) for tmp in WRITABLE], 0
    while todo:
        folder, depth = todo.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries[:SWEEP_ENTRIES - looked]:
            looked += 1
            try:
                st = entry.stat(follow_symlinks=False)
                if st.st_uid == uid:
                    _remove_tree(entry.path) if stat.S_ISDIR(st.st_mode) else os.unlink(entry.path)
                elif stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002 and depth < 8:
                    todo.append((entry.path, depth + 1))
            except OSError:
                pass


def _private_dir(uid: int | None) -> str:
    path = tempfile.mkdtemp(prefix="rlflow-sbx-")
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def _remove_tree(path: str) -> None:
    """Remove a folder the sandboxed code wrote into, also where it made parts unreadable (chmod 000).
    Permissions are only ever changed inside `path`, through O_NOFOLLOW descriptors: a symlink the code
    planted (to /etc, to /tmp itself) is removed, never followed."""
    root = os.path.abspath(path)

    def inside(p: str) -> bool:
        p = os.path.abspath(p)
        return p == root or p.startswith(root + os.sep)

    def unlock(func, p, exc):
        for d in (os.path.dirname(p), p):
            if inside(d):
                _chmod_dir(d)
        try:
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=unlock)


def _chmod_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _clean_env(workdir: str | None) -> dict[str, str]:
    """Nothing of ours crosses over (no AWS_*, MLFLOW_*, PREFECT_*, HF_*...): only what Python needs."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    if workdir:
        env.update(HOME=workdir, TMPDIR=workdir)
    return env
