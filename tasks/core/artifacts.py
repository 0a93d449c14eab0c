"""What makes a committed folder of the store whole: its manifest, written last, of the shape the store writes;
each file of the size and sha256 it lists; each file decoding as what rlflow wrote there. A folder that is not is
an IncompleteArtifact (no manifest yet: a writer was cut off) or a CorruptArtifact (changed after its commit:
flows/repair.py quarantines it and has its producer make it again). tasks/core/store.py reads and writes folders
by these rules; a stage that decodes a stored file does it inside `stored`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tasks.core.errors import printable
from tasks.core.hashing import known_sha256

MANIFEST = "MANIFEST.json"


class IncompleteArtifact(Exception):
    """A folder without a valid manifest, or with a file that does not match it."""


class CorruptArtifact(IncompleteArtifact):
    """A committed folder (its manifest written) whose manifest or a file changed afterwards: missing,
    truncated or altered. `key` is the folder; every stage is deterministic, so its producer can make it again
    (flows/repair.py quarantines it and has its producer make it again)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@contextlib.contextmanager
def stored(key: str, where: str) -> Iterator[None]:
    """Decoding a file (`where`, its URI) of committed folder `key`: bytes that match their manifest yet do not
    decode (edited with their manifest, a writer's fault) raise CorruptArtifact (quarantined and made again:
    flows/repair.py), not a traceback after Prefect's retries. Out of memory is not the file's fault."""
    import pickle

    try:
        yield
    except (ValueError, KeyError, TypeError, EOFError, RuntimeError, pickle.UnpicklingError) as e:
        if type(e).__name__ == "OutOfMemoryError":
            raise
        raise CorruptArtifact(key, _unreadable(where, e)) from None
    except Exception as e:
        if type(e).__name__ != "SafetensorError":
            raise
        raise CorruptArtifact(key, _unreadable(where, e)) from None


def _unreadable(where: str, e: BaseException) -> str:
    said = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
    return printable(f"{where}: not what rlflow writes there ({type(e).__name__}"
                     f"{': ' + said if said else ''})")


def manifest_fault(manifest) -> str | None:
    """What makes `manifest` not one this store writes (files: name -> {size, sha256}; meta: a mapping), or None."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return "not a manifest (expected a mapping whose files maps each name to its size and sha256)"
    for rel, entry in files.items():
        if not (isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
                and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64):
            return f"files.{rel}: expected {{size: bytes, sha256: 64 hex digits}}, got {str(entry)[:80]}"
    if not isinstance(manifest.get("meta"), dict):
        return "meta: expected a mapping"
    if manifest.get("format") != 1:
        return f"format {str(manifest.get('format'))[:20]}: expected 1 (what this rlflow writes)"
    return None


def verify_file(path: Path, want: dict, key: str, where: str) -> None:
    """CorruptArtifact unless the file at `path` (`where`, of folder `key`) has the size and sha256 `want` lists."""
    size = path.stat().st_size
    if size != want["size"]:
        raise CorruptArtifact(key, f"{where}: size {size} != {want['size']} in {MANIFEST} (truncated or altered)")
    if known_sha256(path) != want["sha256"]:
        raise CorruptArtifact(key, f"{where}: sha256 does not match {MANIFEST} (altered)")
