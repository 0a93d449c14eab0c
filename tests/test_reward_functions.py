"""Reward functions that misbehave (raise, hang, crash, wrong count, non-numbers, NaN) cost only their own
scores for that batch, are counted, and fail the stage only with reward.strict; the math-verify reward."""

from __future__ import annotations

import json
import os
import textwrap
import time

import pytest
import torch

from tasks.core.config import load_config
from tasks.core.contracts import Rollout
from tasks.core.errors import UserError
from tasks.rewards.math_answer import math_answer_reward
from tasks.scoring.functions import RewardFunctionError, close_workers, load_functions, score_records
from tests.conftest import TINY, run_cli

BAD = textwrap.dedent('''
    import math, os, signal, sys, threading, time

    def good(completions, answer, **kw):
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    def raises(completions, **kw):
        raise ValueError("cannot parse the answer")

    def hangs(completions, **kw):
        time.sleep(3600)

    def spins(completions, **kw):
        while True:
            pass

    def short(completions, **kw):
        return [1.0] * (len(completions) - 1)

    def text(completions, **kw):
        return ["high"] * len(completions)

    def numeric_text(completions, **kw):
        return ["0.5"] * len(completions)

    def nan_one(completions, **kw):
        return [math.nan] + [0.5] * (len(completions) - 1)

    def exits(completions, **kw):
        sys.exit(0)

    def hard_exit(completions, **kw):
        os._exit(3)

    def segfault(completions, **kw):
        os.kill(os.getpid(), signal.SIGSEGV)

    def forks_and_leaves(completions, **kw):   # a child that ends, never waited for (seen ended first)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        return [1.0] * len(completions)

    PROCESSES = []

    def starts_a_process(completions, **kw):   # a multiprocessing child, joined by the next call
        import multiprocessing
        if PROCESSES:
            p = PROCESSES.pop()
            p.join()
            return [float(p.exitcode == 0)] * len(completions)
        p = multiprocessing.get_context("fork").Process(target=int)
        p.start()
        while open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        PROCESSES.append(p)
        return [1.0] * len(completions)

    POPENS = []

    def popen_across_calls(completions, **kw):  # a program started in one call, waited for in the next
        import subprocess
        if POPENS:
            return [float(POPENS.pop().wait() == 3)] * len(completions)
        p = subprocess.Popen(["sh", "-c", "exit 3"])
        while open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        POPENS.append(p)
        return [1.0] * len(completions)

    def logs(completions, log_extra=None, log_metric=None, **kw):
        log_extra("why", [f"len {len(c)}" for c in completions])
        log_metric("checked", float(len(completions)))
        return [float(len(c)) for c in completions]

    def logs_nan(completions, log_metric=None, **kw):
        log_metric("ratio", float("nan"))
        log_metric("peak", float("inf"))
        log_metric("fine", 0.5)
        return [0.0] * len(completions)

    def scaled(completions, factor=1.0, **kw):
        return [factor] * len(completions)

    def slow_lengths(completions, **kw):
        time.sleep(0.2)
        return [float(len(c)) for c in completions]

    def clears(completions, answer, **kw):
        n = len(completions)
        completions.clear(), answer.clear()
        return [0.5] * n

    def forks_then_dies(completions, **kw):
        if os.fork() == 0:         # a child that lives on, holding the worker's end of the answer pipe
            with open("forked.tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename("forked.tmp", "forked.pid")
            time.sleep(3600)
        while not os.path.exists("forked.pid"):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    def interrupts(completions, **kw):
        raise KeyboardInterrupt

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no text either")

    def unprintable(completions, **kw):
        raise Unprintable()

    def exits_later(completions, **kw):
        def later():
            try:
                time.sleep(0.2)
                os._exit(1)
            finally:
                open("exit_tried", "w").close()
        threading.Thread(target=later).start()
        return [0.0] * len(completions)

    def fork_returns(completions, **kw):
        os.fork()                  # parent and child both return: only the worker may answer
        return [1.0] * len(completions)

    def garbles(completions, **kw):
        import fcntl
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                pipe = os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
                if pipe and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
                    os.write(fd, bytes([255]) * 8)       # a length no answer has, on the answer pipe
            except OSError:
                pass
        return [1.0] * len(completions)

    def logs_odd_values(completions, log_extra=None, **kw):
        log_extra("odd", [{1, 2}, object(), float("nan"), (1, "a")])
        return [0.0] * len(completions)

    def floods(completions, **kw):
        for _ in range(2000):
            print("x" * 1000)
        return [0.0] * len(completions)

    def floods_descriptors(completions, **kw):
        for fd in (1, 2) * 1000:
            os.write(fd, b"y" * 1000 + b"\\n")
        return [0.0] * len(completions)

    def floods_through_a_child(completions, **kw):
        import subprocess
        subprocess.run([sys.executable, "-c", "import os; [os.write(1, b'z' * 1000) for _ in range(2000)]"])
        return [0.0] * len(completions)

    def floods_holding_the_gil(completions, **kw):
        import ctypes
        ctypes.PyDLL(None).write(1, b"c" * 200_000, 200_000)     # (C code that keeps the GIL as it writes)
        return [0.0] * len(completions)

    def last_words(completions, **kw):
        print("last words before the crash", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)

    def huge_one(completions, **kw):           # past float32's range: 1e39 crashed the stage
        return [1e39] + [0.5] * (len(completions) - 1)

    def near_the_top(completions, **kw):       # in range, but weighted and summed past float32's
        return [3e38 * (j % 2) for j in range(len(completions))]

    LIMIT = []

    async def limited(completions, **kw):      # a judge's usual cap, kept across calls: bound to its first loop
        import asyncio
        if not LIMIT:
            LIMIT.append(asyncio.Semaphore(1))

        async def one():
            async with LIMIT[0]:               # (the second waits: the semaphore takes the running loop)
                await asyncio.sleep(0.01)
        await asyncio.gather(one(), one())
        return [1.0] * len(completions)

    def wanders(completions, **kw):
        os.chdir("/")
        return [0.0] * len(completions)

    def reads_here(completions, **kw):         # a relative path, from the run's folder
        return [float(os.path.exists("bad_rewards.py"))] * len(completions)

    def leaves_a_daemon(completions, **kw):    # forked away twice, in a session of its own: the worker's no more
        import subprocess
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            os.write(w, str(subprocess.Popen(["sleep", "600"], start_new_session=True).pid).encode())
            os._exit(0)
        os.close(w)
        pid = int(os.read(r, 32))
        os.wait()
        with open("daemon.pid", "w") as f:
            f.write(str(pid))
        return [1.0] * len(completions)

    def kills_its_parent(completions, **kw):
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(60)
        return [1.0] * len(completions)

    def escapes(completions, **kw):
        raise ValueError("\\x1b[31mRED")

    def a_set(completions, **kw):
        return {float(j) for j in range(len(completions))}

    def past_floats(completions, **kw):
        return [10 ** 400] + [0.0] * (len(completions) - 1)

    def leaves_an_alarm(completions, **kw):
        signal.alarm(1)
        return [0.0] * len(completions)

    def closes_stdin(completions, **kw):
        os.close(0)
        return [0.0] * len(completions)

    def closes_stdout(completions, **kw):
        os.close(1)
        return [0.0] * len(completions)

    async def async_good(completions, answer, **kw):
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    def closes_pipes(completions, **kw):        # (every descriptor past stderr: the worker's answer pipe among them)
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd > 2:
                try:
                    os.close(fd)
                except OSError:
                    pass
        return [0.0] * len(completions)

    def posix_exits_later(completions, **kw):
        import posix
        threading.Thread(target=lambda: (time.sleep(0.5), posix._exit(0))).start()
        return [0.0] * len(completions)

    def slow_good(completions, answer, **kw):
        time.sleep(1.5)
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]
''')

