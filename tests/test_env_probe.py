"""Preflight's check of the environment in a process of its own (tasks/envs/runtime/probe.py), where the episodes'
environments run in theirs (env.isolation: process): what the user's environment code does to its process is one
line naming env.factory, and nothing of it reaches rlflow's process. Before, the check ran here: a crash in the
environment's module or __init__ ended `rlflow run` with exit 139 and no word, a module that swallowed the
deadline hung the check, a chdir made the next file rlflow read "not found", a process it forked outlived it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tasks.core.config import load_config
from tasks.core.errors import UserError
from tests.conftest import ROOT, user_module

LETTERS = ROOT / "configs" / "letters.yaml"
ROW = {"prompt": "Say each letter I name.", "letters": "abc", "seed": 0}

HOSTILE = '''
import ctypes, os, sys, threading, time
from tasks.envs.builtin.games import SayTheLetters


class SegfaultsWhenMade(SayTheLetters):
    def __init__(self, **kw):
        ctypes.string_at(0)


class KillsItsProcessOnReset(SayTheLetters):
    def reset(self, row):
        os.kill(os.getpid(), 9)


class LeavesThingsBehind(SayTheLetters):        # a chdir, a forked process, a thread that never ends, closed stdout
    def __init__(self, **kw):
        os.chdir("/")
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        open(os.environ["KILL_DIR"] + "/forked", "w").write(str(pid))
        threading.Thread(target=time.sleep, args=(600,)).start()
        super().__init__(**kw)

    def reset(self, row):
        os.close(1)
        os.close(2)
        return super().reset(row)


class ExitsWhenMade(SayTheLetters):
    def __init__(self, **kw):
        sys.exit(0)


class ForksADaemonAway(SayTheLetters):        # setsid and a second fork: no one's descendant, no group of ours
    def __init__(self, **kw):
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                open(os.environ["KILL_DIR"] + "/daemon.tmp", "w").write(str(os.getpid()))
                os.rename(os.environ["KILL_DIR"] + "/daemon.tmp", os.environ["KILL_DIR"] + "/daemon")
                time.sleep(600)
            os._exit(0)
        os.wait()
        while not os.path.exists(os.environ["KILL_DIR"] + "/daemon"):     # (it is running: not killed unborn)
            time.sleep(0.01)
        super().__init__(**kw)


class ClosesAllAndOpensItsOwn(SayTheLetters):  # a daemon-style closerange, then files of its own in their numbers
    def reset(self, row):
        os.closerange(3, 256)
        self.kept = [open(os.path.join(os.environ["KILL_DIR"], f"log{i}.txt"), "w") for i in range(40)]
        return super().reset(row)


class WritesALot(SayTheLetters):
    def reset(self, row):
        for _ in range(8):
            os.write(2, b"e" * (1 << 20))
        return super().reset(row)


class SwallowsTheDeadline(SayTheLetters):
    def __init__(self, **kw):
        while True:
            try:
                time.sleep(60)
            except BaseException:
                pass


class Fine(SayTheLetters):
    pass


KINDS = {"one": Fine, "two": SegfaultsWhenMade}
'''


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "hostile_envs", HOSTILE)
    (tmp_path / "mods" / "segfaults_on_import.py").write_text("import ctypes\nctypes.string_at(0)\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _check(factory: str, rows: list[dict] | None = None, *more: str) -> None:
    from datasets import Dataset

    from tasks.envs.runtime.probe import check_in_process

    cfg = load_config(LETTERS, [f"env.factory={factory}", "env.isolation=process", *more])
    check_in_process(cfg, [Dataset.from_list(rows or [ROW])])


@pytest.mark.parametrize("factory, said", [
    ("hostile_envs:SegfaultsWhenMade", "(killed by SIGSEGV) as it made one with env.kwargs, then reset and stepped "
                                       "it with the data's first row"),
    ("hostile_envs:KillsItsProcessOnReset", "(killed by SIGKILL) as it made one with env.kwargs, then reset"),
    ("segfaults_on_import:Env", "(killed by SIGSEGV) as it imported module 'segfaults_on_import'"),
])
def test_an_environment_that_crashes_its_process_is_one_line_naming_the_factory(hostile, factory, said):
    with pytest.raises(UserError) as e:
        _check(factory)
    line = str(e.value)
    assert line.startswith(f"env.factory: {factory}: the environment's code ended the process preflight checks it "
                           f"in {said}"), line
    assert "\n" not in line and "segfaults_on_import" not in sys.modules and "hostile_envs" not in sys.modules


def test_a_dict_of_environments_is_checked_there_each_with_its_first_row(hostile):
    """TRL's multi-environment form: the row of each name travels to the check (one that crashes is found by the
    row that names it); a row naming none is refused as before."""
    rows = [{**ROW, "environment": "one"}, {**ROW, "environment": "one"}, {**ROW, "environment": "two"}]
    with pytest.raises(UserError, match=r"^env.factory: hostile_envs:KINDS: the environment's code ended the "
                                        r"process preflight checks it in \(killed by SIGSEGV\)"):
        _check("hostile_envs:KINDS", rows)
    _check("hostile_envs:KINDS", rows[:2])
    with pytest.raises(UserError, match=r"row 2 of the training data has environment 'three'; expected one of "):
        _check("hostile_envs:KINDS", [rows[0], {**ROW, "environment": "three"}])


def test_what_the_environment_leaves_behind_stays_in_its_process(hostile):
    """A chdir, a process it forked, a thread that never ends and a closed stdout: the check passes (each
    episode's process meets them, and ends), this process keeps its folder and output, nothing is left running."""
    _check("hostile_envs:LeavesThingsBehind")
    from tasks.core.processes import alive

    assert Path.cwd() == hostile
    os.write(1, b"")                     # (our stdout still open)
    assert "hostile_envs" not in sys.modules
    forked, deadline = int((hostile / "forked").read_text()), time.monotonic() + 30
    while time.monotonic() < deadline and alive(forked):      # (killed at once; reaped by whoever adopted it)
        time.sleep(0.2)
    assert not alive(forked)


def test_code_that_swallows_its_deadline_is_stopped_by_ours(hostile, monkeypatch):
    """A loop that catches the deadline's exception and goes on: the check's own deadline, past the user's, ends
    it (it hung the check for ever)."""
    from tasks.envs.runtime import probe

    monkeypatch.setenv("RLFLOW_IMPORT_SECONDS", "1")
    monkeypatch.setattr(probe, "CHECK_SECONDS", 3.0)
    with pytest.raises(UserError, match=r"^env.factory: hostile_envs:SwallowsTheDeadline: preflight's check of the "
                                        r"environment did not end in 14 s as it made one with env.kwargs"):
        _check("hostile_envs:SwallowsTheDeadline")


def test_the_checks_own_lines_come_back_as_they_are(hostile):
    """What check_environment says (here: env.kwargs the factory does not take) comes back word for word."""
    with pytest.raises(UserError, match=r"^env.kwargs: hostile_envs:Fine cannot be called with env.kwargs \['x'\]"):
        _check("hostile_envs:Fine", None, "env.kwargs={x: 1}")



@pytest.mark.parametrize("factory, said", [
    ("hostile_envs:ExitsWhenMade", "the environment's code called sys.exit(0) in preflight's check of it (made "
                                   "with env.kwargs"),
])
def test_what_the_environments_code_raises_past_exception_is_one_line(hostile, factory, said):
    """sys.exit is no Exception: the check's child reported it as rlflow's own failure (a traceback, exit 1)."""
    with pytest.raises(UserError) as e:
        _check(factory)
    assert str(e.value).startswith(f"env.factory: {factory}: {said}"), str(e.value)


def test_sys_exit_in_the_environment_is_one_line_where_it_runs_in_rlflows_process_too(hostile):
    """env.isolation: thread checks it here: sys.exit(0) as it was made ended `rlflow run` with exit 0, no word."""
    from tasks.envs.runtime.protocol import check_environment

    cfg = load_config(LETTERS, ["env.factory=hostile_envs:ExitsWhenMade", "env.isolation=thread"])
    with pytest.raises(UserError, match=r"^env.factory: hostile_envs:ExitsWhenMade: the environment's code called "
                                        r"sys.exit\(0\) in preflight's check of it"):
        check_environment(cfg, dict(ROW))


def test_a_daemon_forked_away_and_descriptors_closed_under_the_check_are_its_own(hostile):
    """A daemon in a session of its own (setsid, a second fork) outlived the command; a closerange(3, 256) and
    files opened in those numbers took the check's answer (the run waited 180 s, then blamed a loop)."""
    from tasks.core.processes import alive

    _check("hostile_envs:ForksADaemonAway")
    daemon, deadline = int((hostile / "daemon").read_text()), time.monotonic() + 30
    while time.monotonic() < deadline and alive(daemon):
        time.sleep(0.2)
    assert not alive(daemon)
    _check("hostile_envs:ClosesAllAndOpensItsOwn")
    assert all((hostile / f"log{i}.txt").read_text() == "" for i in range(40))


def test_what_the_check_prints_is_bounded(hostile, monkeypatch, capfd):
    """Its output reaches this process's stderr within RLFLOW_USER_OUTPUT_BYTES (8 MB went through whole)."""
    monkeypatch.setenv("RLFLOW_USER_OUTPUT_BYTES", "4096")
    _check("hostile_envs:WritesALot")
    err = capfd.readouterr().err
    assert len(err) < 10_000 and "RLFLOW_USER_OUTPUT_BYTES" in err
