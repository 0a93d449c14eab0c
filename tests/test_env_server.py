"""Environments on a server of their own (env.where: local | sky; tasks/envs/runtime/server.py, flows/services.py:
EnvServer): an episode fails there exactly as it would in the stage, a server that goes away fails the stage
and is started again, and the flow runs the letters demo against a local server and against one on a (fake)
spot cluster that is preempted mid-run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from flows.services import EnvServer
from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.contracts import SamplingParams
from tasks.core.errors import UserError
from tasks.core.placement import Services
from tasks.core.store import Store
from tasks.envs.runtime.episodes import run_episodes
from tasks.envs.runtime.server import TOKEN_VAR, URL_VAR, ServerGone
from tests.conftest import free_ports, once_written
from tests.test_envs import LETTERS, Scripted

ROOT = Path(__file__).resolve().parents[1]
MODES = ["ok", "raise", "hang", "garbage", "crash", "exit"]


@pytest.fixture
def served(monkeypatch, tmp_path):
    """An EnvServer (env.where: local) for the given overrides of the letters config; stopped at the end."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))          # (tests.env_classes, in the server's process)
    for var in (URL_VAR, TOKEN_VAR):
        monkeypatch.delenv(var, raising=False)
    made = []

    def make(*overrides: str):
        overrides = ["env.where=local", "env.max_tokens=400", "generate.max_completion_length=40", *overrides]
        cfg = load_config(LETTERS, overrides)
        server = EnvServer(cfg, str(LETTERS), overrides, None)
        made.append(server)
        return cfg, server
    yield make
    for server in made:
        server.stop()


def _episodes(cfg, server, rows, n=1):
    services = server.services(print)            # (the stage's context, as the flow hands it to an inline stage)
    table = dict(enumerate(rows))
    from tasks.core import builtin_models
    from tasks.core.models import load_tokenizer

    tok = load_tokenizer(builtin_models.resolve("builtin:tiny-lm"))
    return run_episodes(cfg, table, list(table), Scripted(lambda ctx: "a").session("base", "unused", tok),
                        SamplingParams(n=n, max_new_tokens=40, temperature=1.0, top_p=1.0, seed=3), services)[0]


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_an_episode_on_the_server_fails_as_it_would_in_the_stage(served, isolation):
    """Every way an environment fails costs its episode only, with the message the in-stage loop gives; the
    others finish with their returns and their environments' state."""
    modes = MODES if isolation == "process" else [m for m in MODES if m not in ("crash", "exit")]
    cfg, server = served("env.factory=tests.env_classes:Flaky", f"env.isolation={isolation}",
                         "env.timeout_seconds=4")
    rows = [{"prompt": "Say each letter I name.", "letters": "abc", "seed": 0, "mode": m} for m in modes]
    records = _episodes(cfg, server, rows)
    want = {"ok": None, "raise": "step raised ValueError: step blew up",
            "hang": "step did not return within env.timeout_seconds", "garbage": "step: step returned str, not a Step",
            "crash": "step: the environment's process died (killed by SIGSEGV)",
            "exit": "step: the environment's process died (exit 3)"}
    for mode, r in zip(modes, records):
        assert r.env_error is None if want[mode] is None else want[mode] in (r.env_error or ""), (mode, r.env_error)
    ok = records[0]
    assert ok.env_return == 3.0 and ok.env_state == {"mode": "ok", "turn": 3}
    assert sum(ok.mask) == 3 * 2 and len(ok.mask) == len(ok.completion_ids) > 6      # "a" and EOS a turn


def test_a_server_that_goes_away_fails_the_stage_and_is_started_again(served):
    cfg, server = served("env.factory=tasks.envs.builtin.games:SayTheLetters", "env.isolation=thread")
    rows = [{"prompt": "Say each letter I name.", "letters": "abc"}]
    assert _episodes(cfg, server, rows, n=2)[0].env_error is None
    first = server.url
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    with pytest.raises(ServerGone, match="did not answer"):
        run_episodes(cfg, dict(enumerate(rows)), [0], _session(), SamplingParams(
            n=1, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=3), Services(env_url=first))
    records = _episodes(cfg, server, rows, n=2)            # server.services(): it does not answer, so it starts again
    assert server.url != first and all(r.env_error is None for r in records)


def _session():
    from tasks.core import builtin_models
    from tasks.core.models import load_tokenizer

    tok = load_tokenizer(builtin_models.resolve("builtin:tiny-lm"))
    return Scripted(lambda ctx: "a").session("base", "unused", tok)