STAGE = textwrap.dedent('''
    import json, os, sys
    from tasks.core.config import load_config
    from tasks.core.contracts import Rollout
    from tasks.scoring.functions import load_functions, score_records
    fns = [{"fn": f"bad_rewards:{name}"} for name in sys.argv[3:]]
    functions = load_functions(load_config(sys.argv[1], [f"reward.functions={json.dumps(fns)}"]))
    records = [Rollout(group=0, row=j, prompt="a=", prompt_ids=[1], completion="x", completion_ids=[1],
                       logprobs=[0.0], truncated=False, columns={}) for j in range(2)]
    scored = score_records(functions, records, "sum")
    print(json.dumps({"scores": scored.scores, "errors": scored.errors}), flush=True)
    if sys.argv[2] == "killed":
        os.kill(os.getpid(), 9)
''')


def _records(n: int = 4) -> list[Rollout]:
    return [Rollout(group=j // 2, row=j, prompt="a=", prompt_ids=[1], completion="bbb" if j % 2 else "x",
                    completion_ids=[1], logprobs=[0.0], truncated=False, columns={"answer": "bbb"}) for j in range(n)]


@pytest.fixture
def bad_module(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text(BAD)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _functions(names: list[str], **reward):
    fns = [{"fn": f"bad_rewards:{n}"} for n in names]
    overrides = [f"reward.functions={json.dumps(fns)}"] + [f"reward.{k}={v}" for k, v in reward.items()]
    return load_functions(load_config(TINY, overrides))


@pytest.mark.parametrize("bad,expected", [
    ("raises", "reward function 'raises' raised ValueError: cannot parse the answer"),
    ("short", "reward function 'short' returned 3 scores for 4 completions"),
    ("text", "reward function 'text' returned str for completion 0"),
    ("numeric_text", "reward function 'numeric_text' returned str for completion 0"),
    ("exits", "reward function 'exits' raised SystemExit: 0 (bad_rewards.py:"),
    # (said it ran "in rlflow's own process" and pointed at the guard, process_wide.py, not the user's line)
    ("hard_exit", "reward function 'hard_exit' raised ExitRefused: os._exit(3) refused: this code runs in the reward "
                  "worker (rlflow's process for users' functions), which it would end (bad_rewards.py:33)"),
    ("segfault", "reward function 'segfault' killed its reward worker (killed by SIGSEGV: a crash or a signal"),
    ("interrupts", "reward function 'interrupts' raised KeyboardInterrupt (bad_rewards.py:"),
    ("garbles", "reward function 'garbles' killed its reward worker (broke its answer pipe"),
    # (the worker printed its own traceback as it tried to answer on a closed pipe, said "exit 1: a crash")
    ("closes_pipes", "reward function 'closes_pipes' killed its reward worker (closed or replaced the descriptors of "
                     "its answer pipe, rlflow's)"),
    ("unprintable", "reward function 'unprintable' raised Unprintable (bad_rewards.py:"),
    ("escapes", "reward function 'escapes' raised ValueError: \\x1b[31mRED"),    # (the escape sequence was raw)
])
def test_a_failing_function_scores_nothing_for_the_batch_and_the_others_still_count(bad_module, bad, expected):
    functions = _functions(["good", bad])
    records = _records()
    scored = score_records(functions, records, "sum")
    assert scored.scores[bad] == [None] * 4
    assert scored.errors[bad].startswith(expected)
    assert scored.scores["good"] == [0.0, 1.0, 0.0, 1.0]
    assert [r.reward for r in records] == [0.0, 1.0, 0.0, 1.0]    # combined over the functions that scored
    # The worker (restarted where it died) serves the next batch.
    assert score_records(_functions(["good"]), _records(), "sum").scores["good"] == [0.0, 1.0, 0.0, 1.0]


def test_a_set_and_an_int_past_a_floats_range_are_that_functions_own_fault(bad_module):
    """A set was taken in its own arbitrary order (scores given to the wrong completions); 10**400 was an
    OverflowError that lost the whole batch (a float past the range makes that completion's score missing)."""
    scored = score_records(_functions(["good", "a_set", "past_floats"]), _records(), "sum")
    assert scored.errors["a_set"].startswith("reward function 'a_set' returned set, expected a list of 4 scores")
    assert "past_floats" not in scored.errors and scored.scores["past_floats"][1:] == [0.0] * 3
    assert scored.scores["past_floats"][0] is None


@pytest.mark.parametrize("bad", ["leaves_an_alarm", "closes_stdin", "posix_exits_later"])
def test_what_a_function_leaves_behind_does_not_fail_the_next_one(bad_module, bad):
    """A pending alarm, a closed fd 0 (the worker's requests came on it), a thread that calls posix._exit later:
    each ended the worker under the next function, which was blamed ("killed its reward worker")."""
    scored = score_records(_functions([bad, "slow_good"], timeout_seconds=60), _records(), "sum")
    assert scored.scores["slow_good"] == [0.0, 1.0, 0.0, 1.0] and "slow_good" not in scored.errors
    assert score_records(_functions([bad, "slow_good"], timeout_seconds=60), _records(), "sum").scores[
        "slow_good"] == [0.0, 1.0, 0.0, 1.0]


def test_a_function_that_closes_its_stdout_does_not_fail_the_next_one_later(bad_module):
    """A function that closes fd 1 (its stdout) left that number free: the async function after it made its event
    loop there, which the first one's next call closed, and the async one failed from then on, blamed (Bad file
    descriptor). The worker puts fd 1 and 2 back after each call."""
    for _ in range(3):
        scored = score_records(_functions(["closes_stdout", "async_good"]), _records(), "sum")
        assert scored.errors == {} and scored.scores["async_good"] == [0.0, 1.0, 0.0, 1.0], scored.errors


def test_a_worker_that_dies_is_seen_at_once_and_what_it_forked_is_killed(bad_module):
    """A function that forks a child (which inherits the worker's end of the answer pipe, so no end of file
    comes) and then kills the worker: the failure is the worker's death, not a wait to reward.timeout_seconds
    read as a hang, and the child is killed with the worker's group."""
    from tasks.core.processes import alive

    functions = _functions(["forks_then_dies", "good"], timeout_seconds=600)
    scored = score_records(functions, _records(), "sum")
    assert scored.errors["forks_then_dies"].startswith("reward function 'forks_then_dies' killed its reward worker "
                                                       "(killed by SIGKILL")
    assert scored.scores["good"] == [0.0, 1.0, 0.0, 1.0]
    child = int((bad_module / "forked.pid").read_text())
    for _ in range(600):                 # (SIGKILL sent: wait for it to land, however loaded the machine)
        if not alive(child):
            break
        time.sleep(0.1)
    assert not alive(child)


def _stage(bad_module, how: str, *names: str):
    """A stage process that scores a batch with `names` and then ends (`how`: "ends", or "killed": SIGKILLed, as
    a preempted machine's processes are): its exit code and what it said."""
    import subprocess
    import sys

    from tasks.core.paths import REPO_ROOT

    (bad_module / "stage.py").write_text(STAGE)
    done = subprocess.run([sys.executable, "stage.py", str(TINY), how, *names], cwd=bad_module, timeout=600,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    said = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, json.loads(said[0]) if said else done.stderr[-2000:]


def _gone(pid: int) -> bool:
    from tasks.core.processes import alive

    for _ in range(600):                 # (killed: wait for it to land, however loaded the machine)
        if not alive(pid):
            return True
        time.sleep(0.1)
    os.kill(pid, 9)
    return False


@pytest.mark.parametrize("how", ["ends", "killed"])
def test_what_a_function_leaves_running_ends_with_the_stage(bad_module, how):
    """A daemon a reward function starts (forked away twice into a session of its own, so that it is no longer
    the worker's descendant) ends with the worker: when the stage ends as it should, and when it is SIGKILLed (a
    preempted machine's processes), where nothing of the stage can run (before 2026-12-05: init's, for good)."""
    code, said = _stage(bad_module, how, "leaves_a_daemon")
    assert code == (0 if how == "ends" else -9), said
    assert said["scores"]["leaves_a_daemon"] == [1.0, 1.0]
    assert _gone(int((bad_module / "daemon.pid").read_text()))


def test_a_function_that_kills_its_parent_fails_alone(bad_module):
    """A reward function that SIGKILLs its parent process kills its worker's keeper, not the stage: that
    function's failure, counted, and the others' scores kept (before 2026-12-05: the stage died, silently)."""
    code, said = _stage(bad_module, "ends", "kills_its_parent", "leaves_a_daemon")
    assert code == 0, said
    assert said["errors"]["kills_its_parent"].startswith("reward function 'kills_its_parent' killed its reward "
                                                       "worker (killed by SIGKILL")
    assert said["scores"]["leaves_a_daemon"] == [1.0, 1.0]


def test_an_exit_from_a_thread_a_function_left_running_does_not_end_the_worker(bad_module):
    """os._exit from a thread the function started and left behind would end the worker after the function
    returned, blamed on whichever function runs next: refused in every thread of the worker."""
    from tasks.scoring import functions as module

    functions = _functions(["exits_later", "good"])
    assert not score_records(functions, _records(), "sum").errors
    for _ in range(600):
        if (bad_module / "exit_tried").exists():
            break
        time.sleep(0.1)
    idle = module._idle[module._key(functions)]
    assert (bad_module / "exit_tried").exists() and len(idle) == 1 and idle[0].alive()
    scored = score_records(functions, _records(), "sum")
    assert not scored.errors and scored.scores["good"] == [0.0, 1.0, 0.0, 1.0]


def test_a_fork_that_returns_instead_of_ending_does_not_answer_beside_the_worker(bad_module):
    """The forked child of a function that does not end it comes back into the worker's loop: it ends there,
    never answering, so the next function's scores are its own."""
    functions = _functions(["fork_returns", "good"])
    for _ in range(3):
        scored = score_records(functions, _records(), "sum")
        assert not scored.errors and scored.scores == {"fork_returns": [1.0] * 4, "good": [0.0, 1.0, 0.0, 1.0]}


def test_a_fork_never_waited_for_is_reaped_and_multiprocessing_keeps_its_own(bad_module):
    """A function that forks a child which ends and is never waited for leaves no zombie behind in the worker
    (was: one per call, for the worker's life); a multiprocessing child it starts in one call and joins in the
    next still has its exit code (the worker does not reap what multiprocessing tracks)."""
    from tasks.scoring import functions as module

    functions = _functions(["forks_and_leaves", "starts_a_process", "popen_across_calls", "good"])
    for _ in range(4):
        scored = score_records(functions, _records(), "sum")
        assert not scored.errors, scored.errors
        assert scored.scores["starts_a_process"] == scored.scores["popen_across_calls"] == [1.0] * 4
    worker = module._idle[module._key(functions)][0].proc.pid
    zombies = []
    for entry in os.listdir("/proc"):
        try:
            state, ppid = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == worker and state == "Z":
            zombies.append(entry)
    assert not zombies, zombies


def test_logged_values_reach_the_record_as_json(bad_module):
    """log_extra values the rollout record could not hold (a set, an object, a tuple) arrive as JSON can hold
    them, not as a crash when the record is written."""
    records = _records()
    score_records(_functions(["logs_odd_values"]), records, "sum")
    odd = [r.extra["odd"] for r in records]
    assert sorted(odd[0]) == [1, 2] and odd[1].startswith("<object object") and odd[3] == [1, "a"]
    json.dumps([r.extra for r in records])


@pytest.mark.parametrize("fn", ["floods", "floods_descriptors", "floods_through_a_child", "floods_holding_the_gil"])
def test_what_a_function_prints_is_bounded(bad_module, monkeypatch, capfd, fn):
    """Through print, written to descriptors 1 and 2 itself, by a process it starts, or by C code that keeps the
    GIL: 200 KB-2 MB bounded to the budget, said once (the worker's stderr is a pipe its parent copies from:
    processes.BoundedCopy; a copier in the worker itself would wait for the GIL the writer holds). Earlier tests'
    idle workers are ended first: what one of them still copies is not this function's."""
    close_workers()
    monkeypatch.setenv("RLFLOW_USER_OUTPUT_BYTES", "10000")
    scored = score_records(_functions([fn]), _records(), "sum")
    out, err = capfd.readouterr()
    assert scored.scores[fn] == [0.0] * 4
    assert err.count("a user's code printed more than 10000 bytes") == 1 and len(out + err) < 12_000


def test_a_flush_waits_for_what_the_pipe_holds_however_slow_the_copy(capfd, monkeypatch):
    """flush() returns once what was in the pipe when it was called has been copied, counted, not after a pause:
    a copy slowed past the old 2 s pause (a loaded machine) still shows all of it, and the budget's line, before
    flush returns (test_what_a_function_prints_is_bounded failed so under load)."""
    from tasks.core.process_wide import OutputBudget
    from tasks.core.processes import BoundedCopy

    slow_take = OutputBudget.take
    monkeypatch.setattr(OutputBudget, "take", lambda self, n: (time.sleep(3), slow_take(self, n))[1])
    r, w = os.pipe()
    with os.fdopen(r, "rb", buffering=0) as pipe:
        copy = BoundedCopy(pipe, lambda: 1000, "a test's pipe")
        os.write(w, b"y" * 4000)
        copy.flush()
        err = capfd.readouterr().err
        os.close(w)
        copy.wait(60)
    assert err.startswith("y" * 1000 + "\n[rlflow: a user's code printed more than 1000 bytes in a test's pipe"), \
        err[-300:]


def test_what_a_function_wrote_before_its_worker_died_is_shown(bad_module, capfd):
    """The lines that explain a crash reach the run's output: the parent reads the worker's pipe to its end."""
    scored = score_records(_functions(["last_words"]), _records(), "sum")
    assert scored.errors["last_words"].startswith("reward function 'last_words' killed its reward worker (killed by "
                                                  "SIGSEGV")
    assert "last words before the crash" in capfd.readouterr().err


WORKER_ONLY = textwrap.dedent('''
    import os, signal, sys, time

    if sys.argv[0].endswith("worker.py"):        # only in the reward worker's process, not when rlflow imports it
        {action}


    def f(completions, **kw):
        return [0.0] * len(completions)
''')


@pytest.mark.parametrize("action,expected", [
    ("os.kill(os.getpid(), signal.SIGKILL)", "it ended (killed by SIGKILL) as it imported the functions"),
    ("sys.exit(3)", "SystemExit: 3 (worker_only.py:5)"),
    ("os._exit(3)", "ExitRefused: os._exit(3) refused"),
    ("time.sleep(3600)", "reward.functions[0].fn: module 'worker_only' did not finish importing in 1 s (it waits "
                         "or loops when imported"),
], ids=["killed", "sys.exit", "os._exit", "hangs"])
def test_a_module_that_fails_only_in_the_worker_is_one_line_before_the_run(tmp_path, monkeypatch, action, expected):
    """Preflight starts the worker (flows/preflight.py): a module that imports in rlflow's process but not in
    the worker's is a UserError naming reward.functions, before anything is written."""
    from tasks.scoring.functions import start_worker

    (tmp_path / "worker_only.py").write_text(WORKER_ONLY.format(action=action))
    monkeypatch.chdir(tmp_path)
    if "sleep" in action:                      # (only where it hangs: the others must not race a short limit)
        monkeypatch.setenv("RLFLOW_IMPORT_SECONDS", "1")
    functions = load_functions(load_config(TINY, ['reward.functions=[{"fn": "worker_only:f"}]']))
    with pytest.raises(UserError) as e:
        start_worker(functions)
    assert str(e.value).startswith("reward.functions[0].fn: module 'worker_only' did not finish importing" if "sleep"
                                   in action else "reward.functions: the reward worker could not set up: ")
    assert expected in str(e.value)


def test_a_function_that_edits_its_arguments_in_place_changes_nothing_the_others_see(bad_module):
    """Each function gets lists of its own: one that clears `completions` (or a column) is scored for the
    completions it was given, and the next function still sees them all."""
    scored = score_records(_functions(["clears", "good"]), _records(), "sum")
    assert scored.scores == {"clears": [0.5] * 4, "good": [0.0, 1.0, 0.0, 1.0]} and not scored.errors


def test_threads_scoring_at_once_each_get_their_own_batchs_scores(bad_module):
    """run.max_staleness > 0 scores on two threads at once (the reward stage of iteration N+1, the evaluation of
    N): each caller gets its own batch's scores (a worker answers one caller at a time), never another's."""
    from concurrent.futures import ThreadPoolExecutor

    functions = _functions(["slow_lengths"])

    def batch(k: int) -> list[Rollout]:
        return [Rollout(group=0, row=j, prompt="a=", prompt_ids=[1], completion="x" * (10 * k + j),
                        completion_ids=[1], logprobs=[0.0], truncated=False, columns={}) for j in range(1, 4)]

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda k: score_records(functions, batch(k), "sum").scores["slow_lengths"], range(12)))
    assert got == [[10.0 * k + j for j in range(1, 4)] for k in range(12)]


