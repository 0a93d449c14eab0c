"""Reward functions: importing them by path, calling them safely on a batch, and combining their scores.
Shared by the reward and evaluate stages. A function is called as TRL calls it, every argument by keyword:
f(prompts=, completions=, completion_ids=, <each dataset column>=, trainer_state=, log_extra=, log_metric=)
-> list[float | None]; for chat prompts, prompts are message lists and completions
[{"role": "assistant", "content": ...}] lists (trl_inputs). A function without **kwargs gets the keywords it
names; an async one is awaited. Before anything runs, each signature is checked against those keywords and
the dataset's columns (tasks/scoring/signatures.py).

A reward function is the user's code and may misbehave: raise, hang, return the wrong count, a non-number or
NaN. The functions run in a worker process (tasks/scoring/worker.py; one per caller scoring at that moment),
started on first use and kept for the life of this process, so that a misbehaving function costs that batch's
scores (counted in `reward/<fn>/errors`), never the iteration, unless `reward.strict: true` makes it fail the
stage.
More: docs/internals.md (tasks/scoring/functions.py): timeouts, missing scores, log_extra and log_metric.
"""

from __future__ import annotations

import atexit
import inspect
import json
import logging
import math
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from tasks.core.contracts import Scored
from tasks.core.errors import UserError, printable
from tasks.core.paths import REPO_ROOT, import_hung, import_user, user_code_seconds
from tasks.core.process_wide import user_output_limit
from tasks.core.processes import BoundedCopy, how_it_ended, kill_group, peek_exit, spawn
from tasks.scoring.shaping import NAME as SHAPING
from tasks.scoring.signatures import TRL_KEYWORDS, check_signature
from tasks.scoring.worker import _HEADER, ANSWER_LOST, RewardState, send

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import Rollout
    from tasks.core.placement import Services

log = logging.getLogger("rlflow.reward")
# What every reward function is called with besides the dataset's columns (TRL's GRPOTrainer passes the same).


SET_UP = 60.0       # seconds the reward worker's own set-up may take after the imports (reward.sandbox's probe)


class WorkerSetupFailed(UserError):
    """The reward worker could not import the functions; `crashed`: it ended as it did (a signal, an exit) or one
    module's import did not finish in time (named), where a module that raised or exited by Python is said again,
    better, by the import here (import_user)."""

    def __init__(self, message: str, crashed: bool):
        super().__init__(message)
        self.crashed = crashed


class RewardFunctionError(UserError):
    """A reward function misbehaved and `reward.strict` is on; the message names the function. It is the
    user's code, so a retry would not help: a user error (exit 2, never retried)."""


@dataclass
class RewardFunctions:
    """The configured functions, imported once here (so a bad path is a user error before anything runs)
    and run in the worker process."""

    names: list[str]
    weights: dict[str, float]
    setup: dict                   # what the worker needs to import and configure them
    timeout_seconds: float
    strict: bool
    env_weight: float | None = None   # multi-turn: the episodes' return is a reward named "env", this weight
    cfg: Config | None = None         # its reward.models score beside the functions (tasks/scoring/judges.py)

    @property
    def all_names(self) -> list[str]:
        """The functions' names and the reward models': every score a completion gets (not 'env')."""
        return self.names + [m.name for m in (self.cfg.reward.models if self.cfg is not None else [])]


