"""Which prompts an iteration samples: the seeded stream (tasks/core/data.py), dynamic sampling's extra rounds,
and the curriculum (`data.curriculum`) that defers prompts whose groups taught nothing.

    rows, metrics = prompts(cfg, store, iteration, round, n_rows)      # what the generate stage samples

Without a curriculum, round 0 of iteration N is stream positions [(N-1)·P, N·P) (P = prompts_per_iteration), as
always; round r > 0 (generate.dynamic_sampling) takes the r-th `prompts_per_round` rows of a stream of its own
(seeded by run.seed and N), skipping the rows round 0 took.

The curriculum defers a prompt whose group was constant (every completion passed, or none did) for some
iterations, longer after each constant group in a row. Its pick never depends on timing, and its state after
each pick is a store folder (`<run>/curriculum/after-N`), so a resumed run has exactly the state an
uninterrupted run had.
More: docs/internals.md (tasks/core/curriculum.py): the curriculum's rule, in full.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import data, layout
from tasks.core.errors import UserError

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.store import Store

EXTRA_STREAM = 104_729        # seeds dynamic sampling's extra rounds apart from the main stream
STATE = "state.json"


def prompts(cfg: Config, store: Store, iteration: int, round: int, n_rows: int) -> tuple[list[int], dict]:
    """The dataset rows iteration `iteration` samples in round `round`, and what the curriculum says of them."""
    rows, metrics = rounds(cfg, store, iteration, round + 1, n_rows)
    return rows[round], metrics


def rounds(cfg: Config, store: Store, iteration: int, n_rounds: int, n_rows: int) -> tuple[list[list[int]], dict]:
    """The dataset rows of iteration `iteration`'s rounds 0 .. n_rounds-1 (round 0: its P prompts; the others
    generate.dynamic_sampling's), and what the curriculum says of them: its state read once for them all."""
    P, seed, shuffle = cfg.generate.prompts_per_iteration, cfg.run.seed, cfg.data.shuffle
    sampler = before(cfg, store, iteration, n_rows) if cfg.data.curriculum is not None else None
    if sampler is None:
        first = data.indices(n_rows, seed, data.cursor(iteration, P), P, shuffle)
        deferred: set[int] = set()
        metrics = {}
    else:
        deferred = sampler.deferred(iteration)
        waiting = len(sampler.waiting)
        first = sampler.pick(iteration, P, n_rows, seed, shuffle)
        metrics = {"curriculum/deferred": float(len(deferred)), "curriculum/waiting": float(waiting),
                   "curriculum/served_late": float(sampler.served_late)}
    if n_rounds <= 1:
        return [first], metrics
    per_round = cfg.generate.dynamic_sampling.prompts_per_round or P
    skip = set(first) | deferred
    if len(skip) >= n_rows:                   # (a tiny data set: every row taken or deferred) the stream as is
        skip = set()
    rows, pos, passed = [], 0, 0
    while len(rows) < (n_rounds - 1) * per_round:       # (the scan never looks at n_rounds: a round's rows are
        row = data.indices(n_rows, [seed, EXTRA_STREAM, iteration], pos, 1, shuffle)[0]   # the same whoever asks)
        pos += 1
        if row in skip and passed < n_rows:  # (a round never comes out short: after a whole data set's worth of
            passed += 1                      # rows skipped in a row, the stream's next is taken as it is)
            continue
        rows.append(row)
        passed = 0
    return [first, *(rows[r * per_round:(r + 1) * per_round] for r in range(n_rounds - 1))], metrics


