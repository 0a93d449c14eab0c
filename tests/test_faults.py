"""Faults between rlflow and its store: S3 requests that fail, replies lost after S3 applied them, bodies that
break off or come truncated (tests/s3_faults.py, a proxy in front of the moto server)."""

from __future__ import annotations

import json
import time

import boto3
import pytest

from tasks.core.lease import Lease
from tasks.core.store import S3Store
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
             "from tasks.core.tracking import _client\n"
             "for uri in sys.argv[1:]:\n"
             "    c = _client(uri)\n"
             "    c.search_experiments(); c.search_registered_models()\n"
             "    name = uri.rsplit('/', 1)[1]\n"
             "    if c.get_experiment_by_name(name) is None:\n"
             "        c.create_experiment(name)\n")


@pytest.mark.drill
def test_a_kill_while_mlflow_creates_its_database_cannot_break_it(tmp_path):
    """MLflow migrates a new sqlite database in place for seconds; killed in there, it used to be broken for
    every later run ("duplicate column name"). Kills across the creation; then every database works."""
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    uris = []
    for i, delay in enumerate([1.6, 2.0, 2.4, 2.8, 3.2, 3.6]):
        uri = f"sqlite:///{tmp_path}/db{i}.db"
        proc = subprocess.Popen([sys.executable, "-c", CREATE_DB, uri], cwd=ROOT, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        uris.append(uri)
    out = subprocess.run([sys.executable, "-c", CREATE_DB, *uris], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-1500:]
    assert not list(tmp_path.glob(".*creating*"))                  # the killed creators' temporary files
