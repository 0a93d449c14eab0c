"""Published policies that travel light: a policy folder holds its weights whole, or as a sparse delta against
an earlier whole policy (its anchor) when that is smaller. RL steps at RL learning rates leave most bf16
weights bit-identical, so a bf16 policy's delta is a small share of it.

    delta = encode(folder, anchor_folder)            # None when a delta would not be smaller than the whole
    write_delta(delta, folder, out, anchor_key)      # out: the policy's files, weights as delta.safetensors
    folder = materialize(store, key)                 # a local folder from_pretrained loads, verified

A delta folder holds every file of the policy but its *.safetensors weight files, plus `delta.safetensors`
(per tensor: the flat indices whose bits changed and their new values, or the whole tensor when its shape or
dtype changed or it is new) and `delta.json` {"anchor": store key of the whole policy, "files": {weight file:
{"metadata": its safetensors header metadata, "tensors": {name: sha256 of the tensor's bytes}}}}. Rebuilding
applies the delta to the anchor's tensors and checks every tensor against its sha256 before anything reads it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tasks.core.hashing import digest as digest_of
from tasks.core.paths import cache_root
from tasks.core.store import IncompleteArtifact

if TYPE_CHECKING:
    from tasks.core.store import Store

DELTA_FILE = "delta.safetensors"
DELTA_INDEX = "delta.json"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


@dataclass
class Delta:
    tensors: dict[str, torch.Tensor]      # "<file>::<name>::idx|val|full"
    files: dict[str, dict]                # weight file -> {"metadata", "tensors": {name: sha256}}
    size: int                             # bytes of `tensors`
    whole: int                            # bytes of the weight files it replaces


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _weight_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.safetensors"))


def _metadata(path: Path) -> dict:
    with safe_open(path, "pt") as f:
        return f.metadata() or {}


def encode(folder: Path, anchor: Path) -> Delta | None:
    """The weights of `folder` as changes against the weights of `anchor` (both local policy folders); None
    when that is not smaller than the weight files themselves (decided first from a sample when it is clearly
    not: fp32 weights, which every Adam step moves, never pay for a whole comparison and digest)."""
    rels = _weight_files(folder)
    if _estimate(folder, anchor, rels) >= SAMPLE_MARGIN * sum((folder / rel).stat().st_size for rel in rels):
        return None
    tensors, files, size, whole = {}, {}, 0, 0
    for rel in rels:
        new = load_file(folder / rel)
        old = load_file(anchor / rel) if (anchor / rel).is_file() else {}
        whole += (folder / rel).stat().st_size
        files[rel] = {"metadata": _metadata(folder / rel), "tensors": {}}
        for name, t in new.items():
            files[rel]["tensors"][name] = digest(t)
            o = old.get(name)
            if o is None or o.shape != t.shape or o.dtype != t.dtype:
                tensors[f"{rel}::{name}::full"] = t
                continue
            bits = _BITS[t.element_size()]
            changed = (t.reshape(-1).view(bits) != o.reshape(-1).view(bits)).nonzero().squeeze(1)
            if changed.numel():
                index_type = torch.int32 if t.numel() < 2**31 else torch.int64
                tensors[f"{rel}::{name}::idx"] = changed.to(index_type)
                tensors[f"{rel}::{name}::val"] = t.reshape(-1)[changed].contiguous()
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    return Delta(tensors, files, size, whole) if size < whole else None


SAMPLE_ROWS = 16           # rows (slices along the first dimension) compared per tensor for the estimate
SAMPLE_MARGIN = 0.9        # a delta estimated at >= this share of the whole is not tried


def _estimate(folder: Path, anchor: Path, rels: list[str]) -> float:
    """Bytes a delta would take, estimated from SAMPLE_ROWS evenly spaced rows of each tensor (read lazily: the
    files are not loaded)."""
    total = 0.0
    for rel in rels:
        if not (anchor / rel).is_file():
            total += (folder / rel).stat().st_size
            continue
        with safe_open(folder / rel, "pt") as f, safe_open(anchor / rel, "pt") as g:
            theirs = set(g.keys())
            for name in f.keys():
                new = f.get_slice(name)
                shape = new.get_shape()
                numel = math.prod(shape)
                old = g.get_slice(name) if name in theirs else None
                if old is None or old.get_shape() != shape or old.get_dtype() != new.get_dtype() or not shape:
                    total += numel * _SIZE.get(new.get_dtype(), 8)      # stored whole
                    continue
                rows = sorted({i * shape[0] // SAMPLE_ROWS for i in range(SAMPLE_ROWS)})
                a = torch.cat([new[i:i + 1].reshape(-1) for i in rows])
                b = torch.cat([old[i:i + 1].reshape(-1) for i in rows])
                bits = _BITS[a.element_size()]
                share = (a.view(bits) != b.view(bits)).float().mean().item() if a.numel() else 0.0
                total += share * numel * ((4 if numel < 2**31 else 8) + a.element_size())
    return total


def write_delta(delta: Delta, folder: Path, out: Path, anchor_key: str) -> None:
    """The policy folder `folder` written to `out` as a delta: its other files as they are (hard links where
    possible), its weight files replaced by delta.safetensors and delta.json."""
    weights = set(delta.files)
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel not in weights:
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, out / rel)
            except OSError:
                shutil.copyfile(path, out / rel)
    save_file(delta.tensors, out / DELTA_FILE, metadata={"format": "rlflow-delta"})
    (out / DELTA_INDEX).write_text(json.dumps({"anchor": anchor_key, "files": delta.files}, indent=1,
                                              sort_keys=True))


def anchor_of(manifest: dict) -> str | None:
    """The whole policy a delta policy folder is built on (None: it is whole itself)."""
    return manifest.get("meta", {}).get("anchor")


def materialize(store: Store, key: str) -> Path:
    """A local folder holding policy `key` whole: the store's (or the local cache's) folder when it is whole,
    else rebuilt once from its anchor and its delta into the local cache, every tensor checked."""
    manifest = store.manifest(key)
    if manifest is None:
        raise IncompleteArtifact(f"{store.uri(key)}: incomplete artifact (no MANIFEST.json)")
    if DELTA_INDEX not in manifest["files"]:
        return store.local(key)
    # (by the folder's URI and its manifest's files: a run started over writes other weights under the same URI)
    dest = cache_root() / "policies" / digest_of([store.uri(key), manifest["files"]])
    if (dest / DELTA_INDEX).is_file():           # rebuilt before: written last, so complete; checked again
        _check(dest, json.loads((dest / DELTA_INDEX).read_text()), store.uri(key))
        return dest
    source = store.local(key)
    index = json.loads((source / DELTA_INDEX).read_text())
    anchor = materialize(store, index["anchor"])
    delta = load_file(source / DELTA_FILE)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        for rel in sorted(manifest["files"]):                    # (what the manifest lists, nothing else)
            if rel not in (DELTA_FILE, DELTA_INDEX):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source / rel, tmp / rel)
        for rel, entry in index["files"].items():
            tensors = load_file(anchor / rel) if (anchor / rel).is_file() else {}
            tensors = {name: tensors.get(name) for name in entry["tensors"]}
            for name in entry["tensors"]:
                if (full := delta.get(f"{rel}::{name}::full")) is not None:
                    tensors[name] = full
                elif (idx := delta.get(f"{rel}::{name}::idx")) is not None:
                    flat = tensors[name].reshape(-1).clone()
                    flat[idx.long()] = delta[f"{rel}::{name}::val"]
                    tensors[name] = flat.reshape(tensors[name].shape)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, tmp / rel, metadata=entry["metadata"] or None)
        _check(tmp, index, store.uri(key))
        (tmp / DELTA_INDEX).write_text(json.dumps(index))       # last: marks the rebuilt folder complete
        try:
            os.rename(tmp, dest)
        except OSError:                                          # another process rebuilt it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _check(folder: Path, index: dict, where: str) -> None:
    for rel, entry in index["files"].items():
        if not (folder / rel).is_file():
            raise IncompleteArtifact(f"{where}: rebuilt {rel} is missing")
        got = load_file(folder / rel)
        for name, want in entry["tensors"].items():
            if name not in got or digest(got[name]) != want:
                raise IncompleteArtifact(f"{where}: tensor {name} of {rel} rebuilt from its anchor does not match "
                                         f"its checksum")


def export(store: Store, key: str, dest: Path) -> Path:
    """Policy `key` as a plain folder at `dest` (from_pretrained loads it): rebuilt if it is a delta. Only the
    files its manifest lists (and a delta's rebuilt ones), each written afresh (readable as the umask says, not
    0600 as safetensors writes); a copy that fails leaves nothing."""
    source = materialize(store, key)
    listed = set(store.manifest(key)["files"]) - {DELTA_FILE, DELTA_INDEX}
    if (source / DELTA_INDEX).is_file():
        listed |= set(json.loads((source / DELTA_INDEX).read_text())["files"])
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} exists and is not empty")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        for rel in sorted(listed):
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / rel, tmp / rel)
        tmp.mkdir(exist_ok=True)
        if dest.exists():
            dest.rmdir()
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