def test_a_worker_outlives_the_thread_that_started_it(bad_module):
    """A worker asks to die with its parent, which Linux takes to be the thread that started it: workers are
    started from one thread that lasts, so a worker a finished thread used (a streamed run's scorer, a look-ahead
    lane) still serves the next caller instead of dying under it."""
    import threading

    from tasks.scoring import functions as module

    functions = _functions(["good"])
    t = threading.Thread(target=score_records, args=(functions, _records(), "sum"))
    t.start()
    t.join()
    time.sleep(1.0)                      # (a parent-death signal, had it been sent, has arrived)
    idle = module._idle[module._key(functions)]
    assert len(idle) == 1 and idle[0].alive()
    scored = score_records(functions, _records(), "sum")
    assert scored.errors == {} and scored.scores["good"] == [0.0, 1.0, 0.0, 1.0]


def test_idle_workers_are_bounded_the_least_recently_used_killed_first(bad_module, monkeypatch):
    """A process that scores with many sets of functions (a study's trials, the tests) keeps at most MAX_IDLE idle
    workers: the set used least recently loses its worker (the process ends), the others keep theirs and still
    score; a set whose worker went gets a new one."""
    from tasks.scoring import functions as module

    monkeypatch.setattr(module, "MAX_IDLE", 2)
    sets = [_functions(names) for names in (["good"], ["clears"], ["good", "clears"])]
    workers = []
    for functions in sets:
        assert not score_records(functions, _records(), "sum").errors
        workers.append(module._idle[module._key(functions)][-1])
    assert sum(map(len, module._idle.values())) <= 2
    assert module._key(sets[0]) not in module._idle and workers[0].ended(wait=5.0) != "running"
    assert workers[1].alive() and workers[2].alive()
    assert score_records(sets[1], _records(), "sum").scores["clears"] == [0.5] * 4
    assert module._idle[module._key(sets[1])] == [workers[1]]          # (the same process served it)
    assert not score_records(sets[0], _records(), "sum").errors         # (a new worker)
    assert workers[2].ended(wait=5.0) != "running"                      # (now the least recent)


