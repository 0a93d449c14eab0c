"""Store contract: a folder is complete only with its manifest; readers verify sizes and sha256 and name the
bad file; a pointer never names an incomplete folder. Checked on both backends (local folder, S3 server)."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import pytest

from tasks.core.config import StoreConfig
from tasks.core.errors import UserError
from tasks.core.store import MANIFEST, IncompleteArtifact, Store


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.server)])
def store(request, tmp_path):
    if request.param == "file":
        return Store.open(f"file://{tmp_path / 'store'}")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("bucket")
    return Store.open(StoreConfig(uri=f"s3://{bucket}/root", endpoint_url=endpoint, multipart_chunk_mb=5))


def _folder(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True, exist_ok=True)
    (src / "a.bin").write_bytes(b"x" * 1000)
    (src / "sub" / "b.json").write_text(json.dumps({"k": 1}))
    return src


def _tamper(store, key: str, rel: str, data: bytes) -> None:
    store._put_bytes(f"{key}/{rel}", data)   # a writer outside rlflow, or a disk/network fault


def test_roundtrip_verifies(store, tmp_path):
    manifest = store.put_folder("run/policy/v000001", _folder(tmp_path), meta={"iteration": 1})
    assert set(manifest["files"]) == {"a.bin", "sub/b.json"}
    got = store.get_folder("run/policy/v000001", tmp_path / "dest")
    assert got["meta"] == {"iteration": 1}
    assert (tmp_path / "dest" / "a.bin").read_bytes() == b"x" * 1000
    assert store.get_json("run/policy/v000001", "sub/b.json") == {"k": 1}


@pytest.mark.parametrize("damage", ["truncated", "altered", "missing"])
def test_damaged_file_is_refused_by_name(store, tmp_path, damage):
    key = "run/iter-000001/rollouts"
    store.put_folder(key, _folder(tmp_path))
    if damage == "truncated":
        _tamper(store, key, "a.bin", b"x" * 999)
    elif damage == "altered":
        _tamper(store, key, "a.bin", b"y" * 1000)
    else:
        if store.root.startswith("s3://"):
            store.client.delete_object(Bucket=store.bucket, Key=store._k(f"{key}/a.bin"))
        else:
            (store.path / key / "a.bin").unlink()
    with pytest.raises(IncompleteArtifact, match=r"a\.bin") as err:
        store.verify(key)
    assert {"truncated": "size 999 != 1000", "altered": "sha256", "missing": "missing"}[damage] in str(err.value)


def test_folder_without_manifest_is_refused(store, tmp_path):
    key = "run/trainer/ckpt-000001"
    store._put_file(f"{key}/a.bin", _folder(tmp_path) / "a.bin")    # what a killed writer leaves behind
    assert store.manifest(key) is None
    with pytest.raises(IncompleteArtifact, match="no MANIFEST.json"):
        store.verify(key)


def test_pointer_never_names_an_incomplete_folder(store, tmp_path):
    with pytest.raises(IncompleteArtifact, match="incomplete"):
        store.set_pointer("run/policy/LATEST", "run/policy/v000001")
    assert store.get_pointer("run/policy/LATEST") is None
    store.put_folder("run/policy/v000001", _folder(tmp_path))
    store.put_folder("run/policy/v000002", _folder(tmp_path))
    store.advance_pointer("run/policy/LATEST", "run/policy/v000002")
    store.advance_pointer("run/policy/LATEST", "run/policy/v000001")   # never moves backwards
    assert store.get_pointer("run/policy/LATEST") == "run/policy/v000002"
    assert store.list_folders("run/policy") == ["v000001", "v000002"]


def test_file_store_stages_folders_under_a_temporary_name(tmp_path):
    store = Store.open(str(tmp_path / "store"))
    store.put_folder("run/x", _folder(tmp_path))
    names = [p.name for p in (tmp_path / "store" / "run").iterdir()]
    assert names == ["x"] and (tmp_path / "store" / "run" / "x" / MANIFEST).exists()


def test_s3_multipart_upload_roundtrip(s3_endpoint, bucket, tmp_path):
    store = Store.open(StoreConfig(uri=f"s3://{bucket}", endpoint_url=s3_endpoint, multipart_chunk_mb=5))
    big = tmp_path / "big" / "weights.bin"
    big.parent.mkdir()
    big.write_bytes(bytes(range(256)) * (12 * 4096))     # 12 MiB: three 5 MiB parts
    store.put_folder("run/policy/v000001", big.parent)
    head = store.client.head_object(Bucket=bucket, Key="run/policy/v000001/weights.bin")
    assert "-" in head["ETag"]                          # a multipart ETag: the transfer manager split it
    store.get_folder("run/policy/v000001", tmp_path / "back")
    assert (tmp_path / "back" / "weights.bin").read_bytes() == big.read_bytes()


def test_unreachable_or_missing_bucket_is_a_user_error(s3_endpoint):
    with pytest.raises(UserError, match="bucket does not exist"):
        Store.open(StoreConfig(uri="s3://no-such-bucket", endpoint_url=s3_endpoint)).check()
    with pytest.raises(UserError, match="cannot reach"):
        Store.open(StoreConfig(uri="s3://b", endpoint_url="http://127.0.0.1:9")).check()


def test_clean_staging_removes_only_hidden_half_written_folders(tmp_path):
    from tasks.core.store import FileStore

    store = FileStore(str(tmp_path / "s"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a")
    store.put_folder("run/iter-000001/rollouts", src)
    (tmp_path / "s" / "run" / "iter-000002" / ".rollouts.partial-1234abcd").mkdir(parents=True)
    assert store.clean_staging("run") == 1
    assert not (tmp_path / "s" / "run" / "iter-000002" / ".rollouts.partial-1234abcd").exists()
    store.verify("run/iter-000001/rollouts")


@pytest.mark.parametrize("kind", ["file", pytest.param("s3", marks=pytest.mark.server)])
def test_copy_folder_in_place(kind, tmp_path, request):
    """publish copies a checkpoint's model/ into a policy folder without downloading it (S3: server-side)."""
    if kind == "s3":
        endpoint, bucket = request.getfixturevalue("s3_endpoint"), request.getfixturevalue("bucket")
        cfg = StoreConfig(uri=f"s3://{bucket}/p", endpoint_url=endpoint, multipart_chunk_mb=5)
    else:
        cfg = StoreConfig(uri=str(tmp_path / "store"))
    store = Store.open(cfg)
    src = tmp_path / "src"
    (src / "model").mkdir(parents=True)
    big = os.urandom(12 << 20)                       # above the 5 MiB part size: a multipart copy on S3
    (src / "model" / "weights.bin").write_bytes(big)
    (src / "model" / "config.json").write_text("{}")
    (src / "optimizer.pt").write_bytes(b"opt")
    store.put_folder("run/ckpt", src, meta={"a": 1})
    manifest = store.copy_folder("run/ckpt", "run/policy", prefix="model/", meta={"b": 2})
    assert sorted(manifest["files"]) == ["config.json", "weights.bin"] and manifest["meta"] == {"b": 2}
    out = tmp_path / "out"
    store.get_folder("run/policy", out)              # verified against the manifest
    assert (out / "weights.bin").read_bytes() == big and not (out / "optimizer.pt").exists()


