"""Generation that never waits (generate.streaming, issue 42): one sampler per run keeps decoding, group after
group in data order across iterations, instead of a batch per generate stage that ends with its slowest one.

    stream = Stream.of(cfg, first, listener)   # started by the run's first generate stage (flow's process)
    records, metrics, rows, said = stream.collect(N)   # iteration N's groups, each committed as it completed

The decoder (HFDecoder: tasks/engines/hf_stream.py; VLLMDecoder: vllm_stream.py) decodes a batch of rows; when
`refill_share` of them have finished, or a newer policy is published, the batch stops between two decode steps,
finished rows leave, new groups join (continuous batching), and with a newer policy its weights are loaded in
place first (`on_update: interrupt`: the unfinished rows continue under it, their KV cache refilled by the new
weights) or after the rows in flight have finished (`finish`). Every token records the version that drew it and
its behaviour logprob; nothing decoded is discarded. A group of iteration N joins only when the loaded policy is
at least v(N-1-S), so every token is within run.max_staleness of it; the generate stage of N takes its own
prompts' groups (tasks/generate.py), and with generate.dynamic_sampling one more for each scored constant
(`Extras`). More: docs/design-notes.md.
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.algorithms import dynamic_sampling
from tasks.core import curriculum, data, layout, rollout
from tasks.core.contracts import Rollout, SamplingParams
from tasks.core.errors import UserError
from tasks.core.models import encode_prompt, load_tokenizer, policy_path
from tasks.core.placement import placement_of
from tasks.core.stage import changed, fingerprint, fingerprinted_as, made_before_files, scored_here
from tasks.core.store import open_store

if TYPE_CHECKING:
    from tasks.core.config import Config

WAIT_SECONDS = 0.2        # how often an idle sampler looks for a newer policy or room in the buffer
ARRIVALS_SECONDS = 0.01   # how often an idle sampler looks for calls of agents at work


@dataclass
class Row:
    """One completion in flight: group `group` (an opaque key), its prompt's ids, its tokens so far; `limit`: its
    own token limit (None: the sampler's), `owner`: what its group source keeps it for (an episode's turn)."""

    group: object
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    limit: int | None = None
    owner: object = None
    seconds: float = 0.0                    # the decode steps' seconds while it was in the batch
    sampling: dict | None = None            # its own {"temperature", "top_p"} (an agent's call); None: the sampler's

    def settings(self, params: SamplingParams) -> tuple[float, float]:
        """The temperature and top_p it is sampled at."""
        own = self.sampling or {}
        return own.get("temperature", params.temperature), own.get("top_p", params.top_p)


class GroupSource:
    """What the sampler asks of its groups' source: `start` a group (its first rows), `advance` finished rows
    (the rows that continue them), the `complete` groups' `records`, the tokens `in_flight`, `close`. A source
    whose rows come on their own time (agents' calls) also answers `arrived` (rows to join now), `queued` (how
    many), `occupied` (the batch's room its groups hold, in the batch or out of it) and `discarded`. Sources:
    PromptGroups here; multi-turn episodes and agents' episodes in tasks/envs/runtime/streamed.py."""

    def arrived(self) -> list[Row]:
        return []

    def queued(self) -> int:
        return 0

    def occupied(self, rows: list[Row]) -> int:
        return len(rows)

    def discarded(self) -> int:
        """Tokens of finished rows the source could not keep (an agent's call that had ended), since last asked."""
        return 0


class PromptGroups(GroupSource):
    """The streaming sampler's groups of single-turn prompts: a group is `n` rows of its prompt, complete when
    they all are."""

    def __init__(self, cfg: Config, tokenizer, n: int):
        self.cfg, self.tokenizer, self.n = cfg, tokenizer, n
        self.groups: dict[tuple, tuple] = {}         # (iteration, group) -> (row, prompt, ids, columns, its rows)

    def start(self, key: tuple, row: int, columns: dict) -> list[Row]:
        prompt = data.prompt_of(self.cfg, columns)
        ids = encode_prompt(self.tokenizer, prompt, self.cfg.generate.max_prompt_length)
        rows = [Row(key, ids) for _ in range(self.n)]
        self.groups[key] = (row, prompt, ids, columns, rows)
        return rows

    def advance(self, finished: list[Row]) -> list[Row]:
        """The rows that continue the finished ones (none: a completion is the whole rollout)."""
        return []

    def complete(self) -> list[tuple]:
        return [k for k, g in self.groups.items() if all(r.done for r in g[4])]

    def records(self, key: tuple) -> tuple[int, list[Rollout]]:
        """A complete group's dataset row and records (the group leaves the source)."""
        row, prompt, ids, columns, rows = self.groups.pop(key)
        return row, [Rollout(group=key[1], row=row, prompt=prompt, prompt_ids=ids,
                             completion=self.tokenizer.decode(r.tokens, skip_special_tokens=True),
                             completion_ids=r.tokens, logprobs=r.logprobs, truncated=r.truncated,
                             columns={k: v for k, v in columns.items() if k != self.cfg.data.prompt_column},
                             versions=r.versions) for r in rows]

    def in_flight(self, rows: list[Row]) -> int:
        """Decoded tokens of the groups not complete (a stopped sampler's; `rows`, those in the batch, are theirs)."""
        return sum(len(r.tokens) for g in self.groups.values() for r in g[4])

    def close(self) -> None:
        self.groups.clear()


@dataclass
class Extras:
    """generate.dynamic_sampling while streaming: an iteration's groups beyond its P prompts' (numbered P, P+1, ..),
    one started for each of its groups scored constant, at most one per row of `rows` (the stage mode's rounds
    1.., in order: tasks/core/curriculum.py)."""

    rows: list[int]
    verdicts: dict[int, bool] = field(default_factory=dict)    # group -> constant, once scored
    started: set[int] = field(default_factory=set)             # extra groups started (or committed before a resume)

    def due(self, P: int) -> list[int]:
        """The extra groups its constant verdicts call for that have not started."""
        wanted = P + min(sum(self.verdicts.values()), len(self.rows))
        return [j for j in range(P, wanted) if j not in self.started]

    def settled(self, P: int) -> bool:
        """Every group of it (its prompts' and the extra ones started) scored, and none more due."""
        return all(j in self.verdicts for j in [*range(P), *self.started]) and not self.due(P)


def decoder_of(cfg: Config, params: SamplingParams, services=None):
    """The run's decoder: the batch's rows spread over generate.replicas (each replica runs this with none), or
    decoded here (hf) or in a vLLM worker process of its own; `services`: how the replicas' router launches them."""
    if placement_of(cfg).replicas:
        from tasks.engines.replica_stream import ReplicasDecoder

        return ReplicasDecoder(cfg, params, services)
    if cfg.generate.engine == "vllm":
        from tasks.engines.vllm_stream import VLLMDecoder

        return VLLMDecoder(cfg, params)
    from tasks.engines.hf_stream import HFDecoder

    return HFDecoder(cfg, params)


class Stream:
    """The run's streaming sampler: a thread of the flow's process that samples iteration after iteration's
    groups (from the first generate stage's iteration to run.iterations), commits each group to the store as
    it completes (`<run>/iter-N/stream/group-J`, manifest last) and is collected by the generate stages."""

    RUNNING: dict[str, Stream] = {}
    LOCK = threading.Lock()
    CARRIED: dict[str, int] = {}     # run -> tokens a failed sampler discarded, counted on by the one after it

    @classmethod
    def of(cls, cfg: Config, first: int, listener=None, groups=None, services=None) -> Stream:
        """The run's sampler (started here, from iteration `first`, if it has none). `listener()`: what each
        committed group is submitted to, `submit(iteration, group, records)`, stopped (`stop()`) once the
        sampler ends (the reward functions' scorer: tasks/scoring/streamed.py). `groups(cfg, tokenizer, n)`: its
        group source (PromptGroups by default; multi-turn episodes: tasks/envs/runtime/streamed.py); `services`:
        the stage's (generate.replicas: how its router launches them)."""
        with cls.LOCK:
            s = cls.RUNNING.get(cfg.run.name)
            if s is None or not s.thread.is_alive() and s.error is None:
                s = cls.RUNNING[cfg.run.name] = Stream(cfg, first, listener() if listener else None, groups,
                                                       services)
            return s

    @classmethod
    def stop_run(cls, run: str) -> int:
        """Stop run `run`'s sampler, if it has one here (the flow's end); the tokens of the rows it had in flight,
        dropped (0 after a whole run: a failed flow's, whose groups the next sampler samples again)."""
        with cls.LOCK:
            stream = cls.RUNNING.pop(run, None)
        if stream is None:
            return 0
        stream.stop()
        return stream.counts["discarded_tokens"]

    def __init__(self, cfg: Config, first: int, listener=None, groups=None, services=None):
        self.cfg, self.first, self.store, self.listener = cfg, first, open_store(cfg), listener
        self.services = services                   # (generate.replicas: how the router launches them on sky)
        self.groups = groups or PromptGroups
        gc, sc = cfg.generate, cfg.generate.streaming
        self.P, self.n, self.S = gc.prompts_per_iteration, gc.num_generations, cfg.run.max_staleness
        self.buffer = sc.buffer or (self.S + 1) * self.P
        self.max_rows = sc.max_rows or gc.batch_size * self.n
        self.changed = threading.Condition()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.collected = first - 1                 # the last iteration a generate stage took
        carried = Stream.CARRIED.pop(cfg.run.name, 0)      # (of() holds Stream.LOCK here; a pop is one step)
        self.counts = {"tokens": 0, "discarded_tokens": carried, "interruptions": 0, "refills": 0, "idle": 0.0,
                       "busy": 0.0}
        self.seen: dict = {}
        self.picked: dict[int, tuple[list[int], dict]] = {}   # iteration -> its prompts' rows, the curriculum's say
        self._looked, self._seen = -1e9, 0
        self.version, self.path, self.decoder = -1, None, None
        self.ds = gc.dynamic_sampling
        self.extras: dict[int, Extras] = {}        # generate.dynamic_sampling: per iteration not yet collected
        self.taken: dict[int, list[str]] = {}      # iteration -> the store keys of the groups its stage took
        # what a group is sampled from, but the policy (its tokens' versions say that): a group committed by a run
        # of other settings (a config edited before a resume) is refused, not trained on
        self.fp, self.made = fingerprint(cfg, ("model", "data", "generate", *cfg.env_sections()))
        if listener is not None:
            listener.on_scored = self._scored
        self.thread = threading.Thread(target=self._run, name=f"rlflow-stream-{cfg.run.name}", daemon=True)
        self.thread.start()

    # -- the sampler's thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._sample()
        except BaseException as e:   # noqa: BLE001 - reported by the generate stage that waits for a group
            self.error = e
        finally:
            if self.listener is not None:
                self.listener.stop()
            with self.changed:
                self.changed.notify_all()

    def _sample(self) -> None:
        cfg, gc = self.cfg, self.cfg.generate
        params = SamplingParams(n=self.n, max_new_tokens=gc.max_completion_length, temperature=gc.temperature,
                                top_p=gc.top_p, top_k=gc.top_k, seed=cfg.run.seed * 1_000_003 + self.first)
        self.decoder = decoder_of(cfg, params, self.services)
        try:
            self._load(self._newest())             # never older than what the store has published
            self.tokenizer = load_tokenizer(self.path)
            ds = data.load_prompts(cfg)
            pending = list(range(self.first, cfg.run.iterations + 1))   # iterations whose prompts are not yet picked
            source = self.groups(cfg, self.tokenizer, self.n)
            try:
                self._decode(source, ds, pending)
            except BaseException:                  # (a failed sampler: its groups in flight are decoded again)
                self.counts["discarded_tokens"] += source.in_flight([])
                raise
            finally:
                source.close()                     # (a stopped sampler: what its groups in flight hold)
        finally:
            self.decoder.close()

    def _decode(self, source, ds, pending: list[int]) -> None:
        """Until every iteration's groups are committed (or the sampler is stopped): groups join while there is
        room, the batch decodes, finished rows leave (and their groups' next rows join: an episode's next turn),
        complete groups are committed."""
        gc = self.cfg.generate
        todo: list[tuple[int, int, int]] = []
        active: list[Row] = []
        refill = gc.streaming.refill_share
        while not self.stopping.is_set():
            newest = self._newest(cached=True)
            if newest > self.version and (gc.streaming.on_update == "interrupt" or not active):
                self._load(newest)
                self.counts["interruptions"] += bool(active)
            finishing = newest > self.version      # (on_update finish: no group joins until the load)
            active += source.arrived()             # (agents' calls made since the last step)
            while not finishing and source.occupied(active) + self.n <= self.max_rows:
                if (extra := self._extra_due()) is not None:     # (a constant group's stand-in: before any other)
                    it, j, row = extra
                else:
                    while not todo and pending and self.version >= self._behind(pending[0]):
                        todo += self._groups(pending.pop(0), len(ds))   # ([]: collected before a resume)
                    if not todo or not self._admits(*todo[0][:2]):
                        break
                    it, j, row = todo.pop(0)
                active += source.start((it, j), row, ds[row])      # (a datasets row access: once)
            self._commit_complete(source)          # (a group of episodes whose every reset failed: at once)
            if not active:
                waiting_on = source.occupied(active)       # (agents at work between their calls)
                if not todo and not pending and not waiting_on and not self._awaiting():
                    return
                t0 = time.perf_counter()
                with self.changed:
                    self.changed.wait(ARRIVALS_SECONDS if waiting_on else WAIT_SECONDS)
                self.counts["idle"] += time.perf_counter() - t0
                continue

            def stop(finished: int, rows: int) -> bool:
                if self.stopping.is_set():
                    return True
                if finished + source.queued() >= max(1, refill * rows):   # drop the finished, let new rows join
                    return True
                return gc.streaming.on_update == "interrupt" and self._newest(cached=True) > self.version

            t0 = time.perf_counter()
            if self.decoder.step_batch(active, self.version, stop):
                self.counts["refills"] += 1
            seconds = time.perf_counter() - t0
            self.counts["busy"] += seconds
            for r in active:
                r.seconds += seconds
            active = [r for r in active if not r.done] + source.advance([r for r in active if r.done])
            self.counts["discarded_tokens"] += source.discarded()
            self._commit_complete(source)
        self.decoder.close()                   # (rows decoding on replicas meanwhile answer first: their tokens)
        self.counts["discarded_tokens"] += source.in_flight(active)     # stopped with groups in flight

    def _groups(self, it: int, n_rows: int) -> list[tuple[int, int, int]]:
        """(iteration, group, dataset row) of iteration `it`'s groups still to sample, in its prompts' order (the
        ones already committed left out: a resume); its prompts and what the curriculum said of them kept for its
        generate stage. Asked once the loaded policy is v(it-1-S), by when the groups data.curriculum learns from
        (iterations up to it-1-S: their policy was published after their rewards) are stored: the curriculum's
        pick is the stage mode's, whatever the timing."""
        if self.store.manifest(layout.rollouts(self.cfg.run.name, it)) is not None:
            return []
        # (first: a group sampled under another config is refused before the curriculum's state is written)
        committed = {j for j in range(self.P) if self._committed(it, j)}
        by_round, said = curriculum.rounds(self.cfg, self.store, it, self.ds.max_rounds if self.ds else 1, n_rows)
        rows, extras = by_round[0], None
        if self.ds is not None:
            extras = Extras([row for later in by_round[1:] for row in later])
            extras.started = {j for j in range(self.P, self.P + len(extras.rows)) if self._committed(it, j)}
        # (before the pick is told: a collect takes an iteration as soon as it is picked and its groups are there)
        committed |= extras.started if extras else set()
        with self.changed:
            self.picked[it] = (rows, said)
            if extras is not None:
                self.extras[it] = extras
            self.changed.notify_all()
        for j in sorted(committed):          # (a resume: their verdicts, or scored again)
            self._recall(it, j)
        return [(it, j, row) for j, row in enumerate(rows) if j not in committed]

    def _committed(self, it: int, j: int) -> bool:
        key = layout.stream_group(self.cfg.run.name, it, j)
        if (manifest := self.store.manifest(key)) is None:
            return False
        if not fingerprinted_as(manifest, self.fp) and not made_before_files(manifest, self.made):
            raise UserError(f"generate.streaming: {self.store.uri(key)} was sampled under another config"
                            + changed(manifest["meta"].get("made_of", {}), self.made))
        return True

    def _recall(self, it: int, j: int) -> None:
        """A group committed before this sampler started (a resume): its verdict from its scored records, or it is
        submitted to the scorer again (the reward stage takes an iteration scored as it completed only whole)."""
        if self.listener is None:
            return
        run = self.cfg.run.name
        if scored_here(self.cfg, self.store.manifest(layout.stream_scored(run, it, j))):
            if self.ds is not None:
                self._scored(it, j, rollout.load(self.store, layout.stream_scored(run, it, j)))
        else:
            self.listener.submit(it, j, rollout.load(self.store, layout.stream_group(run, it, j)))

    def _scored(self, it: int, j: int, records: list[Rollout] | None) -> None:
        """The scorer's word on group `j` of iteration `it` (its thread): with dynamic sampling, whether it is
        constant (tasks/algorithms/dynamic_sampling.py's test; a constant one calls for an extra group). None: left
        unscored (a function failed in its iteration: the reward stage scores it), taken as not constant."""
        if self.ds is None:
            return
        constant = records is not None and dynamic_sampling.constant_groups(records, self.ds.tolerance)[j]
        with self.changed:
            if (extras := self.extras.get(it)) is not None:
                extras.verdicts[j] = constant
            self.changed.notify_all()

    def _scoring(self) -> bool:
        """Whether verdicts may still come (a scorer that failed or ended sends none: no more extra groups)."""
        return self.listener is not None and self.listener.error is None and self.listener.thread.is_alive()

    def _extra_due(self) -> tuple[int, int, int] | None:
        """The next extra group to start, the oldest iteration's first (marked started)."""
        with self.changed:
            for it in sorted(self.extras):
                if due := self.extras[it].due(self.P):
                    self.extras[it].started.add(due[0])
                    return it, due[0], self.extras[it].rows[due[0] - self.P]
        return None

    def _awaiting(self) -> bool:
        """Whether some iteration may still call for extra groups (verdicts to come)."""
        with self.changed:
            return self._scoring() and any(not e.settled(self.P) for e in self.extras.values())

    def _behind(self, it: int) -> int:
        """The oldest policy iteration `it` may sample from: v(it-1-S), the one the schedule names for it."""
        return layout.version_of(layout.behaviour_policy(self.cfg.run.name, it, self.S))

    def _admits(self, it: int, j: int) -> bool:
        """Group `j` of iteration `it` may join: the loaded policy is at least the one the schedule names for
        the iteration (v(it-1-S)), so each of its tokens is within run.max_staleness, and the groups not yet
        collected before it leave room in the buffer."""
        return self.version >= self._behind(it) and (it - self.collected - 1) * self.P + j < self.buffer

    def _newest(self, cached: bool = False) -> int:
        """The newest published policy's version (the run's LATEST pointer, which publish moves after the policy
        is complete; 0: none yet); `cached`: at most one look per WAIT_SECONDS (asked after each decode step)."""
        now = time.monotonic()
        if cached and now - self._looked < WAIT_SECONDS:
            return self._seen
        latest = self.store.get_pointer(layout.latest(self.cfg.run.name, "policy"))
        self._looked, self._seen = now, layout.version_of(latest) if latest else 0
        return self._seen

    def _load(self, version: int) -> None:
        key = layout.BASE if version == 0 else layout.policy(self.cfg.run.name, version)
        path = policy_path(self.cfg, key)
        self.decoder.load(key, path)
        self.version, self.path = version, path

    def _commit_complete(self, source) -> None:
        for key in source.complete():
            self._commit(key, *source.records(key))

    def _commit(self, key: tuple, row: int, records: list[Rollout]) -> None:
        it, j = key
        # (counted before the manifest: a collect may follow; an episode's model tokens only)
        self.counts["tokens"] += sum(sum(r.mask) if r.mask else len(r.completion_ids) for r in records)
        with tempfile.TemporaryDirectory(prefix="rlflow-stream-") as tmp:
            rollout.write(records, Path(tmp))
            self.store.put_folder(layout.stream_group(self.cfg.run.name, it, j), Path(tmp),
                                  meta={"iteration": it, "group": j, "row": row, "fingerprint": self.fp,
                                        "made_of": self.made})
        if self.listener is not None:
            self.listener.submit(it, j, records)
        with self.changed:
            self.changed.notify_all()

    # -- the generate stages' side -------------------------------------------------------------------------
    def collect(self, iteration: int) -> tuple[list[Rollout], dict, list[int], dict]:
        """Iteration `iteration`'s groups, in its prompts' order, waiting for the ones still decoding; with what
        the sampler did since the last collect (its idle share, refills, interruptions, discarded tokens), the
        prompts' rows and what the curriculum said of them."""
        run, t0 = self.cfg.run.name, time.perf_counter()
        if iteration < self.first and iteration not in self.taken:
            self.taken[iteration] = self._stored(iteration)
        with self.changed:
            self.collected = max(self.collected, iteration - 1)
            self.changed.notify_all()
            while (keys := self.taken.get(iteration) or self._complete(iteration)) is None:
                if self.error is not None:          # (a retry of the stage starts a sampler again)
                    with Stream.LOCK:
                        if Stream.RUNNING.get(run) is self:
                            del Stream.RUNNING[run]
                            Stream.CARRIED[run] = self.counts["discarded_tokens"]
                    raise RuntimeError(f"generate.streaming: the sampler failed: {self.error}") from self.error
                if not self.thread.is_alive():
                    raise RuntimeError(f"generate.streaming: the sampler stopped before iteration {iteration}'s "
                                       "groups were complete")
                self.changed.wait(WAIT_SECONDS)
        records = [r for k in keys for r in rollout.load(self.store, k)]
        rows, said = self.picked[iteration]
        now = dict(self.counts)
        d = {k: v - self.seen.get(k, 0) for k, v in now.items()}     # what the sampler did since the last collect
        self.seen, self.collected = now, max(self.collected, iteration)
        with self.changed:
            self.taken[iteration] = keys     # (a stage run again, a retry or a repair, takes the same groups)
            self.extras.pop(iteration, None)
            self.changed.notify_all()
        return records, {"generate/discarded_tokens": float(now["discarded_tokens"]),
                         "generate/interruptions": float(d["interruptions"]),
                         "generate/refills": float(d["refills"]),
                         "generate/sampler_idle_share": d["idle"] / max(d["idle"] + d["busy"], 1e-9),
                         "generate/sampling_seconds": d["busy"],
                         "generate/tokens_per_s": now["tokens"] / max(now["busy"], 1e-9),   # (since its start)
                         "generate/wait_seconds": time.perf_counter() - t0}, rows, said

    def _complete(self, iteration: int) -> list[str] | None:
        """The store keys of iteration `iteration`'s groups once all are committed (with dynamic sampling: and
        scored, none more due, unless the scorer ended), in group order; None before (called holding the lock)."""
        if iteration not in self.picked:
            return None
        extras = self.extras.get(iteration)
        if extras is not None and self._scoring() and not extras.settled(self.P):
            return None
        groups = [*range(self.P), *sorted(extras.started if extras else ())]
        keys = [layout.stream_group(self.cfg.run.name, iteration, j) for j in groups]
        return None if any(self.store.manifest(k) is None for k in keys) else keys

    def _stored(self, iteration: int) -> list[str]:
        """An iteration before this sampler's first, which it never picks (its stage run again after a resume:
        a repair of its rollouts): its groups as the store holds them (it was collected whole by an earlier
        sampler), or one line if they are not all there."""
        run = self.cfg.run.name
        keys = [layout.stream_group(run, iteration, j) for j in range(self.P)]
        if any(self.store.manifest(k) is None for k in keys):
            raise RuntimeError(f"generate.streaming: iteration {iteration} comes before this sampler's first "
                               f"({self.first}) and its groups are not all in the store; run the flow again")
        while self.store.manifest(key := layout.stream_group(run, iteration, len(keys))) is not None:
            keys.append(key)                     # (generate.dynamic_sampling's extra groups, in order)
        for j in range(len(keys)):
            self._committed(iteration, j)        # (each sampled under this config: one line if not)
        by_round, said = curriculum.rounds(self.cfg, self.store, iteration, 1, len(data.load_prompts(self.cfg)))
        self.picked[iteration] = (by_round[0], said)
        return keys

    def stop(self) -> None:
        self.stopping.set()
        with self.changed:
            self.changed.notify_all()
        self.thread.join()
