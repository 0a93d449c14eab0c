"""generate.replicas (tasks/engines/replicas.py, replica.py): N sampling replicas behind one router give the same
rollouts as one, bit for bit on CPU; an episode's turns stay on one replica; only the schedule's policy is
served (a replica asked for another version refuses); a replica killed mid-stage has its shards sent to the
others, is replaced and rejoins, and the stage neither fails nor changes. The fake cloud preempting one of three
replica clusters mid-flow: test_a_preempted_replica_cluster_is_launched_again_and_the_flow_is_unchanged."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.contracts import SamplingParams
from tasks.core.placement import Services
from tasks.core.processes import alive
from tasks.engines.replicas import LAUNCH_VAR, ensure_router, policy_digest
from tasks.engines.sampling import sampling_engine
from tasks.generate import generate
from tests.conftest import AT_LENGTH, ROOT, TINY, free_ports
from tests.test_envs import LETTERS

pytestmark = pytest.mark.slow


def _overrides(tmp_path: Path, n: int, *more: str) -> list[str]:
    return [f"generate.replicas={n}", f"store.uri=file://{tmp_path}/store{n}", "generate.batch_size=4",
            "generate.replica_threads=1", f"tracking.uri=sqlite:///{tmp_path}/m.db", *more]


def _cfg(tmp_path: Path, n: int, *more: str, config: Path = TINY):
    return load_config(config, _overrides(tmp_path, n, *more))


def _rollouts(tmp_path: Path, n: int, run: str = "tiny-demo", iteration: int = 1) -> bytes:
    folder = tmp_path / f"store{n}" / layout.rollouts(run, iteration)
    return (folder / "rollouts.jsonl").read_bytes()


def _generate(cfg, iteration: int = 1) -> dict:
    try:
        return generate(cfg, iteration)
    finally:
        sampling_engine(cfg).stop(lambda _line: None)


def test_one_or_three_replicas_give_the_same_rollouts(tmp_path):
    one = _generate(_cfg(tmp_path, 1))["metrics"]
    three = _generate(_cfg(tmp_path, 3))["metrics"]
    assert _rollouts(tmp_path, 1) == _rollouts(tmp_path, 3)
    assert one["generate/replica0/requests"] == 4                 # 16 prompts in shards of 4
    served = [three[f"generate/replica{i}/requests"] for i in range(3)]
    assert sum(served) == 4 and min(served) >= 1                  # least loaded: every replica took work
    assert three["generate/router/new"] == 4 and three["generate/router/retried"] == 0


def test_an_episode_stays_on_its_replica(tmp_path):
    """Letters episodes (several turns each) on two replicas: every turn after an episode's first goes where its
    first went (sticky), the first turns spread by load."""
    cfg = _cfg(tmp_path, 2, "generate.prompts_per_iteration=4", "generate.num_generations=2", "generate.batch_size=1",
               config=LETTERS)
    m = _generate(cfg)["metrics"]
    turns = m["generate/replica0/requests"] + m["generate/replica1/requests"]
    assert m["generate/router/new"] == 8 and m["generate/router/sticky"] == turns - 8 > 0
    assert m["generate/replica0/requests"] and m["generate/replica1/requests"]


def test_only_the_schedules_policy_is_served(tmp_path):
    cfg = _cfg(tmp_path, 1)
    router = ensure_router(cfg)
    try:
        http = httpx.Client(base_url=router["url"], timeout=120)
        digest = policy_digest(cfg, layout.BASE)
        assert http.post("/policy", json={"policy": layout.BASE, "digest": digest}).json()["ready"] == [0]
        body = {"policy": layout.BASE, "digest": "another", "prompt_ids": [[1, 2]], "key": None,
                "params": {"n": 1, "max_new_tokens": 2, "temperature": 1.0, "top_p": 1.0, "seed": 1}}
        r = http.post("/sample", json=body)                        # the router serves one version
        assert r.status_code == 409 and "not base" in r.json()["error"]
        replica = http.get("/stats").json()["members"]["0"]["url"]
        no = httpx.post(f"{replica}/sample", json={**body, "digest": digest})
        assert no.status_code == 401                               # only the router may ask a replica
        assert http.post("/sample", json={**body, "digest": digest}).status_code == 200
        with pytest.raises(RuntimeError, match="no complete folder"):   # a version the store does not hold
            policy_digest(cfg, layout.policy(cfg.run.name, 3))
    finally:
        sampling_engine(cfg).stop(lambda _line: None)


def _signal_one_while_it_samples(router: dict, sig: int, hit: list[int]) -> threading.Thread:
    """A thread that sends `sig` to the first replica it sees busy (its pid appended to `hit`), started."""
    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not hit:
            try:
                members = httpx.get(f"{router['url']}/stats", timeout=5).json()["members"]
                busy = [m for m in members.values() if m["busy"] and m["url"]]
                if busy:
                    pid = httpx.get(f"{busy[0]['url']}/health", timeout=5).json()["pid"]
                    os.kill(pid, sig)
                    hit.append(pid)
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher


def _replaced_and_ready(router: dict, within: float) -> dict:
    """The router's /stats once a replica has been replaced and every one is ready again, or after `within` s."""
    deadline = time.monotonic() + within
    while True:
        stats = httpx.get(f"{router['url']}/stats", timeout=5).json()
        if stats["counts"]["replaced"] and all(x["state"] == "ready" for x in stats["members"].values()):
            return stats
        if time.monotonic() >= deadline:
            return stats
        time.sleep(0.5)