def test_deepspeed_clean_drops_only_attempts_a_committed_checkpoint_does_not_name(store, tmp_path):
    """DeepSpeed node folders are named per attempt; a killed attempt's (complete or half-written) folders
    go once its iteration's checkpoint is committed without them, and never before."""
    from tasks.core import layout
    from tasks.engines.deepspeed_engine import DeepSpeedEngine

    src = _folder(tmp_path)
    def node(it, attempt, n, complete=True):
        key = layout.engine_state("run", it, attempt, n)
        if complete:
            store.put_folder(key, src)
        else:
            store._put_file(f"{key}/a.bin", src / "a.bin")      # a kill before the manifest
        return key

    kept = [node(1, "good", 0), node(1, "good", 1)]
    killed = [node(1, "dead", 0), node(1, "dead", 1, complete=False)]
    running = [node(2, "running", 0, complete=False)]           # no ckpt-2 yet: maybe still being written
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / layout.CKPT_STATE).write_text(json.dumps({"iteration": 1, "engine_state": kept}))
    store.put_folder(layout.checkpoint("run", 1), ckpt)

    assert DeepSpeedEngine.clean(store, "run") == 1
    assert [store.manifest(k) is not None for k in kept] == [True, True]
    assert store.list_folders("run/trainer-state") == ["ckpt-000001-good", "ckpt-000002-running"]
    assert store._list(running[0] + "/") == [running[0] + "/a.bin"]
    assert not any(store._list(k + "/") for k in killed)
    assert DeepSpeedEngine.clean(store, "run") == 0
    for k in kept:
        store.verify(k)

    # A resident trainer's iteration 3: ckpt-3 is lean (names no shards); full-3 names them, and until it is
    # committed its writer may still be uploading: nothing of iteration 3 goes before.
    resident, lost = node(3, "resident", 0), node(3, "lost", 0, complete=False)
    (ckpt / layout.CKPT_STATE).write_text(json.dumps({"iteration": 3}))
    store.put_folder(layout.checkpoint("run", 3), ckpt, meta={"kind": "lean"})
    assert DeepSpeedEngine.clean(store, "run") == 0
    (ckpt / layout.CKPT_STATE).write_text(json.dumps({"iteration": 3, "engine_state": [resident]}))
    store.put_folder(layout.full_checkpoint("run", 3), ckpt, meta={"kind": "full"})
    assert DeepSpeedEngine.clean(store, "run") == 1
    assert store.manifest(resident) is not None and not store._list(lost + "/")


