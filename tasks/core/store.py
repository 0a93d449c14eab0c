"""The store: the only way stages talk. `file://` (default) or `s3://` (boto3; any S3-compatible endpoint).

Contract (docs/design-notes.md): an artifact is a folder under `<root>/<run>/`; it is complete only when its
MANIFEST.json (every file's size and sha256, plus the stage's metadata) exists, and the manifest is written
last. Readers verify sizes and checksums and refuse a folder with a missing, truncated or altered file,
naming it. A pointer (`policy/LATEST`) is replaced only after the manifest it names exists.

    store = open_store(cfg)                     # one per store config (and working directory) per process
    uri = store.put_folder("run/policy/v000003", local_dir, meta={...})
    manifest = store.get_folder("run/policy/v000003", dest_dir)   # verified

One concept: Store's folder logic calls hooks its two backends fill in, and Store.open names both (apart: a cycle);
how each S3 request is tried again lives apart (tasks/core/s3_calls.py).
More: docs/internals.md (tasks/core/store.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.core.artifacts import MANIFEST, CorruptArtifact, IncompleteArtifact, manifest_fault, stored, verify_file
from tasks.core.errors import UserError
from tasks.core.hashing import REMEMBER_FROM, known_sha256, remember_sha256, sha256_file
from tasks.core.paths import cache_root, require_creatable
from tasks.core.processes import exclusive
from tasks.core.s3_calls import RETRIES, Resilient, again, body_errors, say_retry

if TYPE_CHECKING:
    from tasks.core.config import Config, StoreConfig

TRANSFERS = 8       # a remote store's files of one folder moved at once (each a request: its latency, paid once)


def _each(fn: Callable[[Any], object], items: list, threads: int) -> None:
    """fn(item) for each item, `threads` at a time (one after another for 1); the first failure raised once the
    calls under way have ended (the rest not begun, as one at a time stopped there; a Ctrl-C waits for none)."""
    if threads <= 1 or len(items) <= 1:
        for item in items:
            fn(item)
        return
    pool = ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="rlflow-store")
    try:
        for _ in pool.map(fn, items):
            pass
    except BaseException as e:             # (nothing of it writes after it raised, unless a Ctrl-C cut it short)
        pool.shutdown(wait=not isinstance(e, KeyboardInterrupt | SystemExit), cancel_futures=True)
        raise
    pool.shutdown()


def _local_files(folder: Path) -> Iterator[tuple[str, Path]]:
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            yield p.relative_to(folder).as_posix(), p


class Store:
    """Base: folder-level logic (manifests, verification, pointers) over a few byte-level primitives."""

    root: str  # URI of the store root, e.g. file:///abs/path or s3://bucket/prefix
    remote: bool = False    # readers elsewhere download what it holds (S3); a file store is read in place

    # ---- primitives each backend implements
    def _put_file(self, key: str, src: Path) -> None: raise NotImplementedError
    def _get_file(self, key: str, dest: Path) -> None: raise NotImplementedError
    def _put_bytes(self, key: str, data: bytes) -> None: raise NotImplementedError
    def _get_bytes(self, key: str) -> bytes | None: raise NotImplementedError
    def _list(self, prefix: str) -> list[str]: raise NotImplementedError
    def _delete(self, key: str) -> None: raise NotImplementedError
    def _delete_prefix(self, prefix: str) -> None: raise NotImplementedError

    # Compare-and-swap on one small object (the run lease): `tag` identifies the version read.
    def read_tagged(self, key: str) -> tuple[bytes | None, str | None]: raise NotImplementedError
    def write_if(self, key: str, data: bytes, tag: str | None) -> str | None:
        """Write only if the object is still at version `tag` (None: only if it does not exist).
        Returns the new version's tag, or None if the condition failed."""
        raise NotImplementedError
    def delete_if(self, key: str, tag: str) -> bool: raise NotImplementedError

    def clean_staging(self, prefix: str) -> int:
        """Remove what killed writers left half-written under `prefix` (invisible to readers either way): staged
        folders, files and pointers not renamed into place. Only the holder of the run's lease calls this.
        Returns how many were removed."""
        return 0
    def check(self) -> None: """Raise UserError if the store cannot be reached."""

    @staticmethod
    def open(cfg: StoreConfig | str) -> Store:
        """Factory from a StoreConfig (or a bare URI string)."""
        uri = cfg if isinstance(cfg, str) else cfg.uri
        if uri.startswith("s3://"):
            return S3Store(uri, cfg if not isinstance(cfg, str) else None)
        return FileStore(uri[len("file://"):] if uri.startswith("file://") else uri)

    def uri(self, key: str) -> str:
        return f"{self.root.rstrip('/')}/{key}"

    # ---- folders
    def manifest(self, key: str) -> dict | None:
        """The folder's manifest, or None if the folder is not complete (no manifest yet)."""
        raw = self._get_bytes(f"{key}/{MANIFEST}")
        if raw is None:
            return None
        try:
            manifest = json.loads(raw)
        except ValueError:
            raise CorruptArtifact(key, f"{self.uri(key)}/{MANIFEST}: not valid JSON") from None
        if fault := manifest_fault(manifest):                  # (an edited one: each reader trusted its shape)
            raise CorruptArtifact(key, f"{self.uri(key)}/{MANIFEST}: {fault}")
        return manifest

    def put_folder(self, key: str, folder: Path, meta: dict[str, Any] | None = None,
                   keep_local: Callable[[str], bool] | None = None, give_up: bool = False) -> dict:
        """Upload every file of `folder`, then the manifest (last). Returns the manifest. `keep_local(rel)`:
        which files to keep in this machine's cache too (`local`), so a later stage here reads them without a
        download (write-through; a file store is local anyway). `give_up`: the caller never writes to these
        files again (a temporary folder), so a file store may link them in instead of copying.

        Checksums are computed on a thread while the files upload (both read the same pages from the OS
        cache), so a large policy costs its upload time, not upload + a hashing pass (docs/benchmarks.md)."""
        folder = Path(folder)
        paths = dict(_local_files(folder))
        sizes = {rel: p.stat().st_size for rel, p in paths.items()}
        if sum(sizes.values()) < REMEMBER_FROM:           # small (rollouts, rewards): a thread costs more
            digests = [sha256_file(p) for p in paths.values()]
            staged = self._write_files(key, folder, list(paths), give_up)
        else:
            with ThreadPoolExecutor(1, thread_name_prefix="rlflow-sha256") as pool:
                digests = list(pool.map(sha256_file, paths.values()))
                staged = self._write_files(key, folder, list(paths), give_up)
        files = {rel: {"size": sizes[rel], "sha256": d} for rel, d in zip(paths, digests)}
        for rel, p in paths.items():                        # what we just hashed, we know
            remember_sha256(p, files[rel]["sha256"])
        manifest = {"format": 1, "created": time.time(), "files": files, "meta": meta or {}}
        self._commit_folder(key, staged, json.dumps(manifest, indent=1, sort_keys=True).encode())
        if keep_local is not None and self.remote:
            _link_files({rel: folder / rel for rel in files if keep_local(rel)}, self.local_cache(key), give_up)
        return manifest

    def copy_folder(self, src: str, dst: str, prefix: str = "", meta: dict[str, Any] | None = None) -> dict:
        """Make `dst` a complete folder holding the files of complete folder `src` under `prefix` (e.g.
        "model/"), without the bytes passing through this machine where the backend can copy in place (S3:
        server-side multipart copy). The new manifest takes sizes and checksums from the source's."""
        source = self.manifest(src)
        if source is None:
            raise IncompleteArtifact(f"{self.uri(src)}: incomplete artifact (no {MANIFEST})")
        files = {rel[len(prefix):]: entry for rel, entry in source["files"].items() if rel.startswith(prefix)}
        if not self.remote:      # the copy shares the files (hard links): never pass a corrupt source on
            for rel, entry in files.items():
                verify_file(self._p(f"{src}/{prefix}{rel}"), entry, src, f"{self.uri(src)}/{prefix}{rel}")
        staged = self._copy_files(src, dst, {rel: prefix + rel for rel in files})
        manifest = {"format": 1, "created": time.time(), "files": files, "meta": meta or {}}
        self._commit_folder(dst, staged, json.dumps(manifest, indent=1, sort_keys=True).encode())
        cached = self.local_cache(src)
        if self.remote and cached.is_dir():    # the source is here: so is the copy
            _link_files({rel: cached / (prefix + rel) for rel in files
                         if (cached / (prefix + rel)).is_file()}, self.local_cache(dst))
        return manifest

    # Writing a folder is: put its files (possibly in a staging place), then commit it with its manifest.
    def _write_files(self, key: str, folder: Path, rels: list[str], give_up: bool = False):
        _each(lambda rel: self._put_file(f"{key}/{rel}", folder / rel), rels, TRANSFERS if self.remote else 1)
        return key

    def _copy_files(self, src: str, dst: str, pairs: dict[str, str]):
        with tempfile.TemporaryDirectory(prefix="rlflow-copy-") as tmp:
            for rel, src_rel in pairs.items():
                (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
                self._get_file(f"{src}/{src_rel}", Path(tmp) / rel)
            return self._write_files(dst, Path(tmp), list(pairs), give_up=True)

    def _commit_folder(self, key: str, staged, manifest: bytes) -> None:
        self._put_bytes(f"{key}/{MANIFEST}", manifest)

    def get_folder(self, key: str, dest: Path) -> dict:
        """Download a complete folder into `dest` and verify each file against the manifest."""
        manifest = self.manifest(key)
        if manifest is None:
            raise IncompleteArtifact(f"{self.uri(key)}: incomplete artifact (no {MANIFEST})")
        dest = Path(dest)

        def get(item: tuple[str, dict]) -> None:
            rel, want = item
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists() and target.stat().st_size == want["size"] and known_sha256(target) == want["sha256"]:
                return                                      # here already (a cache), and verified
            try:
                self._get_file(f"{key}/{rel}", target)
            except FileNotFoundError:
                raise CorruptArtifact(key, f"{self.uri(key)}/{rel}: missing (listed in {MANIFEST})") from None
            verify_file(target, want, key, f"{self.uri(key)}/{rel}")
        _each(get, list(manifest["files"].items()), TRANSFERS if self.remote else 1)
        return manifest

    def local(self, key: str) -> Path:
        """A complete folder on this machine's disk, verified against its manifest. A file store's own folder
        (nothing copied); for a remote store a copy in the local cache, where files already there (written or
        read on this machine before, see `put_folder(keep_local=True)`) are checked, not downloaded again."""
        self.get_folder(key, self.local_cache(key))
        return self.local_cache(key)

    def local_cache(self, key: str) -> Path:
        """Where `local` keeps a remote folder on this machine (by the folder's URI)."""
        return cache_root() / "store" / hashlib.sha256(self.uri(key).encode()).hexdigest()[:16]

    def verify(self, key: str) -> dict:
        """Check a folder in place (downloads to a temporary folder for remote stores)."""
        with tempfile.TemporaryDirectory(prefix="rlflow-verify-") as tmp:
            return self.get_folder(key, Path(tmp))

    def get_json(self, key: str, name: str) -> Any:
        """Read one small JSON file of a complete folder, verified against the manifest."""
        manifest = self.manifest(key)
        if manifest is None:
            raise IncompleteArtifact(f"{self.uri(key)}: incomplete artifact (no {MANIFEST})")
        raw = self._get_bytes(f"{key}/{name}")
        want = manifest["files"].get(name)
        where = f"{self.uri(key)}/{name}"
        if want is None:
            raise IncompleteArtifact(f"{where}: not in the folder's {MANIFEST}")
        if raw is None:
            raise CorruptArtifact(key, f"{where}: missing (listed in {MANIFEST})")
        if len(raw) != want["size"] or hashlib.sha256(raw).hexdigest() != want["sha256"]:
            raise CorruptArtifact(key, f"{where}: does not match {MANIFEST} (truncated or altered)")
        with stored(key, where):
            return json.loads(raw)

    # ---- pointers
    def set_pointer(self, key: str, target: str) -> None:
        """Point `key` (e.g. run/policy/LATEST) at folder `target`; refused unless target is complete."""
        if self.manifest(target) is None:
            raise IncompleteArtifact(f"refusing to point {key} at incomplete {self.uri(target)}")
        self._put_bytes(key, json.dumps({"target": target, "updated": time.time()}).encode())

    def advance_pointer(self, key: str, target: str) -> None:
        """Move a pointer forward only: versions are zero-padded, so a later one sorts after an earlier one."""
        current = self.get_pointer(key)
        if current is None or current < target:
            self.set_pointer(key, target)

    def delete_pointer(self, key: str) -> None:
        self._delete(key)

    def get_pointer(self, key: str) -> str | None:
        """The folder `key` points at, None where there is no pointer; CorruptArtifact where it is not one (a
        truncated or edited file: retention.mend_pointers makes it again)."""
        raw = self._get_bytes(key)
        if not raw:
            return None
        try:
            target = json.loads(raw)["target"]
        except (ValueError, KeyError, TypeError):
            target = None
        if not isinstance(target, str):
            raise CorruptArtifact(key, f"{self.uri(key)}: not a pointer (truncated or altered)")
        return target

    def delete_folder(self, key: str) -> None:
        """Remove a folder, complete or not: its manifest first, so readers never see a complete folder with
        files missing. Only the run's lease holder, or a stage deleting what only it can name, calls this."""
        self._delete(f"{key}/{MANIFEST}")
        self._delete_prefix(f"{key}/")

    def quarantine(self, key: str) -> str:
        """Move a corrupt committed folder out of the way, to <run>/quarantine/<rest of key>-<UTC time> (kept
        for a look); from then on `key` has no manifest, so its producer writes it anew. Returns the new key."""
        run, _, rest = key.partition("/")
        dst = f"{run}/quarantine/{rest}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:4]}"
        self._move(key, dst)
        return dst

    def _move(self, src: str, dst: str) -> None: raise NotImplementedError

    def list_folders(self, prefix: str) -> list[str]:
        """Immediate child folder names under prefix (complete or not)."""
        return sorted(self._children(prefix.rstrip("/") + "/"))

    def _children(self, prefix: str) -> set[str]:
        """The names of the folders directly under `prefix` (ending in /): by default from the whole listing."""
        return {k[len(prefix):].split("/", 1)[0] for k in self._list(prefix) if "/" in k[len(prefix):]}


def _link_files(sources: dict[str, Path], dest: Path, link: bool = True) -> None:
    """Hard-link (`link`: the sources never change again; else, or across file systems, copy) files into a
    cache folder; what `local` finds there is still checked."""
    for rel, src in sources.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            if not link:
                raise OSError
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, target)