def test_a_replica_killed_mid_stage_is_replaced_and_the_rollouts_are_unchanged(tmp_path):
    more = ("generate.prompts_per_iteration=32", "generate.max_completion_length=24", "generate.batch_size=2")
    _generate(_cfg(tmp_path, 1, *more))
    cfg = _cfg(tmp_path, 3, *more, "run.max_staleness=2")      # (iterations 2, 3 below: from the base model too)
    router = ensure_router(cfg)
    killed: list[int] = []
    watcher = _signal_one_while_it_samples(router, signal.SIGKILL, killed)
    try:
        m = generate(cfg, 1)["metrics"]
        watcher.join(5)
        assert killed
        assert _rollouts(tmp_path, 1) == _rollouts(tmp_path, 3)      # the killed replica's shards, sampled again
        assert m["generate/router/retried"] >= 1
        stats = _replaced_and_ready(router, within=120)               # replaced, and back with the policy
        assert stats["counts"]["replaced"] == 1 and stats["replace_seconds"], stats
        assert all(x["state"] == "ready" for x in stats["members"].values()), stats
        assert m["generate/router/lost"] == 1
        # one lost between stages (while the flow trains): the next stage's metrics, and the console, say it
        pid = httpx.get(f"{stats['members']['0']['url']}/health", timeout=5).json()["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and httpx.get(f"{router['url']}/stats", timeout=5).json()["lost"] < 2:
            time.sleep(0.2)
        m2 = generate(cfg, 2, layout.BASE)["metrics"]
        m3 = generate(cfg, 3, layout.BASE)["metrics"]
        assert m2["generate/router/lost"] == m3["generate/router/lost"] == 2
        from flows.training import ConsoleWarnings

        noted: list[str] = []
        watch = ConsoleWarnings(cfg, noted.append, None)
        for it, metrics in ((1, m), (2, m2), (3, m3)):
            watch.replicas(it, metrics)
        assert [n.split(" (why")[0] for n in noted] == ["iteration 1: 1 generate replica lost, replaced by the router",
                                                        "iteration 2: 1 generate replica lost, replaced by the router"]
    finally:
        sampling_engine(cfg).stop(lambda _line: None)


def test_a_hung_replica_on_sky_is_cut_off_launched_fresh_and_its_requests_sampled_elsewhere(tmp_path, fake_cloud):
    """A replica on its own (fake) cluster that stops answering without exiting (SIGSTOP: a hung machine, whose
    connections stay open and which holds its port) while it samples: once its probes fail the router says it
    lost, cuts its requests off and sends them to the others; launched again on the cluster still up, the hung
    job is cancelled first (--fresh) and the new one serves on the same port. The rollouts are one replica's."""
    import json

    from flows.launch import BRIDGE
    from tasks.engines.replicas import TOKEN_VAR

    more = ("generate.prompts_per_iteration=32", "generate.max_completion_length=24", "generate.batch_size=2")
    _generate(_cfg(tmp_path, 1, *more))
    cfg = _cfg(tmp_path, 3, *more)
    cluster = ["--cluster", "hung-replica-{i}"]
    launch = {"start": [fake_cloud.python, str(BRIDGE), "serve", *cluster, "--recipe", str(ROOT / "sky/replica.yaml"),
                        "--port", "{port}", "--wait", "300", "--launch", "--fresh", f"--env=CONFIG={TINY}",
                        f"--env=OVERRIDES={json.dumps(_overrides(tmp_path, 3, *more))}", "--env=PORT={port}",
                        f"--env={TOKEN_VAR}={{token}}"],
              "stop": [fake_cloud.python, str(BRIDGE), "down", *cluster], "port_base": free_ports(3)}
    router = ensure_router(cfg, launch)
    stopped: list[int] = []
    watcher = _signal_one_while_it_samples(router, signal.SIGSTOP, stopped)
    try:
        m = generate(cfg, 1, services=Services(replica_launch=launch))["metrics"]
        watcher.join(5)
        assert stopped
        assert _rollouts(tmp_path, 1) == _rollouts(tmp_path, 3)
        assert m["generate/router/retried"] >= 1
        stats = _replaced_and_ready(router, within=300)    # (replaced in the watch's next round, then loads)
        assert stats["counts"]["replaced"] and all(x["state"] == "ready" for x in stats["members"].values()), \
            f"the hung replica was never back: {stats}"
        cancelled = [c for c in fake_cloud.calls() if c["call"] == "cancel" and c.get("all")]
        assert len(cancelled) == 1 and cancelled[0]["cluster"].startswith("hung-replica-"), cancelled
    finally:
        sampling_engine(cfg, Services(replica_launch=launch)).stop(lambda _line: None)


def _preempt_once(fake_cloud, cluster: str, port: int, signs: tuple[str, ...], done: list) -> threading.Thread:
    """A thread that preempts `cluster` once the replica on 127.0.0.1:`port` reports any of `signs` in its
    /health (appending True to `done`), started."""
    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                if any(health[k] for k in signs):
                    fake_cloud.preempt(cluster)
                    done.append(True)
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.05)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher


