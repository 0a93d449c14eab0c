"""The daemon helper every server rlflow starts and finds again shares (tasks/core/daemon.py), on real detached
processes standing in for a server: the state file, start with its readiness wait, found again, replaced for
another key, stopped without touching a process that is not ours, and the daemon side's reasons to leave. The
servers themselves: tests/test_resident.py, tests/test_server_watchdog.py, tests/test_vllm.py,
tests/test_env_server.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.core.daemon import Daemon, DidNotStart, Watch, carries, forget, write_state
from tasks.core.processes import alive

MARKER = "--stand-in-for-a-daemon"
SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)", MARKER]


def _execd(state: dict) -> dict | None:
    """Ready once the stand-in runs Python: between fork and exec its pid is `sh`'s child, and during the exec
    its command line reads empty for a moment (the new program's arguments not yet in place), so a caller that
    asks then does not find it (seen under load in CI)."""
    try:
        argv = Path(f"/proc/{state['pid']}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return state if argv[0] == sys.executable.encode() and MARKER.encode() in argv else None


def _start(daemon: Daemon, key: str = "k") -> dict:
    return daemon.start(SLEEPER, dict(os.environ), _execd, 30, "the stand-in", {"key": key})


def test_the_state_file_is_written_whole_and_private(tmp_path):
    path = tmp_path / "run.json"
    (tmp_path / "run.tmp").write_text("left by a killed writer")
    os.chmod(tmp_path / "run.tmp", 0o644)
    write_state(path, {"pid": 1, "authkey": "secret"})
    assert json.loads(path.read_text()) == {"pid": 1, "authkey": "secret"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not (tmp_path / "run.tmp").exists()


def test_a_daemon_is_found_again_replaced_for_another_key_and_stopped(tmp_path):
    daemon = Daemon(tmp_path / "run.json", MARKER, stop_wait=5)
    first = daemon.ensure("k", lambda s: True, lambda: _start(daemon))
    assert alive(first["pid"]) and daemon.read() == first and first["log"] == str(tmp_path / "run.log")
    again = daemon.ensure("k", lambda s: True, lambda: pytest.fail("started a second one"))
    assert again["pid"] == first["pid"]                                   # another caller finds the same one
    hung = daemon.ensure("k", lambda s: False, lambda: _start(daemon))    # does not answer: replaced
    assert not alive(first["pid"]) and alive(hung["pid"])
    other = daemon.ensure("other", lambda s: True, lambda: _start(daemon, "other"))   # another config: replaced
    assert not alive(hung["pid"]) and daemon.read()["key"] == "other"
    daemon.stop()
    assert not alive(other["pid"]) and not daemon.path.exists()


def test_a_reused_pid_is_never_signalled(tmp_path):
    """The state file of a daemon long gone names a pid another program now has: it is neither taken for the
    daemon nor stopped."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        daemon = Daemon(tmp_path / "run.json", MARKER, stop_wait=5)
        daemon.write({"pid": stranger.pid, "key": "k"})
        started = daemon.ensure("k", lambda s: True, lambda: _start(daemon))
        assert started["pid"] != stranger.pid and stranger.poll() is None
        daemon.stop()
    finally:
        stranger.kill()
        stranger.wait()


def test_a_daemon_that_exits_or_never_answers_fails_with_its_log(tmp_path):
    daemon = Daemon(tmp_path / "run.json", MARKER, stop_wait=5)
    crash = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)", MARKER]
    with pytest.raises(DidNotStart, match=r"(?s)the stand-in did not come up \(it exited; log .*run.log\):\n"
                                          r".*no such model"):
        daemon.start(crash, dict(os.environ), lambda s: None, 30, "the stand-in", {"key": "k"})
    assert not daemon.path.exists()
    def never_answers(state):            # (once it is up, however long a loaded machine takes to start python)
        deadline = time.monotonic() + 120
        while "up" not in (daemon.log.read_text() if daemon.log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)

    with pytest.raises(DidNotStart, match=r"no answer in 1 s"):
        daemon.start(SLEEPER, dict(os.environ), never_answers, 1, "the stand-in", {"key": "k"})
    assert not daemon.path.exists()
    assert daemon.log.read_text().count("up") == 1 and not _stand_ins()    # it had started: stopped, not left


def _stand_ins() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and carries(int(p), MARKER) and alive(int(p))]


def test_the_daemon_side_leaves_when_replaced_idle_or_orphaned(tmp_path):
    path = tmp_path / "run.json"
    write_state(path, {"pid": 7})
    assert Watch(7, path).check() is None
    write_state(path, {"pid": 8})
    assert Watch(7, path).check() == "replaced"
    path.unlink()
    assert Watch(7, path, wait_named=3600).check() is None            # not named yet: the caller writes it soon
    assert Watch(7, path).check() == "replaced"
    assert Watch(idle=10, unused=lambda: 11).check() == "idle"
    assert Watch(idle=10, unused=lambda: None).check() is None        # in use now
    assert Watch(idle=0, unused=lambda: 1e9).check() is None          # 0: never idle
    assert Watch(parent=os.getppid()).check() is None
    assert Watch(parent=os.getppid() + 1).check() == "orphaned"
    write_state(path, {"pid": 8})
    forget(path, 7)
    assert path.exists()                                              # a newer daemon's file is not ours
    forget(path, 8)
    assert not path.exists()
    started = time.monotonic()
    assert Watch(idle=0.1, unused=lambda: time.monotonic() - started).wait(0.05) == "idle"