@pytest.mark.parametrize("kind", ["file", pytest.param("s3", marks=pytest.mark.server)])
def test_a_folder_written_here_is_read_here_without_a_download(kind, tmp_path, request, monkeypatch):
    """Write-through: what a stage wrote (and publish copied) on this machine, a later stage here reads from
    the local disk, verified against the manifest; a file store hands out its own folder."""
    if kind == "s3":
        endpoint, bucket = request.getfixturevalue("s3_endpoint"), request.getfixturevalue("bucket")
        store = Store.open(StoreConfig(uri=f"s3://{bucket}/w", endpoint_url=endpoint))
    else:
        store = Store.open(str(tmp_path / "store"))
    src = tmp_path / "src"
    (src / "model").mkdir(parents=True)
    (src / "model" / "weights.bin").write_bytes(os.urandom(1 << 16))
    (src / "optimizer.pt").write_bytes(b"opt")
    store.put_folder("run/ckpt", src, keep_local=lambda rel: rel.startswith("model/"))
    store.copy_folder("run/ckpt", "run/policy", prefix="model/")
    downloads = []
    monkeypatch.setattr(store, "_get_file", lambda key, dest: downloads.append(key))
    folder = store.local("run/policy")
    assert (folder / "weights.bin").read_bytes() == (src / "model" / "weights.bin").read_bytes()
    assert downloads == []
    if kind == "file":
        assert folder == tmp_path / "store" / "run" / "policy"
    (folder / "weights.bin").write_bytes(b"tampered")
    with pytest.raises(IncompleteArtifact, match="weights.bin"):
        store.local("run/policy")           # checked every time: a changed byte is refused, named


