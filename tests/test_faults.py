"""Faults between rlflow and its store: S3 requests that fail, replies lost after S3 applied them, bodies that
break off or come truncated (tests/s3_faults.py, a proxy in front of the moto server)."""

from __future__ import annotations

import hashlib
import json
import random
import time

import boto3
import pytest

from tasks.core.lease import Lease
from tasks.core.store import S3Store
from tests.conftest import AT_LENGTH
from tests.s3_faults import FaultProxy, Rule


@pytest.fixture
def proxy(s3_endpoint):
    p = FaultProxy(s3_endpoint, seed=7)
    yield p
    p.close()


@pytest.fixture
def faulty_store(proxy, s3_endpoint):
    name = f"faults-{time.time_ns()}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return S3Store(f"s3://{name}/runs", type("C", (), {"endpoint_url": proxy.url})())


def test_small_reads_survive_bodies_that_break_off(proxy, faulty_store):
    faulty_store._put_bytes("r/pointer", b"x" * 5000)
    proxy.rules += [Rule("truncate", method="GET", path="r/pointer", times=2),
                    Rule("reset", method="GET", path="r/pointer", times=2)]
    data, tag = faulty_store.read_tagged("r/pointer")
    assert data == b"x" * 5000 and tag
    assert proxy.counts["truncate"] == 2 and proxy.counts["reset"] == 2


def test_folders_round_trip_and_verify_at_a_fifth_of_requests_faulty(proxy, faulty_store, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"f{i}.bin").write_bytes(bytes([i]) * (3000 + 397 * i))
    proxy.rates = {"error": 0.05, "applied_then_error": 0.05, "reset": 0.05, "truncate": 0.05}
    faulty_store.put_folder("r/artifact", src)
    faulty_store.get_folder("r/artifact", tmp_path / "dst")            # verified against the manifest
    got = tmp_path / "dst"
    for i in range(30):
        assert (got / f"f{i}.bin").read_bytes() == (src / f"f{i}.bin").read_bytes()
    assert sum(proxy.counts.values()) >= 5, proxy.counts


def test_a_renewal_whose_reply_was_lost_is_not_a_takeover_and_release_releases(proxy, faulty_store):
    lease = Lease(faulty_store, "r", 60)
    lease._renew_loop = lambda: None               # renewals by hand here
    lease.acquire()
    for kind in ("applied_then_error", "reset"):
        proxy.rules.append(Rule(kind, method="PUT", path="LEASE.json", times=1))   # applied, reply lost
        try:
            lease.renew()
        except Exception:                   # botocore gave up on the retries: the next renewal must still hold
            lease.renew()
        assert lease.lost is None
        assert json.loads(faulty_store.read_tagged("r/LEASE.json")[0])["owner"] == lease.owner
    proxy.rules += [Rule("applied_then_error", method="PUT", path="LEASE.json", times=1),
                    Rule("error", method="GET", path="LEASE.json", times=6)]
    try:
        lease.renew()
    except Exception:
        pass
    lease.release()
    assert faulty_store.read_tagged("r/LEASE.json")[0] is None


def test_a_lease_holds_through_many_renewals_at_a_fifth_of_requests_faulty(proxy, faulty_store):
    lease = Lease(faulty_store, "r", 60)
    lease._renew_loop = lambda: None
    lease.acquire()
    proxy.rates = {"error": 0.05, "applied_then_error": 0.05, "reset": 0.05, "truncate": 0.05}
    failed = 0
    for _ in range(40):
        try:
            lease.renew()
        except Exception as e:       # a renewal may fail (retries used up); it must never be taken for lost
            assert "taken over" not in str(e)
            failed += 1
    assert lease.lost is None and failed < 10
    lease.release()
    proxy.rates = {}
    assert faulty_store.read_tagged("r/LEASE.json")[0] is None


CREATE_DB = ("import sys\n"
             "from tasks.core.tracking_db import tracking_client\n"
             "for uri in sys.argv[1:]:\n"
             "    c = tracking_client(uri)\n"
             "    c.search_experiments(); c.search_registered_models()\n"
             "    name = uri.rsplit('/', 1)[1]\n"
             "    if c.get_experiment_by_name(name) is None:\n"
             "        c.create_experiment(name)\n")


