"""Environment pools (env.servers: N; tasks/envs/runtime/pool.py, flows/services.py: EnvServer): N environment servers
behind one URL. Episodes are spread over the servers and stay on the one that made them; a server that dies
fails its own open episodes only, the stage goes on, and the server is replaced and used again."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tasks.core.contracts import Step
from tasks.envs.builtin.games import SayTheLetters

ROOT = Path(__file__).resolve().parents[1]
LETTERS = ROOT / "configs" / "letters.yaml"


class Tracked(SayTheLetters):
    """The letters game, noting the process (the pool's server: env.isolation thread) that each of its calls
    reached. With `kill_flag`, the first episode to take its second step kills its own server (SIGKILL), once
    per file: the flag file is made by that episode and holds the pid it killed."""

    def __init__(self, kill_flag: str | None = None):
        self.kill_flag, self.pids = kill_flag, []

    def reset(self, row: dict) -> list[dict]:
        self.pids = [os.getpid()]
        return super().reset(row)

    def step(self, message: dict) -> Step:
        self.pids.append(os.getpid())
        if self.kill_flag and self.turn == 1:
            try:
                fd = os.open(self.kill_flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        return super().step(message)


FACTORY = "env.factory=tests.test_env_pool:Tracked"
ROWS = [{"prompt": "Say each letter I name.", "letters": letters} for letters in ("abc", "dcb")]


@pytest.fixture
def pool(monkeypatch):
    """An EnvServer with env.servers 3, env.where: local (three server processes and the front, here)."""
    from flows.services import EnvServer
    from tasks.core.config import load_config
    from tasks.envs.runtime.server import TOKEN_VAR, URL_VAR

    monkeypatch.setenv("PYTHONPATH", str(ROOT))          # (this module, in the servers' processes)
    for var in (URL_VAR, TOKEN_VAR):
        monkeypatch.delenv(var, raising=False)
    made = []

    def make(*overrides: str):
        overrides = ["env.where=local", "env.servers=3", "env.isolation=thread", "env.concurrency=32", FACTORY,
                     *overrides]
        server = EnvServer(load_config(LETTERS, overrides), str(LETTERS), overrides, None)
        made.append(server)
        for k, v in server.services(print).variables().items():
            monkeypatch.setenv(k, v)
        return server
    yield make
    for server in made:
        server.stop()


def _episodes(cfg, n: int):
    from tasks.core import builtin_models
    from tasks.core.contracts import SamplingParams
    from tasks.core.models import load_tokenizer
    from tasks.envs.runtime.episodes import run_episodes
    from tasks.envs.runtime.sources import Environments
    from tests.test_envs import Scripted

    tok = load_tokenizer(builtin_models.resolve("builtin:tiny-lm"))
    table = dict(enumerate(ROWS))
    records, sampled = run_episodes(cfg, table, list(table), Scripted(lambda ctx: "a").session("base", "-", tok),
                                    SamplingParams(n=n, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=3))
    return records, Environments().metrics(cfg, records)      # (env/pool_*: from each record's env_server)


def _health(server) -> dict:
    import httpx

    return httpx.get(f"{server.url}/health", timeout=10).json()


def _member_pids(server) -> list[int]:
    return [m["proc"].pid for m in server.members]


def test_a_lost_server_fails_its_own_episodes_only_and_is_replaced(pool, tmp_path):
    """24 episodes over 3 servers; one server kills itself at an episode's second step. Its open episodes fail
    ("died"), every other one ends with its return, and no call of any episode reached another server than the
    one that made it (sticky). The flow's watcher starts a new server in its place, and the next episodes use
    it."""
    from flows.services import Told

    flag = tmp_path / "killed"
    server = pool(f"env.kwargs={{kill_flag: {flag}}}")
    logged, noted = [], []
    server.services(Told(logged.append, noted.append))  # (as the flow's stages ask: the watcher's lines, from now)
    first = _member_pids(server)
    records, metrics = _episodes(server.cfg, n=12)
    killed = int(flag.read_text())
    lost = first.index(killed)
    for r in records:                                   # sticky: every call on the server that made it
        assert r.env_error is not None or len(set(r.env_state["pids"])) == 1, r.env_state
    failed = [r for r in records if r.env_error is not None]
    assert failed and all("of the pool was lost" in r.env_error for r in failed), [r.env_error for r in failed]
    ok = [r for r in records if r.env_error is None]
    assert ok and all(r.env_return is not None and r.env_state["pids"][0] != killed for r in ok)
    spread = [metrics[f"env/pool_server{i}_episodes"] for i in range(3)]
    assert sum(spread) == 24 and min(spread) >= 7, metrics              # least loaded: ~8 each
    assert metrics["env/errors"] == len(failed) == metrics["env/pool_lost"] == spread[lost]

    deadline = time.monotonic() + 300                   # the watcher replaces it (a new process, generation 1)
    while time.monotonic() < deadline and not (_health(server)["live"] == 3 and _health(server)["replaced"] == 1):
        time.sleep(0.2)
    health = _health(server)
    assert health["live"] == 3 and health["members"][lost]["generation"] == 1, health
    now = _member_pids(server)
    assert now[lost] != killed and [p for i, p in enumerate(now) if i != lost] == \
        [p for i, p in enumerate(first) if i != lost]
    records, metrics = _episodes(server.cfg, n=6)
    assert all(r.env_error is None for r in records)
    assert now[lost] in {r.env_state["pids"][0] for r in records}
    assert metrics[f"env/pool_server{lost}_episodes"] >= 3 and metrics["env/pool_replaced"] == 1
    assert all(len(set(r.env_state["pids"])) == 1 for r in records)
    # the console heard of the loss as it happened (the flow's log has every line; the members' output only there)
    assert noted == [f"environment servers [{lost}] of the pool lost: replacing them"], noted
    assert noted[0] in logged and len(logged) > len(noted)


@pytest.mark.slow
def test_the_letters_demo_on_a_pool_of_three_local_servers(tmp_path, prefect_api, monkeypatch):
    """The flow starts three servers and the front (env.where: local, env.servers: 3) and hands generate the
    front's URL: each iteration's episodes are spread over the three (env/pool_server<i>_episodes, and the
    process each episode's calls reached), each episode on one server throughout. One server kills itself in
    iteration 1: its 4 episodes fail, the iteration completes, and iteration 2 runs on its replacement and the
    other two. The pool ends with the flow."""
    from flows.training import train_flow
    from tasks.core import layout, rollout
    from tasks.core.store import Store
    from tasks.envs.runtime.server import TOKEN_VAR, URL_VAR

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    for var in (URL_VAR, TOKEN_VAR):
        monkeypatch.delenv(var, raising=False)
    out = train_flow(str(LETTERS), ["generate.prompts_per_iteration=3", "generate.num_generations=4",
                                    "run.iterations=2", "env.where=local", "env.servers=3", FACTORY,
                                    f"env.kwargs={{kill_flag: {tmp_path}/killed}}",
                                    f"store.uri={tmp_path}/store", f"tracking.uri=sqlite:///{tmp_path}/m.db"])
    assert out["iterations_completed"] == 2
    store = Store.open(str(tmp_path / "store"))
    killed = int((tmp_path / "killed").read_text())
    servers = []
    for it, lost in ((1, 4), (2, 0)):
        meta = store.manifest(layout.rollouts("letters-demo", it))["meta"]["metrics"]
        store.get_folder(layout.rollouts("letters-demo", it), tmp_path / f"r{it}")
        records = rollout.read(tmp_path / f"r{it}")
        errors = [r.env_error for r in records if r.env_error]
        assert meta["env/episodes"] == 12 and meta["env/errors"] == meta["env/pool_lost"] == lost, (meta, errors)
        assert [meta[f"env/pool_server{i}_episodes"] for i in range(3)] == [4, 4, 4], meta
        assert meta["env/pool_replaced"] == 1 if it == 2 else meta["env/pool_replaced"] <= 1   # (by the watcher)
        ok = [r for r in records if r.env_error is None]
        assert len(ok) == 12 - lost and all(len(set(r.env_state["pids"])) == 1 for r in ok)       # sticky
        assert all("of the pool was lost" in e for e in errors)
        servers.append({r.env_state["pids"][0] for r in ok})
    assert len(servers[0]) == 2 and killed not in servers[0]
    assert len(servers[1]) == 3 and len(servers[1] - servers[0]) == 1 and killed not in servers[1]
    assert not _ours(tmp_path)                                  # the servers and the front ended with the flow


def _ours(tmp_path: Path) -> list[int]:
    """The pids of this test's servers and front (their --overrides-json names its store)."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"tasks.envs." in cmd and str(tmp_path).encode() in cmd:
            out.append(int(proc.name))
    return out


def test_the_front_answers_as_one_server_and_refuses_what_a_server_refuses(monkeypatch):
    """What the stage's client sees of a front (run by hand: --member, here two that refuse connections): the token
    is asked for, an id the pool never made is a dead episode (the server's own answer), and with every server lost
    the front answers 503, the stage's ServerGone."""
    import subprocess
    import sys

    import httpx

    from tasks.core.config import load_config
    from tasks.envs.builtin.webshop import free_port
    from tasks.envs.runtime import server as one
    from tasks.envs.runtime.pool import READY, SLACK_SECONDS, TOKEN_VAR, URL_VAR

    assert (READY, TOKEN_VAR, URL_VAR, SLACK_SECONDS) == (one.READY, one.TOKEN_VAR, one.URL_VAR, one.SLACK_SECONDS)
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    front = subprocess.Popen([sys.executable, "-m", "tasks.envs.runtime.pool", "--config", str(LETTERS), "--port", "0",
                              *(a for url in dead for a in ("--member", url))], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env={**os.environ, TOKEN_VAR: "secret"}, cwd=ROOT)
    try:
        url = next(line.split()[1] for line in front.stdout if line.startswith(READY))
        auth = {"Authorization": "Bearer secret"}
        assert httpx.get(f"{url}/health").json()["live"] == 2
        assert httpx.post(f"{url}/episodes", json={"row": ROWS[0]}).status_code == 401
        assert httpx.put(f"{url}/pool/members", json={"members": []}).status_code == 401
        assert httpx.post(f"{url}/episodes/nope/step", json={}, headers=auth).json()["kind"] == "died"
        assert httpx.post(f"{url}/episodes/1.0.abc/step", json={}, headers=auth).json()["kind"] == "died"
        assert httpx.post(f"{url}/episodes", json={"row": ROWS[0]}, headers=auth).status_code == 503
        health = httpx.get(f"{url}/health").json()
        assert health["live"] == 0 and all("ConnectError" in m["why"] for m in health["members"]), health
        monkeypatch.setenv(URL_VAR, url)
        monkeypatch.setenv(TOKEN_VAR, "secret")
        cfg = load_config(LETTERS, ["env.where=local", FACTORY])
        with pytest.raises(one.ServerGone, match="has none left"):
            _episodes(cfg, n=1)
    finally:
        front.kill()
        front.wait()


def test_a_pool_with_a_server_of_your_own_is_one_line():
    from tasks.core.config import load_config
    from tasks.core.errors import UserError

    with pytest.raises(UserError, match="env.servers"):
        load_config(LETTERS, ["env.servers=2", "env.where=http://127.0.0.1:9"])


def test_on_sky_each_server_has_a_cluster_and_a_port_of_its_own_and_the_front_one_more(monkeypatch):
    """env.where: sky: server i on cluster <cluster>-env-<i> at env.server_port + 1 + i; the front, where the stages
    run on sky, on <cluster>-env-front at env.server_port (sky/env.yaml, ROLE=front); all torn down with the run.
    With the stages on this machine the front is a process here."""
    from flows.launch import Sky
    from flows.services import EnvServer
    from tasks.core.config import load_config

    cfg = load_config(LETTERS, ["env.where=sky", "env.servers=2", "launcher.stages={generate: sky}"])
    sky, calls = Sky(cfg), []

    def bridge(args, log):
        calls.append(args)
        return {"url": f"http://10.0.0.{len(calls)}:{args[args.index('--port') + 1]}"}
    monkeypatch.setattr(sky, "_bridge", bridge)
    server = EnvServer(cfg, str(LETTERS), [], sky)
    assert server._start_member(1, print) == (None, "http://10.0.0.1:8332")
    assert server._start_front(print) == "http://10.0.0.2:8330"
    clusters = ["rlflow-letters-demo-env-1", "rlflow-letters-demo-env-front"]
    assert [a[a.index("--cluster") + 1] for a in calls] == clusters and sky.launched == set(clusters)
    assert "--env=ROLE=front" in calls[1] and not any(a.startswith("--env=ROLE") for a in calls[0])
    assert not server._front_here()
    here = load_config(LETTERS, ["env.where=sky", "env.servers=2", "launcher.stages={generate: local}"])
    assert EnvServer(here, str(LETTERS), [], Sky(here))._front_here()


ORPHANING = """
import os, subprocess, sys
procs = [subprocess.Popen([sys.executable, "-m", module, "--config", sys.argv[1], "-o", "env.isolation=thread",
                           "--port", "0", "--exit-with-parent"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
         for module in ("tasks.envs.runtime.server", "tasks.envs.runtime.pool")]
for proc in procs:
    assert any(line.startswith("RLFLOW_ENV_SERVER_READY") for line in proc.stdout)
print(*(proc.pid for proc in procs), flush=True)
os._exit(0)                  # as a flow that is killed: their output's pipe has no reader any more
"""


def test_a_server_and_a_front_whose_flow_died_leave():
    """--exit-with-parent: the flow gone (killed), a server and a front leave within seconds, although the pipe
    they would say so into is gone with it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", ORPHANING, str(LETTERS)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out.stderr[-2000:]
    deadline = time.monotonic() + 120      # (a bound on "never": they end within a poll or two)
    while time.monotonic() < deadline and any(map(_running, pids)):
        time.sleep(0.2)
    alive = [p for p in pids if _running(p)]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"     # (a zombie has left)
    except (OSError, IndexError):
        return False


def test_the_flow_hands_its_console_to_the_fleets_it_asks():
    """Launchers.services gives the fleets a Told once the flow set its console (flows/training.py); without one
    (a stage typed by hand, a test) the log as it is."""
    from flows.services import Launchers, Told
    from tasks.core.config import load_config

    launchers = Launchers(load_config(LETTERS, ["env.where=local", "env.servers=2"]), str(LETTERS), [])
    given = []

    class Env:
        def services(self, log):
            given.append(log)
            return Services()

    from tasks.core.placement import Services

    launchers.env_server = Env()
    launchers.services("generate", print)
    launchers.note = noted = [].append
    launchers.services("generate", print)
    assert given[0] is print and isinstance(given[1], Told) and given[1].note is noted and given[1].log is print