def load_functions(cfg: Config, columns: Iterable[str] | None = None) -> RewardFunctions:
    """Import every configured function here too: a bad path is a user error naming the entry. With the
    dataset's `columns` (preflight), each function's signature is checked against what it will be called
    with."""
    functions = functions_of(cfg)                   # ("environments": an episode's keyword, agents' too)
    names, keywords = functions.names, {*TRL_KEYWORDS, *(["environments"] if cfg.env.episodic() else [])}
    columns = None if columns is None else set(columns) - {"completion"}       # (TRL forwards no such column)
    clash = sorted(keywords & columns) if columns and cfg.reward.functions else []      # (TRL: a TypeError)
    if clash:
        raise UserError(f"data: column {clash[0]!r} is named as a keyword reward functions are called with (TRL's "
                        f"convention), which would be given twice; expected another name for that column (rename it)")
    for i, spec in enumerate(cfg.reward.functions):
        fn = import_user(spec.fn, f"reward.functions[{i}].fn", noun="function")   # (user modules: the cwd first)
        if inspect.isclass(fn) or inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            kind = "a class (calling it makes an instance)" if inspect.isclass(fn) else "a generator function"
            raise UserError(f"reward.functions[{i}].fn: {spec.fn} is {kind}; expected a function that returns a "
                            f"list of scores, one per completion (TRL's convention)")
        if columns is not None:
            given = {*keywords, *columns}
            for key in (k for k in spec.kwargs if k in given):      # (the worker's kwargs go last: they won)
                kind = "a dataset column" if key in columns else "a keyword TRL's convention passes"
                raise UserError(f"reward.functions[{i}].kwargs.{key}: {key!r} is {kind}, given to every call; a "
                                f"configured value would replace it for every completion; expected another name")
            check_signature(f"reward.functions[{i}].fn: {spec.fn}", fn, {*given, *spec.kwargs},
                            sorted(columns), kwargs=spec.kwargs, kwargs_field=f"reward.functions[{i}].kwargs",
                            prompt_column=cfg.data.prompt_column)
    if len(set(names)) != len(names):
        raise UserError(f"reward.functions: two functions share a name ({names}); names key the scores")
    if cfg.env.episodic() and "env" in names:
        raise UserError("reward.functions: 'env' names the episode's return; rename that function")
    if SHAPING in names:
        raise UserError(f"reward.functions: {SHAPING!r} names reward.overlong's shaping (left out of reward/mean); "
                        f"rename that function")
    if cfg.reward.models:
        from tasks.scoring.judges import check_specs

        check_specs(cfg, columns, names)
    return functions


def functions_of(cfg: Config) -> RewardFunctions:
    """The configured functions as their worker takes them, nothing imported in this process (load_functions
    imports and checks them: preflight starts their worker with this first, see start_worker)."""
    names = [spec.fn.partition(":")[2] for spec in cfg.reward.functions]
    setup = {"functions": [{"fn": s.fn, "kwargs": s.kwargs} for s in cfg.reward.functions], "cwd": os.getcwd(),
             "sandbox": cfg.reward.sandbox.model_dump(mode="json")}
    return RewardFunctions(names=names, weights={n: s.weight for n, s in zip(names, cfg.reward.functions)},
                           setup=setup, timeout_seconds=cfg.reward.timeout_seconds, strict=cfg.reward.strict,
                           env_weight=cfg.env.reward_weight if cfg.env.episodic() else None, cfg=cfg)


class _Garbled(Exception):
    """The worker's answer could not be read (a length no answer has, bytes that do not unpickle): something a
    function started wrote to the worker's answer pipe."""


MAX_ANSWER_BYTES = 1 << 31        # an answer's length past this is not an answer
LARGEST = 3.4e38                  # a score beyond ±this (float32's range, where the update computes) is made missing
#                                   as NaN and inf are: 1e39 crashed the stage, 1e308 summed to inf and NaN weights