@dataclass
class Sampler:
    """The curriculum's state: picks of iterations 1..`after` made, the groups of iterations up to after - S
    folded in."""

    after: int = 0
    cursor: int = 0                                   # the main stream's next position
    waiting: list[list[int]] = field(default_factory=list)     # [row, due]: deferred rows the stream passed
    rows: dict[str, list[int]] = field(default_factory=dict)   # row -> [constant groups in a row, deferred until]
    served_late: int = 0                              # of the last pick: rows served from `waiting`

    def deferred(self, iteration: int) -> set[int]:
        return {int(row) for row, (_, until) in self.rows.items() if until > iteration}

    def pick(self, iteration: int, count: int, n_rows: int, seed: int, shuffle: bool) -> list[int]:
        """Iteration `iteration`'s rows: the waiting ones now due (by due iteration, then the order they waited
        in), then the stream's, skipping (and keeping waiting) those deferred now."""
        deferred = self.deferred(iteration)
        chosen: list[int] = []
        for entry in sorted(self.waiting, key=lambda w: w[1]):           # (stable: the order they waited in)
            if len(chosen) < count and entry[1] <= iteration and entry[0] not in deferred:
                chosen.append(entry[0])
        self.served_late = len(chosen)
        self.waiting = [w for w in self.waiting if w[0] not in chosen]
        scanned = 0
        while len(chosen) < count:
            row = data.indices(n_rows, seed, self.cursor, 1, shuffle)[0]
            self.cursor += 1
            scanned += 1
            self.waiting = [w for w in self.waiting if w[0] != row]      # (the stream came round to it again)
            if row in chosen and scanned <= n_rows:
                continue
            if row in deferred and scanned <= n_rows:                    # (every row deferred: taken anyway)
                self.waiting.append([row, self.rows[str(row)][1]])
                continue
            chosen.append(row)
        self.after = iteration
        return chosen

    def fold(self, iteration: int, outcomes: list[tuple[int, bool]], defer: int, max_defer: int) -> None:
        """Iteration `iteration`'s groups, (row, constant) each, in the order they were sampled (a row sampled
        twice counts once: constant when every group of it was)."""
        rows: dict[int, bool] = {}
        for row, is_constant in outcomes:
            rows[row] = rows.get(row, True) and is_constant
        for row, is_constant in rows.items():
            streak, _ = self.rows.get(str(row), (0, 0))
            if is_constant:
                streak += 1
                # (deferred while `until` > the iteration picked: the `defer` iterations after this one)
                self.rows[str(row)] = [streak, iteration + min(defer * 2 ** (streak - 1), max_defer) + 1]
            else:
                self.rows.pop(str(row), None)


def outcomes(cfg: Config, store: Store, iteration: int) -> list[tuple[int, bool]]:
    """(row, constant) of every group iteration `iteration` scored, as its reward stage recorded them (the
    manifest's `groups`): each round's with dynamic sampling (the dropped groups are what the curriculum learns
    from), else its rewards'."""
    ds = cfg.generate.dynamic_sampling
    keys = [layout.rewards(cfg.run.name, iteration)] if ds is None else \
        [layout.scored(cfg.run.name, iteration, r) for r in range(ds.max_rounds)]
    manifests = [m for m in map(store.manifest, keys) if m is not None]
    return [(int(row), bool(flag)) for m in manifests for row, flag in m["meta"].get("groups", [])]


def before(cfg: Config, store: Store, iteration: int, n_rows: int) -> Sampler:
    """The sampler as iteration `iteration` finds it: after iteration N-1's pick, with the groups of iterations up
    to N-1-S; from the newest stored state, brought forward (and each state on the way stored)."""
    cur, S, run = cfg.data.curriculum, cfg.run.max_staleness, cfg.run.name
    found = [int(n.rsplit("-", 1)[1]) for n in store.list_folders(f"{run}/curriculum")
             if n.startswith("after-") and n.rsplit("-", 1)[1].isdigit()]
    start = max((k for k in found if k < iteration and store.manifest(layout.curriculum(run, k))), default=0)
    sampler = Sampler(**store.get_json(layout.curriculum(run, start), STATE)) if start else Sampler()
    for k in range(start + 1, iteration):
        sampler.pick(k, cfg.generate.prompts_per_iteration, n_rows, cfg.run.seed, cfg.data.shuffle)
        if k - S >= 1:
            sampler.fold(k - S, outcomes(cfg, store, k - S), cur.defer, cur.max_defer)
        with tempfile.TemporaryDirectory(prefix="rlflow-curriculum-") as tmp:
            (Path(tmp) / STATE).write_text(json.dumps(asdict(sampler)))
            store.put_folder(layout.curriculum(run, k), Path(tmp), meta={"iteration": k})
    return sampler


def check(cfg: Config) -> None:
    """data.curriculum needs prompts whose row numbers stay theirs for the run's life: a local file or a
    reasoning-gym task. One line if not (preflight)."""
    if cfg.data.curriculum is None or cfg.data.reasoning_gym is not None:
        return
    path = str(cfg.data.path)
    if Path(path).expanduser().is_file():
        return
    if Path(path).expanduser().exists() or data.looks_local(path):
        data.load_table(path, cfg.data.name, cfg.data.split)      # a folder, a missing file: said as data says it
    raise UserError(f"data.curriculum: needs prompts with stable ids (a local data file, or data.reasoning_gym); "
                    f"{cfg.data.path} is a hub dataset, whose rows a new revision may renumber under a resumed run: "
                    f"save it to a local file (datasets' to_json) first")