LOCKS = ".locks"


def _hidden(parts: tuple[str, ...]) -> bool:
    """A file store's own files, never listed: lock files, folders being staged, files being written."""
    return parts[:1] == (LOCKS,) or any(p.startswith(".") and (".partial-" in p or ".tmp-" in p) for p in parts)


class FileStore(Store):
    """A local folder. Folders are staged under a temporary name and renamed into place, manifest included."""

    def __init__(self, path: str):
        self.path = Path(path).expanduser().absolute()
        self.root = f"file://{self.path}"

    def check(self) -> None:
        require_creatable(self.path, "store.uri")

    def _p(self, key: str) -> Path:
        return self.path / key

    def local(self, key: str) -> Path:
        """The store's own folder, verified in place: a file store is on this machine already."""
        manifest = self.manifest(key)
        if manifest is None:
            raise IncompleteArtifact(f"{self.uri(key)}: incomplete artifact (no {MANIFEST})")
        for rel, want in manifest["files"].items():
            if not self._p(f"{key}/{rel}").is_file():
                raise CorruptArtifact(key, f"{self.uri(key)}/{rel}: missing (listed in {MANIFEST})")
            verify_file(self._p(f"{key}/{rel}"), want, key, f"{self.uri(key)}/{rel}")
        return self._p(key)

    def _write_files(self, key, folder, rels, give_up=False):
        return self._stage(key, {rel: folder / rel for rel in rels}, link=give_up)

    def _copy_files(self, src, dst, pairs):
        # A complete folder's files never change (writers replace, never modify): the copy can share them.
        return self._stage(dst, {rel: self._p(f"{src}/{src_rel}") for rel, src_rel in pairs.items()}, link=True)

    def _stage(self, key: str, sources: dict[str, Path], link: bool = False) -> Path:
        final = self._p(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.parent / f".{final.name}.partial-{uuid.uuid4().hex[:8]}"
        try:
            for rel, src in sources.items():
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                if link:
                    try:
                        os.link(src, staging / rel)
                        continue
                    except OSError:                 # another file system
                        pass
                shutil.copyfile(src, staging / rel)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return staging

    def _commit_folder(self, key, staging, manifest):
        final = self._p(key)
        try:
            (staging / MANIFEST).write_bytes(manifest)
            if (final / MANIFEST).exists():
                return  # another writer completed it first; complete folders are immutable, theirs stands
            if final.exists():
                shutil.rmtree(final)  # an incomplete leftover (e.g. copied in by hand); never a complete one
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _put_file(self, key, src):
        dst = self._p(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)

    def _get_file(self, key, dest):
        shutil.copyfile(self._p(key), dest)

    def _put_bytes(self, key, data):
        dst = self._p(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(data)
        os.replace(tmp, dst)

    def _get_bytes(self, key):
        try:
            return self._p(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _list(self, prefix):
        base = self._p(prefix)
        if not base.is_dir():
            return []
        return [f"{prefix}{p.relative_to(base).as_posix()}" for p in base.rglob("*") if p.is_file()
                and not _hidden(p.relative_to(self.path).parts)]

    def _delete(self, key):
        self._p(key).unlink(missing_ok=True)

    def _move(self, src, dst):
        self._p(dst).parent.mkdir(parents=True, exist_ok=True)
        os.rename(self._p(src), self._p(dst))         # one step: the manifest goes with the files

    def _delete_prefix(self, prefix):
        base = self._p(prefix.rstrip("/"))
        if base.is_dir():     # renamed out of sight first: a reader sees the folder whole or not at all
            hidden = base.with_name(f".{base.name}.partial-{uuid.uuid4().hex[:8]}")
            os.rename(base, hidden)
            shutil.rmtree(hidden, ignore_errors=True)

    def clean_staging(self, prefix):
        base = self._p(prefix)
        stale = [p for p in base.rglob(".*.partial-*") if p.is_dir()] if base.is_dir() else []
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
        files = [p for p in base.rglob(".*.tmp-*") if p.is_file()] if base.is_dir() else []     # (a pointer's,
        for p in files:                                                 # a file's: killed before their rename)
            p.unlink(missing_ok=True)
        return len(stale) + len(files)

    @contextlib.contextmanager
    def _locked(self, key):
        """Serialise compare-and-swap on `key` across processes on this machine: a lock file under the store's
        `.locks/`, outside every run's folder (a run's folder holds only what the run wrote)."""
        with exclusive(self.path / LOCKS / f"{key}.lock"):
            yield

    def read_tagged(self, key):
        data = self._get_bytes(key)
        return data, (hashlib.sha256(data).hexdigest() if data is not None else None)

    def write_if(self, key, data, tag):
        with self._locked(key):
            if self.read_tagged(key)[1] != tag:
                return None
            self._put_bytes(key, data)
            return hashlib.sha256(data).hexdigest()

    def delete_if(self, key, tag):
        with self._locked(key):
            if self.read_tagged(key)[1] != tag:
                return False
            self._p(key).unlink(missing_ok=True)
            return True


class S3Store(Store):
    """S3 or any S3-compatible server. Large files go through boto3's transfer manager (multipart, parallel).

    Objects are written under their final keys; a folder is invisible to readers until its manifest, the last
    PUT, exists. Each PUT is atomic, so a killed upload leaves at most a folder without a manifest, which every
    reader refuses and the next writer overwrites.
    """

    remote = True

    def __init__(self, uri: str, cfg=None):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config as BotoConfig

        self.root = uri.rstrip("/")
        bucket_and_prefix = uri[len("s3://"):].strip("/")
        self.bucket, _, self.prefix = bucket_and_prefix.partition("/")
        endpoint = getattr(cfg, "endpoint_url", None)
        def client(attempts: int):
            return boto3.client("s3", endpoint_url=endpoint, region_name=getattr(cfg, "region", None),
                                config=BotoConfig(retries={"max_attempts": attempts, "mode": "standard"},
                                                  connect_timeout=10, max_pool_connections=max(
                                                      32, TRANSFERS * (getattr(cfg, "max_concurrency", 8) or 8))))

        from botocore.exceptions import BotoCoreError

        self._body_errors = body_errors()
        try:       # a region that is none, a profile or config file not there or unparsable, half a key pair
            self.client = Resilient(client(RETRIES), self._body_errors)   # transient faults retried with back-off
            self._probe = client(1)      # check(): a wrong endpoint should fail in seconds, not after retries
        except BotoCoreError as e:
            raise UserError(f"store.uri: {uri}: the S3 client cannot be made ({type(e).__name__}: "
                            f"{str(e).splitlines()[0]})") from None
        self.client.raw.meta.events.register("needs-retry.s3", functools.partial(say_retry, store=endpoint))
        chunk = (getattr(cfg, "multipart_chunk_mb", 16) or 16) << 20
        self.transfer = TransferConfig(multipart_threshold=chunk, multipart_chunksize=chunk,
                                       max_concurrency=getattr(cfg, "max_concurrency", 8) or 8)
        self.endpoint = endpoint

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def check(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        where = f"{self.root}" + (f" at {self.endpoint}" if self.endpoint else "")
        try:
            self._probe.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "?")
            what = {"404": "bucket does not exist", "403": "access denied (check AWS credentials)"}.get(code, code)
            raise UserError(f"store.uri: {where}: {what}") from None
        except BotoCoreError as e:
            said = " ".join(str(e).split())[:200]
            raise UserError(f"store.uri: cannot reach {where}: {type(e).__name__}: {said}") from None

    def _put_file(self, key, src):
        self.client.upload_file(str(src), self.bucket, self._k(key), Config=self.transfer)

    def _copy_files(self, src, dst, pairs):
        """Server-side copies: no bytes through this machine. One CopyObject per file up to S3's 5 GB limit
        (a single request, much faster than boto3's multipart UploadPartCopy: docs/benchmarks.md), a managed
        multipart copy above it."""
        sizes = {rel: e["size"] for rel, e in (self.manifest(src) or {"files": {}})["files"].items()}

        def copy(pair: tuple[str, str]) -> None:
            rel, src_rel = pair
            source = {"Bucket": self.bucket, "Key": self._k(f"{src}/{src_rel}")}
            if sizes.get(src_rel, 0) < (5 << 30):
                self.client.copy_object(CopySource=source, Bucket=self.bucket, Key=self._k(f"{dst}/{rel}"))
            else:
                self.client.copy(source, self.bucket, self._k(f"{dst}/{rel}"), Config=self.transfer)
        _each(copy, list(pairs.items()), TRANSFERS)
        return dst

    def _get_file(self, key, dest):
        from botocore.exceptions import ClientError

        tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            self.client.download_file(self.bucket, self._k(key), str(tmp), Config=self.transfer)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                raise FileNotFoundError(key) from None
            raise
        os.replace(tmp, dest)

    def _put_bytes(self, key, data):
        self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data)

    def _get_bytes(self, key):
        return self.read_tagged(key)[0]

    def read_tagged(self, key):
        """The object's bytes and ETag, (None, None) if there is none. botocore retries a request that fails,
        not a body that breaks off after the reply began (reset, truncated): those are read again here."""
        def read():        # the call and its body, retried together (one layer: the raw client)
            try:
                obj = self.client.raw.get_object(Bucket=self.bucket, Key=self._k(key))
            except self.client.exceptions.NoSuchKey:
                return None, None
            return obj["Body"].read(), obj["ETag"]
        return again(read, self._body_errors)

    def write_if(self, key, data, tag):
        from botocore.exceptions import ClientError

        cond = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        try:      # S3 conditional writes: exactly one of two racing writers succeeds
            return self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data, **cond)["ETag"]
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict",
                                                             "412", "409"):
                return None
            raise

    def delete_if(self, key, tag):
        if self.read_tagged(key)[1] != tag:
            return False
        self.client.delete_object(Bucket=self.bucket, Key=self._k(key))
        return True

    def _delete(self, key):
        self.client.delete_object(Bucket=self.bucket, Key=self._k(key))

    def _move(self, src, dst):
        for key in self._list(f"{src}/"):           # server-side copies, then the source, manifest first
            self.client.copy_object(CopySource={"Bucket": self.bucket, "Key": self._k(key)}, Bucket=self.bucket,
                                    Key=self._k(dst + key[len(src):]))
        self.delete_folder(src)

    def _delete_prefix(self, prefix):
        keys = [self._k(k) for k in self._list(prefix)]
        for i in range(0, len(keys), 1000):                   # DeleteObjects takes up to 1000 keys a request
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]],
                                                                    "Quiet": True})

    def _children(self, prefix):
        # One level, by the delimiter: a run's policy/ or trainer/ folder lists one row per version, not every
        # file of every version.
        base = self._k(prefix)

        def listing():
            names = set()
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base,
                                                                              Delimiter="/"):
                names |= {p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", [])}
            return names
        return again(listing, self._body_errors)

    def _list(self, prefix):
        strip = len(self.prefix) + 1 if self.prefix else 0

        def listing():
            out = []
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                              Prefix=self._k(prefix)):
                out += [o["Key"][strip:] for o in page.get("Contents", [])]
            return out
        return again(listing, self._body_errors)


@functools.lru_cache(maxsize=8)
def _open_store(store_cfg_json: str, cwd: str) -> Store:
    from tasks.core.config import StoreConfig

    return Store.open(StoreConfig.model_validate_json(store_cfg_json))


def open_store(cfg: Config) -> Store:
    """The run's store. One Store per store config (and working directory: a relative file store resolves
    against it) in this process: a boto3 client is not free to build."""
    return _open_store(cfg.store.model_dump_json(), os.getcwd())
