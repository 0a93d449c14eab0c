"""One writer per run name: a lease object `<run>/LEASE.json` in the store.

A flow run takes the lease before writing anything and renews it from a background thread every third of
`run.lease_seconds`; it gives it back at the end. A second flow run for the same run name finds a live lease
and stops with one line saying who holds it. A writer that crashed (SIGKILL, lost machine) cannot give the
lease back: it expires after `run.lease_seconds`, and the next run takes it over — at once when the holder
was a process on this same machine that no longer exists, or the same Prefect flow run (a flow retry).

A holder whose renewals the store has not answered for `run.lease_seconds` (stopped, unreachable) may have lost
the lease meanwhile: before its next stage it renews first (`check`), and the compare-and-swap says whether the
lease is still its own (then it goes on) or another flow run took it over (then it stops writing).

Taking and renewing are compare-and-swap writes (S3 conditional PUT: If-None-Match / If-Match; a file lock
for the local store), so of two flows racing for a free lease exactly one wins. Different run names have
different prefixes and different leases: they never touch each other.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from tasks.core.errors import UserError
from tasks.core.processes import alive

if TYPE_CHECKING:
    from tasks.core.store import Store

LEASE = "LEASE.json"


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class LeaseLost(RuntimeError):
    """Our lease expired and another writer took it: stop writing."""


class Lease:
    def __init__(self, store: Store, run: str, seconds: float, flow_run_id: str | None = None):
        self.store, self.run, self.seconds = store, run, seconds
        self.key = f"{run}/{LEASE}"
        self.owner = uuid.uuid4().hex
        self.host, self.pid, self.flow_run_id = socket.gethostname(), os.getpid(), flow_run_id
        self.holder = f"{self.host} pid {self.pid}" + (f", flow run {flow_run_id}" if flow_run_id else "")
        self._tag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewing = threading.Lock()         # (the thread's renewals and check's, one at a time)
        self._renewed_at = time.monotonic()       # the last write of the lease the store answered
        self.lost: str | None = None

    def _record(self) -> bytes:
        return json.dumps({"owner": self.owner, "holder": self.holder, "host": self.host, "pid": self.pid,
                           "flow_run_id": self.flow_run_id, "expires_at": time.time() + self.seconds}).encode()

    def _stale(self, cur: dict) -> bool:
        if cur.get("owner") == self.owner or cur.get("expires_at", 0) <= time.time():
            return True
        if self.flow_run_id and cur.get("flow_run_id") == self.flow_run_id:
            return True                                    # our own flow run, retried
        if cur.get("host") == self.host and isinstance(cur.get("pid"), int) and cur["pid"] != self.pid:
            return not alive(cur["pid"])                   # its process on this machine is gone
        return False

    def acquire(self) -> Lease:
        for _ in range(5):           # a lost race re-reads and decides again
            data, tag = self.store.read_tagged(self.key)
            if data is not None:
                try:
                    cur = json.loads(data)
                except ValueError:
                    cur = {"owner": "?", "holder": "?", "expires_at": 0}
                if not self._stale(cur):
                    raise UserError(
                        f"run.name {self.run!r}: another flow run is writing this run ({cur.get('holder')}, lease "
                        f"valid until {_when(cur['expires_at'])}); wait for it to end or use another run.name")
            started, body = time.monotonic(), self._record()     # (its expiry counts from here, not the answer)
            if (new := self.store.write_if(self.key, body, tag)) is not None:
                self._tag, self._renewed_at = new, started
                self._thread = threading.Thread(target=self._renew_loop, daemon=True, name="rlflow-lease")
                self._thread.start()
                return self
        raise UserError(f"run.name {self.run!r}: could not take the run's lease (contended); try again")

    def _ours(self) -> str | None:
        """The lease's current tag when the lease in the store is ours, else None. A write whose reply was lost
        (a reset or 500 after the store applied it) changed the tag without telling us: the record says."""
        data, tag = self.store.read_tagged(self.key)
        try:
            return tag if data is not None and json.loads(data).get("owner") == self.owner else None
        except ValueError:
            return None

    def renew(self) -> None:
        with self._renewing:
            started, body = time.monotonic(), self._record()
            new = self.store.write_if(self.key, body, self._tag)
            if new is None:
                current = self._ours()       # our own earlier renewal, applied but unanswered?
                if current is not None:
                    new = self.store.write_if(self.key, body, current)
            if new is None:
                self.lost = f"run {self.run!r}: the lease was taken over by another flow run"
                raise LeaseLost(self.lost)
            self._tag, self._renewed_at = new, started

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            try:
                self.renew()
            except LeaseLost:
                return
            except Exception:   # a transient store error: the next tick tries again before expiry
                continue

    def check(self) -> None:
        """Raise if the lease was lost; the flow calls this before each stage. One whose renewals the store has not
        answered for run.lease_seconds may have expired and been taken over: it is renewed here first (LeaseLost if
        it was taken over; while the store still does not answer, a RuntimeError: no stage starts unconfirmed)."""
        if not self.lost and time.monotonic() - self._renewed_at > self.seconds:
            try:
                self.renew()
            except LeaseLost:
                pass
            except Exception as e:  # noqa: BLE001 - the store's failure, said with the lease's state
                age = time.monotonic() - self._renewed_at
                raise RuntimeError(f"run {self.run!r}: the run's lease was last renewed {age:.0f} s ago (past "
                                   f"run.lease_seconds, {self.seconds:g} s: it may have expired) and the store does "
                                   f"not answer its renewal ({type(e).__name__}: {str(e)[:200]}); no stage starts "
                                   f"until it is renewed") from e
        if self.lost:
            raise LeaseLost(self.lost)

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if self._tag and not self.lost:
            for attempt in range(4):     # a store fault now would leave the lease held until it expires
                try:
                    if self.store.delete_if(self.key, self._tag):
                        return
                    current = self._ours()                       # our renewal changed it unanswered
                    if current is None or self.store.delete_if(self.key, current):
                        return
                except Exception:
                    time.sleep(0.2 * 2 ** attempt)
            # still there: it expires on its own (run.lease_seconds)