@pytest.mark.drill
def test_a_kill_while_mlflow_creates_its_database_cannot_break_it(tmp_path):
    """MLflow migrates a new sqlite database in place for seconds; killed in there, it used to be broken for
    every later run ("duplicate column name"). Kills across the creation (from a cache with no empty database
    kept: the migrations run, then the empty one is kept and copied); then every database works."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    uris = []
    env = {**os.environ, "RLFLOW_CACHE": str(tmp_path / "cache")}
    for i, delay in enumerate([1.8, 2.4, 3.0, 3.6, 4.2]):
        uri = f"sqlite:///{tmp_path}/db{i}.db"
        proc = subprocess.Popen([sys.executable, "-c", CREATE_DB, uri], cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        uris.append(uri)
    out = subprocess.run([sys.executable, "-c", CREATE_DB, *uris], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-1500:]
    assert not list(tmp_path.glob(".*creating*"))                  # the killed creators' temporary files
    assert len(list((tmp_path / "cache" / "mlflow-db").glob("empty-*.db"))) == 1


def _dump(database) -> tuple:
    """A sqlite database's tables (their columns), indexes and every row, the Default experiment's times aside.
    (Not the tables' SQL: MLflow's migrations write the values of a CHECK constraint in an order of their own.)"""
    import sqlite3

    with sqlite3.connect(database) as db:
        tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()]
        schema = sorted((name, db.execute(f'PRAGMA table_info("{name}")').fetchall()) for name in tables)
        schema += sorted(db.execute("SELECT name, tbl_name FROM sqlite_master WHERE type = 'index'").fetchall())
        rows = {name: sorted(map(str, db.execute(f'SELECT * FROM "{name}"').fetchall())) for name in tables}
        rows["experiments"] = sorted(map(str, db.execute(
            "SELECT experiment_id, name, artifact_location, lifecycle_stage, workspace FROM experiments").fetchall()))
    db.close()
    return schema, rows


def test_a_new_database_is_a_copy_of_the_kept_empty_one_equal_to_a_migrated_one(tmp_path, monkeypatch):
    """The first sqlite database of an environment is migrated by MLflow and an empty copy kept; the next ones are
    copies of it, equal to a migrated one table for table and row for row (the Default experiment's artifact
    location is the folder each is opened from); a kept copy that is damaged (cut short: sqlite sees it) or that
    MLflow refuses (another schema revision) is replaced by migrating again; a cache that cannot be read is no
    error; the part of a kept copy that a killed process was writing goes once a database is copied."""
    import sqlite3
    import subprocess
    import sys

    from tasks.core import tracking_db

    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))
    kept = tracking_db._empty_database()
    made = []
    for name in ("migrated", "copied", "cut-short", "another-revision", "unreadable-cache"):
        folder = tmp_path / name
        folder.mkdir()
        monkeypatch.chdir(folder)
        if name == "copied":                # (a process gone since: its pid, reaped)
            dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True, check=True).stdout.strip()
            for suffix in ("", "-journal"):
                (kept.parent / f".{kept.name}.creating-{dead}-1{suffix}").write_bytes(b"cut short")
        if name == "cut-short":
            kept.write_bytes(kept.read_bytes()[:5000])
        if name == "another-revision":
            with sqlite3.connect(kept) as db:
                db.execute("UPDATE alembic_version SET version_num = 'ffffffffffff'")
            db.close()
        if name == "unreadable-cache":
            monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache" / "mlflow-db" / kept.name / "under-a-file"))
        client = tracking_db.tracking_client(f"sqlite:///{folder}/mlflow.db")
        made.append(_dump(folder / "mlflow.db"))
        assert client.create_experiment("x") == "1" and client.create_registered_model("m").name == "m"
        tracking_db._dispose_engines(client)
        assert kept.stat().st_size > 5000 and f"'{folder}/mlruns/0'" in str(made[-1][1]["experiments"])
        assert not list(folder.glob(".*")) and not list(kept.parent.glob(".*"))
        with sqlite3.connect(kept) as db:
            assert db.execute("SELECT version_num FROM alembic_version").fetchone() != ("ffffffffffff",)
        db.close()
    for other in made[1:]:
        assert other[0] == made[0][0]
        assert {k: v for k, v in other[1].items() if k != "experiments"} == \
            {k: v for k, v in made[0][1].items() if k != "experiments"}


SMALL = ["-o", "run.name=rot", "-o", "generate.prompts_per_iteration=2", "-o", "generate.num_generations=2",
         "-o", "tracking.sample_completions=2", "-o", "launcher.retry_backoff_seconds=0"]


@pytest.mark.slow
@pytest.mark.drill
@AT_LENGTH
@pytest.mark.parametrize("mode", ["inline", "local"])
def test_a_corrupt_committed_artifact_is_moved_aside_and_made_again(prefect_api, tmp_path, mode):
    """A byte of the newest published policy flips after its manifest was written; the next iteration's
    generate reads it: one line names the file, the policy goes to <run>/quarantine/, publish makes it again
    (here it first finds the checkpoint it copies corrupt too: on a file store the policy's weights are a hard
    link to the checkpoint's, so train makes that again from iteration 2's state), the remade policy is the
    one written before, bit for bit, and the run goes on; no stage is retried for it (in-process, or through
    a stage process's exit 3)."""
    from tasks.core import layout
    from tasks.core.store import Store
    from tests.conftest import ROOT, TINY, run_cli

    extra = ["-o", f"launcher.where={mode}", "-o", f"launcher.recipes={ROOT / 'sky'}"]
    out = run_cli(["run", str(TINY), *SMALL, *extra, "-o", "run.iterations=3"], tmp_path, prefect_api)
    assert out.returncode == 0, out.stderr[-2000:]
    store = Store.open(str(tmp_path / "rlflow-store"))
    written = {it: store.manifest(layout.policy("rot", it))["files"] for it in (1, 2, 3)}
    weights = tmp_path / "rlflow-store" / "rot" / "policy" / "v000003" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10
    weights.write_bytes(bytes(data))

    out = run_cli(["run", str(TINY), *SMALL, *extra, "-o", "run.iterations=4"], tmp_path, prefect_api)
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("corrupt artifact:")]
    assert len(said) == 2, out.stdout + out.stderr
    assert "rot/policy/v000003/model.safetensors: sha256 does not match MANIFEST.json" in said[0]
    assert "making it again (publish of iteration 3)" in said[0]
    assert "rot/trainer/ckpt-000003/model/model.safetensors: sha256 does not match" in said[1]
    assert "making it again (train of iteration 3)" in said[1]
    assert "Retrying" not in out.stdout + out.stderr                      # not taken for an infrastructure fault

    [moved] = store.list_folders("rot/quarantine/policy")
    assert moved.startswith("v000003-") and store.list_folders("rot/quarantine/trainer")[0].startswith("ckpt-000003-")
    for it in (1, 2, 3):
        store.verify(layout.policy("rot", it))
        assert store.manifest(layout.policy("rot", it))["files"] == written[it]      # the same weights
    store.verify(layout.policy("rot", 4))


