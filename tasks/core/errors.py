"""The two kinds of failure a user sees, and how a user error crosses a process boundary.

`UserError`: the user's input is wrong (config, data, reward path, store URI). One line naming the field or
row and what was expected; exit code 2; never retried; raised before anything is written to the store.
Anything else is an internal or infrastructure error: exit code 1, with a traceback.

A stage that runs in another process (a local subprocess, torchrun's workers, a SkyPilot job) reports a user
error as one line `RLFLOW_USER_ERROR: <message>` before it exits 2; whoever streams its output turns that line
back into a UserError (`user_error_in`). Standard library only: the SkyPilot bridge imports this in its own
environment. A stage that finds a committed artifact corrupt (its bytes no longer match its manifest) prints
`RLFLOW_CORRUPT_ARTIFACT: <key>\t<message>` and exits 3: the flow quarantines and recomputes that artifact.
"""

from __future__ import annotations

USER_ERROR = "RLFLOW_USER_ERROR: "
CORRUPT = "RLFLOW_CORRUPT_ARTIFACT: "      # a committed artifact whose bytes changed; the flow recomputes it


class UserError(Exception):
    """A mistake in the user's input. The message is one line: `field: what was expected, what was found`."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message.strip().splitlines()[0] if message.strip() else "invalid input")


def cause_of(exc: BaseException | None, kinds) -> BaseException | None:
    """The exception of type `kinds` behind `exc`, also when Prefect or a chain of exceptions wraps it."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kinds):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def user_error_line(error: UserError) -> str:
    """What a stage process prints on stderr before exit 2: the message, then the marker line."""
    return f"error: {error}\n{USER_ERROR}{error}"


def user_error_in(line: str) -> str | None:
    """The user error a line of a stage's output reports, or None."""
    return line.split(USER_ERROR, 1)[1].strip() if USER_ERROR in line else None


def corrupt_line(key: str, message: str) -> str:
    """What a stage process prints on stderr before exit 3, when a committed artifact it read is corrupt."""
    return f"error: {message}\n{CORRUPT}{key}\t{message}"


def corrupt_in(line: str) -> tuple[str, str] | None:
    """(artifact key, message) of a corrupt-artifact line of a stage's output, or None."""
    if CORRUPT not in line:
        return None
    key, _, message = line.split(CORRUPT, 1)[1].strip().partition("\t")
    return key, message or key
