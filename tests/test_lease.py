"""One writer per run name: the run lease in the store (file and S3), and through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import boto3
import pytest

from tasks.core.errors import UserError
from tasks.core.lease import Lease, LeaseLost
from tasks.core.store import FileStore, S3Store
from tests.conftest import AT_LENGTH, TINY, read_summary, run_cli, s3_overrides


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.server)])
def store(request, tmp_path):
    if request.param == "file":
        return FileStore(str(tmp_path / "store"))
    s3_endpoint = request.getfixturevalue("s3_endpoint")
    name = f"lease-{time.time_ns()}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return S3Store(f"s3://{name}/runs", type("C", (), {"endpoint_url": s3_endpoint})())


def _foreign(store, run: str, expires_in: float, host="elsewhere", pid=1) -> None:
    """A lease held by a flow on another machine."""
    store.write_if(f"{run}/LEASE.json", json.dumps({"owner": "other", "holder": f"{host} pid {pid}", "host": host,
                                                   "pid": pid, "expires_at": time.time() + expires_in}).encode(),
                   store.read_tagged(f"{run}/LEASE.json")[1])


def test_a_live_lease_refuses_a_second_writer_and_names_the_holder(store):
    _foreign(store, "r", 60)
    with pytest.raises(UserError, match=r"run.name 'r': another flow run is writing this run \(elsewhere pid 1"):
        Lease(store, "r", 60).acquire()


def test_an_expired_lease_is_taken_over_and_the_old_holder_learns_it(store):
    old = Lease(store, "r", 60).acquire()
    old._stop.set()                                   # the old holder stops renewing (a hung machine)
    _foreign(store, "r", -1)                          # ... and its lease has expired
    new = Lease(store, "r", 60).acquire()
    with pytest.raises(Exception, match="taken over"):
        old.renew()
    new.release()
    assert store.read_tagged("r/LEASE.json")[0] is None


def _holder(store, run: str) -> str | None:
    data = store.read_tagged(f"{run}/LEASE.json")[0]
    return json.loads(data)["owner"] if data else None


def test_a_dead_process_on_this_machine_does_not_block_and_a_live_one_does(store):
    import socket

    here = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _foreign(store, "r", 600, host=here, pid=dead.pid)
    lease = Lease(store, "r", 60).acquire()
    assert _holder(store, "r") == lease.owner                   # taken over at once, not after 600 s
    lease.release()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])    # exited, never reaped: not a writer either
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)     # (waits for its exit, leaves it unreaped)
    _foreign(store, "z", 600, host=here, pid=zombie.pid)
    Lease(store, "z", 60).acquire().release()
    zombie.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _foreign(store, "l", 600, host=here, pid=live.pid)
        with pytest.raises(UserError, match="another flow run is writing this run"):
            Lease(store, "l", 60).acquire()
        assert _holder(store, "l") == "other"
    finally:
        live.kill()
        live.wait()


def test_exactly_one_of_racing_writers_wins(store, monkeypatch):
    """Six threads take the same lease at once: one wins. (moto checks If-None-Match and then stores, unlocked,
    where S3 does both as one: its conditional put is made one here, in moto's threads of this process; two
    winners were seen about once in 100 tries at a short GIL switch interval.)"""
    from moto.s3.responses import S3Response

    lock, put = threading.Lock(), S3Response.put_object

    def put_as_one(self, *args, **kwargs):
        with lock:
            return put(self, *args, **kwargs)

    monkeypatch.setattr(S3Response, "put_object", put_as_one)
    results = []

    def take():
        try:
            results.append(Lease(store, "race", 60).acquire())
        except UserError:
            results.append(None)

    threads = [threading.Thread(target=take) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    winners[0].release()


def test_run_names_have_separate_leases(store):
    a, b = Lease(store, "a", 60).acquire(), Lease(store, "b", 60).acquire()
    assert (_holder(store, "a"), _holder(store, "b")) == (a.owner, b.owner)
    with pytest.raises(UserError, match="run.name 'a': another flow run"):
        Lease(store, "a", 60).acquire()
    a.release()
    assert (_holder(store, "a"), _holder(store, "b")) == (None, b.owner)      # releasing one leaves the other
    b.release()
    if isinstance(store, FileStore):         # the compare-and-swap lock files live outside the runs' folders
        assert [p.name for p in store.path.rglob("*") if p.is_file() and ".locks" not in p.parts] == []
        assert store._list("") == []


@AT_LENGTH
@pytest.mark.slow
def test_cli_refuses_a_second_run_of_the_same_name_and_runs_another_name_beside_it(prefect_api, s3_endpoint, bucket,
                                                                                   tmp_path):
    store = S3Store(f"s3://{bucket}/runs", type("C", (), {"endpoint_url": s3_endpoint})())
    _foreign(store, "busy", 300)
    small = ["-o", "run.iterations=1", "-o", "generate.prompts_per_iteration=2", "-o", "generate.num_generations=2"]
    out = run_cli(["run", str(TINY), *s3_overrides(s3_endpoint, bucket), "-o", "run.name=busy", *small],
                  tmp_path, prefect_api)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error: run.name 'busy': another flow run is writing this run")
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys == ["runs/busy/LEASE.json"]            # nothing written under the busy run

    out = run_cli(["run", str(TINY), *s3_overrides(s3_endpoint, bucket), "-o", "run.name=free", *small,
                   "--summary-json", str(tmp_path / "s.json")], tmp_path, prefect_api)
    assert out.returncode == 0, out.stderr[-2000:]
    assert read_summary(tmp_path / "s.json")["iterations_completed"] == 1
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]]
    assert "runs/busy/LEASE.json" in keys and not any(k.startswith("runs/busy/") and k != "runs/busy/LEASE.json"
                                                      for k in keys)
    assert not any(k == "runs/free/LEASE.json" for k in keys)   # released at the end


def test_a_holder_whose_renewals_went_unanswered_past_expiry_confirms_before_its_next_stage(store, monkeypatch):
    """The store stopped answering the renewals (stopped, unreachable) for longer than the lease: it may have
    expired and been taken over. Before its next stage the holder renews first: still its own (the
    compare-and-swap holds), it goes on; taken over, it stops (it wrote on beside the new holder until its
    renewal thread's next tick, or for good where that thread was stuck in the store's retries); while the store
    still does not answer, no stage starts."""
    held = Lease(store, "r", 1).acquire()
    held._stop.set()
    held._thread.join()                           # (its renewals from here on are the ones that went unanswered)
    held.check()                                  # (within its time: nothing to confirm)
    time.sleep(1.2)                               # (at least this long: a loaded machine only makes it longer)
    before = json.loads(store.read_tagged("r/LEASE.json")[0])["expires_at"]
    held.check()                                  # nobody took it: renewed, goes on
    assert json.loads(store.read_tagged("r/LEASE.json")[0])["expires_at"] > before and held.lost is None

    time.sleep(1.2)
    real = store.write_if
    monkeypatch.setattr(store, "write_if", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("no answer")))
    with pytest.raises(RuntimeError, match=r"^run 'r': the run's lease was last renewed \d+ s ago \(past "
                                           r"run.lease_seconds, 1 s: it may have expired\) and the store does not "
                                           r"answer its renewal \(ConnectionError: no answer\); no stage starts"):
        held.check()
    monkeypatch.setattr(store, "write_if", real)
    other = Lease(store, "r", 60).acquire()       # the lease expired meanwhile: another flow run takes it over
    with pytest.raises(LeaseLost, match="taken over by another flow run"):
        held.check()
    other.release()
