"""`rlflow export CONFIG VERSION DEST`: a published policy as a plain folder (from_pretrained loads it) or as one
GGUF file (llama.cpp, Ollama); VERSION a number, latest, best, or an MLflow model version (models:/NAME/3,
models:/NAME/latest, models:/NAME@champion). What it writes: tasks/core/policy.py (export), tasks/core/models.py
(policy_gguf).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from tasks.core.errors import UserError
from tasks.core.paths import check_environment, check_path


def cmd_export(args) -> int:
    """VERSION: N, latest, best, or an MLflow model version (models:/NAME/3, models:/NAME@champion). DEST: a
    folder from_pretrained loads, or (--format gguf, or a DEST ending .gguf) one GGUF file, LoRA merged first."""
    from tasks.core import layout
    from tasks.core.config import load_config
    from tasks.core.models import policy_gguf
    from tasks.core.stage import given_overrides
    from tasks.core.store import CorruptArtifact, open_store

    check_environment()                           # ($RLFLOW_CACHE: where a delta policy is rebuilt)
    dest = Path(args.dest).expanduser()
    fmt = args.format or ("gguf" if dest.name.lower().endswith(".gguf") else "folder")
    if fmt == "folder":
        if args.quant or args.register:
            raise UserError(f"--{'quant' if args.quant else 'register'}: only with --format gguf")
        check_path("DEST", args.dest, "folder", replaces=True)     # (written beside it, then renamed)
        if dest.exists() and any(dest.iterdir()):
            raise UserError(f"DEST: {dest} exists and is not an empty folder")
    else:
        check_path("DEST", args.dest, "file")
        if dest.exists():
            raise UserError(f"DEST: {dest} exists; a GGUF export writes a new file")
    if dest.is_symlink() or Path.cwd().resolve().is_relative_to(dest.resolve()):
        what = "a symbolic link" if dest.is_symlink() else "the working folder or one holding it"
        raise UserError(f"DEST: {args.dest}: {what}; expected a new path (or an empty folder) to write the export at")
    cfg = load_config(args.config, given_overrides(args))
    store, run, version = open_store(cfg), cfg.run.name, args.version
    store.check()                                 # (an S3 store without credentials or bucket: one line)
    if version.isascii() and version.isdigit():
        key = layout.policy(run, int(version))
    elif version in ("latest", "best"):
        pointer = layout.latest(run, "policy") if version == "latest" else layout.best(run)
        key = store.get_pointer(pointer)
        if key is None:
            raise UserError(f"VERSION: run {run!r} has no {version} policy in {store.uri(run)}")
        if not _policy_of(run, key):                                             # (a pointer edited by hand)
            raise CorruptArtifact(pointer, f"{store.uri(pointer)} names {key}, not a policy of run {run!r}")
    elif version.startswith("models:/"):
        key = _mlflow_policy(cfg, store, version)
    else:
        raise UserError(f"VERSION: expected a number, latest, best or models:/NAME/VERSION, got {version!r}")
    if store.manifest(key) is None:
        raise UserError(f"VERSION: no published policy at {store.uri(key)}")
    if fmt == "folder":
        from tasks.core.policy import export

        with _damage_said(key):
            print(export(store, key, dest))
        return 0
    registered = _registered_version(cfg, store.uri(key)) if args.register else None
    with _damage_said(key):
        done = policy_gguf(cfg, store, key, dest, args.quant or "f16")
    print(f"{done['file']}: {done['architecture']}, {done['quant']} ("
          + ", ".join(f"{n} {k}" for k, n in sorted(done["tensors"].items())) + f" tensors), "
          f"{done['bytes'] / 2**20:.1f} MiB, tokenizer {done['tokenizer']}/{done['pre']}")
    if registered is not None:
        print(f"registered: {_attach_gguf(cfg, registered, dest, done['quant'])}")
    return 0


def _policy_of(run: str, key: str) -> bool:
    """Whether `key` names one of run `run`'s published policies (layout.policy's own form)."""
    from tasks.core import layout

    try:
        return key == layout.policy(run, layout.version_of(key))
    except (ValueError, IndexError):
        return False


@contextlib.contextmanager
def _damage_said(key: str):
    """A policy that cannot be made whole (a delta whose anchor is gone): one line, as a damaged file is."""
    from tasks.core.store import CorruptArtifact, IncompleteArtifact

    try:
        yield
    except IncompleteArtifact as e:
        raise CorruptArtifact(key, str(e)) from e


def _registered_version(cfg, policy_uri: str):
    """The MLflow model version registered for `policy_uri` (--register), or one UserError line."""
    from tasks.core.registry import _find_version, registered_model_name
    from tasks.core.tracking import reading_client

    name = registered_model_name(cfg)
    client = reading_client(cfg.tracking.uri, "--register")
    try:
        version = _find_version(client, name, policy_uri)
    except Exception as e:  # noqa: BLE001 - no server, no such registered model: one line
        raise UserError(f"--register: cannot read the model versions of {name!r} at {cfg.tracking.uri}: "
                        f"{(str(e).splitlines() or [type(e).__name__])[0][:200]}") from None
    if version is None:
        raise UserError(f"--register: {policy_uri} is not a version of the registered model {name!r} "
                        f"(publish.register_model, publish.register_versions)")
    return client.get_model_version(name, version)


def _attach_gguf(cfg, mv, file: Path, quant: str) -> str:
    """Log the GGUF file as an artifact of the version's MLflow run and point the version at it (tags
    rlflow.gguf, rlflow.gguf_quant): the model version carries the file."""
    from tasks.core.tracking_db import tracking_client

    client = tracking_client(cfg.tracking.uri)
    folder = f"gguf/v{mv.version}"
    client.log_artifact(mv.run_id, str(file), folder)
    uri = f"runs:/{mv.run_id}/{folder}/{file.name}"
    client.set_model_version_tag(mv.name, mv.version, "rlflow.gguf", uri)
    client.set_model_version_tag(mv.name, mv.version, "rlflow.gguf_quant", quant)
    return f"models:/{mv.name}/{mv.version} carries {uri}"


def _mlflow_policy(cfg, store, uri: str) -> str:
    """The store key of the policy an MLflow model version (models:/NAME/VERSION or models:/NAME@ALIAS) names."""
    from mlflow.exceptions import MlflowException

    from tasks.core.tracking import reading_client

    name, _, rest = uri[len("models:/"):].partition("/")
    if "@" in rest or ("@" in name) == bool(rest):
        raise UserError(f"VERSION: {uri}: expected models:/NAME/VERSION or models:/NAME@ALIAS")
    if "@" in name:
        name, alias = name.split("@", 1)
    client = reading_client(cfg.tracking.uri, f"VERSION: {uri}")
    try:
        if rest == "latest":                      # (MLflow's name for the newest version)
            rest = str(max((int(v.version) for v in client.search_model_versions(f"name = '{name}'")), default=0))
        mv = client.get_model_version_by_alias(name, alias) if "@" in uri else client.get_model_version(name, rest)
    except MlflowException as e:
        raise UserError(f"VERSION: {uri}: {str(e).splitlines()[0][:200]}") from None
    source = mv.tags.get("rlflow.policy_uri") or mv.source
    root = store.root.rstrip("/") + "/"
    if not source.startswith(root):
        raise UserError(f"VERSION: {uri} names {source}, which is not in store.uri ({store.root})")
    return source[len(root):]
