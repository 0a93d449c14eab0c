"""Resume: a run killed (SIGKILL, the whole process group) in the middle of a stage and started again ends
with exactly `run.iterations` iterations, none repeated, none skipped, and the same result as a run that was
never interrupted. The store never holds a folder that a reader accepts without a valid manifest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.core import layout
from tasks.core.processes import descendants
from tasks.core.store import MANIFEST, IncompleteArtifact, Store
from tests.conftest import AT_LENGTH, TINY, read_summary, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.drill]

GATED_REWARD = '''
import os, time
from tasks.rewards.demo import successor_reward

def gated(completions, answer, trainer_state, **kwargs):
    """Blocks in iteration 2 while the gate file exists, so the test can kill the run inside that reward stage."""
    gate = os.environ.get("GATE_FILE")
    if gate and os.path.exists(gate) and trainer_state.global_step == 1:
        open(gate + ".entered", "w").close()
        time.sleep(600)
    return successor_reward(completions, answer)
'''

ARGS = ["-o", "run.name=resume", "-o", "run.iterations=3", "-o", "generate.prompts_per_iteration=4",
        "-o", "generate.num_generations=4", "-o", 'reward.functions=[{"fn": "gated_reward:gated"}]']


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {(proc.stderr or proc.stdout).read()}")
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {path}")
        time.sleep(0.05)


def _start(cwd: Path, prefect_api: str, extra_env: dict, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_API_URL": prefect_api, **extra_env}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(TINY), *args, "--summary-json", "s.json"],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _args(staleness: int) -> list[str]:
    return [*ARGS, "-o", f"run.max_staleness={staleness}"]


@pytest.fixture(scope="module")
def uninterrupted(prefect_api, tmp_path_factory) -> Path:
    """The run of `_args(0)` that nothing stops: what every stopped and resumed run of it must equal."""
    clean = tmp_path_factory.mktemp("uninterrupted")
    (clean / "gated_reward.py").write_text(GATED_REWARD)
    ref = run_cli(["run", str(TINY), *_args(0), "--summary-json", "s.json"], clean, prefect_api)
    assert ref.returncode == 0, ref.stderr
    return clean


def _equal_runs(got_dir: Path, want_dir: Path, iterations: int = 3) -> None:
    """The same rewards in every iteration and the same policy weights, bit for bit."""
    got, want = read_summary(got_dir / "s.json"), read_summary(want_dir / "s.json")
    assert got["iterations_completed"] == iterations and len(got["reward_mean"]) == iterations
    assert got["reward_mean"] == want["reward_mean"]             # same prompts, samples and updates
    store, ref_store = Store.open(str(got_dir / "rlflow-store")), Store.open(str(want_dir / "rlflow-store"))
    for it in range(1, iterations + 1):
        key = layout.policy("resume", it)
        assert store.manifest(key)["files"] == ref_store.manifest(key)["files"]


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@AT_LENGTH
@pytest.mark.parametrize("staleness", [0, pytest.param(1, marks=AT_LENGTH), pytest.param(2, marks=AT_LENGTH)])
def test_killed_twice_then_resumed_equals_uninterrupted(prefect_api, tmp_path, staleness, request):
    """Also with run.max_staleness S > 0, where generate and reward of later iterations run beside train: the
    rollouts a kill leaves of iterations ahead are reused, and every policy is the uninterrupted run's."""
    args = _args(staleness)
    for d in ("killed", "clean"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "gated_reward.py").write_text(GATED_REWARD)
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    store_dir = killed / "rlflow-store" / "resume"
    gate = tmp_path / "gate"

    # Kill 1: inside iteration 2's reward stage (the reward function is blocked on the gate).
    # (S > 0: as soon as v1 is published, with generate and reward of the iterations ahead under way.)
    if staleness == 0:
        gate.touch()                # (the reward function blocks in iteration 2 only: no race with the flow)
    proc = _start(killed, prefect_api, {"GATE_FILE": str(gate)}, args)
    _wait_for(store_dir / "policy" / "v000001" / MANIFEST, proc)
    if staleness == 0:
        _wait_for(Path(str(gate) + ".entered"), proc)
    _kill(proc)
    if staleness == 0:
        assert not (store_dir / "iter-000002" / "rewards").exists()

    # Kill 2: restarted, killed again as soon as iteration 3's rollouts exist (in reward/train of iteration 3).
    # (S > 0: once v2 is published, while iteration 3 trains on rollouts generated beside iteration 2's train.)
    gate.unlink(missing_ok=True)
    proc = _start(killed, prefect_api, {"GATE_FILE": str(gate)}, args)
    _wait_for(store_dir / ("iter-000003/rollouts" if staleness == 0 else "policy/v000002") / MANIFEST, proc)
    _kill(proc)

    # Restart to the end; an uninterrupted run of the same config (S = 0: the module's) gives the same.
    done = run_cli(["run", str(TINY), *args, "--summary-json", "s.json"], killed, prefect_api)
    assert done.returncode == 0, done.stderr
    if staleness == 0:
        clean = request.getfixturevalue("uninterrupted")
    else:
        ref = run_cli(["run", str(TINY), *args, "--summary-json", "s.json"], clean, prefect_api)
        assert ref.returncode == 0, ref.stderr
    _equal_runs(killed, clean)
    got = read_summary(killed / "s.json")

    store = Store.open(str(killed / "rlflow-store"))
    assert store.get_pointer(layout.latest("resume", "policy")) == layout.policy("resume", 3)
    assert store.list_folders("resume/policy") == ["v000001", "v000002", "v000003"]
    # train.mode auto = resident: lean ckpt-N, a full checkpoint when the flow ended; store.keep: the newest two
    # ckpt-N (a resume's needs) and full checkpoints (checkpoints_last 2).
    assert store.list_folders("resume/trainer") == ["ckpt-000002", "ckpt-000003", "full-000003"]
    state = store.get_json(layout.checkpoint("resume", 3), "state.json")
    assert state["step"] == 3                                     # one optimizer step per iteration, none repeated
    # Every artifact folder is either complete and verified, or refused by readers. A kill can also leave a
    # hidden staging folder (`.<name>.partial-*`, maybe with a half-written manifest): no key names it, it is
    # never listed, and only a complete one is ever renamed into place.
    artifacts = [p for p in store_dir.rglob("*") if p.is_dir() and not any(c.is_dir() for c in p.iterdir())
                 and p.name != "model"]
    staging = [p for p in artifacts if ".partial-" in p.name]
    assert staging == []              # the resumed run (the lease holder) removed what the kills left half-written
    for folder in [p for p in artifacts if p not in staging]:
        key = folder.relative_to(killed / "rlflow-store").as_posix()
        if (folder / MANIFEST).exists():
            store.verify(key)
        else:
            with pytest.raises(IncompleteArtifact):
                store.verify(key)

    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{killed}/mlflow.db")
    steps = [m.step for m in client.get_metric_history(got["mlflow_run_id"], "reward/mean")]
    assert steps == [1, 2, 3]                                      # each iteration logged once
    assert len(client.search_runs([client.get_experiment_by_name("rlflow").experiment_id])) == 1


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stop_signal_ends_the_run_cleanly_and_the_same_command_resumes_it(prefect_api, tmp_path, uninterrupted):
    """SIGINT (Ctrl-C: to the whole process group, Prefect's temporary server's session aside) and then SIGTERM
    (a scheduler's, with a Prefect server) stop `rlflow run` within 10 s with one line saying where and how to
    resume, exit 130 / 143, no process left behind (the temporary server included), no traceback; the same
    command then resumes, and the run ends with the uninterrupted one's weights."""
    args = _args(0)
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "gated_reward.py").write_text(GATED_REWARD)       # (no gate file: it never blocks)
    store_dir = stopped / "rlflow-store" / "resume"
    user = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}      # the temporary server, as a user has
    scheduled = {**os.environ, "PREFECT_API_URL": prefect_api}                    # a server, as a scheduler's run has
    for sig, after, code, env in ((signal.SIGINT, 1, 130, user), (signal.SIGTERM, 2, 143, scheduled)):
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(TINY), *args], cwd=stopped, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        _wait_for(store_dir / "policy" / f"v{after:06d}" / MANIFEST, proc)
        started = descendants(proc.pid)
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
        err, _ = proc.communicate(timeout=300)              # (stdout and stderr in the order they were written)
        assert proc.returncode == code, err
        # First that the run was interrupted (after the last progress line), then only what the stop restored
        # (the resident trainer's full checkpoint), last what is kept and how to resume.
        lines = [line for line in err.splitlines() if line.strip()]
        at = next(i for i, line in enumerate(lines) if line.startswith("interrupted at iteration "))
        assert ": stopping" in lines[at] and not any(line.startswith("iter ") for line in lines[at:]), err
        assert all(line.startswith("restored the state after iteration ") for line in lines[at + 1:-1]), err
        assert lines[-1].startswith("stopped: every committed output is kept, the newest policy ") and \
            lines[-1].endswith("; run the same command to resume"), err
        assert "Traceback" not in err, err
        deadline = time.monotonic() + 120       # (what was sent SIGTERM at the end winds down: a loaded machine's time)
        while [p for p in started if _running(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in started if _running(p)], err                    # nothing left running
    done = run_cli(["run", str(TINY), *args, "--summary-json", "s.json"], stopped, prefect_api)
    assert done.returncode == 0, done.stderr
    assert "resuming resume: iterations 1-" in done.stdout and " of 3 found in " in done.stdout, done.stdout
    again = run_cli(["run", str(TINY), *args], stopped, prefect_api)
    assert again.returncode == 0 and "resume is already complete (3 iterations" in again.stdout, again.stdout
    _equal_runs(stopped, uninterrupted)


def test_a_stop_after_done_says_the_run_had_finished_and_exits_0(monkeypatch, capfd):
    """Ctrl-C after `done:` (the run's result complete; the process sends Prefect its last logs, then exits): one
    line saying so and what was left undone, exit code 0, no "interrupted". A signal while the summary is printed
    waits for it; one during the tidying up ends it there."""
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities import engine as prefect_engine

    from flows import cli

    class Exited(SystemExit):         # (what main lets through, as exit_now would end it)
        pass

    def exit_(code):
        raise Exited(code)

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(prefect_engine, "_prefect_sigterm_handler", prefect_engine._prefect_sigterm_handler)
    monkeypatch.setattr(cli, "_end_children", lambda sig: None)       # (this process's children are pytest's)
    monkeypatch.setattr(cli, "exit_now", exit_)
    monkeypatch.setattr(APILogWorker, "drain_all", classmethod(lambda cls, timeout=None: None))
    for during, undone in (("summary", "sending the flow's last logs"), ("exit", "nothing (only this process's")):
        monkeypatch.setattr(cli, "_stopped_by", [])
        monkeypatch.setattr(cli, "_finished", [])

        def cmd_run(args, during=during):
            cli._finished.append(cli.SUMMARY)
            if during == "summary":
                os.kill(os.getpid(), signal.SIGINT)
            print("done: 3 iterations")
            return 0

        def exit_after_done(code, during=during):
            if during == "exit":
                os.kill(os.getpid(), signal.SIGINT)
            exit_(code)

        monkeypatch.setattr(cli, "cmd_run", cmd_run)
        monkeypatch.setattr(cli, "exit_wound_down", lambda code, what, also=None, ed=exit_after_done: ed(code))
        try:
            with pytest.raises(Exited) as exited:
                cli.main(["run", str(TINY)])
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        out, err = capfd.readouterr()
        assert exited.value.args == (0,) and "done: 3 iterations" in out
        assert err.strip().startswith("rlflow: SIGINT after the run had finished (done: above") and \
            f"left undone: {undone}" in err and err.strip().endswith("exit code 0") and "interrupted" not in err, err


def test_a_sigterm_while_prefect_creates_a_task_run_is_still_a_stop(monkeypatch):
    """Prefect's SIGTERM handler raises its TerminationSignal; landing while a task run is being created, that
    becomes Prefect's own ValueError ("Task run is not set") and the signal is not sent again. The stop was
    noted all the same: the run says where it stopped and exits 143, without a traceback."""
    import threading

    from prefect.exceptions import TerminationSignal
    from prefect.utilities import engine as prefect_engine

    from flows import cli
    from tasks.core.stage import STOP

    exits = []
    monkeypatch.setattr(cli, "_stopped_by", [])
    monkeypatch.setattr(cli, "_interrupted", lambda: exits.append(128 + cli._stopped_by[0]) or 0)
    monkeypatch.setattr(prefect_engine, "_prefect_sigterm_handler", prefect_engine._prefect_sigterm_handler)
    monkeypatch.setattr(threading, "Timer", lambda *a, **k: type("T", (), {"start": lambda self: None,
                                                                          "daemon": True})())
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def cmd_run(args):
        try:                                     # what Prefect's task engine does with it
            prefect_engine._prefect_sigterm_handler(signal.SIGTERM, None)
        except TerminationSignal:
            raise ValueError("Task run is not set") from None

    monkeypatch.setattr(cli, "cmd_run", cmd_run)
    try:
        cli.main(["run", str(TINY)])
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        STOP.clear()
    assert exits == [143] and cli._stopped_by == [signal.SIGTERM]


HELD_REWARD = '''
import os, time
from tasks.rewards.demo import successor_reward

def held(completions, answer, trainer_state, **kwargs):
    """Holds iteration 2's reward stage while the gate file exists (the test kills the Prefect server then)."""
    gate = os.environ["GATE_FILE"]
    if trainer_state.global_step == 1:
        open(gate + ".entered", "w").close()
        while os.path.exists(gate):
            time.sleep(0.05)
    return successor_reward(completions, answer)
'''


def test_prefects_temporary_server_killed_during_a_run_is_started_again_and_the_run_goes_on(tmp_path):
    """No PREFECT_API_URL: the flow's API is Prefect's temporary server, a child of `rlflow run`. Killed by pid
    (the OOM killer's way) in the middle of a run, it was gone for good: every call of the flow's client retried
    against its dead port, iterations took 11-39 s instead of 0.2 s and each wrote a multi-KB error line until the
    end. Now it is started again on its port, said in one line, and the run completes."""
    (tmp_path / "held_reward.py").write_text(HELD_REWARD)
    gate = tmp_path / "gate"
    gate.touch()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(TINY), "-o", "run.name=served",
                             "-o", "run.iterations=2", "-o", "generate.prompts_per_iteration=4",
                             "-o", "generate.num_generations=4", "-o", 'reward.functions=[{"fn": "held_reward:held"}]'],
                            cwd=tmp_path, env={**env, "GATE_FILE": str(gate)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for(tmp_path / "gate.entered", proc)
        servers = _prefect_servers(proc.pid)
        assert len(servers) == 1
        os.kill(servers[0], signal.SIGKILL)
        deadline = time.monotonic() + 120                # (the server's start: seconds, a loaded machine's more)
        while time.monotonic() < deadline and not set(_prefect_servers(proc.pid)) - set(servers):
            time.sleep(0.2)
        gate.unlink()
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert out.count("rlflow: Prefect's temporary API server ended (killed by SIGKILL); starting it again on "
                     "http://127.0.0.1:") == 1, out
    assert "iter    2/2" in out and "done: 2 iterations" in out, out
    assert "EventsWorker' failed" not in out and "Traceback" not in out, out


def _prefect_servers(pid: int) -> list[int]:
    """The running Prefect API servers among `pid`'s descendants."""
    def cmdline(p: int) -> bytes:
        try:
            return Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            return b""
    return [p for p in descendants(pid) if _running(p) and b"prefect.server.api.server:create_app" in cmdline(p)]
