"""Failures that are not the user's (issue 44, items 12 and 13): a stage whose every episode timed out is an
infrastructure fault (EnvironmentsStalled: retried, the environment server started again first), not a user
error; one whose environment's own code raised every time is the user's (one line, exit 2). An evaluation whose
every episode or reward call fails stops the run the same way, and records no held-out score of 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tasks.core import layout, rollout
from tasks.core.config import load_config
from tasks.core.errors import UserError
from tasks.core.processes import alive
from tasks.core.store import open_store
from tests.conftest import ROOT, TINY

LETTERS = ROOT / "configs" / "letters.yaml"


def _cfg(tmp_path, *more: str):
    return load_config(LETTERS, [f"store.uri={tmp_path}/store", "env.isolation=thread", "env.timeout_seconds=1",
                                 "generate.prompts_per_iteration=2", "generate.num_generations=2", *more])


def test_every_episode_timing_out_is_an_infrastructure_fault(tmp_path):
    from tasks.envs.runtime.episodes import EnvironmentsStalled
    from tasks.generate import generate

    cfg = _cfg(tmp_path, "env.factory=tests.env_classes:Stalls")
    with pytest.raises(EnvironmentsStalled, match=r"^every episode of iteration 1 timed out \(4 of 4\): the "
                                                  r"environment does not answer within env.timeout_seconds \(1 s\)"):
        generate(cfg, 1, layout.BASE)
    assert not isinstance(EnvironmentsStalled("x"), UserError)
    assert open_store(cfg).manifest(layout.rollouts(cfg.run.name, 1)) is None


def test_a_stage_stalled_at_every_retry_ends_the_run_with_one_line(tmp_path, prefect_api, monkeypatch):
    """Retried as an infrastructure fault, and stalled at each try: `rlflow run` ends with one line saying so and
    how to resume, exit 1 (was an 83-line traceback)."""
    from tests.conftest import run_cli

    monkeypatch.setenv("PYTHONPATH", str(ROOT))          # (tests.env_classes)
    out = run_cli(["run", str(LETTERS), "-o", "run.iterations=1", "-o", "env.factory=tests.env_classes:Stalls",
                   "-o", "env.isolation=thread", "-o", "env.timeout_seconds=1", "-o", "launcher.retries=1", "-o",
                   "launcher.retry_backoff_seconds=0", "-o", "generate.prompts_per_iteration=2", "-o",
                   "generate.num_generations=2"], tmp_path, prefect_api)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: every episode of iteration 1 timed out (4 of 4): the environment does not answer within "
        "env.timeout_seconds (1 s); the first: "), out.stderr[-3000:]
    assert out.stderr.strip().endswith("retried as launcher.retries (1) says and failed each time (the flow's log "
                                       "holds the details): run the same command to resume")


def test_every_episode_raising_is_the_users_mistake(tmp_path):
    from tasks.generate import generate

    cfg = _cfg(tmp_path, "env.factory=tests.env_classes:Flaky", 'env.kwargs={mode: raise}')
    with pytest.raises(UserError, match=r"^env.factory: every episode of iteration 1 failed \(4 of 4\), nothing to "
                                        r"train on; the first: step raised ValueError: step blew up"):
        generate(cfg, 1, layout.BASE)


@pytest.mark.parametrize(("isolation", "mode", "first"), [
    ("thread", "sys_exit", "step raised SystemExit: 0"), ("process", "sys_exit", "step raised SystemExit: 0"),
    ("thread", "exit", r"step raised ExitRefused: os._exit\(3\) refused: this code runs in rlflow's own process"),
    ("process", "exit", r"step: the environment's process died \(exit 3\)")])
def test_an_environment_that_calls_sys_exit_fails_its_episode_not_the_stage(tmp_path, isolation, mode, first):
    """sys.exit() or os._exit() in a step, in a thread of the stage: that episode's failure, as in a process of its
    own (was: the SystemExit reached the CLI, which exited 0 having done nothing; os._exit ended the run's process
    with the code it chose, 0 read as success)."""
    from tasks.generate import generate

    cfg = _cfg(tmp_path, "env.factory=tests.env_classes:Flaky", f"env.kwargs={{mode: {mode}}}",
               f"env.isolation={isolation}", "env.timeout_seconds=30")
    with pytest.raises(UserError, match=r"^env.factory: every episode of iteration 1 failed \(4 of 4\), nothing to "
                                        r"train on; the first: " + first):
        generate(cfg, 1, layout.BASE)


@pytest.mark.parametrize("isolation,mode", [("thread", "chatty"), ("process", "chatty"), ("process", "chatty_fd")])
def test_what_an_environment_prints_is_bounded_and_its_episodes_go_on(tmp_path, capfd, monkeypatch, isolation,
                                                                      mode):
    """An environment that prints 8M characters a step: every episode completes, and what reaches the stage's
    output is bounded, said once per budget (was: all of it, on the run's console and log): in the stage's
    threads one budget; an episode's own process has one of its own, for everything it writes (print, os.write,
    the processes it starts: before 2026-12-04 only print was bounded there), copied by the stage from a pipe."""
    from tasks.generate import generate

    limit = 100_000
    monkeypatch.setenv("RLFLOW_USER_OUTPUT_BYTES", str(limit))
    cfg = _cfg(tmp_path, "env.factory=tests.env_classes:Flaky", f"env.kwargs={{mode: {mode}}}",
               f"env.isolation={isolation}", "env.timeout_seconds=60")
    generate(cfg, 1, layout.BASE)
    records = [r for r in rollout.load(open_store(cfg), layout.rollouts(cfg.run.name, 1)) if not r.part]
    assert len(records) == 4 and not [r.env_error for r in records if r.env_error]
    out, err = capfd.readouterr()
    said = (out + err).count("[rlflow: a user's code printed more than")
    printed = sum(len(line) for line in (out + err).splitlines() if line and set(line) <= {"x", "e"})
    budgets = 1 if isolation == "thread" else 4          # (4 episodes, each a process of its own)
    assert budgets * (limit - 1000) < printed <= budgets * limit, printed
    assert said == budgets, said


def test_rlflow_still_exits_where_a_users_code_runs_and_its_own_captures_are_whole():
    """rlflow's own exit (a second Ctrl-C's handler runs on the main thread, maybe inside a user's import) is never
    refused; a coroutine's executor thread is marked; a StringIO a user's code collects output in is not capped."""
    script = ("import asyncio, io, os, contextlib\n"
              "from tasks.core.process_wide import user_code, exit_now, ExitRefused\n"
              "from tasks.envs.runtime.loops import users_loop\n"
              "loop = users_loop()\n"
              "try:\n    loop.run_until_complete(asyncio.to_thread(lambda: os._exit(9)))\n"
              "except ExitRefused:\n    print('executor: refused')\n"
              "with user_code():\n"
              "    buf = io.StringIO()\n"
              "    with contextlib.redirect_stdout(buf):\n        print('y' * 300_000)\n"
              "    print('captured', buf.getvalue().count('y'))\n"
              "    exit_now(5)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "RLFLOW_USER_OUTPUT_BYTES": "1000"})
    assert out.returncode == 5, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["executor: refused", "captured 300000"], out.stdout[-2000:]


def test_os_exit_in_a_users_module_or_factory_is_one_line_and_a_fork_of_it_still_exits(tmp_path, monkeypatch):
    """os._exit in code rlflow runs in its own process (a module it imports, an environment made for the check
    before the run): one line naming the field, the process goes on. A child that code forks ends by os._exit as
    it always did (the refusal is for the process that marked the thread, not its forks)."""
    from tasks.core.paths import import_user
    from tasks.core.process_wide import user_code
    from tasks.envs.runtime.protocol import check_environment
    from tests.conftest import user_module

    user_module(tmp_path, monkeypatch, "exits_when_imported", "import os\nos._exit(0)\n")
    with pytest.raises(UserError, match=r"^reward.functions: cannot import module 'exits_when_imported': "
                                        r"ExitRefused: os._exit\(0\) refused"):
        import_user("exits_when_imported:f", "reward.functions")
    user_module(tmp_path, monkeypatch, "exits_in_reset", (
        "import os\n\n\nclass Env:\n    def reset(self, row):\n        os._exit(0)\n\n"
        "    def step(self, message):\n        return None\n"))
    with pytest.raises(UserError, match=r"^env.factory: exits_in_reset:Env: os._exit\(0\) refused"):
        check_environment(_cfg(tmp_path, "env.factory=exits_in_reset:Env"), {"prompt": "p"})
    user_module(tmp_path, monkeypatch, "exits_when_made", (
        "import os\n\n\nclass Env:\n    def __init__(self):\n        os._exit(0)\n\n"
        "    def reset(self, row):\n        return []\n\n    def step(self, message):\n        return None\n"))
    cfg = _cfg(tmp_path, "env.factory=exits_when_made:Env")
    with pytest.raises(UserError, match=r"^env.factory: exits_when_made:Env: os._exit\(0\) refused"):
        check_environment(cfg, {"prompt": "p"})
    with user_code():
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(7)         # (in the child: exits, as a fork's child must)
            finally:
                os.kill(os.getpid(), signal.SIGKILL)     # (never pytest's code on in a fork)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7


def test_an_environment_that_kills_its_process_group_ends_only_its_own_episode(tmp_path):
    """env.isolation: process: a step that forks and then kills its process group ends its episode and the
    process it forked, not the stage (was: the run's group, SIGTERM: the run stopped; and an episode's forked
    children were left running after it)."""
    from tasks.generate import generate

    pids = tmp_path / "forked"
    cfg = _cfg(tmp_path, "env.factory=tests.env_classes:Flaky", f'env.kwargs={{mode: killpg, pids: "{pids}"}}',
               "env.isolation=process", "env.timeout_seconds=30")
    with pytest.raises(UserError, match=r"^env.factory: every episode of iteration 1 failed \(4 of 4\), nothing to "
                                        r"train on; the first: step: the environment's process died \(killed by "
                                        r"SIGTERM\)"):
        generate(cfg, 1, layout.BASE)
    forked = pids.read_text().split()     # (a fork killed with its group before it wrote its pid is not here)
    deadline = time.monotonic() + 120          # (a SIGKILL is delivered after killpg returns: gone soon after)
    while [p for p in forked if alive(int(p))] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert forked and not [p for p in forked if alive(int(p))], [_stat(p) for p in forked]


def _stat(pid: str) -> str:
    try:
        return open(f"/proc/{pid}/stat").read()
    except OSError:
        return f"{pid} gone"


def test_an_agent_that_calls_sys_exit_fails_its_episode_and_the_loop_goes_on(tmp_path, monkeypatch):
    """sys.exit() in an `async def` agent on the shared event loop (env.isolation: thread): its episode fails, the
    others run (was: the loop's thread ended, every later agent timed out)."""
    from tasks.generate import generate
    from tests.conftest import user_module

    user_module(tmp_path, monkeypatch, "exiting_agent", (
        "import sys\nfrom openai import AsyncOpenAI\n\nSTARTED = []\n\n\n"
        "async def agent(row, base_url, api_key):\n"
        "    STARTED.append(1)\n"
        "    if len(STARTED) == 1:\n"
        "        sys.exit(0)\n"
        "    client = AsyncOpenAI(base_url=base_url, api_key=api_key)\n"
        "    await client.chat.completions.create(model='policy', messages=[{'role': 'user', 'content': 'hi'}])\n"
        "    return 1.0\n"))
    cfg = load_config(ROOT / "configs" / "agent.yaml", [
        f"store.uri={tmp_path}/store", "env.agent=exiting_agent:agent", "env.isolation=thread",
        "env.timeout_seconds=60", "generate.prompts_per_iteration=4", "generate.num_generations=2"])
    generate(cfg, 1, layout.BASE)
    from tasks.core import rollout

    records = [r for r in rollout.load(open_store(cfg), layout.rollouts(cfg.run.name, 1)) if not r.part]
    errors = [r.env_error for r in records if r.env_error]
    assert errors == ["agent raised SystemExit: 0"], errors
    assert len(errors) < len(records)             # the others ran on the same loop


def test_an_evaluation_whose_every_call_fails_records_no_score(tmp_path, monkeypatch):
    from tasks.evaluate import evaluate
    from tests.conftest import user_module

    user_module(tmp_path, monkeypatch, "broken_reward", "def boom(completions, **kw):\n    raise ValueError('no')\n")
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", 'reward.functions=[{"fn": "broken_reward:boom"}]',
                             "eval.every=1"])
    with pytest.raises(UserError, match=r"^reward: every reward call of the evaluation of v000000 failed, no "
                                        r"completion was scored \(nothing to evaluate\); the first: reward function "
                                        r"'boom' raised ValueError: no"):
        evaluate(cfg, 0)
    assert open_store(cfg).manifest(layout.evaluation(cfg.run.name, 0)) is None
    stalled = _cfg(tmp_path, "env.factory=tests.env_classes:Stalls", "eval.every=1", "eval.max_prompts=2",
                   "eval.num_generations=1", "eval.k=1", "eval.split=train")
    from tasks.envs.runtime.episodes import EnvironmentsStalled

    with pytest.raises(EnvironmentsStalled, match=r"^every episode of the evaluation of v000000 timed out"):
        evaluate(stalled, 0)