@AT_LENGTH               # (~45 s; a replica killed mid-stage, above, is CI's smoke of replacement)
@pytest.mark.drill
def test_a_preempted_replica_cluster_is_launched_again_and_the_flow_is_unchanged(tmp_path, prefect_api, monkeypatch,
                                                                                 fake_cloud, s3_endpoint, bucket):
    """generate on sky with three replicas, each its own cluster: the cloud takes one back while iteration 1
    samples; the stage finishes on the others, the cluster is launched again, and the run's rollouts equal a run
    with one local replica. Every replica cluster is torn down with the flow."""
    from flows.training import train_flow
    from tasks.core.store import open_store

    monkeypatch.chdir(tmp_path)
    common = ["run.iterations=2", "generate.prompts_per_iteration=32", "generate.max_completion_length=24",
              "generate.batch_size=2", "generate.replica_threads=1", f"tracking.uri=sqlite:///{tmp_path}/m.db",
              f"store.endpoint_url={s3_endpoint}"]
    base = free_ports(3)
    sky = [*common, "generate.replicas=3", f"store.uri=s3://{bucket}/sky", "launcher.stages={generate: sky}",
           f"launcher.sky_python={fake_cloud.python}", f"launcher.recipes={ROOT / 'sky'}",
           f"generate.replica_port={base}"]
    cluster = "rlflow-tiny-demo-replica-1"
    preempted: list[bool] = []
    # (busy or has served: a batch can begin and end between two polls, so "busy" alone may never be seen; the
    # first poll after its first request preempts it, early in iteration 1 whatever the machine's load)
    watcher = _preempt_once(fake_cloud, cluster, base + 1, ("busy", "served"), preempted)
    out = train_flow(str(TINY), sky)
    watcher.join(5)
    assert out["iterations_completed"] == 2 and preempted
    assert LAUNCH_VAR not in os.environ        # (the launch is the stage's context: never in the environment)
    calls = [c for c in fake_cloud.calls() if c.get("cluster", "").startswith("rlflow-tiny-demo-replica-")]
    mine = [c["call"] for c in calls if c["cluster"] == cluster]
    assert mine.count("launch") == 2 and "preempted" in mine and mine[-1] == "down", mine
    assert {c["cluster"] for c in calls if c["call"] == "down"} == {f"rlflow-tiny-demo-replica-{i}" for i in range(3)}

    one = [*common, "generate.replicas=1", f"store.uri=s3://{bucket}/one"]
    train_flow(str(TINY), one)
    stores = [open_store(load_config(TINY, overrides)) for overrides in (sky, one)]
    for it in (1, 2):
        key = layout.rollouts("tiny-demo", it)
        assert len({(s.local(key) / "rollouts.jsonl").read_bytes() for s in stores}) == 1


