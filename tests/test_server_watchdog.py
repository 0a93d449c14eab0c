"""Server mode's watchdog (tasks/engines/vllm_watchdog.py), with real processes and a stand-in for `vllm serve`
(a sleeping python whose command line says vllm, started detached exactly as the real server is): a flow
killed before its teardown must not leave the server running forever. The real server's start, reload and
stop are in tests/test_vllm.py."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tasks.core.processes import alive as _alive
from tasks.core.processes import group_members
from tasks.core.processes import spawn_detached as _spawn_detached
from tasks.engines.vllm_offline import worker_env
from tasks.engines.vllm_server import Server

IDLE = 2.0


def _start(tmp_path: Path, idle: float = IDLE, state_after: float = 0.0) -> tuple[Path, dict]:
    """A detached stand-in server with its watchdog, and the state file the stage would write (`state_after`
    seconds later)."""
    state_path = tmp_path / "run.json"
    argv = [sys.executable, "-c", "import time; time.sleep(120)", "--stand-in-for-vllm"]
    watch = [sys.executable, "-m", "tasks.engines.vllm_watchdog", str(state_path), str(idle), "0.2"]
    pid = _spawn_detached(argv, worker_env(LOG=str(tmp_path / "server.log")), watch)
    state = {"pid": pid, "pgid": os.getpgid(pid), "port": 1}
    if state_after:
        assert _wait(lambda: len(_watchdog(state)) == 1, 30)
        time.sleep(state_after)
    _write_used(state_path, state, time.time() + 3600)
    return state_path, state


def _write_used(state_path: Path, state: dict, at: float) -> None:
    """The state file as a generate left it at `at` (its mtime, in place at once): an hour ahead reads as used
    whatever this machine's stalls, an hour back as unused (a loaded machine's pause past IDLE stopped a server
    the test was still touching every half second)."""
    new = state_path.with_suffix(".new")
    new.write_text(json.dumps(state))
    os.utime(new, (at, at))
    os.replace(new, state_path)


def _wait(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def _watchdog(state: dict) -> list[int]:
    """The watchdog once it runs: `vllm_watchdog` in its command line (the `sh` it is exec'd from carries the
    server's argv, `vllm` included, and while exec replaces it its command line reads empty: counted by `vllm`
    alone, one poll saw the sh and the next none, on a loaded machine)."""
    return [p for p in group_members(state["pgid"], "vllm_watchdog") if p != state["pid"]]


def test_an_unused_server_is_stopped_and_a_used_one_is_not(tmp_path):
    state_path, state = _start(tmp_path)
    assert _wait(lambda: len(_watchdog(state)) == 1, 30)            # beside the server, in its process group
    time.sleep(2.5 * IDLE)                                          # used (many polls of the watchdog's: 0.2 s)
    assert _alive(state["pid"]) and len(_watchdog(state)) == 1
    _write_used(state_path, state, time.time() - 3600)              # then nothing for longer than IDLE: stopped
    assert _wait(lambda: not _alive(state["pid"]), 120)
    assert not state_path.exists()                                  # and forgotten (first), so a stage starts one
    assert _wait(lambda: not _watchdog(state), 5)
    log = (tmp_path / "server.log").read_text()
    assert "no generate used it for 2 s (generate.server_idle_timeout)" in log


def test_a_state_file_written_after_the_watchdog_started_is_waited_for(tmp_path):
    """The stage writes the state file just after the spawn returns: a watchdog polling before that must not
    take the missing file for a forgotten server."""
    state_path, state = _start(tmp_path, idle=3600, state_after=1.0)     # five polls without a state file
    time.sleep(1.0)
    assert _alive(state["pid"]) and len(_watchdog(state)) == 1
    Server(state_path, state).stop()
    assert not _alive(state["pid"])


def test_a_server_the_state_file_never_names_is_stopped_after_the_idle_timeout(tmp_path):
    state_path, state = _start(tmp_path)
    state_path.unlink()                                              # the stage died before writing it
    assert _wait(lambda: not _alive(state["pid"]), IDLE + 15)
    assert "no longer names it" in (tmp_path / "server.log").read_text()


def test_a_server_the_state_file_no_longer_names_is_stopped(tmp_path):
    state_path, state = _start(tmp_path, idle=3600)
    state_path.write_text(json.dumps({**state, "pid": 1}))          # the run started another one
    assert _wait(lambda: not _alive(state["pid"]), 15)
    assert state_path.exists()                                      # not ours to remove
    assert "no longer names it" in (tmp_path / "server.log").read_text()


def test_stopping_the_server_stops_its_watchdog(tmp_path):
    state_path, state = _start(tmp_path, idle=3600)
    assert _wait(lambda: len(_watchdog(state)) == 1, 30)
    dog = _watchdog(state)[0]
    Server(state_path, state).stop()                                # what the flow's teardown does
    assert not _alive(state["pid"]) and not _alive(dog) and not state_path.exists()


@pytest.mark.parametrize("idle, start, ok", [(0, 900, True), (7200, 900, True), (600, 900, False)])
def test_idle_timeout_must_outlast_a_start(idle, start, ok):
    from tasks.core.config import load_config
    from tasks.core.errors import UserError
    from tests.conftest import TINY

    overrides = [f"generate.server_idle_timeout={idle}", f"generate.server_start_timeout={start}"]
    if ok:
        assert load_config(TINY, overrides).generate.server_idle_timeout == idle
    else:
        with pytest.raises(UserError, match="server_idle_timeout .* must exceed server_start_timeout"):
            load_config(TINY, overrides)
