"""Places on the local disk: the cache, the checkout rlflow runs from, the sibling virtualenvs, and whether a
path given for an output can be written (check_path, require_creatable: before anything is).

vLLM and SkyPilot pin packages below what the rest of rlflow needs (Makefile), so each lives in a virtualenv
of its own beside `.venv`: `.venv-vllm` and `.venv-sky`. Their interpreters are found by one rule,
`sibling_python`: the working directory first (where `rlflow` is run from, and a SkyPilot node's workdir),
then the checkout this code was imported from (where `make setup` built them). A user's own module (a reward
function, an environment factory, an agent, a judge's parser: `module:name`) is found from the working
directory first and imported by one helper, `import_user`, under a deadline: a module that waits or loops when
imported is one line naming the field, not a preflight that never ends.
"""

from __future__ import annotations

import importlib
import os
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from tasks.core.errors import UserError
from tasks.core.process_wide import (
    DeadlinePassed,
    deadline,
    number_from_environment,
    user_code,
    user_import,
    user_output_limit,
)

REPO_ROOT = Path(__file__).resolve().parents[2]     # the checkout holding tasks/ and flows/


def require_creatable(folder: Path, field: str) -> None:
    """UserError naming `field` unless `folder` is a folder, or one this process can create: its nearest existing
    ancestor is a folder in which a folder can be made (_cannot_make_in), found here, before the run."""
    try:
        probe = _nearest_existing(folder.expanduser().absolute())
        is_dir = probe.is_dir()
    except OSError as e:                         # (a name past the filesystem's limit: ENAMETOOLONG)
        raise UserError(f"{field}: {str(folder)[:80]}...: {e.strerror or type(e).__name__}") from None
    if not is_dir:
        raise UserError(f"{field}: {probe} is a file, not a folder")
    if probe == folder.expanduser().absolute():
        if not os.access(probe, os.W_OK) or _cannot_make_in(probe) is not None:     # (/proc: W_OK to root)
            raise UserError(f"{field}: {probe} is not writable")
        return
    if (why := _cannot_make_in(probe)) is not None:
        raise UserError(f"{field}: cannot create {folder} ({why} in {probe})")


def _nearest_existing(path: Path) -> Path:
    """`path` if it exists, else its nearest ancestor that does."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _cannot_make_in(folder: Path) -> str | None:
    """Why nothing can be made in `folder` (a read-only filesystem, /proc, a missing permission), or None: tried
    with a folder made and removed at once, so nothing is left."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rlflow-probe-", dir=folder))
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def check_path(flag: str, path: str | Path, want: str, writes: bool = True, replaces: bool = False) -> None:
    """One UserError line, before anything is created, if `path` cannot be the `want` ("folder" or "file") a
    command writes there (`writes`; else reads): empty, it exists as the other kind, something on the way to it
    is a file or cannot be entered, or nothing can be made where it would go (/proc, a read-only filesystem, a
    missing permission: _cannot_make_in). An existing file is written in place (it must be writable: /dev/stdout
    will do), or with `replaces` beside it and renamed over it (its folder must take a new file); so is an
    existing (empty) folder with `replaces`, where else what goes inside it."""
    if not str(path).strip():
        raise UserError(f"{flag}: empty; expected the path of a {want}")
    path = Path(path).expanduser()
    try:
        if path.exists():
            if want == "folder" and not path.is_dir():
                raise UserError(f"{flag}: {path} is a file, not a folder")
            if want == "file" and path.is_dir():
                raise UserError(f"{flag}: {path} is a folder, not a file")
            if writes and want == "file" and not replaces:
                if not os.access(path, os.W_OK):
                    raise UserError(f"{flag}: {path} is not writable")
                return
            probe = path if path.is_dir() and not replaces else path.absolute().parent
        else:
            probe = _nearest_existing(path.absolute().parent)
            if not probe.is_dir():
                raise UserError(f"{flag}: {path}: {probe} is a file, not a folder")
    except OSError as e:                                 # (a folder on the way that cannot be entered)
        raise UserError(f"{flag}: {path}: cannot be reached ({e.strerror or type(e).__name__})") from None
    if writes and (why := _cannot_make_in(probe)) is not None:
        raise UserError(f"{flag}: cannot write {path} ({why} in {probe})")


def cache_root() -> Path:
    """Local cache: builtin models, verified copies of store folders, vLLM server state. $RLFLOW_CACHE (set and
    empty: unset, not the working directory)."""
    return Path(os.environ.get("RLFLOW_CACHE") or Path.home() / ".cache" / "rlflow")


