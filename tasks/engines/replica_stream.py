"""The streaming sampler's decode steps on replicas (generate.streaming with generate.replicas: N): the batch's
rows spread over the replicas, each decoding its own with the run's decoder (tasks/engines/replica.py's /stream:
HFDecoder or VLLMDecoder there), through the run's router (tasks/engines/replica_router.py), which starts and
replaces them.

    decoder = ReplicasDecoder(cfg, params, services)   # Stream's decoder when generate.replicas is set
    decoder.load(key, path)                  # each replica loads it in place before its next request
    decoder.step_batch(rows, version, stop)  # returns once any replica has answered, or `stop` says so

A group's rows go to one replica (its prompt's KV shared there), a new group to the one with the fewest rows. A
replica's request decodes until one of its rows finishes, `refill_share` of them have, or the sampler interrupts
it; the other replicas go on meanwhile. A newer policy: every replica interrupted answers with its tokens so far
and loads it in place at its next request, so every later token is the new version's. A replica lost (its
process gone, its spot cluster preempted): its rows continue on the others from their tokens so far.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from tasks.core.contracts import SamplingParams
from tasks.engines.replicas import ANSWERING, ensure_router, policy_digest, shard_seed

if TYPE_CHECKING:
    from tasks.core.config import Config

POLL = 0.01            # how often a waiting step asks the sampler's `stop`


class ReplicasDecoder:
    """The streaming sampler's rows on the run's replicas: which replica holds which row, the requests in
    flight (one per replica at most), and what each replica is yet to be told (rows added or dropped)."""

    def __init__(self, cfg: Config, params: SamplingParams, services=None):
        import httpx

        from tasks.core.placement import placement_of
        from tasks.engines.sampling import sampling_engine

        self.cfg, self.params, self.n = cfg, params, placement_of(cfg).replicas
        router = ensure_router(cfg, sampling_engine(cfg, services).launch)
        self.http = httpx.Client(base_url=router["url"], timeout=httpx.Timeout(None, connect=10),
                                 limits=httpx.Limits(max_connections=4 * self.n + 4))
        self.pool = ThreadPoolExecutor(max_workers=self.n, thread_name_prefix="replica-stream")
        self.session = secrets.token_hex(8)      # (a replica drops the rows of an earlier sampler's session)
        self.policy: tuple[str, str] | None = None
        self.placed: dict[int, tuple[int, str]] = {}      # id(row) -> (replica, request id)
        self.rows: dict[str, object] = {}                # request id -> its row (tasks/engines/streaming.py: Row)
        self.add: dict[int, list[str]] = {i: [] for i in range(self.n)}    # to tell each replica next
        self.drop: dict[int, list[str]] = {i: [] for i in range(self.n)}
        self.busy: dict[int, tuple[Future, int, int]] = {}        # replica -> (its request, seq, version)
        self.up: set[int] = set()
        self.made = self.seq = 0
        self.moved = 0                                   # rows continued elsewhere after their replica was lost

    # -- the replicas
    def _refresh(self, need: bool) -> None:
        """The replicas that answer now (the router's view); `need`: wait for one (the router starts or replaces
        them) up to generate.server_start_timeout."""
        deadline = time.monotonic() + self.cfg.generate.server_start_timeout
        while True:
            members = self.http.get("/stats").json()["members"]
            self.up = {int(i) for i, m in members.items() if m["state"] in ANSWERING}
            for i in {m for m, _ in self.placed.values()} - self.up - set(self.busy):
                self._unplace(i)                 # (down, nothing in flight: its rows go on elsewhere)
            if self.up or not need:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"generate.streaming: no replica answered within "
                                   f"{self.cfg.generate.server_start_timeout} s (generate.server_start_timeout)")
            time.sleep(0.2)

    def _request(self, i: int, body: dict) -> tuple[int, dict]:
        r = self.http.post(f"/stream/{i}/stream", json=body)
        return r.status_code, r.json()

    def _send(self, i: int, version: int) -> None:
        gc = self.cfg.generate
        refill = max(1, int(gc.streaming.refill_share * sum(m == i for m, _ in self.placed.values())))
        self.seq += 1
        body = {"session": self.session, "policy": self.policy[0], "digest": self.policy[1], "seq": self.seq,
                "params": dataclasses.asdict(dataclasses.replace(self.params, seed=shard_seed(self.params.seed, i))),
                "add": [[rid, self.rows[rid].prompt, self.rows[rid].tokens, self.rows[rid].limit,
                         self.rows[rid].sampling] for rid in self.add[i]],
                "drop": self.drop[i], "refill": refill}
        self.add[i], self.drop[i] = [], []
        self.busy[i] = (self.pool.submit(self._request, i, body), self.seq, version)

    def _answered(self, i: int) -> int:
        """Replica i's answer taken (its rows' new tokens, under the version it was asked with); how many of its
        rows finished. A lost replica's rows are placed again, their tokens kept."""
        future, _, version = self.busy.pop(i)
        try:
            code, out = future.result()
        except Exception as e:  # noqa: BLE001 - the router is local: a failure here is the router's
            raise RuntimeError(f"generate.streaming: the replicas' router failed: {e}") from e
        if code == 503:
            self._lost(i)
            return 0
        if code != 200:
            raise RuntimeError(f"generate.streaming: replica {i}: HTTP {code}: {out.get('error', out)}")
        finished = 0
        for rid, ids, logprobs, done, truncated in out["rows"]:
            r = self.rows.get(rid)
            if r is None:
                continue                              # (dropped meanwhile)
            r.tokens += ids
            r.logprobs += logprobs
            r.versions += [version] * len(ids)
            if done:
                r.done, r.truncated = True, truncated
                del self.rows[rid], self.placed[id(r)]
                finished += 1
        return finished

    def _lost(self, i: int) -> None:
        self.up.discard(i)
        self._unplace(i)
        self._refresh(need=False)

    def _unplace(self, i: int) -> None:
        """Replica i's rows unplaced, their tokens kept: each is placed again, and continues, where it lands."""
        for key, (m, rid) in list(self.placed.items()):
            if m == i:
                del self.placed[key], self.rows[rid]
                self.moved += 1
        self.add[i], self.drop[i] = [], []

    def _place(self, row) -> int:
        """Where the row's group (an agent's call: its episode) has rows already, else the emptiest replica up."""
        def key(r):
            return r.group if r.group is not None else r.owner
        for r in self.rows.values():
            if key(r) == key(row) and (m := self.placed[id(r)][0]) in self.up:
                return m
        load = {i: 0 for i in self.up}
        for m, _ in self.placed.values():
            if m in load:
                load[m] += 1
        return min(load, key=lambda i: (load[i], i))

    # -- the decoder's side
    def load(self, key: str, path: str) -> None:
        """Policy `key` for the requests from now on: the ones in flight interrupted and answered first (their
        tokens the old version's), so each replica loads it in place before it decodes again."""
        self._interrupt()
        self.policy = (key, policy_digest(self.cfg, key))

    def _interrupt(self) -> None:
        for i, (_, seq, _) in list(self.busy.items()):
            try:
                self.http.post(f"/stream/{i}/interrupt", json={"seq": seq})
            except Exception:  # noqa: BLE001 - a replica that cannot be told is lost: its answer says so
                pass
        for i in list(self.busy):
            self._answered(i)

    def step_batch(self, rows: list, version: int, stop) -> bool:
        """Decode `rows` on the replicas until one answers with a finished row, or `stop(finished, rows)` says so;
        True when rows are left unfinished. Replicas in flight go on meanwhile (a newer policy interrupts them:
        `load`), and rows that joined are sent to a replica once it has answered. A lost replica's rows are
        placed again on the others."""
        while True:
            self._place_all(rows)
            left = self._decode(rows, version, stop)
            if left is not None:
                return left

    def _place_all(self, rows: list) -> None:
        """Rows that left the batch unfinished are dropped from their replica; rows not on one are placed."""
        live = {id(r) for r in rows}
        for key, (m, rid) in list(self.placed.items()):
            if key not in live:
                del self.placed[key], self.rows[rid]
                self.drop[m].append(rid)
        if not self.up:
            self._refresh(need=True)
        for r in rows:
            if id(r) not in self.placed and not r.done:
                m, rid = self._place(r), f"{self.made}"
                self.made += 1
                self.placed[id(r)], self.rows[rid] = (m, rid), r
                self.add[m].append(rid)

    def _decode(self, rows: list, version: int, stop) -> bool | None:
        """step_batch's wait on the replicas: True/False as it returns, None when rows are to be placed again."""
        while True:
            for i in sorted(self.up):
                holds = any(m == i for m, _ in self.placed.values())
                if i not in self.busy and (holds or self.add[i] or self.drop[i]):
                    self._send(i, version)
            if not self.busy:
                return None if any(not r.done for r in rows) else False   # (every replica holding rows lost)
            done, _ = wait([f for f, _, _ in self.busy.values()], timeout=POLL, return_when=FIRST_COMPLETED)
            finished = sum(self._answered(i) for i, (f, _, _) in list(self.busy.items()) if f in done)
            if finished:
                return any(not r.done for r in rows)
            if stop(sum(r.done for r in rows), len(rows)):
                return True
            if any(id(r) not in self.placed and not r.done for r in rows):     # (a lost replica's: placed again)
                return None

    def close(self) -> None:
        """The requests in flight interrupted and answered (a stopped sampler); the router and its replicas stay
        for the flow's end (ReplicaEngine.stop)."""
        if self.http.is_closed:
            return
        try:
            self._interrupt()
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.http.close()