class _Worker:
    """One `python -m tasks.scoring.worker` process with the functions imported."""

    def __init__(self, setup: dict):
        # (`-m` from the user's folder: spawn's safe path, so that it imports rlflow's tasks, not a tasks/ there)
        self.proc = spawn([sys.executable, "-m", "tasks.scoring.worker"], {**os.environ, "PYTHONPATH":
                          _pythonpath(setup["cwd"])}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, start_new_session=True, cwd=setup["cwd"])
        # what the functions write (prints, os.write, what they start): bounded per batch, here; the pipe is the
        # copier's to close (kill_group closes what Popen holds)
        stderr, self.proc.stderr = self.proc.stderr, None
        self.output = BoundedCopy(stderr, user_output_limit, f"the reward worker {self.proc.pid}")
        seconds, step = user_code_seconds(), None      # (each module's import within it, then the sandbox's set-up)
        try:
            send(self.proc.stdin, setup)
            status, message = self._receive(timeout=seconds + 30.0)      # (Python's start, then the first import)
            while status in ("importing", "imported"):
                step = message if status == "importing" else "sandbox"
                status, message = self._receive(timeout=seconds if status == "importing" else max(seconds, SET_UP))
            self.output.flush()
        except TimeoutError:
            self.kill()
            if isinstance(step, int):      # (as import_user says it: the module named, its field)
                module = setup["functions"][step]["fn"].partition(":")[0]
                raise WorkerSetupFailed(import_hung(f"reward.functions[{step}].fn", module, seconds, "function"),
                                        crashed=True) from None
            status, message = "crashed", (f"its reward.sandbox set-up did not finish in {max(seconds, SET_UP):g} s"
                                          if step else f"it did not start in {seconds + 30:g} s")
        except (EOFError, OSError, _Garbled):
            status, message = "crashed", (f"it ended ({self.ended(wait=5.0)}) as it imported the functions (a "
                                          f"module that exits or crashes when imported)")
        if status != "ready":
            self.kill()
            raise WorkerSetupFailed(f"reward.functions: the reward worker could not set up: {message}",
                                    crashed=status == "crashed")

    def call(self, index: int, completions: list, columns: dict, timeout: float, renew: bool = True):
        if index == 0 and renew:
            self.output.renew()            # (a budget per batch: per iteration where its groups come one by one)
        send(self.proc.stdin, (index, completions, columns))
        try:
            return self._receive(timeout)
        finally:
            self.output.flush()            # (what the function wrote shows before what is said of its call)

    def _receive(self, timeout: float):
        """The next answer within `timeout` (its body, once its length has come, within 30 s more at least), or
        raise TimeoutError, EOFError (the worker died: also where a process it forked still holds its end of
        the pipe, so that no end of file comes) or _Garbled. Read from the pipe's descriptor, never through a
        buffer select cannot see."""
        deadline = time.monotonic() + timeout
        (n,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
        if n > MAX_ANSWER_BYTES:
            raise _Garbled
        blob = self._read(n, max(deadline, time.monotonic() + 30.0))
        try:
            return pickle.loads(blob)
        except Exception:  # noqa: BLE001 - not an answer the worker wrote
            raise _Garbled from None

    def _read(self, n: int, deadline: float) -> bytes:
        fd, buf = self.proc.stdout.fileno(), bytearray()
        while len(buf) < n:
            while not select.select([fd], [], [], min(max(deadline - time.monotonic(), 0), 1.0))[0]:
                if self._exit_status() is not None:
                    raise EOFError
                if time.monotonic() >= deadline:
                    raise TimeoutError
            chunk = os.read(fd, min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    def _exit_status(self) -> int | str | None:
        """How the worker ended (Popen's returncode), None while it runs, "reaped" where that is not known."""
        try:
            return peek_exit(self.proc)
        except ChildProcessError:
            return "reaped"

    def ended(self, wait: float = 0.0) -> str:
        """'exit 3', 'killed by SIGSEGV': how the worker ended, for the message ('running' while it runs);
        `wait`: seconds to give it (its pipe closed as it exits, a moment before it can be waited for)."""
        status, waited = self._exit_status(), 0.0
        while status is None and waited < wait:
            time.sleep(0.05)
            status, waited = self._exit_status(), waited + 0.05
        if status is None or status == "reaped":
            return "running" if status is None else "ended"
        return how_it_ended(status)

    def alive(self) -> bool:
        return self._exit_status() is None

    def kill(self) -> None:
        kill_group(self.proc)          # the worker and what it started in its group, also once it has ended


def _pythonpath(cwd: str) -> str:
    """The worker must import `tasks` (this package) and the user's modules next to `cwd`."""
    return os.pathsep.join(p for p in (str(REPO_ROOT), cwd, os.environ.get("PYTHONPATH", "")) if p)


# Idle workers by their functions: a caller takes one for a batch and gives it back, so a worker answers one
# caller at a time. With run.max_staleness > 0 the flow's threads score at once (the reward stage of iteration
# N+1 in the look-ahead lane, the evaluation of N in the loop); sharing a worker, a caller could read the other's
# reply (another batch's scores) or lose the worker to the other's timeout. As many workers as callers at once.
# At most MAX_IDLE wait, the least recently given back killed first: a process that runs many flows (a study's
# trials, the tests) kept a worker of every set of functions it ever scored with, each a Python process.
MAX_IDLE = 8
_idle: dict[str, list[_Worker]] = {}          # (in the order given back: the least recent key first)
_workers_lock = threading.Lock()
_shown: set = set()       # functions whose first failure (columns whose drop) this process has printed


# Workers are started from one thread that lives as long as the process: a worker asks to be killed when "its
# parent" dies (worker.py: die_with_parent), and Linux means the thread that started it, so a worker started by a
# thread that ended (a scorer's, a look-ahead lane's) would die under the next caller.
# (a daemon thread: the CLI's exit joins every other thread first)
_to_start: queue.Queue = queue.Queue()
_starter: threading.Thread | None = None


def _start_workers() -> None:
    while True:
        setup, started = _to_start.get()
        try:
            started.set_result(_Worker(setup))
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            started.set_exception(e)


def _take(functions: RewardFunctions) -> _Worker:
    """An idle worker for these functions, else a new one (started by the lasting thread)."""
    global _starter
    with _workers_lock:
        key = _key(functions)
        idle = _idle.get(key, [])
        while idle:
            w = idle.pop()
            if not idle:
                del _idle[key]     # (no key without an idle worker: _give_back counts and evicts by key)
            if w.alive():
                return w
            w.kill()               # (ended while idle: what it started in its group goes with it)
        if _starter is None:
            _starter = threading.Thread(target=_start_workers, name="rlflow-reward-workers", daemon=True)
            _starter.start()
    started: Future = Future()
    _to_start.put((functions.setup, started))
    return started.result()


def start_worker(functions: RewardFunctions, keep: bool = True) -> None:
    """A worker for these functions, started now (preflight): a module that fails only in the worker's own
    process (exits, crashes or waits when imported there) is one line before anything is written, not a failed
    reward stage. `keep`: kept idle, to score the run's first batch (the reward stage runs in this process);
    otherwise killed once it has set up."""
    if functions.names:
        w = _take(functions)
        if keep:
            _give_back(functions, w)
        else:
            w.kill()


def _give_back(functions: RewardFunctions, w: _Worker) -> None:
    evicted = []
    with _workers_lock:
        key = _key(functions)
        _idle[key] = [*_idle.pop(key, []), w]                  # (its key to the end: the most recent)
        while sum(map(len, _idle.values())) > MAX_IDLE:
            oldest = next(iter(_idle))
            evicted.append(_idle[oldest].pop(0))
            if not _idle[oldest]:
                del _idle[oldest]
    for old in evicted:
        old.kill()


def _key(functions: RewardFunctions) -> str:
    return json.dumps(functions.setup, sort_keys=True)


@atexit.register
def close_workers() -> None:
    """The idle workers killed (at exit; and by `rlflow tune` once its preflight has checked the functions)."""
    with _workers_lock:
        for w in [w for idle in _idle.values() for w in idle]:
            w.kill()
        _idle.clear()


def trl_inputs(records: list[Rollout]) -> tuple[list, dict]:
    """A batch as TRL hands it to reward functions: `completions` (text; for chat prompts
    `[{"role": "assistant", "content": ...}]` per completion, the prompt's messages as they are, as TRL 1.16 does:
    the generator starts a new assistant turn after an assistant message that ends the prompt, so what it wrote is
    the completion; for episodes the messages after the prompt) and
    every other keyword: prompts, completion_ids, the dataset's columns, and for episodes `environments`: each
    episode's environment as its public attributes were when it ended (`env.reward` in TRL's docs' reward
    function), read back from the rollout record."""
    completions, prompts = [], []
    for r in records:
        prompt = r.prompt
        if r.turns is not None:          # multi-turn: the messages after the prompt, as TRL passes them
            completions.append(r.turns)
        elif isinstance(prompt, list):
            completions.append([{"role": "assistant", "content": r.completion}])
        else:
            completions.append(r.completion)
        prompts.append(prompt)
    columns: dict[str, list] = {k: [r.columns.get(k) for r in records]        # (TRL drops a `completion` column)
                                for k in (records[0].columns if records else {}) if k != "completion"}
    columns["prompts"] = prompts
    columns["completion_ids"] = [r.completion_ids for r in records]
    if any(r.env_state is not None for r in records):    # multi-turn: what TRL passes as `environments`
        columns["environments"] = [SimpleNamespace(**(r.env_state or {})) for r in records]
    return completions, columns


def score(functions: RewardFunctions, records: list[Rollout], state: RewardState | None = None,
          renew_output: bool = True) -> Scored:
    """Call each function once on the whole batch (in the worker), with the failure rules above; `state` is
    what the functions get as `trainer_state`. Failed episodes (env_error: their environment's state, maybe
    their messages, missing) are left out of the calls, and get no score from them (None): a function written as TRL's
    (`env.reward`, `c[-1]["content"]`) raised on their placeholders and lost the whole batch's scores.
    `renew_output`: what the functions print gets a new budget (not for another group of the same iteration)."""
    kept = [j for j, r in enumerate(records) if r.env_error is None]
    completions, columns = trl_inputs([records[j] for j in kept])
    columns["trainer_state"] = state
    out = Scored()
    worker, logged, owners = None, {}, {}
    try:
        for index, name in enumerate(functions.names):
            if not kept:
                out.scores[name] = [None] * len(records)
                continue
            worker = worker or _take(functions)
            try:
                reply = worker.call(index, completions, columns, functions.timeout_seconds, renew_output)
            except (TimeoutError, EOFError, OSError, _Garbled) as e:
                reply = ("error", _lost(worker, e, functions.timeout_seconds))
                worker.kill()
                worker = None
            _record(functions, out, name, reply, len(kept), logged, owners)
    except RewardFunctionError:
        raise                       # (reward.strict: the worker answered; given back below)
    except BaseException:
        if worker is not None:      # (cut off in a call: its reply could reach the next caller)
            worker.kill()
            worker = None
        raise
    finally:
        if worker is not None:
            _give_back(functions, worker)
    if len(kept) < len(records):        # (each list back in place: None for the failed episodes)
        for part in (out.scores, out.extra):
            for key, values in part.items():
                part[key] = [None] * len(records)
                for j, v in zip(kept, values):
                    part[key][j] = v
    return out


def _lost(worker: _Worker, e: BaseException, timeout: float) -> str:
    """Why a call got no answer, as the function's failure: its time ran out, the worker ended (how), or its
    answer pipe was broken by what the function started (written to, or closed)."""
    if isinstance(e, TimeoutError):
        return f"timed out after {timeout:g}s (killed)"
    how = "running" if isinstance(e, _Garbled) else worker.ended(wait=5.0)
    if how == f"exit {ANSWER_LOST}":
        return "killed its reward worker (closed or replaced the descriptors of its answer pipe, rlflow's)"
    if how == "running":
        return ("killed its reward worker (broke its answer pipe: a process or thread it started wrote to it or "
                "closed it)")
    return f"killed its reward worker ({how}: a crash or a signal while it ran)"


def _record(functions: RewardFunctions, out: Scored, name: str, reply: tuple, n: int, logged: dict,
            owners: dict) -> None:
    """Function `name`'s reply on a batch of `n` into `out`: its scores, or its failure by the rules above.
    A metric several functions log is the mean of their values (`logged`: name -> those values), as TRL's; a
    log_extra column several log is the last one's (`owners`: column -> function), said once."""
    if reply[0] == "error":
        message = printable(f"reward function {name!r} {_phrase(reply[1])}")    # (its text is the user's)
        if functions.strict:
            raise RewardFunctionError(message)
        log.warning("%s; its scores for this batch are missing", message)
        if name not in _shown:          # the first failure of each function, on the console whatever logs
            _shown.add(name)
            print(f"warning: {message}; its scores for this batch are missing (counted in "
                  f"reward/{name}/errors; reward.strict: true makes it fail the run)", file=sys.stderr)
        out.errors[name] = message
        out.scores[name] = [None] * n
        return
    _, values, extra, metrics, dropped = reply
    for column, length in dropped.items():        # (TRL's table fails on such a column; here it is left out, said)
        if (name, column) not in _shown:
            _shown.add((name, column))
            print(printable(f"warning: reward function {name!r} logged {length} values in log_extra({column!r}) "
                            f"for {n} completions; the column is left out of the samples (one value per "
                            f"completion)"), file=sys.stderr)
    bad = [j for j, v in enumerate(values) if v is not None and not (math.isfinite(v) and abs(v) <= LARGEST)]
    if bad and functions.strict:
        raise RewardFunctionError(f"reward function {name!r} returned {values[bad[0]]} for completion {bad[0]}")
    if bad:
        out.nan[name] = len(bad)
        values = [None if j in set(bad) else v for j, v in enumerate(values)]
    out.scores[name] = values
    for column in extra:
        first = owners.setdefault(column, name)
        if first != name and ("extra", column, first, name) not in _shown:
            _shown.add(("extra", column, first, name))
            print(printable(f"warning: reward functions {first!r} and {name!r} both logged log_extra({column!r}); "
                            f"the samples keep the values of {name!r}"), file=sys.stderr)
    out.extra.update(extra)
    for key, v in metrics.items():
        logged.setdefault(key, []).append(v)
        out.metrics[key] = math.fsum(logged[key]) / len(logged[key])


def _phrase(message: str) -> str:
    """Worker messages read as 'raised X: ...', 'returned 3 scores for 4 completions', 'timed out ...'."""
    if message.startswith(("ValueError: returned", "TypeError: returned")):
        return message.split(": ", 1)[1]
    if message.startswith(("timed out", "killed its reward worker")):
        return message
    return f"raised {message}"


def score_records(functions: RewardFunctions, records: list[Rollout], aggregate: str,
                  state: RewardState | None = None, judge_cache: str | None = None,
                  services: Services | None = None, renew_output: bool = True) -> Scored:
    """Score `records` in place: per-function (and per reward model) scores in `.rewards`, the combined reward
    in `.reward` (None where nothing scored it), logged columns in `.extra`. Returns what happened.
    `judge_cache`: the store prefix of this stage's reward-model answers (layout.judge_cache); `services`: the
    stage's context (the judge servers the flow started)."""
    scored = score(functions, records, state, renew_output)
    weights = dict(functions.weights)
    if functions.cfg is not None and functions.cfg.reward.models:
        from tasks.scoring.judges import score_models

        judged = score_models(functions.cfg, records, judge_cache, functions.strict, services)
        if functions.strict and judged.errors:
            raise RewardFunctionError(next(iter(judged.errors.values())))
        scored.scores.update(judged.scores)
        scored.errors.update(judged.errors)
        scored.metrics.update(judged.metrics)
        weights.update({m.name: m.weight for m in functions.cfg.reward.models})
    if functions.env_weight is not None:
        scored.scores["env"] = [r.env_return for r in records]
        weights["env"] = functions.env_weight
    for j, r in enumerate(records):
        r.rewards = {name: scored.scores[name][j] for name in scored.scores}
        r.extra = {column: values[j] for column, values in scored.extra.items()}
    totals = combine([r.rewards for r in records], weights, aggregate).tolist()
    for r, t in zip(records, totals):
        r.reward = None if math.isnan(t) else t
    return scored


def require_some_score(records: list[Rollout], scored: Scored, what: str, skippable: bool = False) -> None:
    """Stop a stage where every reward call failed and no completion was scored: one line naming the first
    failure (the functions are the user's code: exit 2). `what`: "iteration 3", "the evaluation of v000010".
    `skippable` (reward.strict off, and the run's previous iteration was scored: the functions have worked, so
    this may be a passing fault such as a judge's network): said once as a warning instead; the iteration
    trains on nothing (Trainer.update takes no step) and the run goes on. Two such iterations in a row stop it."""
    if not records or any(r.reward is not None for r in records):
        return
    nothing = 'evaluate' if what.startswith('the evaluation') else 'train on'
    if scored.errors:
        said = f"every reward call of {what} failed, no completion was scored (nothing to {nothing}); the first: " \
               f"{next(iter(scored.errors.values()))}"
    else:
        said = "; ".join(f"{name!r} returned NaN, inf or beyond ±{LARGEST:g} for {k}"
                         for name, k in scored.nan.items()) or \
            "every score was None (no function scored any completion)" + _episodes_without_return(records)
        said = f"no completion of {what} was scored (nothing to {nothing}): {said}; expected a finite score for " \
               f"some completion"
    if not skippable:
        raise UserError(f"reward: {said}")
    if nothing == "evaluate":
        print(f"warning: reward: {said}; {what} has no numbers (eval/unscored_passes; BEST and the champion "
              f"unchanged) and the run goes on: the evaluation before was scored; a second such evaluation in a "
              f"row stops it", file=sys.stderr)
        return
    print(f"warning: reward: {said}; {what} takes no training step (its policy is the one before, published "
          f"again) and the run goes on: the previous iteration was scored; a second such iteration in a row "
          f"stops it", file=sys.stderr)


def _episodes_without_return(records: list[Rollout]) -> str:
    """Why episodes (env.factory, env.agent) gave no return, when that is why nothing was scored: cut at a limit
    (an agent calling on past env.max_turns), or failed; '' for prompts."""
    episodes = [r for r in records if r.env_state is not None or r.env_error is not None]
    if not episodes or any(r.env_return is not None for r in episodes):     # (returns given: not why)
        return ""
    who = "agent" if any("agent_info" in (r.env_state or {}) for r in episodes) else "environment"
    limited = [r for r in episodes if r.truncated and (r.env_state or {}).get("limited")]
    failed = [r for r in episodes if r.env_error]
    parts = [f"{len(limited)} of {len(episodes)} completions are of episodes cut at "
             f"{limited[0].env_state['limited']} before the {who} gave a return" if limited else "",
             f"{len(failed)} of {len(episodes)} failed (the first: {failed[0].env_error})" if failed else ""]
    return ": " + ("; ".join(p for p in parts if p) or f"no {who} gave a return")


def combine(rewards: list[dict[str, float | None]], weights: dict[str, float], how: str = "sum") -> torch.Tensor:
    """Weighted sum (TRL's nansum) or mean over the reward functions that scored each completion;
    NaN where every weighted score is missing (TRL's nansum gives 0 there; rlflow leaves the completion out of its
    group's statistics). A function of weight 0 is logged, never combined. (N,) float64: scores up to
    LARGEST, weighted and summed, stay finite."""
    out = torch.full((len(rewards),), float("nan"), dtype=torch.float64)
    for i, scores in enumerate(rewards):
        present = [weights[name] * s for name, s in scores.items() if s is not None and weights[name] != 0]
        if present:
            total = math.fsum(present) if how == "sum" else math.fsum(present) / len(present)
            out[i] = total if math.isfinite(total) else math.nan
    return out
