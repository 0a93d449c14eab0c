"""The two kinds of failure a user sees.

`UserError`: the user's input is wrong (config, data, reward path, store URI). One line naming the field or
row and what was expected; exit code 2; never retried; raised before anything is written to the store.
Anything else is an internal or infrastructure error: exit code 1, with a traceback.
"""


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