@pytest.mark.slow
def test_a_corrupt_full_checkpoint_or_curriculum_state_is_rebuilt_in_the_same_run(prefect_api, tmp_path):
    """A resident trainer's full checkpoint and the curriculum's state are made by no stage: found corrupt, each
    was quarantined and the run ended asking to be run again. Now the stage that read it runs again and rebuilds
    that state from the one before it (an older full checkpoint, or none, and the stored rewards since), in the
    same run, and the next policy is the uninterrupted run's, bit for bit. The optimizer's file is replaced with
    bytes its manifest is made to match (edited with it): they do not decode, which was a traceback after
    Prefect's retries (artifacts.stored)."""
    import shutil

    from tasks.core import layout
    from tasks.core.store import Store
    from tests.conftest import TINY, run_cli

    args = ["run", str(TINY), *SMALL, "-o", "data.curriculum={defer: 2}"]
    out = run_cli([*args, "-o", "run.iterations=3"], tmp_path, prefect_api)
    assert out.returncode == 0, out.stderr[-2000:]
    shutil.copytree(tmp_path / "rlflow-store", tmp_path / "before")
    out = run_cli([*args, "-o", "run.iterations=4"], tmp_path, prefect_api)            # the uninterrupted run
    assert out.returncode == 0, out.stderr[-2000:]
    clean = Store.open(str(tmp_path / "rlflow-store")).manifest(layout.policy("rot", 4))["files"]

    shutil.rmtree(tmp_path / "rlflow-store")
    (tmp_path / "before").rename(tmp_path / "rlflow-store")
    store = Store.open(str(tmp_path / "rlflow-store"))
    assert store.manifest(layout.full_checkpoint("rot", 3)) and store.manifest(layout.curriculum("rot", 2))
    path = tmp_path / "rlflow-store" / layout.curriculum("rot", 2) / "state.json"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    folder = tmp_path / "rlflow-store" / layout.full_checkpoint("rot", 3)
    (folder / "optimizer.pt").write_bytes(random.Random(0).randbytes(4096))   # (fixed bytes: one outcome)
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    manifest["files"]["optimizer.pt"] = {"size": 4096, "sha256": hashlib.sha256((folder / "optimizer.pt")
                                                                                .read_bytes()).hexdigest()}
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    latest = tmp_path / "rlflow-store" / layout.latest("rot", "policy")
    latest.write_text(json.dumps({"target": "rot/policy/v000009"}))          # (edited: no such version)
    out = run_cli([*args, "-o", "run.iterations=4"], tmp_path, prefect_api)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pointer mended: " in out.stderr and "points at rot/policy/v000009" in out.stderr    # (said, not logged)
    said = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("corrupt artifact:")]
    assert len(said) == 2 and all(line.endswith("rebuilding it from the state before it") for line in said), said
    assert {"trainer", "curriculum"} <= set(store.list_folders("rot/quarantine"))
    assert store.manifest(layout.policy("rot", 4))["files"] == clean
