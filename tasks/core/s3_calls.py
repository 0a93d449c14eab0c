"""How each S3 request of the store (tasks/core/store.py: S3Store) is tried again and said: botocore retries a
request that fails (RETRIES), `Resilient`/`again` a reply whose body breaks off as it is read (not a call that got
no answer after AGAIN_SECONDS: botocore waited that out already), `say_retry` tells the console once a minute while
a store does not answer, and `store_gone` names a bucket no retry brings back.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time

from tasks.core.errors import cause_of

READ_ATTEMPTS = 5
AGAIN_SECONDS = 60.0        # a call with no answer after this long (botocore waited out its own tries): not again


def body_errors() -> tuple[type[BaseException], ...]:
    from botocore import exceptions as bx
    from urllib3.exceptions import ProtocolError

    return (bx.IncompleteReadError, bx.ResponseStreamingError, bx.ReadTimeoutError, bx.ConnectionClosedError,
            ProtocolError, ConnectionError)


RETRIES = 5                 # botocore's tries of each S3 request (standard mode, back-off between them)
_SAID_AT = [-math.inf]      # when this process last said a store's request is tried again (say_retry)


def store_gone(exc: BaseException | None) -> str | None:
    """What a store call that failed for good says (its bucket gone: deleted, or another server answers at the
    endpoint now), or None: no retry brings such a bucket back (the stage's retries waited on it, silent)."""
    from botocore.exceptions import ClientError

    if (e := cause_of(exc, ClientError)) is None or e.response.get("Error", {}).get("Code") != "NoSuchBucket":
        return None
    bucket = e.response["Error"].get("BucketName") or "of store.uri"
    return (f"store.uri: the bucket {bucket} does not exist (it did when the run started: deleted, or another "
            f"server answers at the endpoint now); the run's outputs were there")


class Resilient:
    """A boto3 S3 client whose calls are tried again when the reply breaks off while its body is read (a reset,
    a truncated body): botocore retries a request that fails, but raises such a read error from the call.
    S3's operations here are idempotent (a conditional PUT answered 412 on the retry is the caller's to
    read back: the lease does)."""

    def __init__(self, client, errors: tuple[type[BaseException], ...]):
        self.raw, self._errors = client, errors          # raw: for a caller that retries a wider step itself
        self.exceptions, self.meta = client.exceptions, client.meta

    def get_paginator(self, name):
        return self.raw.get_paginator(name)

    def __getattr__(self, name):
        method = getattr(self.raw, name)

        def call(*args, **kwargs):
            return again(lambda: method(*args, **kwargs), self._errors)
        return call


def again(fn, errors: tuple[type[BaseException], ...], attempts: int = READ_ATTEMPTS):
    """fn() tried again on `errors`, up to `attempts` in all; not a call that got no answer (a read or connect
    timeout) after AGAIN_SECONDS: a server that answers nothing (stopped, gone) made botocore wait out its own
    RETRIES tries of 60 s each, and each try here waited that again (~25 min a call; the stage's retries then
    multiplied it). A long transfer broken off by a reset is still tried again."""
    from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError

    for attempt in range(attempts):
        began = time.monotonic()
        try:
            return fn()
        except errors as e:
            silent = isinstance(e, ReadTimeoutError | ConnectTimeoutError)
            if attempt == attempts - 1 or silent and time.monotonic() - began > AGAIN_SECONDS:
                raise
            time.sleep(0.1 * 2 ** attempt)
    raise AssertionError("unreachable")


def say_retry(attempts=None, caught_exception=None, operation=None, *, store: str | None = None, **_) -> None:
    """botocore is about to try a request again that got no answer (a timeout, a refused or dropped
    connection): said on stderr, at most once a minute (a stalled store was silent for as long as it
    stalled: each try waits botocore's 60 s read timeout)."""
    from botocore.exceptions import ConnectionClosedError, ConnectionError, ReadTimeoutError

    if not isinstance(caught_exception, ConnectionError | ReadTimeoutError | ConnectionClosedError) or \
            (attempts or 0) >= RETRIES or time.monotonic() - _SAID_AT[0] < 60:
        return                  # (after the last try botocore gives up: the error says it)
    _SAID_AT[0] = time.monotonic()
    with contextlib.suppress(OSError, ValueError):      # (a closed stderr must not replace the store's error)
        print(f"warning: store: {store or 'S3'} did not answer {getattr(operation, 'name', 'a request')} "
              f"({type(caught_exception).__name__}): try {attempts} of {RETRIES} failed, trying again (said "
              f"once a minute while it lasts)", file=sys.stderr, flush=True)
