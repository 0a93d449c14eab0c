"""The tracking database and the one way rlflow opens a client to it (`tracking_client`). A sqlite database is
created whole or not at all (MLflow migrates a new one in place, for seconds),
and, after an environment's first, as a copy of the empty one kept in the local cache (~3 s become ~0.1 s).
More: docs/internals.md (tasks/core/tracking_db.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading
from pathlib import Path

from tasks.core.errors import disk_full

MIGRATIONS_NEED = 16 << 20     # bytes MLflow's empty sqlite database takes while its migrations run (~1 MB), with room


def tracking_client(uri: str):
    """An MlflowClient for `uri` (its registry too), the database made whole first: every MLflow call of rlflow
    goes through one of these, nothing through MLflow's global state."""
    from tasks.core.process_wide import set_default

    set_default("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow.tracking import MlflowClient

    create_whole(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def sqlite_file(uri: str) -> Path | None:
    """The database file of a sqlite tracking URI, absolute; None for any other URI (and sqlite in memory)."""
    if not uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(uri).database
    return Path(database).absolute() if database and database != ":memory:" else None


def create_whole(uri: str) -> None:
    """A new sqlite tracking database appears whole or not at all. MLflow creates it in place, in a few
    seconds of schema migrations: a process killed in them leaves a half-migrated database that every later
    run fails on ("duplicate column name"). So it is built under a temporary name and linked into place (an
    atomic create-if-absent: of two processes creating it, one wins and the other uses the winner's). After the
    first, a database is a copy of the empty one this environment kept (~3 s of migrations become ~0.1 s)."""
    path = sqlite_file(uri)
    if path is None or path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(path)
    tmp = _temporary(path)
    try:
        template = _empty_database()
    except Exception:  # noqa: BLE001 - no cache (no home folder, MLflow's metadata missing): always migrate
        template = None
    try:
        try:
            copied = _open_whole(tmp, template)
        except Exception as e:
            # sqlite's "database or disk is full" reaches here as whatever migration step it broke (alembic's
            # "table spans already exists"): a full disk is told by the space left, in one line
            if shutil.disk_usage(path.parent).free < MIGRATIONS_NEED:
                raise disk_full(OSError(errno.ENOSPC, "No space left on device", str(path))) from e
            raise
        if not copied:
            _keep_empty(tmp, template)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        _remove_sqlite(tmp)


def _open_whole(tmp: Path, template: Path | None) -> bool:
    """Make `tmp` a database MLflow has opened (its tables, its Default experiment): a copy of this environment's
    empty one when there is one that MLflow opens (True), else by MLflow's migrations (False). A kept copy that
    MLflow refuses (its schema check, a damage sqlite did not see) is removed, and this database migrated."""
    copied = _copy_empty(template, tmp)
    try:
        _open(tmp)
    except Exception:
        if not copied:
            raise
        template.unlink(missing_ok=True)
        _remove_sqlite(tmp)
        fresh = tmp.with_name(f"{tmp.name}-migrated")       # (MLflow keeps its engine for tmp's URI: another name)
        try:
            _open(fresh)
            os.replace(fresh, tmp)
        finally:
            _remove_sqlite(fresh)
        return False
    return copied


def _open(database: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{database}"
    client = None
    try:
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)              # the tables: tracking,
        client.search_experiments(max_results=1)
        client.search_registered_models(max_results=1)                      # and the model registry
    finally:
        if client is not None:
            _dispose_engines(client)


def _copy_empty(template: Path | None, tmp: Path) -> bool:
    """Copy the empty database kept here to `tmp`, checked by sqlite (a damaged one is removed: it is migrated
    again); False where there is none, or it cannot be read (the cache is a convenience: never an error). A full
    disk where the database goes is raised."""
    import sqlite3

    if template is None:
        return False
    with contextlib.suppress(OSError):  # (parts of a kept copy that killed processes left: before a copy or a keep)
        _clear_stale(template)
    try:
        shutil.copyfile(template, tmp)
    except OSError as e:                           # (none yet, replaced just now, a cache this user cannot read)
        _remove_sqlite(tmp)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        return False
    try:
        db = sqlite3.connect(tmp)
        try:
            whole = db.execute("PRAGMA quick_check").fetchall() == [("ok",)] and \
                db.execute("SELECT count(*) FROM alembic_version").fetchone() == (1,)
        finally:
            db.close()
    except sqlite3.Error:
        whole = False
    if not whole:
        _remove_sqlite(tmp)
        template.unlink(missing_ok=True)
    return whole


def _empty_database() -> Path | None:
    """Where this environment keeps an empty database MLflow migrated (MLflow's migrations take seconds, a copy a
    few milliseconds): one per MLflow version and set of migrations, in the local cache. None where MLflow's
    migrations are not found (the database is then always migrated)."""
    import hashlib
    from importlib.metadata import version

    import mlflow.store.db_migrations as migrations

    names = sorted(p.name for p in (Path(migrations.__file__).parent / "versions").glob("*.py"))
    if not names:
        return None
    from tasks.core.paths import cache_root

    key = hashlib.sha256(json.dumps([version("mlflow"), names]).encode()).hexdigest()[:16]
    return cache_root() / "mlflow-db" / f"empty-{key}.db"


def _keep_empty(tmp: Path, template: Path | None) -> None:
    """Keep a copy of the database just migrated as this environment's empty one, without its Default experiment
    (MLflow makes that on opening, with the artifact location of the folder it is opened from). Written under a
    temporary name and renamed: a copy cut short is never used. A cache that cannot be written is no error."""
    import sqlite3

    if template is None:
        return
    part = _temporary(template)
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp, part)
        with sqlite3.connect(part) as db:
            db.execute("DELETE FROM experiments")
        db.close()
        os.replace(part, template)
    except (OSError, sqlite3.Error):
        pass
    finally:
        with contextlib.suppress(OSError):
            _remove_sqlite(part)


def _temporary(path: Path) -> Path:
    """The name `path` is written under by this thread, renamed or linked into place when whole."""
    return path.with_name(f".{path.name}.creating-{os.getpid()}-{threading.get_ident()}")


def _clear_stale(path: Path) -> None:
    """Remove the temporary files of `path` (and their journals) left by processes that were killed."""
    from tasks.core.processes import alive

    for stale in path.parent.glob(f".{path.name}.creating-*"):
        pid = stale.name.split(".creating-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            stale.unlink(missing_ok=True)


def _remove_sqlite(database: Path) -> None:
    database.unlink(missing_ok=True)
    for extra in ("-journal", "-wal", "-shm"):
        database.with_name(database.name + extra).unlink(missing_ok=True)


def _dispose_engines(client) -> None:
    """Close the client's connections to the temporary database before it is unlinked."""
    for store in (lambda: client._tracking_client.store, lambda: client._get_registry_client().store):
        try:
            store().engine.dispose()
        except Exception:  # noqa: BLE001 - a courtesy (an open handle to an unlinked file is harmless)
            pass
