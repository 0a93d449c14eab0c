"""File hashes, and the one memo of them: a file this machine hashed (or wrote with a known hash) is remembered by
its identity (device, inode, size, modification time), so a reader of the same unchanged multi-GB file (a policy
a store verifies, a GGUF file converted once, a judge's pinned weights) takes the remembered hash instead of reading
it again; any write to the file changes its modification time, and so its identity. And `digest`, the one short
fingerprint of a JSON value (config sections, a stage's inputs).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

from tasks.core.paths import cache_root

HASH_CHUNK = 8 << 20
REMEMBER_FROM = 4 << 20     # smaller files are hashed again when read (~1 ms per MB): remembering costs more


def digest(value) -> str:
    """A short fingerprint of a JSON value, its keys sorted: the config's sections, a stage's inputs, a trainer's
    settings. One formula: stored fingerprints are compared with it."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _identity(path: Path) -> Path:
    st = os.stat(path)
    return cache_root() / "known-files" / f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"


def remember_sha256(path: Path, sha: str) -> None:
    """Remember `sha` as this exact file's (a store writing a file it hashed as it copied)."""
    if path.stat().st_size < REMEMBER_FROM:
        return
    known = _identity(path)
    known.parent.mkdir(parents=True, exist_ok=True)
    tmp = known.with_name(f".{known.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(sha)
    os.replace(tmp, known)


def remembered_sha256(path: Path) -> str | None:
    """The sha256 remembered for this exact file, or None (never hashed here, or small): nothing read."""
    try:
        return _identity(path).read_text()
    except OSError:
        return None


def known_sha256(path: Path) -> str:
    """The file's sha256: remembered for this exact file (see above), else computed and remembered."""
    if path.stat().st_size < REMEMBER_FROM:
        return sha256_file(path)
    if (sha := remembered_sha256(path)) is None:
        sha = sha256_file(path)
        remember_sha256(path, sha)
    return sha