@AT_LENGTH               # (~1 min; a replica killed while streaming, below, is CI's smoke of rows continued)
@pytest.mark.drill
def test_a_preempted_replica_cluster_while_streaming_loses_no_group(tmp_path, prefect_api, monkeypatch, fake_cloud,
                                                                     s3_endpoint, bucket):
    """generate.streaming on two replica clusters (generate on sky: the sampler in the flow, its rows decoded on
    the replicas): the cloud takes one back once it has decoded; its rows continue on the other, it is launched
    again, and every iteration trains on its prompts' groups once each, every token tagged with its version."""
    import json

    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    base = free_ports(2)
    overrides = ["run.name=skystream", "run.iterations=3", "run.max_staleness=1", "eval.every=0",
                 "generate.streaming.on_update=interrupt", "generate.prompts_per_iteration=4",
                 "generate.num_generations=4", "generate.max_completion_length=24", "generate.replicas=2",
                 "generate.replica_threads=1", f"generate.replica_port={base}", f"tracking.uri=sqlite:///{tmp_path}/m.db",
                 f"store.endpoint_url={s3_endpoint}", f"store.uri=s3://{bucket}/sky", "launcher.stages={generate: sky}",
                 f"launcher.sky_python={fake_cloud.python}", f"launcher.recipes={ROOT / 'sky'}"]
    cluster = "rlflow-skystream-replica-1"
    preempted: list[bool] = []
    watcher = _preempt_once(fake_cloud, cluster, base + 1, ("tokens",), preempted)
    out = train_flow(str(TINY), overrides)
    watcher.join(5)
    assert out["iterations_completed"] == 3 and preempted
    mine = [c["call"] for c in fake_cloud.calls() if c.get("cluster") == cluster]
    assert mine.count("launch") >= 2 and "preempted" in mine and mine[-1] == "down", mine
    from tasks.core.store import open_store

    store = open_store(load_config(TINY, overrides))
    for it in (1, 2, 3):
        lines = (store.local(layout.rollouts("skystream", it)) / "rollouts.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert sorted(r["group"] for r in records) == [j for j in range(4) for _ in range(4)]
        assert all(len(r["versions"]) == len(r["completion_ids"]) for r in records)


def test_replicas_that_cannot_start_are_said_at_once_not_after_the_start_timeout(tmp_path):
    """Local replicas whose every start fails (here: the config they are given cannot be read) fail the policy
    request after START_TRIES starts each, with the replica's own error, instead of waiting out
    generate.server_start_timeout (here 300 s; 15 min by default) while the watch starts them again."""
    from tasks.engines.replica_router import START_TRIES, Router

    cfg = _cfg(tmp_path, 2, "generate.server_start_timeout=300")
    router = Router(cfg, tmp_path / "missing.json", None)
    for m in router.members:
        threading.Thread(target=router._start, args=(m,), daemon=True).start()
    watcher = threading.Thread(target=router.watch, daemon=True)
    watcher.start()
    try:
        with pytest.raises(RuntimeError, match=f"every replica failed to start {START_TRIES} times") as e:
            router.set_policy("tiny-demo/policy/v000000", "digest")
        assert "missing.json" in str(e.value)
    finally:
        router.stop_members()
    watcher.join(60)
    assert not watcher.is_alive()           # the watch ends with the stop: no replica is started again after it


def test_streaming_on_replicas_loads_each_policy_in_place_and_a_lost_ones_rows_continue_elsewhere(tmp_path,
                                                                                                   monkeypatch):
    """generate.streaming on two replicas (tasks/engines/replica_stream.py): a policy published while rows are in
    flight is loaded by each replica in place (its request interrupted, its rows going on under it), and a replica
    killed while it holds rows has them continued on the other from their tokens so far: every token's behaviour
    logprob is its recorded version's on its whole prefix, some rows hold both versions, each iteration's groups
    come once in order, nothing decoded is discarded."""
    from tasks.core.models import base_path, load_model
    from tasks.engines.replica_stream import ReplicasDecoder
    from tasks.engines.streaming import Stream
    from tests.test_interruption import _teacher_forced
    from tests.test_vllm import _publish_full

    cfg = _cfg(tmp_path, 2, "run.name=rstream", "generate.top_p=1.0", "generate.max_completion_length=12",
               "run.iterations=3", "run.max_staleness=1", "generate.streaming.on_update=interrupt",
               "generate.prompts_per_iteration=4", "generate.num_generations=4")
    models, killed = {0: load_model(base_path(cfg)).eval()}, []
    real_step, real_send = ReplicasDecoder.step_batch, ReplicasDecoder._send

    def step_batch(self, rows, version, stop):
        if 1 not in models:                     # (published before the first request: the replicas are
            models[1] = _publish_full(cfg, 1, tmp_path)     # interrupted while their rows are part-way)
        return real_step(self, rows, version, stop)

    def send(self, i, version):
        if version == 1 and not killed and any(m == i for m, _ in self.placed.values()):
            url = self.http.get("/stats").json()["members"][str(i)]["url"]     # (killed just before a request
            os.kill(httpx.get(f"{url}/health", timeout=5).json()["pid"], signal.SIGKILL)   # with rows: lost)
            killed.append(i)
        return real_send(self, i, version)
    monkeypatch.setattr(ReplicasDecoder, "step_batch", step_batch)
    monkeypatch.setattr(ReplicasDecoder, "_send", send)
    monkeypatch.setattr("tasks.engines.streaming.WAIT_SECONDS", 0.0)       # (the pointer read at every step)
    stream = Stream.of(cfg, 1)
    try:
        records = {it: stream.collect(it)[0] for it in (1, 2, 3)}
    finally:
        discarded = Stream.stop_run("rstream")
        sampling_engine(cfg).stop(lambda _line: None)
    assert discarded == 0 and killed and stream.decoder.moved > 0
    mixed = 0
    for group in records.values():
        assert [r.group for r in group] == [j for j in range(4) for _ in range(4)]
        for r in group:
            assert len(r.versions) == len(r.completion_ids) == len(r.logprobs) and r.versions == sorted(r.versions)
            mixed += set(r.versions) == {0, 1}
            for v in set(r.versions):
                want = _teacher_forced(models[v], r.prompt_ids, r.completion_ids, cfg.generate.temperature)
                assert max(abs(a - b) for a, b, w in zip(want, r.logprobs, r.versions) if w == v) < 1e-4
    assert mixed > 0


def test_a_session_is_served_while_the_streaming_sampler_holds_the_replicas_and_the_fleet_ends_with_its_owner(
        tmp_path):
    """An evaluation's session opened while the streaming sampler's rows decode on the replicas it started (no
    policy wanted then): each replica loads the session's policy and serves it, the stream goes on (before: the
    policy request waited out generate.server_start_timeout, the run hung). The fleet's starter (a process here,
    the flow in a run) killed: the router and its replicas leave, not left orphaned."""
    import subprocess
    import sys

    from tasks.core.models import base_path, load_tokenizer
    from tasks.engines.streaming import Stream

    cfg = _cfg(tmp_path, 2, "run.name=rshare", "run.iterations=2", "run.max_staleness=1",
               "generate.streaming={}", "generate.prompts_per_iteration=4", "generate.num_generations=2",
               "generate.server_start_timeout=45")
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    owner = subprocess.Popen([sys.executable, "-c", "import sys, time; from tasks.core.config import Config; "
                              "from tasks.engines.replicas import ensure_router; ensure_router(Config."
                              f"model_validate_json(open({str(tmp_path / 'cfg.json')!r}).read())); print('up', "
                              "flush=True); time.sleep(600)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "up"
        router = ensure_router(cfg)                          # (the owner's, found again)
        stream = Stream.of(cfg, 1)
        assert len(stream.collect(1)[0]) == 8                # (iteration 2's rows decode meanwhile)
        path = base_path(cfg)
        with sampling_engine(cfg).session(layout.BASE, path, load_tokenizer(path)) as session:
            assert len(session.sample([[1, 2, 3]] * 4, SamplingParams(2, 4, 1.0, 1.0, seed=1)).samples) == 8
        assert len(stream.collect(2)[0]) == 8
        assert Stream.stop_run("rshare") == 0
        pids = [router["pid"]] + [httpx.get(f"{m['url']}/health", timeout=5).json()["pid"]
                                  for m in httpx.get(f"{router['url']}/stats", timeout=5).json()["members"].values()]
        owner.kill()
        deadline = time.monotonic() + 120      # (a bound on "never": they end within a poll or two)
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids)
    finally:
        Stream.stop_run("rshare")
        owner.kill()
        owner.wait()
        sampling_engine(cfg).stop(lambda _line: None)