@pytest.mark.slow
def test_a_stalled_environment_server_is_started_again_before_the_retry(tmp_path, monkeypatch):
    """The flow marks the server after a stalled stage; its next check starts it again (a new process)."""
    from flows.services import EnvServer
    from tasks.core.daemon import answers_http
    from tasks.envs.runtime.server import TOKEN_VAR, URL_VAR

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    for var in (URL_VAR, TOKEN_VAR):
        monkeypatch.delenv(var, raising=False)
    overrides = ["env.where=local", "env.isolation=thread"]
    server = EnvServer(load_config(LETTERS, overrides), str(LETTERS), overrides, None)
    said = []
    try:
        server.services(said.append)
        first = server.proc.pid
        server.stalled = True
        server.services(said.append)
        # (answers with a long timeout: on a loaded machine a new server's first /health may take > 10 s)
        assert server.proc.pid != first and answers_http(f"{server.url}/health", timeout=120)
        assert any("every episode of the last stage timed out" in line for line in said), said
    finally:
        server.stop()


def test_a_full_disk_is_one_line_never_retried_and_crosses_a_process():
    """ENOSPC (or a quota) anywhere in an exception's chain is a DiskFull naming the file; the retry condition
    refuses it (the same disk is as full a second later); a stage process's `RLFLOW_DISK_FULL:` line comes back
    through `stream` as the message its parent raises."""
    import errno
    import sys
    from types import SimpleNamespace

    from flows.repair import retryable
    from tasks.core.errors import DiskFull, disk_full, disk_full_line
    from tasks.core.processes import stream

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/tmp/a", None, "/data/store/.ckpt.partial/x")
        except OSError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as e:
        full = disk_full(e)
    assert str(full).startswith("no space left on device writing /data/store/.ckpt.partial/x: free space there")
    assert "quota" in str(disk_full(OSError(errno.EDQUOT, "Disk quota exceeded")))
    assert disk_full(OSError(errno.EACCES, "Permission denied", "/x")) is None
    assert disk_full(ValueError("No space left on device")) is None       # the errno decides, not the words
    for exc, again in ((OSError(errno.ENOSPC, "full"), False), (full, False), (OSError(errno.EIO, "io"), True)):
        assert retryable(None, None, SimpleNamespace(data=exc)) is again
    line = disk_full_line(DiskFull("no space left on device writing /d/x: free space there"))
    ran = stream([sys.executable, "-c", f"import sys; print('log line'); print({line!r}, file=sys.stderr); "
                  f"sys.exit({DiskFull.exit_code})"], env={}, sink=lambda _: None, rlflow=False)
    assert (ran.code, ran.disk_full) == (4, "no space left on device writing /d/x: free space there")