@pytest.mark.parametrize("bad", ["hangs", "spins"])
def test_a_hanging_function_is_killed_at_its_timeout(bad_module, bad):
    functions = _functions([bad, "good"], timeout_seconds=2)
    scored = score_records(functions, _records(), "sum")
    assert scored.errors[bad] == f"reward function {bad!r} timed out after 2s (killed)"
    assert scored.scores[bad] == [None] * 4 and scored.scores["good"] == [0.0, 1.0, 0.0, 1.0]


def test_nan_makes_only_that_completion_missing(bad_module):
    scored = score_records(_functions(["nan_one"]), records := _records(), "sum")
    assert scored.scores["nan_one"] == [None, 0.5, 0.5, 0.5] and scored.nan == {"nan_one": 1}
    assert records[0].reward is None and records[1].reward == 0.5


@pytest.mark.parametrize("bad,expected", [
    ("raises", "reward function 'raises' raised ValueError: cannot parse the answer (bad_rewards.py:8)"),
    ("short", "reward function 'short' returned 3 scores for 4 completions"),
    ("nan_one", "reward function 'nan_one' returned nan for completion 0"),
    ("hangs", "reward function 'hangs' timed out after 1s (killed)"),
])
def test_strict_fails_with_the_message(bad_module, bad, expected):
    with pytest.raises(RewardFunctionError) as e:
        score_records(_functions([bad], strict="true", timeout_seconds=1 if bad == "hangs" else 60), _records(),
                      "sum")                 # (a short clock only where it is what is tested: a loaded machine)
    assert str(e.value) == expected and isinstance(e.value, UserError)