def test_quarantine_moves_a_corrupt_folder_aside_and_its_key_reads_as_absent(tmp_path):
    from tasks.core.store import CorruptArtifact, FileStore

    store = FileStore(str(tmp_path / "store"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"abc" * 1000)
    store.put_folder("r/policy/v000002", src)
    path = store.path / "r/policy/v000002/w.bin"
    path.write_bytes(b"abd" * 1000)
    with pytest.raises(CorruptArtifact) as bad:
        store.local("r/policy/v000002")
    assert bad.value.key == "r/policy/v000002" and "w.bin: sha256 does not match MANIFEST.json" in str(bad.value)
    moved = store.quarantine("r/policy/v000002")
    assert moved.startswith("r/quarantine/policy/v000002-")
    assert store.manifest("r/policy/v000002") is None and store.manifest(moved) is not None
    store.put_folder("r/policy/v000002", src)                       # its producer writes it again
    store.verify("r/policy/v000002")


def test_each_stage_output_names_its_producer():
    from flows.repair import OUTPUT_KEY, producer_of
    from tasks.core import layout

    for stage, key_of in OUTPUT_KEY.items():
        assert producer_of("r", key_of("r", 7)) == (stage, 7, 0)
    assert producer_of("r", layout.rollouts("r", 7, 2)) == ("generate", 7, 2)      # dynamic sampling's rounds
    assert producer_of("r", layout.scored("r", 7, 0)) == ("reward", 7, 0)
    assert producer_of("r", layout.scored("r", 7, 3)) == ("reward", 7, 3)
    assert producer_of("r", layout.full_checkpoint("r", 7)) is None     # not a stage's output
    assert producer_of("r", "r/policy/BEST") is None


@pytest.mark.parametrize("manifest,expected", [
    ([], "not a manifest"), ({"format": 1}, "not a manifest"), ({"files": "x"}, "not a manifest"),
    ({"files": {"a.bin": {"size": "1000", "sha256": "0" * 64}}}, "files.a.bin: expected {size: bytes"),
    ({"files": {"a.bin": {"size": 1000}}}, "files.a.bin: expected"),
    ({"files": {}, "meta": [1]}, "meta: expected a mapping"), ({"format": 1, "files": {}}, "meta: expected a mapping"),
    ({"format": 99, "files": {}, "meta": {}}, "format 99: expected 1"),
])
def test_a_manifest_of_another_shape_is_a_corrupt_folder_not_a_traceback(store, tmp_path, manifest, expected):
    """A manifest edited into valid JSON of another shape reached its readers: a TypeError in retention, a KeyError
    in get_folder, an AttributeError in local, each retried by Prefect and a traceback. Now the folder is corrupt
    (quarantined and made again), as one that is not JSON was."""
    from tasks.core.store import CorruptArtifact

    key = "run/policy/v000003"
    store.put_folder(key, _folder(tmp_path))
    _tamper(store, key, MANIFEST, json.dumps(manifest).encode())
    with pytest.raises(CorruptArtifact, match=f"MANIFEST.json: {expected}".replace("{", r"\{").replace(".", r"\.")):
        store.manifest(key)


def test_a_file_that_matches_its_manifest_but_does_not_decode_is_corrupt(store, tmp_path):
    """Bytes edited together with their manifest (a hand edit, a writer's fault) passed verification and failed
    where they were decoded: a JSONDecodeError traceback after Prefect's retries (curriculum state, get_json)."""
    import hashlib

    from tasks.core.store import CorruptArtifact

    key = "run/curriculum/after-000002"
    store.put_folder(key, _folder(tmp_path))
    manifest = store.manifest(key)
    manifest["files"]["sub/b.json"] = {"size": 2, "sha256": hashlib.sha256(b"[1").hexdigest()}
    _tamper(store, key, "sub/b.json", b"[1")
    _tamper(store, key, MANIFEST, json.dumps(manifest).encode())
    with pytest.raises(CorruptArtifact, match=r"sub/b\.json: not what rlflow writes there \(JSONDecodeError"):
        store.get_json(key, "sub/b.json")


def test_what_does_not_decode_is_corrupt_and_running_out_of_memory_is_not(tmp_path):
    """artifacts.stored: a safetensors file or a torch.save file that does not decode (their own errors) is the
    folder's corruption; out of memory while reading is not the file's fault and passes through."""
    import torch
    from safetensors import safe_open

    from tasks.core.artifacts import CorruptArtifact, stored

    store = Store.open(f"file://{tmp_path / 'store'}")
    noise = random.Random(0).randbytes(4096)  # fixed: which decoder error random bytes raise depends on the bytes
    (tmp_path / "w.safetensors").write_bytes(noise)
    (tmp_path / "o.pt").write_bytes(noise)
    with pytest.raises(CorruptArtifact, match=r"run/trainer/full-000003/model/w\.safetensors: not what rlflow writes "
                                              r"there \(SafetensorError: Error while deserializing header"):
        with stored("run/trainer/full-000003", store.uri("run/trainer/full-000003/model/w.safetensors")), \
                safe_open(str(tmp_path / "w.safetensors"), framework="pt") as opened:
            opened.keys()
    with pytest.raises(CorruptArtifact, match=r"o\.pt: not what rlflow writes there \(\w+Error: "):
        with stored("run/trainer/full-000003", store.uri("run/trainer/full-000003/o.pt")):
            torch.load(tmp_path / "o.pt", weights_only=True)

    class OutOfMemoryError(RuntimeError):
        pass

    with pytest.raises(OutOfMemoryError):
        with stored("run/trainer/full-000003", store.uri("run/trainer/full-000003/o.pt")):
            raise OutOfMemoryError("CUDA out of memory")


def test_clean_staging_removes_the_temporary_files_a_killed_writer_left(tmp_path):
    """A kill between a pointer's (or a file's) temporary write and its rename left `.LATEST.tmp-*` in the run's
    folder for good (seen after an SFT kill); only hidden temporaries go, a user's `a.tmp-1` stays."""
    from tasks.core.store import FileStore

    store = FileStore(str(tmp_path / "s"))
    store._put_bytes("run/policy/LATEST", b"v000001")
    left = [tmp_path / "s" / "run" / "policy" / ".LATEST.tmp-1234abcd",
            tmp_path / "s" / "run" / "trainer" / ".state.json.tmp-deadbeef"]
    for p in left:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"half")
    (tmp_path / "s" / "run" / "a.tmp-1").write_text("mine")
    assert store.clean_staging("run") == 2
    assert not any(p.exists() for p in left)
    assert (tmp_path / "s" / "run" / "a.tmp-1").exists() and store._get_bytes("run/policy/LATEST") == b"v000001"


