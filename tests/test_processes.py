"""The child-process helpers every launcher, worker and server shares (tasks/core/processes.py), on real
processes: streaming with the user-error line spotted, no child left behind, process groups killed whole."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tasks.core import processes
from tasks.core.errors import UserError, user_error_in, user_error_line
from tasks.core.processes import alive, descendant_groups, descendants, kill_group, stream


def test_stream_forwards_lines_spots_the_user_error_and_keeps_the_tail():
    script = ("import sys\n"
              "for i in range(60): print(f'line {i}')\n"
              "print('error: data.path: no such file\\nRLFLOW_USER_ERROR: data.path: no such file', file=sys.stderr)\n"
              "sys.exit(2)")
    seen = []
    ran = stream([sys.executable, "-c", script], {**os.environ, "PYTHONUNBUFFERED": "1"}, seen.append, keep=5)
    assert ran.code == 2 and ran.user_error == "data.path: no such file"
    assert seen[:2] == ["line 0", "line 1"] and len(seen) == 62          # stdout and stderr, merged, in order
    assert ran.last == ["line 57", "line 58", "line 59", "error: data.path: no such file",
                        "RLFLOW_USER_ERROR: data.path: no such file"]


def test_stream_of_a_crash_has_no_user_error():
    ran = stream([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), lambda line: None)
    assert (ran.code, ran.user_error) == (3, None)


def test_an_interrupted_stream_leaves_no_child_behind(tmp_path):
    pid_file = tmp_path / "pid"
    script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); print('up', flush=True); " \
             "time.sleep(120)"

    def sink(line: str) -> None:
        raise KeyboardInterrupt          # Ctrl-C while the child is running

    with pytest.raises(KeyboardInterrupt):
        stream([sys.executable, "-c", script], dict(os.environ), sink)
    assert not alive(int(pid_file.read_text()))


def test_the_user_error_line_round_trips():
    text = user_error_line(UserError("train.lr: must be > 0, got -1"))
    assert [user_error_in(line) for line in text.splitlines()] == [None, "train.lr: must be > 0, got -1"]


def _with_a_grandchild(tmp_path, session: bool) -> tuple[subprocess.Popen, int]:
    """A child in a group of its own that started `sleep 120` (in a session of its own too with `session`)."""
    pid_file = tmp_path / "grandchild"
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '120'], start_new_session={session}); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return proc, int(pid_file.read_text())


def test_kill_group_takes_what_the_child_started_and_alive_knows_a_zombie(tmp_path):
    proc, grandchild = _with_a_grandchild(tmp_path, session=False)
    assert alive(proc.pid) and alive(grandchild)
    kill_group(proc)
    assert proc.returncode is not None and not alive(proc.pid)
    deadline = time.monotonic() + 60
    while alive(grandchild) and time.monotonic() < deadline:     # reparented to init, which reaps it
        time.sleep(0.05)
    assert not alive(grandchild)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)       # exited, not reaped
    assert os.path.exists(f"/proc/{zombie.pid}") and not alive(zombie.pid)
    zombie.wait()


def test_kill_group_takes_the_groups_its_descendants_made(tmp_path):
    """An environment server's episodes are sessions of their own (isolation.own_group); killing the server's
    group takes them, and what they started, too (it reached only the server's own group)."""
    proc, grandchild = _with_a_grandchild(tmp_path, session=True)
    assert os.getpgid(grandchild) == grandchild != os.getpgid(proc.pid)
    kill_group(proc)
    deadline = time.monotonic() + 60
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)


def test_descendants_are_found_under_every_thread_and_session_as_a_scan_of_proc_finds_them(tmp_path):
    """descendants() walks /proc's per-thread `children` files down from a process: a child started from another
    thread than the main one is listed under that thread alone, a grandchild in a session of its own is still a
    descendant; the same set as a scan of every /proc entry (the fallback), and their groups."""
    import threading

    if not processes._children_files():
        pytest.skip("this kernel has no /proc/PID/task/TID/children files")
    started = []
    thread = threading.Thread(target=lambda: started.append(_with_a_grandchild(tmp_path, session=True)))
    thread.start()
    thread.join()
    proc, grandchild = started[0]
    try:
        found = descendants(os.getpid())
        assert proc.pid in found and grandchild in found
        assert descendants(proc.pid) == processes._descendants_scanned(proc.pid) == [grandchild]
        assert descendant_groups(proc.pid) == {grandchild}          # (its own group is not counted)
        assert descendants(grandchild) == [] and descendants(2 ** 22 + 1) == []      # (none; no such process)
    finally:
        kill_group(proc)


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_a_live_one_kept(tmp_path):
    """DeepSpeed's CPU comm op is built under torch's lock file; a killed builder left it behind and the next
    DeepSpeed process waited on it forever (tasks/engines/deepspeed_engine.py: clear_stale_build_locks)."""
    from tasks.engines.deepspeed_engine import BUILD_LOCK_STALE, clear_stale_build_locks

    stale, live = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (stale, live):
        lock.parent.mkdir(parents=True)
        lock.write_text("")
    old = time.time() - BUILD_LOCK_STALE - 60
    os.utime(stale, (old, old))
    assert clear_stale_build_locks(tmp_path) == [stale]
    assert not stale.exists() and live.exists()


def test_a_servers_socket_takes_connections_before_it_serves_them():
    """The READY line comes from uvicorn's lifespan startup, before uvicorn serves the socket: a client that
    connects in that gap must wait, not be refused (the pool's front reads a refusal as a lost member)."""
    import socket

    from tasks.core.serving import listening_socket

    sock, url = listening_socket("127.0.0.1", 0)
    try:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10):   # nothing accepts yet: queued
            pass
    finally:
        sock.close()


def _waits_for_its_parent(conn) -> None:
    """An episode's process as isolation.py starts one (a group of its own, its keeper behind it, which ignores
    SIGTERM), with a process its code started in a session of its own, waiting for its parent's next call."""
    from tasks.envs.runtime.isolation import own_group

    own_group()
    started = subprocess.Popen(["sleep", "600"], start_new_session=True)
    conn.send(started.pid)
    conn.recv()                                  # (never sent)


def test_children_left_running_are_ended_so_the_exit_does_not_wait_for_them():
    """multiprocessing's exit handler joins every child for good: one waiting for its parent's next call (an
    episode's environment a failed stage left) kept the CLI from exiting. end_children ends them with what they
    started (a SIGTERM alone reached the keeper, which ignores it), and says which."""
    import multiprocessing

    from tasks.core.processes import end_children

    ctx = multiprocessing.get_context("forkserver")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_waits_for_its_parent, args=(child,), name="left-behind")
    proc.start()
    started = parent.recv()
    assert proc.is_alive() and alive(started)
    assert "process left-behind" in end_children(grace=5.0)
    assert not proc.is_alive() and proc not in multiprocessing.active_children()
    assert not alive(started), "what the episode's code started outlived it"
    parent.close()