def test_a_score_past_float32s_range_is_missing_and_a_sum_past_it_stays_finite(bad_module):
    """1e39 is made missing as NaN is (it crashed the stage: a float32 tensor cannot hold it); 3e38 weighted by 2
    is summed in float64, and the group's advantages (computed in float64) are finite."""
    from tasks.algorithms.learners.registry import make
    from tasks.engines.training import episode_signal

    scored = score_records(_functions(["huge_one"]), records := _records(), "sum")
    assert scored.scores["huge_one"] == [None, 0.5, 0.5, 0.5] and scored.nan == {"huge_one": 1}
    fns = json.dumps([{"fn": "bad_rewards:near_the_top", "weight": 2.0}])
    cfg = load_config(TINY, [f"reward.functions={fns}", "generate.num_generations=2"])
    score_records(load_functions(cfg), records := _records(), "sum")
    assert [r.reward for r in records] == [0.0, 6e38, 0.0, 6e38]
    signal = episode_signal(make(cfg, 1), records)
    assert bool(torch.isfinite(signal).all()) and signal[1] > 0 > signal[0]


def test_an_async_function_keeps_its_event_loop_across_calls(bad_module):
    """A semaphore made in the first call is bound to that call's loop: a loop per call failed every later one."""
    functions = _functions(["limited"])
    for _ in range(3):
        scored = score_records(functions, _records(), "sum")
        assert scored.errors == {} and scored.scores["limited"] == [1.0] * 4


