"""The standing drill suite: faults at random, and the result must equal a run that saw none.

  - kills: the run's whole process group is SIGKILLed three times at random moments spread over the run
    (start-up, or just after a random stage output appeared), restarted after each, then left to complete
    (inline and local launchers; the stage under way at each kill is recorded);
  - S3 faults: the whole run talks to S3 through tests/s3_faults.py (errors, replies lost after S3 applied
    the request, resets, truncated bodies, delays) with a short lease, so that renewals meet faults too;
  - two runs of different names in one bucket at once.
Every published policy must equal the clean run's bit for bit and every manifest in the bucket must verify.

`make test` runs one trial of 5% S3 faults (tests/test_resume.py's deterministic kills at S=0 run there too);
`make drills` runs every drill,
RLFLOW_DRILL_TRIALS of each (default there: 5), with S3 fault rates of 5% and 20%, and appends one JSON line
per trial to RLFLOW_DRILL_REPORT (docs/reliability.md has the figures).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import boto3
import pytest

from tasks.core import layout
from tasks.core.store import S3Store
from tests.conftest import AT_LENGTH, TINY, run_cli
from tests.s3_faults import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.drill]
TRIALS = int(os.environ.get("RLFLOW_DRILL_TRIALS", "1"))

RATES = [float(r) for r in os.environ.get("RLFLOW_DRILL_RATES", "0.05").split(",")]
ITERATIONS = 3
STAGES = ("generate", "reward", "train", "publish")


def _args(name: str, endpoint: str, bucket: str, extra=()) -> list[str]:
    return ["run", str(TINY), "-o", f"run.name={name}", "-o", f"run.iterations={ITERATIONS}",
            "-o", "generate.prompts_per_iteration=2", "-o", "generate.num_generations=2",
            "-o", "tracking.sample_completions=2", "-o", "launcher.retry_backoff_seconds=0.5",
            "-o", f"store.uri=s3://{bucket}/runs", "-o", f"store.endpoint_url={endpoint}", *extra]


def _bucket(endpoint: str) -> str:
    name = f"drill-{time.time_ns()}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


def _report(**row) -> None:
    if path := os.environ.get("RLFLOW_DRILL_REPORT"):
        with open(path, "a") as f:
            f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **row}) + "\n")


def _policies(store: S3Store, name: str) -> dict:
    return {it: store.manifest(layout.policy(name, it))["files"] for it in range(1, ITERATIONS + 1)}


def _verify_all(store: S3Store, name: str) -> int:
    """Every complete folder of the run verifies against its manifest; returns how many were checked."""
    folders = {k.rsplit("/", 1)[0] for k in store._list(f"{name}/") if k.endswith("/MANIFEST.json")}
    for key in folders:
        store.verify(key)
    return len(folders)


@pytest.fixture(scope="module")
def clean(prefect_api, s3_endpoint, tmp_path_factory):
    """The run without faults: its policies, per launcher (a remote store publishes deltas either way)."""
    cwd = tmp_path_factory.mktemp("drill-clean")
    bucket = _bucket(s3_endpoint)
    out = run_cli(_args("drill", s3_endpoint, bucket), cwd, prefect_api)
    assert out.returncode == 0, out.stderr[-2000:]
    return _policies(S3Store(f"s3://{bucket}/runs", type("C", (), {"endpoint_url": s3_endpoint})()), "drill")


def _stage_under_way(store: S3Store, name: str) -> str:
    """The first stage output (in the order they are written) that is not there yet: what a kill interrupted."""
    for it in range(1, ITERATIONS + 1):
        for stage, key in zip(STAGES, (layout.rollouts, layout.rewards, layout.checkpoint, layout.policy),
                              strict=True):
            if store.manifest(key(name, it)) is None:
                return stage
    return "finish"           # after the last policy: evaluate, the final checkpoint, teardown


OUTPUTS = [(stage, it) for it in range(1, ITERATIONS + 1) for stage in STAGES]     # in the order they are written
KEY_OF = dict(zip(STAGES, (layout.rollouts, layout.rewards, layout.checkpoint, layout.policy), strict=True))


def _kill_after(proc: subprocess.Popen, store: S3Store, target: int, rng: random.Random) -> str | None:
    """SIGKILL the run's process group a random moment after output `target` appeared (-1: during start-up);
    returns the stage that was under way, or None when the run ended first."""
    if target < 0:
        try:
            proc.wait(timeout=rng.uniform(0.5, 6))
            return None
        except subprocess.TimeoutExpired:
            pass
    else:
        stage, it = OUTPUTS[target]
        while store.manifest(KEY_OF[stage]("drill", it)) is None:
            if proc.poll() is not None:
                return None
            time.sleep(0.1)
        time.sleep(rng.uniform(0, 1.5))
        if proc.poll() is not None:
            return None
    under_way = "start-up" if target < 0 else _stage_under_way(store, "drill")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return under_way


@pytest.mark.parametrize("launcher", [pytest.param("inline", marks=AT_LENGTH), pytest.param("local", marks=AT_LENGTH)])
def test_random_kills_then_resume_equal_the_clean_run(prefect_api, s3_endpoint, tmp_path, clean, launcher):
    """Three kills a trial at random moments spread over the run (start-up, or just after a random stage
    output appeared: in whatever runs then), restarting after each; then the run completes."""
    from tests.conftest import ROOT

    rng = random.Random(int(os.environ.get("RLFLOW_DRILL_SEED", "0")) * 1000 + (launcher == "local"))
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    for trial in range(TRIALS):
        bucket = _bucket(s3_endpoint)
        store = S3Store(f"s3://{bucket}/runs", type("C", (), {"endpoint_url": s3_endpoint})())
        argv = [sys.executable, "-m", "flows.cli", *_args("drill", s3_endpoint, bucket, [
            "-o", f"launcher.where={launcher}", "-o", f"launcher.recipes={ROOT / 'sky'}"])]
        targets = sorted(rng.sample(range(-1, len(OUTPUTS) - 1), 3))
        kills: dict[str, int] = {}
        cwd = tmp_path / f"t{trial}"
        cwd.mkdir()
        for target in [*targets, None]:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
            if target is not None and (stage := _kill_after(proc, store, target, rng)) is not None:
                kills[stage] = kills.get(stage, 0) + 1
                continue
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-2000:]
        assert _policies(store, "drill") == clean
        checked = _verify_all(store, "drill")
        _report(drill="kills", launcher=launcher, trial=trial, kills=kills, restarts=sum(kills.values()),
                 folders_verified=checked)


@pytest.mark.parametrize("rate", RATES)
def test_a_run_through_s3_faults_equals_the_clean_run(prefect_api, s3_endpoint, tmp_path, clean, rate):
    for trial in range(TRIALS):
        proxy = FaultProxy(s3_endpoint, seed=trial)
        try:
            bucket = _bucket(s3_endpoint)
            proxy.rates = {"error": rate / 4, "applied_then_error": rate / 4, "reset": rate / 4,
                           "truncate": rate / 4, "delay": rate / 4}
            started = time.perf_counter()
            out = run_cli(_args("drill", proxy.url, bucket, ["-o", "run.lease_seconds=5"]), tmp_path, prefect_api)
            seconds = time.perf_counter() - started
            assert out.returncode == 0, out.stderr[-3000:]
            proxy.rates = {}
            store = S3Store(f"s3://{bucket}/runs", type("C", (), {"endpoint_url": s3_endpoint})())
            assert _policies(store, "drill") == clean
            checked = _verify_all(store, "drill")
            assert store.read_tagged("drill/LEASE.json")[0] is None                 # released
            retried = out.stderr.count("Retrying") + out.stdout.count("Retrying")
            _report(drill="s3-faults", rate=rate, trial=trial, requests=proxy.requests,
                    faults={k: v for k, v in proxy.counts.items() if v}, stage_retries=retried,
                    seconds=round(seconds, 1), folders_verified=checked)
        finally:
            proxy.close()


@AT_LENGTH
def test_two_runs_in_one_bucket_at_once(prefect_api, s3_endpoint, tmp_path, clean):
    bucket = _bucket(s3_endpoint)
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    procs = []
    for name in ("drill", "other"):
        (tmp_path / name).mkdir()
        procs.append(subprocess.Popen([sys.executable, "-m", "flows.cli", *_args(name, s3_endpoint, bucket)],
                                      cwd=tmp_path / name, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
    store = S3Store(f"s3://{bucket}/runs", type("C", (), {"endpoint_url": s3_endpoint})())
    assert _policies(store, "drill") == clean
    assert _policies(store, "other")[1] == clean[1]     # the same config and seed (later ones: deltas name their run)
    _report(drill="two-runs-one-bucket", folders_verified=_verify_all(store, "drill") + _verify_all(store, "other"))


def _command(pid: int) -> str:
    """A process's command line, short (what a drill killed)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return "gone"
    return " ".join(a.rsplit("/", 1)[-1] for a in argv if a)[:80]