def test_a_wrong_token_is_one_line_and_no_token_no_server_is_one_line(served, monkeypatch):
    cfg, server = served("env.factory=tasks.envs.builtin.games:SayTheLetters", "env.isolation=thread")
    server.services(print)
    monkeypatch.setenv(URL_VAR, server.url)            # (a stage process's context, read from its environment)
    monkeypatch.setenv(TOKEN_VAR, "wrong")
    with pytest.raises(UserError, match="refused the token"):
        run_episodes(cfg, {0: {"prompt": "p", "letters": "ab"}}, [0], _session(),
                     SamplingParams(n=1, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=3))
    with pytest.raises(UserError, match="refused the token"):   # (an inline stage's: its argument)
        run_episodes(cfg, {0: {"prompt": "p", "letters": "ab"}}, [0], _session(),
                     SamplingParams(n=1, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=3),
                     Services(env_url=server.url, env_token="wrong"))
    monkeypatch.delenv(URL_VAR)
    with pytest.raises(UserError, match="no environment server given"):
        run_episodes(cfg, {0: {"prompt": "p", "letters": "ab"}}, [0], _session(),
                     SamplingParams(n=1, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=3))


def test_a_factory_the_server_cannot_import_is_the_flows_one_line(served):
    cfg, server = served("env.factory=no_such_module:Env")
    with pytest.raises(UserError, match="env.factory: cannot import module 'no_such_module'"):
        server.services(print)
    assert server.proc is None


# ------------------------------------------------------------------------------------------ through the flow

COMMON = ["generate.prompts_per_iteration=2", "generate.num_generations=4", "run.iterations=2"]


@pytest.mark.slow
def test_the_letters_demo_with_its_environments_on_a_local_server(tmp_path, prefect_api, monkeypatch):
    """generate in a local subprocess (launcher: local), its environments in the flow's server: the URL and
    token reach the stage through its environment; the server ends with the flow."""
    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    for var in (URL_VAR, TOKEN_VAR):
        monkeypatch.delenv(var, raising=False)
    out = train_flow(str(LETTERS), [*COMMON, "env.where=local", "launcher.stages={generate: local}",
                                    f"launcher.recipes={ROOT / 'sky'}",
                                    f"store.uri={tmp_path}/store", f"tracking.uri=sqlite:///{tmp_path}/m.db"])
    assert out["iterations_completed"] == 2
    meta = Store.open(str(tmp_path / "store")).manifest(layout.rollouts("letters-demo", 2))["meta"]["metrics"]
    assert meta["env/episodes"] == 8 and meta["env/turns_mean"] == 3 and meta["env/errors"] == 0
    assert not _servers_alive(tmp_path)


def _servers_alive(tmp_path: Path) -> list[int]:
    """The letters game's environment servers this test started (their overrides name its tmp_path: another
    test file's, run by the other xdist worker meanwhile, are not its)."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"tasks.envs.runtime.server" in cmd and b"letters" in cmd and str(tmp_path).encode() in cmd:
            out.append(int(proc.name))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["preempted", "hung"])
def test_the_env_cluster_is_launched_once_relaunched_after_a_preemption_and_torn_down(
        tmp_path, prefect_api, monkeypatch, fake_cloud, fault):
    """env.where: sky: the flow launches sky/env.yaml's cluster, reads the server's endpoint, and hands it to
    generate. Once iteration 1's episodes are in, the cluster is preempted (its server killed, the cluster gone):
    iteration 2 finds it gone and launches it again; or its server hangs (SIGSTOP: the cluster up, the port held):
    iteration 2 finds it not answering, cancels its job and starts one again there. Both iterations' episodes
    are whole."""
    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    for var in (URL_VAR, TOKEN_VAR):
        monkeypatch.delenv(var, raising=False)
    port = free_ports(1)
    store = Store.open(str(tmp_path / "store"))
    cluster = "rlflow-letters-demo-env"

    def hang() -> None:
        for pid in _servers_alive(tmp_path):
            os.kill(pid, signal.SIGSTOP)
    watcher = once_written(store, layout.rollouts("letters-demo", 1),
                           (lambda: fake_cloud.preempt(cluster)) if fault == "preempted" else hang)
    out = train_flow(str(LETTERS), [*COMMON, "env.where=sky", f"env.server_port={port}",
                                    f"launcher.sky_python={fake_cloud.python}", f"launcher.recipes={ROOT / 'sky'}",
                                    f"store.uri={tmp_path}/store", f"tracking.uri=sqlite:///{tmp_path}/m.db"])
    watcher.join(5)
    assert out["iterations_completed"] == 2
    env_calls = [c for c in fake_cloud.calls() if c.get("cluster") == cluster]
    # (preempted: the exec finds the cluster gone, launched again; hung: its job cancelled, one sent again)
    want = ["launch", "preempted", "exec", "launch", "down"] if fault == "preempted" else \
        ["launch", "cancel", "exec", "down"]
    assert [c["call"] for c in env_calls] == want, env_calls
    assert env_calls[0]["envs"][TOKEN_VAR] and env_calls[0]["envs"]["PORT"] == str(port)
    assert env_calls[0]["envs"][TOKEN_VAR] == env_calls[-2]["envs"][TOKEN_VAR]
    for it in (1, 2):
        meta = store.manifest(layout.rollouts("letters-demo", it))["meta"]["metrics"]
        assert meta["env/episodes"] == 8 and meta["env/errors"] == 0
    assert not _servers_alive(tmp_path)