def test_a_bucket_gone_mid_run_is_one_line_and_not_retried(s3_endpoint, bucket):
    """The store's bucket deleted (or an empty S3 answering at the endpoint) while a run goes on: each stage was
    retried as a passing fault, silent for minutes, and the run ended in botocore's 80-line traceback."""
    import boto3

    from flows.repair import final_line

    store = Store.open(StoreConfig(uri=f"s3://{bucket}/runs", endpoint_url=s3_endpoint))
    boto3.client("s3", endpoint_url=s3_endpoint).delete_bucket(Bucket=bucket)
    with pytest.raises(store.client.exceptions.NoSuchBucket) as e:
        store.read_tagged("r/LEASE.json")
    assert final_line(e.value) == (f"error: store.uri: the bucket {bucket} does not exist (it did when the run "
                                   f"started: deleted, or another server answers at the endpoint now); the run's "
                                   f"outputs were there", 1)


def test_a_store_that_does_not_answer_is_said_while_botocore_tries_again(capfd):
    """Each S3 request botocore tried again after no answer (60 s each at a stopped server) went unsaid: a run
    stalled on its store printed nothing for as long as it stalled. A line now, once a minute at most."""
    import socket

    with socket.socket() as s:          # (a port nothing listens on: refused at once, as a stopped host's)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from botocore.exceptions import EndpointConnectionError

    from tasks.core import s3_calls as module

    module._SAID_AT[0] = -math.inf                  # (said once a minute a process: another test may have)
    store = Store.open(StoreConfig(uri="s3://b/runs", endpoint_url=f"http://127.0.0.1:{port}"))
    with pytest.raises(EndpointConnectionError):
        store.read_tagged("r/LEASE.json")
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning: store:")]
    assert said and said[0].startswith(f"warning: store: http://127.0.0.1:{port} did not answer GetObject "
                                       f"(EndpointConnectionError): try 1 of 5 failed, trying again"), said