STREAMED = ["run.name=streamed", "run.iterations=4", "run.max_staleness=1", "generate.prompts_per_iteration=4",
            "generate.num_generations=4", "train.lr=1e-2", "eval.every=0", "launcher.retry_backoff_seconds=0.5",
            "tracking.sample_completions=2"]


@pytest.mark.parametrize("launcher", [pytest.param("inline", marks=AT_LENGTH), pytest.param("local", marks=AT_LENGTH)])
@pytest.mark.parametrize("on_update", ["interrupt", "finish"])
def test_random_kills_of_a_streamed_run_train_every_prompt_once(prefect_api, tmp_path, launcher, on_update):
    """generate.streaming under three SIGKILLs a trial at random moments (start-up, or just after a random group
    or policy was committed), each of the flow's whole process group or of one process it started (the reward
    worker, a stage process), restarting the run where it died: every iteration still trains on the stage
    mode's prompts, each group once, every token within the staleness, and every group committed before a kill
    is the one trained on (streaming depends on timing: the weights are not compared)."""
    from tasks.core.processes import descendants
    from tasks.core.store import Store
    from tests.test_streaming import trained_each_prompt_once

    rng = random.Random(int(os.environ.get("RLFLOW_DRILL_SEED", "0")) * 1000 + 10 * (launcher == "local")
                        + (on_update == "finish"))
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    targets = [("group", it, j) for it in range(1, 5) for j in range(4)] + [("policy", it, 0) for it in (1, 2, 3)]
    for trial in range(TRIALS):
        cwd = tmp_path / f"t{trial}"
        cwd.mkdir()
        where = [f"launcher.where={launcher}", "launcher.stages.generate=inline"]    # (the sampler: the flow's)
        args = [a for o in [*STREAMED, f"generate.streaming.on_update={on_update}", *where] for a in ("-o", o)]
        argv = [sys.executable, "-m", "flows.cli", "run", str(TINY), *args]
        uri = cwd / "rlflow-store"
        kills, committed = [], {}
        proc, log = None, cwd / "stderr.log"
        for target in [*rng.sample([(-1, 0, 0), *targets], 3), None]:
            if proc is None or proc.poll() is not None:     # (the first start, or after a kill of the whole run)
                assert proc is None or proc.returncode == -signal.SIGKILL, (kills, log.read_text()[-3000:])
                with open(log, "w") as err:
                    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                            start_new_session=True)
            if target is None:
                break
            kind, it, j = target
            if kind == -1:
                time.sleep(rng.uniform(0.5, 6))
            else:
                key = layout.stream_group("streamed", it, j) if kind == "group" else layout.policy("streamed", it)
                while proc.poll() is None and not (uri / key / "MANIFEST.json").exists():
                    time.sleep(0.05)
                time.sleep(rng.uniform(0, 1.5))
            if proc.poll() is not None:
                continue
            whole = rng.random() < 0.6 or not descendants(proc.pid)
            if whole:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            else:
                victim = rng.choice(descendants(proc.pid))
                what = _command(victim)
                try:
                    os.kill(victim, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            kills.append("flow" if whole else f"one process ({what})")
            store = Store.open(str(uri))
            committed.update({(i, g): m for i in range(1, 5) for g in range(4)
                              if (m := store.manifest(layout.stream_group("streamed", i, g))) is not None})
        proc.wait(timeout=900)          # (a process killed alone: the run carries on, retrying what it ran)
        assert proc.returncode == 0, (kills, log.read_text()[-3000:])
        trained_each_prompt_once(uri, args, "streamed", 4)
        store = Store.open(str(uri))
        for (i, g), manifest in committed.items():
            assert store.manifest(layout.stream_group("streamed", i, g)) == manifest, (i, g, kills)
        _report(drill="streamed kills", launcher=launcher, on_update=on_update, trial=trial, kills=kills)


def _sft_step(store_dir) -> int:
    """The step of the warm start's latest checkpoint (0: none yet)."""
    from tasks.core.store import Store

    try:
        target = Store.open(str(store_dir)).get_pointer(layout.latest("warm/sft", "trainer"))
    except (OSError, ValueError):
        return 0
    return int(target.rsplit("-", 1)[1]) if target else 0


@AT_LENGTH
def test_random_kills_of_a_warm_start_publish_the_v0_of_one_never_killed(prefect_api, tmp_path):
    """`rlflow sft` (issue 43) SIGKILLed three times a trial at random moments (during start-up, or just after a
    random one of its checkpoints was committed: in a step, a checkpoint being written, v0 being published),
    restarted after each: the v0 it publishes equals the one a run never killed publishes, bit for bit, and every
    folder in the store verifies."""
    import hashlib

    from tasks.core.store import Store

    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"prompt": f"{chr(97 + i)}=", "completion": chr(98 + i) * 3}) + "\n"
                             for i in range(16)))
    args = [a for o in [f"warmup.path={demos}", "warmup.epochs=3", "warmup.batch_size=4", "warmup.lr=1e-3",
                        "warmup.checkpoint_every=2", "run.name=warm"] for a in ("-o", o)]

    def v0(store_dir) -> str:
        manifest = Store.open(str(store_dir)).manifest(layout.policy("warm", 0))
        return hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()

    clean = tmp_path / "clean"
    clean.mkdir()
    started = time.monotonic()
    out = run_cli(["sft", str(TINY), *args], clean, prefect_api)
    assert out.returncode == 0, out.stderr[-2000:]
    length = time.monotonic() - started
    rng = random.Random(int(os.environ.get("RLFLOW_DRILL_SEED", "0")) * 1000 + 7)
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    for trial in range(TRIALS):
        cwd = tmp_path / f"t{trial}"
        cwd.mkdir()
        kills = []
        for step in sorted(rng.sample([-1, 2, 4, 6, 8, 10], 3)):      # (12 steps, a checkpoint every 2)
            proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "sft", str(TINY), *args], cwd=cwd, env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            if step < 0:
                time.sleep(rng.uniform(0.5, length))
            else:              # (the latest checkpoint's pointer at `step` or past it: older ones are deleted)
                while proc.poll() is None and _sft_step(cwd / "rlflow-store") < step:
                    time.sleep(0.005)
                time.sleep(rng.uniform(0, 0.05))
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                kills.append("start-up" if step < 0 else f"after checkpoint {step}")
        out = run_cli(["sft", str(TINY), *args], cwd, prefect_api)
        assert out.returncode == 0, out.stderr[-2000:]
        assert v0(cwd / "rlflow-store") == v0(clean / "rlflow-store"), trial
        checked = _verify_all(Store.open(str(cwd / "rlflow-store")), "warm")
        _report(drill="warm start kills", trial=trial, kills=kills, folders_verified=checked)