def test_a_function_that_changes_the_working_directory_changes_it_for_no_other(bad_module):
    scored = score_records(_functions(["wanders", "reads_here"]), _records(), "sum")
    assert scored.errors == {} and scored.scores["reads_here"] == [1.0] * 4


def test_a_module_that_changes_the_working_directory_when_imported_leaves_rlflows(tmp_path, monkeypatch):
    (tmp_path / "wanders_away.py").write_text(
        "import os\nos.chdir('/')\n\ndef f(completions, **kw):\n"
        "    return [float(os.path.exists('wanders_away.py'))] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    functions = load_functions(load_config(TINY, ['reward.functions=[{"fn": "wanders_away:f"}]']))
    assert os.getcwd() == str(tmp_path)
    assert score_records(functions, _records(), "sum").scores["f"] == [1.0] * 4


def test_log_metric_names_mlflow_refuses_or_rlflow_owns_are_logged_under_names_that_stay_theirs():
    from mlflow.utils.validation import _validate_metric_name

    from tasks.core.tracking import metric_key
    from tasks.reward import logged_metrics

    for name in ("pass@1", "a//b", "../up", "./", "", "x" * 300, "x" * 249 + "/.y", "é ok:1"):
        _validate_metric_name(metric_key(name))
    assert metric_key("pass@1") == "pass_1" and metric_key("reward/accuracy") == "reward/accuracy"
    own = {"reward/mean": 0.5, "reward/std": 0.1}
    assert logged_metrics({"mean": 123.0, "pass@1": 0.25}, own) == {"reward/log_metric/mean": 123.0,
                                                                     "reward/pass_1": 0.25}


def test_log_extra_and_log_metric_reach_the_records(bad_module):
    records = _records()
    scored = score_records(_functions(["logs"]), records, "sum")
    assert [r.extra["why"] for r in records] == ["len 1", "len 3", "len 1", "len 3"]
    assert scored.metrics == {"checked": 4.0}


def test_a_metric_logged_as_nan_or_inf_is_logged_as_such(bad_module):
    """log_metric(name, nan) was dropped without a word (the metric missing from MLflow, as if never logged);
    TRL logs what it is given: NaN and inf stay what they are."""
    import math

    m = score_records(_functions(["logs_nan"]), _records(), "sum").metrics
    assert set(m) == {"ratio", "peak", "fine"} and math.isnan(m["ratio"]) and m["peak"] == math.inf
    assert m["fine"] == 0.5


def test_function_kwargs_from_config(bad_module):
    fns = json.dumps([{"fn": "bad_rewards:scaled", "kwargs": {"factor": 0.25}}])
    functions = load_functions(load_config(TINY, [f"reward.functions={fns}"]))
    assert score_records(functions, _records(), "sum").scores["scaled"] == [0.25] * 4


@pytest.mark.slow
def test_a_run_with_a_failing_function_completes_and_counts_it(prefect_api, tmp_path):
    """Non-strict (the default): the iteration goes on with the good function's scores; MLflow counts the
    error. Strict: one line, exit 2 (tests/test_bad_input.py)."""
    (tmp_path / "bad_rewards.py").write_text(BAD)
    fns = json.dumps([{"fn": "tasks.rewards.demo:successor_reward"}, {"fn": "bad_rewards:raises"}])
    out = run_cli(["run", str(TINY), "-o", "run.iterations=2", "-o", f"reward.functions={fns}",
                   "--summary-json", "s.json"], tmp_path, prefect_api)
    assert out.returncode == 0, out.stderr[-2000:]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = json.loads((tmp_path / "s.json").read_text())["mlflow_run_id"]
    errors = client.get_metric_history(run_id, "reward/raises/errors")
    assert sorted(m.step for m in errors) == [1, 2] and all(m.value == 1.0 for m in errors)
    assert len(client.get_metric_history(run_id, "reward/successor_reward/mean")) == 2
    assert client.get_metric_history(run_id, "reward/raises/mean") == []    # (scored nothing: no mean, not 0)


FLAKY = textwrap.dedent('''
    import os

    from tasks.rewards.demo import successor_reward


    def flaky(completions, answer, trainer_state, **kw):
        """The demo's reward, but failing in the iterations FAIL_AT names (1-based)."""
        if trainer_state.global_step + 1 in [int(i) for i in os.environ["FAIL_AT"].split(",")]:
            raise ConnectionError("the grader's service is away")
        return successor_reward(completions, answer)
''')


@pytest.mark.parametrize("fail_at, rc", [("2", 0), ("2,3", 2)], ids=["once", "twice in a row"])
def test_an_iteration_whose_every_reward_call_fails_takes_no_step_once(prefect_api, tmp_path, monkeypatch, fail_at,
                                                                      rc):
    """Not strict: an iteration where the only function fails (a passing fault, after an iteration it scored)
    trains on nothing: no optimiser step, its policy the one before, one warning; the run goes on. A second such
    iteration in a row stops the run (exit 2) as a first iteration's does. Its mean reward is no number (NaN in
    MLflow, "n/a" on the console, null in the summary): it was logged as 0.0, a collapse that never happened."""
    import math

    import mlflow
    from safetensors.torch import load_file

    (tmp_path / "flaky_rewards.py").write_text(FLAKY)
    monkeypatch.setenv("FAIL_AT", fail_at)
    out = run_cli(["run", str(TINY), "-o", "run.iterations=3", "-o", 'reward.functions=[{"fn": "flaky_rewards:flaky"}]',
                   "--summary-json", "s.json"], tmp_path, prefect_api)
    assert out.returncode == rc, out.stderr[-2000:]
    warned = [line for line in out.stderr.splitlines() if line.startswith("warning: reward: every reward call")]
    assert warned == ["warning: reward: every reward call of iteration 2 failed, no completion was scored (nothing "
                      "to train on); the first: reward function 'flaky' raised ConnectionError: the grader's service "
                      "is away (flaky_rewards.py:10); iteration 2 takes no training step (its policy is the one "
                      "before, published again) and the run goes on: the previous iteration was scored; a second "
                      "such iteration in a row stops it"]
    policy = tmp_path / "rlflow-store" / "tiny-demo" / "policy"
    v1, v2 = (load_file(next((policy / v).glob("*.safetensors"))) for v in ("v000001", "v000002"))
    assert v1.keys() == v2.keys() and all(torch.equal(v1[k], v2[k]) for k in v1)
    if rc:
        assert out.stderr.strip().splitlines()[-1].startswith("error: reward: every reward call of iteration 3 "
                                                               "failed"), out.stderr[-2000:]
        return
    v3 = load_file(next((policy / "v000003").glob("*.safetensors")))
    assert any(not torch.equal(v2[k], v3[k]) for k in v2)           # iteration 3 was scored and trained
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = json.loads((tmp_path / "s.json").read_text())["mlflow_run_id"]
    assert [m.value for m in sorted(client.get_metric_history(run_id, "train/skipped"), key=lambda m: m.step)] == \
        [0.0, 1.0, 0.0]
    for key in ("reward/mean", "reward/std", "train/reward_mean"):
        values = [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
        assert len(values) == 3 and math.isnan(values[1]) and not any(map(math.isnan, values[::2])), (key, values)
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["reward_mean"][1] is None and None not in summary["reward_mean"][::2]
    assert any(line.startswith("iter    2/3  reward   n/a  loss") for line in out.stdout.splitlines()), out.stdout
    assert f"mean reward {summary['reward_mean'][0]:.3f} -> {summary['reward_mean'][2]:.3f}" in out.stdout


@pytest.mark.parametrize("completion,reference,expected", [
    ("so it is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("I get \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("The answer is \\boxed{72}", "Natalia sold 48/2 = 24 clips in May. ... #### 72", 1.0),
    ("so 72 dollars", "#### 72", 1.0),
    ("\\boxed{1,234}", "1234", 1.0),
    ("\\boxed{71}", "#### 72", 0.0),
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
    ("no answer here", "3", 0.0),
    ("\\boxed{3}", "", None),
])
def test_math_answer_reward(completion, reference, expected):
    assert math_answer_reward([completion], answer=[reference]) == [expected]


def test_math_answer_reward_solution_column():
    assert math_answer_reward(["\\boxed{\\frac{3}{4}}", "\\boxed{0.7}"],
                              solution=["Thus the probability is $\\boxed{\\dfrac34}$."] * 2) == [1.0, 0.0]


def test_the_first_failure_of_each_function_is_on_the_console(bad_module, capsys, monkeypatch):
    """Not only a metric: the function, the exception and the line of the user's code, once per function."""
    import tasks.scoring.functions as scoring

    monkeypatch.setattr(scoring, "_shown", set())
    for _ in range(2):
        score_records(_functions(["raises", "good"]), _records(), "sum")
    err = capsys.readouterr().err
    assert err.count("warning: reward function 'raises' raised ValueError: cannot parse the answer "
                     "(bad_rewards.py:8); its scores for this batch are missing") == 1


def test_a_functions_log_extra_columns_cannot_replace_the_samples_own():
    """log_extra("reward", ...) and log_extra("prompt", ...) replaced the samples table's own columns."""
    from tasks.core.config import load_config
    from tasks.reward import _samples

    records = _records(2)
    for r in records:
        r.reward, r.rewards, r.extra = 0.5, {"good": 0.5}, {"reward": "FAKE", "prompt": "FAKE", "note": "kept"}
    rows = _samples(load_config(TINY), records)
    assert [(row["prompt"], row["reward"], row["reward/good"], row["note"]) for row in rows] == [("a=", 0.5, 0.5,
                                                                                                   "kept")] * 2


def test_a_budgets_limit_is_read_once_a_budget():
    """The limit is read at a budget's first write and holds until it is renewed: output counted under one limit
    (an idle worker's, under the default) is not judged by another read later (a test's smaller one: the bounded
    test above once saw two lines, one of them another worker's)."""
    from tasks.core.process_wide import OutputBudget

    limit = [4000]
    budget = OutputBudget(lambda: limit[0])
    assert budget.take(3000) == (3000, None)
    limit[0] = 1000
    assert budget.take(500) == (500, None)
    budget.renew()
    assert budget.take(3000) == (1000, 1000) and budget.take(10) == (0, None)


def test_log_metric_names_that_come_out_alike_stay_apart_within_mlflows_length():
    """"pass@1" and "pass#1" both make reward/pass_1, two long names alike in their first 250 characters one key:
    the second one logged replaced the first, unsaid; and reward/ went before a name already cut to 250, which
    MLflow refuses (its keys hold 250)."""
    from tasks.reward import logged_metrics

    own = {"reward/mean": 0.5}
    assert logged_metrics({"pass@1": 1.0, "pass#1": 2.0, "mean": 3.0, "log_metric/mean": 4.0}, own) == {
        "reward/pass_1": 1.0, "reward/pass_1-2": 2.0, "reward/log_metric/mean": 3.0, "reward/log_metric/mean-2": 4.0}
    long = logged_metrics({"x" * 300 + "a": 1.0, "x" * 300 + "b": 2.0, "x" * 300 + "c": 3.0}, own)
    assert sorted(long.values()) == [1.0, 2.0, 3.0] and all(len(k) <= 250 for k in long)


def test_a_log_extra_column_of_another_length_is_said_and_a_long_value_is_cut(tmp_path, monkeypatch, capfd):
    """A column without one value per completion is left out (TRL's table fails on it) and now said, once; a
    value of 100 KB is kept as its JSON text cut to 64 KB (the records and the samples table stay small)."""
    (tmp_path / "odd_logs.py").write_text(
        "def f(completions, log_extra, **kw):\n"
        "    log_extra('short', [1, 2, 3])\n"
        "    log_extra('long', ['y' * 100_000] + ['z'] * (len(completions) - 1))\n"
        "    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    functions = load_functions(load_config(TINY, ['reward.functions=[{"fn": "odd_logs:f"}]']))
    records = _records()
    score_records(functions, records, "sum")
    score_records(functions, _records(), "sum")
    err = capfd.readouterr().err
    assert err.count("reward function 'f' logged 3 values in log_extra('short') for 4 completions; the column "
                     "is left out") == 1, err
    assert all("short" not in r.extra for r in records) and [r.extra["long"] for r in records[1:]] == ["z"] * 3
    long = records[0].extra["long"]
    assert long.startswith('"yyy') and long.endswith("(cut: 100002 characters as JSON, log_extra keeps 65536)")
    assert len(long) < 66_000


def test_a_killed_workers_output_pipe_is_closed_by_its_copier_alone(bad_module):
    """Killing a worker closed the pipe its output copier was waiting on, and the copier went on with the number:
    the next pipe opened (a new worker's stdout or stderr) got it, the old copier read from it, and the new
    worker's "ready" went to the console (its set-up timed out after 120 s) or a flood was said twice (CI,
    2026-12-06). The copier closes its pipe itself, once it has read the end."""
    from tasks.scoring.functions import _take

    worker = _take(_functions(["good"]))
    copy = worker.output
    worker.kill()
    with copy._lock:
        assert not copy._pipe.closed or copy._closed      # (only the copier closes it, and says so under its lock)
    copy.wait(30)
    assert copy._pipe.closed and not copy._thread.is_alive()
    assert score_records(_functions(["good"]), _records(), "sum").scores["good"]