def check_environment() -> None:
    """rlflow's own environment variables, each read where it is used, checked once before a command starts:
    $RLFLOW_IMPORT_SECONDS, $RLFLOW_USER_OUTPUT_BYTES and $RLFLOW_CACHE (a folder that can be made)."""
    user_code_seconds()
    user_output_limit()
    if os.environ.get("RLFLOW_CACHE"):        # (unset: ~/.cache/rlflow, made when first used, as before)
        require_creatable(cache_root(), "RLFLOW_CACHE")


def sibling_python(venv: str) -> str | None:
    """`<dir>/<venv>/bin/python` for the first of (working directory, repository root) that has it, or None."""
    for folder in (Path.cwd(), REPO_ROOT):
        python = folder / venv / "bin" / "python"
        if python.exists():
            return str(python)
    return None


IMPORT_SECONDS = 60.0      # a user's module that takes longer to import is taken as hung ($RLFLOW_IMPORT_SECONDS)


def user_code_seconds() -> float:
    """How long a user's module may take to import, or a user's object to be made, before it is taken as hung."""
    return number_from_environment("RLFLOW_IMPORT_SECONDS", IMPORT_SECONDS, 0.01, 7 * 86400)


def working_directory_on_path(here: str | None = None) -> None:
    """The working directory first on sys.path (user modules live where rlflow is run), behind only this checkout's
    root: a child that copies this sys.path and runs the main module again (multiprocessing's spawn and
    forkserver, started by user code) imports rlflow's `tasks` and `flows`, not a user's package of that name in
    the working directory. '' and '.' (the working directory by name: `python -c`, notebooks) give way to it.
    (Installed as a wheel, rlflow's packages sit in site-packages: the working directory goes first, as before.)"""
    here, root = os.path.abspath(here or os.getcwd()), str(REPO_ROOT)
    if not (REPO_ROOT / "pyproject.toml").is_file() or here == root:
        if here not in sys.path:
            sys.path.insert(0, here)
        return
    sys.path[:] = [root, here, *(p for p in sys.path if p not in (root, here, "", os.curdir))]


def import_hung(key: str, module: str, seconds: float, noun: str) -> str:
    """The line for a user's module that did not finish importing in time (here, or in the reward worker)."""
    return (f"{key}: module {module!r} did not finish importing in {seconds:g} s (it waits or loops when imported: "
            f"move that work into the {noun}; RLFLOW_IMPORT_SECONDS allows more)")


def import_user(spec: str, key: str, noun: str = "callable", by_name: bool = False) -> Callable:
    """`module:name` from the working directory first (user modules live where rlflow is run), imported within
    IMPORT_SECONDS: a UserError naming `key` if the module cannot be imported (it raises, calls sys.exit, or
    does not finish importing in time) or has no such callable (`by_name`: or a dict of them by name, returned
    as it is). A module that changes the working directory when imported leaves rlflow's where it was."""
    module_name, _, attr = spec.partition(":")
    here = os.getcwd()
    working_directory_on_path(here)
    seconds = user_code_seconds()
    try:
        with deadline(seconds), user_code(may_chdir=True), user_import():   # (preflight's in the main thread)
            try:
                module = importlib.import_module(module_name)
            finally:
                if os.getcwd() != here:
                    os.chdir(here)
    except DeadlinePassed:
        raise UserError(import_hung(key, module_name, seconds, noun)) from None
    except (Exception, SystemExit) as e:           # (a module that calls sys.exit when imported)
        raise UserError(f"{key}: cannot import module {module_name!r}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None
    fn = getattr(module, attr, None)
    if by_name and isinstance(fn, dict) and fn:
        for name, value in fn.items():
            if not isinstance(name, str) or not callable(value):
                raise UserError(f"{key}: {spec} is a dict, whose {name!r} is {type(value).__name__}; expected "
                                f"{noun}s by name (str keys)")
        return fn
    if not callable(fn):
        if isinstance(fn, dict) or not hasattr(module, attr):
            raise UserError(f"{key}: {module_name!r} has no {noun} {attr!r}"
                            + (" (or a dict of them by name; it is an empty dict)" if isinstance(fn, dict) else ""))
        raise UserError(f"{key}: {spec} is {type(fn).__name__} {_short(fn)}, not a {noun}")
    return fn


def _short(value) -> str:
    """A value as a line may show it: its repr, cut."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def file_uri_path(name: str) -> str:
    """A file:// URI as its path (file:///a/b -> /a/b; file://localhost/a too; FILE:// alike); anything else
    unchanged. ValueError: a URI of another host."""
    if name[:7].lower() != "file://":
        return name
    uri = urllib.parse.urlparse(name)
    if uri.netloc not in ("", "localhost"):
        raise ValueError(f"a file:// URI of another host ({uri.netloc}); expected file:///<path> on this machine")
    return urllib.parse.unquote(uri.path) or "/"