def _small_tmpfs(path, size: str) -> bool:
    import subprocess

    path.mkdir(exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_disk_that_fills_mid_run_stops_it_with_one_line_and_the_run_resumes(tmp_path, prefect_api):
    """A store on a 3 MB filesystem fills at iteration 5 of the tiny run: `rlflow run` ends with one line naming
    the file it could not write (no traceback, no retries: exit 1) and nothing partial is left visible; with room
    made, the same command resumes from iteration 5 and finishes."""
    import subprocess

    from tests.conftest import run_cli

    disk = tmp_path / "disk"
    if not _small_tmpfs(disk, "3m"):
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        args = ["run", str(TINY), "-o", f"store.uri=file://{disk}/store", "-o", "run.iterations=8",
                "-o", "launcher.retries=3"]
        full = run_cli(args, tmp_path, prefect_api)
        assert full.returncode == 1, full.stderr[-3000:]
        said = [line for line in full.stderr.splitlines() if line.startswith("error:")]
        assert len(said) == 1 and said[0].startswith(f"error: no space left on device writing {disk}/store/"), \
            full.stderr[-3000:]
        assert "Traceback" not in full.stderr and "restored the state" not in full.stderr + full.stdout
        store = open_store(load_config(TINY, [f"store.uri=file://{disk}/store"]))
        done = layout.version_of(store.get_pointer(layout.latest("tiny-demo", "policy")))
        assert 1 <= done < 8
        assert not list(disk.glob("store/**/*.partial*"))        # the staged write that failed is gone
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        again = run_cli(args, tmp_path, prefect_api)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"resuming tiny-demo: iterations 1-{done} of 8" in again.stdout + again.stderr
        assert layout.version_of(store.get_pointer(layout.latest("tiny-demo", "policy"))) == 8
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_disk_too_full_for_mlflows_database_is_one_line(tmp_path, prefect_api):
    """The tracking database on a filesystem too small for MLflow's schema migrations: one line naming the
    database (was a 160-line alembic traceback, "table spans already exists"), exit 1, no half-made database."""
    import subprocess

    from tests.conftest import run_cli

    disk = tmp_path / "disk"
    if not _small_tmpfs(disk, "300k"):
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        out = run_cli(["run", str(TINY), "-o", "run.iterations=1", "-o", f"tracking.uri=sqlite:///{disk}/mlflow.db"],
                      tmp_path, prefect_api)
        assert out.returncode == 1, out.stderr[-3000:]
        said = [line for line in out.stderr.strip().splitlines() if not line.startswith("warning: ")]  # (the config's)
        assert said == [f"error: no space left on device writing {disk}/mlflow.db: free space there (or keep fewer "
                        f"policies: store.keep) and run the same command to resume"], out.stderr[-3000:]
        assert not list(disk.iterdir())
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_the_last_line_says_how_often_a_failing_stage_was_tried():
    """An infrastructure fault that stayed: the line says the retries launcher.retries gave it, and with
    launcher.retries: 0 that it was not retried (was "retried as launcher.retries says" with no retry)."""
    from flows.launch import InfraError
    from flows.repair import final_line

    fault = InfraError("the generate stage's process was killed (SIGKILL)")
    assert final_line(fault, 0) == ("error: the generate stage's process was killed (SIGKILL); not retried "
                                    "(launcher.retries: 0) (the flow's log holds the details): run the same "
                                    "command to resume", 1)
    assert "; retried as launcher.retries (3) says and failed each time" in final_line(fault, 3)[0]
    try:
        raise RuntimeError("the Prefect task around it") from fault
    except RuntimeError as wrapped:
        assert final_line(wrapped, 2)[0].startswith("error: the generate stage's process was killed (SIGKILL); ")
    assert final_line(ValueError("nobody foresaw this"), 1) is None


def test_a_bug_in_a_handler_of_a_users_mistake_is_reported_as_the_bug():
    """An exception raised while a UserError was being handled (its implicit context) is a new failure: no
    one-line "error: <the user's mistake>" with exit 2 hiding a traceback of rlflow's own bug, and Prefect may
    retry it. A UserError raised *from* another exception, or re-raised from a wrapper, is still the user's; a
    full disk is found behind a library's handler too (a write that failed, re-raised without `from`)."""
    import errno

    from flows.repair import final_line, retryable

    class State:
        def __init__(self, data):
            self.data = data

    def raised(make):
        try:
            make()
        except BaseException as e:  # noqa: BLE001 - the test keeps whatever was raised
            return e

    def handler_bug():
        try:
            raise UserError("data.path: expected a .jsonl file, found a folder")
        except UserError:
            {}["a key the handler forgot"]

    def wrapped():
        try:
            raise UserError("data.path: expected a .jsonl file, found a folder")
        except UserError as e:
            raise RuntimeError("the Prefect task around it") from e

    bug, user = raised(handler_bug), raised(wrapped)
    assert isinstance(bug, KeyError) and final_line(bug) is None
    assert retryable(None, None, State(bug))
    assert final_line(user) == ("error: data.path: expected a .jsonl file, found a folder", 2)
    assert not retryable(None, None, State(user))

    def library_write():
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/data/run/policy.bin")
        except OSError:
            raise RuntimeError("file write failed")  # noqa: B904 - as a library without `from` does

    line, code = final_line(raised(library_write))
    assert code == 1 and line.startswith("error: no space left on device writing /data/run/policy.bin")



def test_a_full_disk_under_the_data_files_temporary_cache_is_a_full_disk_not_the_files_fault(tmp_path,
                                                                                              monkeypatch):
    """datasets writes a local data file's table through a temporary folder: a disk that fills there is said
    as a full disk (one line, not retried, resumable), not as the data file being unreadable (exit 2)."""
    import errno

    import datasets

    from tasks.core.data import load_table
    from tasks.core.errors import DiskFull

    def fills(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/tmp/rlflow-data-x/json-train.arrow")

    monkeypatch.setattr(datasets, "load_dataset", fills)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1"}\n')
    with pytest.raises(DiskFull, match="no space left on device writing /tmp/rlflow-data-x/json-train.arrow"):
        load_table(str(tmp_path / "rows.jsonl"), None, "train")


@pytest.mark.parametrize("mode", ["daemonizes", "daemonizes_and_dies"])
def test_a_daemon_an_environment_leaves_behind_ends_with_its_episode(tmp_path, mode):
    """env.isolation: process: a step that forks twice into a session of its own (a daemon, out of the episode's
    group): the episode's process adopts it and it ends with the episode (was: it ran on after the run), and the
    episode completes (its output's pipe, which the daemon held, does not hold the stage up). Also where the
    episode's process is then SIGKILLed, so that nothing of its own ends the daemon: its keeper does (before
    2026-12-05 the daemon was init's, for good); the episodes fail, as a crash's do."""
    from tasks.core.errors import UserError
    from tasks.generate import generate

    pids = tmp_path / "daemons"
    cfg = _cfg(tmp_path, "env.factory=tests.env_classes:Flaky", f'env.kwargs={{mode: {mode}, pids: "{pids}"}}',
               "env.isolation=process", "env.timeout_seconds=60")
    if mode == "daemonizes_and_dies":
        with pytest.raises(UserError, match=r"every episode of iteration 1 failed \(4 of 4\).*the environment's "
                                            r"process died \(killed by SIGKILL\)"):
            generate(cfg, 1, layout.BASE)
    else:
        generate(cfg, 1, layout.BASE)
        records = [r for r in rollout.load(open_store(cfg), layout.rollouts(cfg.run.name, 1)) if not r.part]
        assert len(records) == 4 and not [r.env_error for r in records if r.env_error]
    daemons = pids.read_text().split()
    deadline = time.monotonic() + 120          # (a SIGKILL is delivered after killpg returns: gone soon after)
    while [p for p in daemons if alive(int(p))] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(daemons) == 4 and not [p for p in daemons if alive(int(p))], [_stat(p) for p in daemons]


def test_a_group_that_failed_is_raised_as_what_its_processes_said():
    """torchrun exits 1 whatever its processes' codes: their marker lines say whether it was the user's mistake (one
    line, exit 2), a corrupt artifact, a full disk, or something else (its last lines)."""
    from tasks.core.errors import DiskFull, UserError
    from tasks.core.processes import Streamed
    from tasks.core.stage import raise_failure
    from tasks.core.store import CorruptArtifact

    with pytest.raises(UserError, match=r"^warmup: changed$"):
        raise_failure(Streamed(1, "warmup: changed", ["a"]), "the group")
    with pytest.raises(CorruptArtifact) as e:
        raise_failure(Streamed(1, None, [], corrupt=("run/iter-000001/rewards", "changed")), "the group")
    assert e.value.key == "run/iter-000001/rewards"
    with pytest.raises(DiskFull, match="no space"):
        raise_failure(Streamed(1, None, [], disk_full="no space"), "the group")
    with pytest.raises(RuntimeError, match=r"^the group exited with 1: x \| y$"):
        raise_failure(Streamed(1, None, ["x", "", "y"]), "the group")


def test_an_environment_module_whose_thread_never_ends_does_not_keep_the_runs_output_open(prefect_api, tmp_path):
    """env.factory's module starts a thread that never ends as it is imported. The forkserver of the episodes'
    processes imports it too, and that thread kept the forkserver alive after the run had ended (ppid 1, for
    good), holding the run's stdout: `rlflow run ... | tail` waited for ever. It is killed as the run exits."""
    from tests.conftest import run_cli

    (tmp_path / "thread_at_import.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), name='user-forever').start()\n"
        "from tasks.envs.builtin.games import SayTheLetters as Env\n")
    out = run_cli(["run", str(LETTERS), "-o", "env.factory=thread_at_import:Env", "-o", "env.isolation=process", "-o",
                   "run.iterations=1", "-o", "generate.prompts_per_iteration=2", "-o", "generate.num_generations=2",
                   "-o", f"store.uri={tmp_path}/store"], tmp_path, prefect_api, timeout=300)   # (waits for its pipes)
    assert out.returncode == 0, out.stderr[-2000:]
    left = [p for p in os.listdir("/proc") if p.isdigit() and b"thread_at_import" in _cmdline(p)]
    assert not left, left


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_a_stage_process_ends_though_a_users_module_left_a_thread_running(prefect_api, tmp_path):
    """launcher.where local: each stage in a process of its own, which imports env.factory's module; a thread
    that module starts and never ends kept the generate stage's process alive after its rollouts were written, and
    the flow waited on it for good (the thread's hour here). The stage ends as `rlflow run` does, and says so."""
    from tests.conftest import run_cli

    (tmp_path / "stage_keeps_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), name='user-forever').start()\n"
        "from tasks.envs.builtin.games import SayTheLetters as Env\n")
    out = run_cli(["run", str(LETTERS), "-o", "env.factory=stage_keeps_thread:Env", "-o", "launcher.where=local",
                   "-o", "run.iterations=1", "-o", "generate.prompts_per_iteration=2", "-o",
                   "generate.num_generations=2", "-o", f"store.uri={tmp_path}/store"], tmp_path, prefect_api,
                  timeout=400)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "done: 1 iterations" in out.stdout, out.stdout[-2000:]
    left = [p for p in os.listdir("/proc") if p.isdigit() and b"stage_keeps_thread" in _cmdline(p)]
    assert not left, left


def test_a_non_daemon_thread_an_environments_reset_left_running_does_not_hold_a_command(prefect_api, tmp_path):
    """env.isolation thread: reset runs in rlflow's process and starts a thread (daemon=False) that never ends.
    Python's exit waited for it: `rlflow record` wrote its demonstrations and never returned (a finished run
    waited 60 s). Threads a user's code starts are noted as its (process_wide.USER_THREADS) and not waited for."""
    from tests.conftest import run_cli

    (tmp_path / "reset_keeps_thread.py").write_text(
        "import threading, time\nfrom tasks.envs.builtin.games import SayTheLetters\n"
        "class Env(SayTheLetters):\n    def reset(self, row):\n"
        "        threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()\n"
        "        return super().reset(row)\n")
    out = run_cli(["record", str(LETTERS), "--policy", "tasks.envs.builtin.games:reference_action", "--out",
                   str(tmp_path / "demos.jsonl"), "--rows", "0-1", "-o", "env.isolation=thread",
                   "-o", "env.factory=reset_keeps_thread:Env"], tmp_path, prefect_api, timeout=300)
    assert out.returncode == 0 and "2 demonstrations of 2 episodes" in out.stderr, out.stderr[-2000:]
