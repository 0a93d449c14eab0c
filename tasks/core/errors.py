"""The two kinds of failure a user sees, and how a user error crosses a process boundary.

`UserError`: the user's input is wrong (config, data, reward path, store URI). One line naming the field or
row and what was expected; exit code 2; never retried; raised before anything is written to the store.
Anything else is an internal or infrastructure error: exit code 1, with a traceback.

A stage that runs in another process (a local subprocess, torchrun's workers, a SkyPilot job) reports a user
error as one line `RLFLOW_USER_ERROR: <message>` before it exits 2; whoever streams its output turns that line
back into a UserError (`user_error_in`). Standard library only: the SkyPilot bridge imports this in its own
environment. A stage that finds a committed artifact corrupt (its bytes no longer match its manifest) prints
`RLFLOW_CORRUPT_ARTIFACT: <key>\t<message>` and exits 3: the flow quarantines and recomputes that artifact.
A disk that fills (`DiskFull`) is neither the user's input nor worth a retry: one line, `RLFLOW_DISK_FULL:`, exit 4.
"""

from __future__ import annotations

import errno
import re

USER_ERROR = "RLFLOW_USER_ERROR: "
CORRUPT = "RLFLOW_CORRUPT_ARTIFACT: "      # a committed artifact whose bytes changed; the flow recomputes it
DISK_FULL = "RLFLOW_DISK_FULL: "          # no space left where a stage writes; the run stops, resumable


class UserError(Exception):
    """A mistake in the user's input. The message is one line: `field: what was expected, what was found`."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(printable(redact(message.strip().splitlines()[0])) if message.strip() else "invalid input")


# What looks like a credential, wherever a message would quote it (a key pasted where the *name* of its variable
# belongs, a URL with a password): providers' key shapes, a JWT, and any long token that mixes upper and lower case
# letters and digits (a secret's shape; a sha256 or a run id is hex, a path's parts are not taken), and AWS's
# 40-character secret access keys.
_SECRET = re.compile(
    r"(?<![/A-Za-z0-9_-])(?:sk-[A-Za-z0-9_-]{12,}|sk_(?:live|test)_[A-Za-z0-9]{10,}|(?:AKIA|ASIA)[0-9A-Z]{16}"
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|hf_[A-Za-z0-9]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}"
    r"|AIza[0-9A-Za-z_-]{30,}|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"
    r"|(?=[A-Za-z0-9+_=-]{24,}(?![A-Za-z0-9+/_=-]))(?=[A-Za-z0-9+_=-]*[a-z])(?=[A-Za-z0-9+_=-]*[A-Z])"
    r"(?=[A-Za-z0-9+_=-]*[0-9])[A-Za-z0-9+_=-]{24,}"
    r"|(?=[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=]))(?=[A-Za-z0-9/+]*[a-z])(?=[A-Za-z0-9/+]*[A-Z])(?=[A-Za-z0-9/+]*[0-9])"
    r"[A-Za-z0-9/+]{40})")
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]+):[^\s/@]+@")


# Control characters a value quoted in a message may hold (an escape sequence would drive the user's terminal).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    r"""`text` with its control characters but tab written as escapes, as Python's repr writes them.
    >>> print(printable("data.path: a\x1b[2Jb\x07c"))
    data.path: a\x1b[2Jb\x07c
    """
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def redact(text: str) -> str:
    """`text` with what looks like a credential replaced by `***` (a URL keeps its user, not its password):
    messages never echo a secret a user pasted into a config or an override."""
    return _SECRET.sub("***", _URL_PASSWORD.sub(r"\g<head>:***@", text))


def cause_of(exc: BaseException | None, kinds) -> BaseException | None:
    """The exception of type `kinds` that `exc` is, or was raised from (`raise ... from`, however deep).

    Not one that was being handled when `exc` was raised (its implicit `__context__`): that is a new failure, such
    as a bug in a handler of a UserError, and is reported as itself (exit 1, with both tracebacks), not as the
    user's mistake (rlflow's own code re-raises with `from`: ruff's B904 rule, `make lint`).
    >>> try:
    ...     try:
    ...         raise UserError("data.path: expected a file")
    ...     except UserError:
    ...         {}["bug"]
    ... except KeyError as e:
    ...     cause_of(e, UserError) is None
    True
    """
    return next((e for e in chain(exc) if isinstance(e, kinds)), None)


def chain(exc: BaseException | None, implicit: bool = False):
    """`exc` and the exceptions behind it, each once: each explicit cause (`raise ... from`), and with `implicit`
    also the exception being handled when one was raised (unless `raise ... from None` said it is not the cause)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        yield exc
        seen.add(id(exc))
        exc = exc.__cause__ or (exc.__context__ if implicit and not exc.__suppress_context__ else None)


def user_error_line(error: UserError) -> str:
    """What a stage process prints on stderr before exit 2: the message, then the marker line."""
    return f"error: {error}\n{USER_ERROR}{error}"


def user_error_in(line: str) -> str | None:
    """The user error a line of a stage's output reports, or None."""
    return _said_after(USER_ERROR, line)


def _said_after(marker: str, line: str) -> str | None:
    """The message after `marker` in a line of a stage's output, or None."""
    return line.split(marker, 1)[1].strip() if marker in line else None


def corrupt_line(key: str, message: str) -> str:
    """What a stage process prints on stderr before exit 3, when a committed artifact it read is corrupt."""
    return f"error: {message}\n{CORRUPT}{key}\t{message}"


def corrupt_in(line: str) -> tuple[str, str] | None:
    """(artifact key, message) of a corrupt-artifact line of a stage's output, or None."""
    if CORRUPT not in line:
        return None
    key, _, message = line.split(CORRUPT, 1)[1].strip().partition("\t")
    return key, message or key


class DiskFull(Exception):
    """No space left on a device a stage writes to (ENOSPC, or a quota: EDQUOT). Not the user's input and not
    worth a retry (the same disk is as full a second later): the run stops with this one line, what is committed
    stays, and the same command resumes once there is room. Exit code 4 from a stage process, 1 from `rlflow`."""

    exit_code = 4

    def __init__(self, message: str):
        super().__init__(message.strip().splitlines()[0] if message.strip() else "no space left on device")


_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException | None) -> DiskFull | None:
    """The full disk behind `exc` (an OSError with ENOSPC or EDQUOT anywhere in its chain, or a DiskFull a stage
    process reported), as one DiskFull naming the file that could not be written, or None.

    >>> str(disk_full(OSError(errno.ENOSPC, "No space left on device", "/data/a.bin")))[:44]
    'no space left on device writing /data/a.bin:'
    >>> disk_full(OSError(errno.ENOENT, "No such file")) is None
    True
    """
    said = cause_of(exc, DiskFull)
    if said is not None:
        return said
    # A library may re-raise a failed write without `from` (an error in its handler of the OSError): the disk
    # is as full, so here the implicit context counts too.
    full = next((e for e in chain(exc, implicit=True) if isinstance(e, OSError) and e.errno in _FULL), None)
    if full is None:
        return None
    where = full.filename2 or full.filename
    return DiskFull(("no space left on device" if full.errno == errno.ENOSPC else "disk quota exceeded")
                    + (f" writing {where}" if where else "") + ": free space there (or keep fewer policies: "
                    "store.keep) and run the same command to resume")


def disk_full_line(error: DiskFull) -> str:
    """What a stage process prints on stderr before exit 4, when a disk it writes to is full."""
    return f"error: {error}\n{DISK_FULL}{error}"


def disk_full_in(line: str) -> str | None:
    """The full-disk message a line of a stage's output reports, or None."""
    return _said_after(DISK_FULL, line)