@pytest.mark.server
def test_a_remote_stores_files_of_one_folder_move_at_once(s3_endpoint, bucket, tmp_path):
    """Each file is a request whose latency was paid once per file, one after another (a policy's ~9 files: about
    2x the time behind a store 25 ms away, docs/benchmarks.md). Up, down and copied, two of them are in flight
    together (a barrier two transfers must reach; one at a time, it breaks), and the folder is whole and verified."""
    import threading

    store = Store.open(StoreConfig(uri=f"s3://{bucket}/together", endpoint_url=s3_endpoint))
    folder = tmp_path / "policy"
    folder.mkdir()
    for i in range(6):
        (folder / f"f{i}.bin").write_bytes(os.urandom(1000 + i))
    met = {name: threading.Barrier(2, timeout=30) for name in ("_put_file", "_get_file")}
    for name, barrier in met.items():
        real = getattr(store, name)

        def together(key, path, real=real, barrier=barrier):
            barrier.wait()                      # (BrokenBarrierError after 30 s alone)
            return real(key, path)
        setattr(store, name, together)
    store.put_folder("run/p", folder)
    store.get_folder("run/p", tmp_path / "back")
    assert {p.name: p.read_bytes() for p in (tmp_path / "back").iterdir()} == \
           {p.name: p.read_bytes() for p in folder.iterdir()}
    copied = []
    real_copy = store.client.copy_object
    barrier = threading.Barrier(2, timeout=30)

    def copy_together(**kw):
        copied.append(kw["Key"])
        barrier.wait()
        return real_copy(**kw)
    store.client.copy_object = copy_together
    store.copy_folder("run/p", "run/q")
    assert len(copied) == 6 and store.verify("run/q")["files"].keys() == store.manifest("run/p")["files"].keys()


def test_a_call_that_failed_after_botocore_waited_out_its_tries_is_not_tried_again(monkeypatch):
    """A store that answers nothing (SIGSTOPped, its machine gone): botocore tries each request RETRIES times,
    60 s each, and raises ReadTimeoutError; the reply-body retry then tried the whole call 5 times more (~25 min
    a call, before the stage's own retries). No answer after AGAIN_SECONDS is raised at once; a quick failure (a
    reset as the body is read), or a long transfer broken off by a reset, is still tried again."""
    import time

    from botocore.exceptions import ConnectionClosedError, ReadTimeoutError

    from tasks.core import s3_calls as stores

    monkeypatch.setattr(stores, "AGAIN_SECONDS", 2.0, raising=False)
    calls = []

    def slow():
        calls.append("slow")
        time.sleep(2.1)                  # (at least this long: the test does not depend on the machine's speed)
        raise ReadTimeoutError(endpoint_url="http://stopped")

    def quick():
        calls.append("quick")
        if calls.count("quick") < 3:
            raise ReadTimeoutError(endpoint_url="http://reset")
        return "answered"
    def long_then_reset():
        calls.append("long")
        if calls.count("long") == 1:
            time.sleep(2.1)              # (a multi-GB upload's time, then a reset)
            raise ConnectionClosedError(endpoint_url="http://reset")
        return "answered"
    errors = stores.body_errors()
    with pytest.raises(ReadTimeoutError):
        stores.again(slow, errors)
    assert stores.again(quick, errors) == "answered"
    assert stores.again(long_then_reset, errors) == "answered"
    assert calls == ["slow", "quick", "quick", "quick", "long", "long"]
