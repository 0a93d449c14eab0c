"""The seccomp filter of the bubblewrap sandbox, compiled by libseccomp (Debian's python3-seccomp).

Run under the system Python that has the bindings; writes the BPF program to stdout, which the sandbox
hands to bubblewrap (`--seccomp FD`): bubblewrap loads it before it starts the harness, so it holds for the
harness, the code and everything the code starts.

    /usr/bin/python3 -I tasks/scoring/syscall_filter.py > filter.bpf

Allow by default, refuse what sandboxed code has no use for and what reaches outside its limits (docs/sandbox.md):
other processes, kernel memory and budgets outside every limit, kernel interfaces with a history of exploits,
namespaces and mounts, sockets other than AF_UNIX, calls that act on the whole machine, direct I/O and
administration. docs/sandbox.md lists every system call whose effect is machine-wide and what becomes of it.
Standard library and `seccomp` only.
More: docs/internals.md (tasks/scoring/syscall_filter.py): what is refused, call by call, and why.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys

EPERM = [
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop",
    "semtimedop", "semctl",
    "keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf",
    "perf_event_open", "userfaultfd",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "syslog", "quotactl", "open_by_handle_at", "name_to_handle_at", "iopl", "ioperm",
    "fanotify_init", "lookup_dcookie", "vhangup",
    # budgets the kernel keeps for the whole machine (or the whole user), not per cgroup: one sandbox could
    # use them up and the host's own requests would be refused (asynchronous-I/O contexts, fs.aio-max-nr;
    # inotify instances, fs.inotify.max_user_instances; io_uring, fanotify, keyrings, perf and userfaultfd
    # above hold their own such budgets too)
    "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
    "inotify_init", "inotify_init1",
    # machine-wide effects: every dirty page of the host flushed (sync, syncfs: past the sandbox's own disk
    # throttle), the clock, the disk's I/O priorities, POSIX message queues (kept apart by the IPC namespace too)
    "sync", "syncfs", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "ioprio_set",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
]
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
AF_UNIX = 1
F_SETFL = fcntl.F_SETFL


def build():
    import seccomp

    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in EPERM:
        try:
            f.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (RuntimeError, ValueError):       # not a syscall of this architecture (e.g. iopl on arm64)
            pass
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for bit in CLONE_NEW:             # any one namespace flag refuses the clone
        f.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, bit, bit))
    f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), "socket", seccomp.Arg(0, seccomp.NE, AF_UNIX))
    f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), "socketpair", seccomp.Arg(0, seccomp.NE, AF_UNIX))
    f.add_rule(seccomp.ERRNO(errno.EPERM), "prlimit64", seccomp.Arg(0, seccomp.NE, 0))
    # direct I/O: refused at open (open's flags are its 2nd argument, openat's its 3rd) and by fcntl F_SETFL
    direct = os.O_DIRECT
    for name, arg in (("open", 1), ("openat", 2)):
        try:
            f.add_rule(seccomp.ERRNO(errno.EINVAL), name, seccomp.Arg(arg, seccomp.MASKED_EQ, direct, direct))
        except (RuntimeError, ValueError):       # (no open(2) on arm64: openat only)
            pass
    f.add_rule(seccomp.ERRNO(errno.EINVAL), "fcntl", seccomp.Arg(1, seccomp.EQ, F_SETFL),
               seccomp.Arg(2, seccomp.MASKED_EQ, direct, direct))
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "openat2")
    return f


if __name__ == "__main__":
    build().export_bpf(sys.stdout.buffer)
    sys.stdout.flush()
