"""Demonstrations recorded by running a policy through the run's environment, for the warm start (tasks/sft.py).

    rlflow record configs/letters.yaml --policy tasks.envs.builtin.games:reference_action --out demos.jsonl

The policy is a scripted one (MODULE:FUNCTION, a function of the context text the model would see, returning the
text of its next turn: the shop's `reference_action`) or `model` (the config's model, through its sampling
engine). The episodes are the episode loop's own (episodes.py: run_episodes), so each recorded row is what RL
would have sampled: a `messages` row in TRL's format (the prompt, each assistant turn as the model wrote it, the
observations), `tools` (the tools' JSON schemas, where the environment declares some) and `return`. Rendered back by
Renderer.conversation (the warm start), a row gives the episode's own token ids and mask.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.contracts import Rollout, Sample, Sampled, SamplingParams, SamplingSession
from tasks.core.errors import UserError
from tasks.core.paths import import_user
from tasks.envs.runtime.rendering import Renderer

if TYPE_CHECKING:
    from tasks.core.config import Config


MAX_EPISODES = 1_000_000     # episodes `rlflow record` runs in one call (rows x --n)
CHUNK_EPISODES = 64          # episodes `rlflow record` runs between two saves of its progress


class _Late(BaseException):
    """A scripted policy's turn past its time (raised in it by the timer signal)."""


class ScriptedPolicy(SamplingSession):
    """A sampling session whose every completion is `fn(context)`: the context's text (special tokens included,
    as the model sees it) in, the turn's text out; EOS appended, as a model that stops writes it."""

    def __init__(self, fn: Callable[[str], str], tokenizer, timeout: float = 120.0):
        self.fn, self.tokenizer, self.timeout = fn, tokenizer, timeout

    def _turn(self, context: str):
        """fn(context) within `timeout` seconds (a policy that never answers was a silent hang): on the main thread
        as before, under a timer signal (a policy may use signals, thread-bound objects, its own loop); from another
        thread, on a thread of its own."""
        import signal
        import threading

        late = UserError(f"--policy: {_name(self.fn)}(context) gave no answer in {self.timeout:g} s "
                         f"(env.timeout_seconds); expected it to return the turn's text")
        if threading.current_thread() is threading.main_thread():
            def stop(_signum, _frame):
                raise _Late           # (not an Exception: a policy's `except Exception` does not keep it)
            before = signal.signal(signal.SIGALRM, stop)
            signal.setitimer(signal.ITIMER_REAL, self.timeout)
            try:
                return self.fn(context)
            except _Late:
                raise late from None
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, before)
        got: list = []

        def call() -> None:
            try:
                got.append((True, self.fn(context)))
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                got.append((False, e))
        thread = threading.Thread(target=call, name="rlflow-scripted-policy", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if not got:
            raise late
        ok, value = got[0]
        if not ok:
            raise value
        return value

    def sample(self, prompt_ids: list[list[int]], params: SamplingParams, keys: list[str] | None = None) -> Sampled:
        tok, out = self.tokenizer, []
        for i, ids in enumerate(prompt_ids):
            for _ in range(params.n):
                try:
                    text = self._turn(tok.decode(ids))
                except UserError:
                    raise
                except Exception as e:  # noqa: BLE001 - the user's policy: one line, naming it
                    raise UserError(f"--policy: {_name(self.fn)}(context) raised {type(e).__name__}: "
                                    f"{(str(e).splitlines() or [''])[0][:200]}") from None
                except SystemExit as e:
                    raise UserError(f"--policy: {_name(self.fn)}(context) called sys.exit({e.code!r}); expected it "
                                    f"to return the turn's text") from None
                if inspect.isawaitable(text):
                    getattr(text, "close", lambda: None)()          # (never awaited: no warning of it)
                    raise UserError(f"--policy: {_name(self.fn)} is a coroutine function (async def); expected a "
                                    f"plain function returning the turn's text")
                if not isinstance(text, str):
                    raise UserError(f"--policy: {_name(self.fn)}(context) returned {type(text).__name__}, expected "
                                    f"the turn's text (str)")
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:           # (a lone surrogate: no tokenizer takes it)
                    raise UserError(f"--policy: {_name(self.fn)}(context) returned text that is not Unicode "
                                    f"({text[e.start:e.end]!r} at {e.start}: a lone surrogate)") from None
                toks = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                truncated = len(toks) > params.max_new_tokens
                toks = toks[:params.max_new_tokens]
                out.append(Sample(i, toks, [0.0] * len(toks), truncated=truncated))
        return Sampled(out, 0.0, 0.0)


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"


def scripted(spec: str) -> Callable[[str], str]:
    """MODULE:FUNCTION, imported; one UserError line if it is not there."""
    if ":" not in spec:
        raise UserError(f"--policy: {spec}: expected MODULE:FUNCTION (a function of the context text) or `model`")
    return import_user(spec, f"--policy: {spec}", noun="function")


def as_row(r: Rollout, tokenizer, schemas: list[dict] | None) -> dict:
    """One episode as a TRL `messages` row: the prompt, each model turn as the text it wrote (its tokens, EOS
    dropped), each observation as the environment gave it; what came after the last model turn (an observation
    the episode ended on) is left out, as it is of the episode's tokens."""
    runs, at = [], 0
    while at < len(r.mask or []):           # the model's turns: the runs of mask 1
        if r.mask[at]:
            end = at
            while end < len(r.mask) and r.mask[end]:
                end += 1
            runs.append(tokenizer.decode(r.completion_ids[at:end], skip_special_tokens=True))
            at = end
        else:
            at += 1
    messages, turn = list(r.prompt), 0
    for m in r.turns or []:
        if m.get("role") == "assistant":
            if turn == len(runs):
                break
            messages.append({"role": "assistant", "content": runs[turn]})
            turn += 1
        elif turn:
            messages.append(dict(m))
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    return {"messages": messages, "tools": json.dumps(schemas) if schemas else None, "return": r.env_return}


def record(cfg: Config, policy: str, rows: list[int] | None = None, n: int = 1, min_return: float | None = 1.0,
           split: str = "train", seed: int = 0, skip: int = 0,
           on_chunk: Callable[[int, list[dict], int, int, str | None], None] | None = None
           ) -> tuple[list[dict], list[Rollout], int]:
    """Episodes of `policy` on the dataset's rows (`split`: train, or the held-out eval split; `rows`: their
    indices, all by default; the first `skip` of them left out), `n` per row, greedy for a model. Returns the rows
    of those with a return ≥ `min_return` (None: all that ended without an error), every episode, and how many of
    the first kind were left out because they do not render back to their own tokens and mask (a turn cut at
    max_completion_length, text that does not round-trip through the tokenizer): a demonstration is kept only where
    RL's masks agree. With `on_chunk`, the rows run CHUNK_EPISODES // n at a time (chunks from the first row on)
    and after each, the rows done so far, its kept rows, episode and unrendered counts and its first episode's error
    (None: none failed) go to it instead (no episode returned or held: `rlflow record`'s progress)."""
    from tasks.core.data import load_prompts
    from tasks.core.models import base_path, load_tokenizer
    from tasks.envs.runtime.episodes import run_episodes

    if not cfg.env.episodic():
        raise UserError("env: recording demonstrations needs an environment (env.factory or env.agent)")
    ds = load_prompts(cfg, split)
    rows = list(range(len(ds))) if rows is None else rows
    if bad := [i for i in rows if not 0 <= i < len(ds)]:
        raise UserError(f"--rows: row {bad[0]} is not in the {split} split ({len(ds)} rows)")
    if len(rows) * n > MAX_EPISODES:      # (each is held in memory until written)
        raise UserError(f"--n: {n} episodes per row x {len(rows)} rows: more than {MAX_EPISODES:,} episodes; "
                        f"record at most that many at a time")
    left = rows[skip:]
    if not left:
        return [], [], 0
    table = {i: dict(ds[i]) for i in left}
    params = SamplingParams(n=n, max_new_tokens=cfg.generate.max_completion_length,
                            temperature=0.0 if policy == "model" else 1.0, top_p=1.0, seed=seed)
    if policy == "model":
        from tasks.core import layout
        from tasks.engines.sampling import open_session

        session = open_session(cfg, layout.BASE)
    else:
        session = ScriptedPolicy(scripted(policy), load_tokenizer(base_path(cfg)), cfg.env.timeout_seconds)
    schemas = _schemas(cfg, dict(ds[rows[0]]))
    kept, records, unrendered = [], [], 0
    per = max(1, CHUNK_EPISODES // n) if on_chunk else len(left)
    with session:
        render = Renderer(session.tokenizer, 1 << 30)
        for at in range(0, len(left), per):
            chunk = left[at:at + per]
            got, _ = run_episodes(cfg, table, chunk, session, params)
            rendered, lost = _demonstrations(cfg, got, session.tokenizer, render, schemas, min_return)
            if on_chunk is not None:
                on_chunk(skip + at + len(chunk), rendered, len(got), lost,
                         next((r.env_error for r in got if r.env_error is not None), None))
            else:
                kept, records, unrendered = kept + rendered, records + got, unrendered + lost
    return kept, records, unrendered


def _demonstrations(cfg: Config, records: list[Rollout], tokenizer, render: Renderer, schemas: list[dict] | None,
                    min_return: float | None) -> tuple[list[dict], int]:
    """The rows of the episodes worth keeping (record's rule), and how many of those did not render back."""
    kept, unrendered = [], 0
    for r in records:
        if r.env_error is not None or r.truncated or (min_return is not None and (r.env_return or 0.0) < min_return):
            continue
        row = as_row(r, tokenizer, schemas)
        first = next(k for k, m in enumerate(row["messages"]) if m["role"] == "assistant")
        ids, mask = render.conversation(row["messages"][:first], row["messages"][first:], schemas,
                                        cfg.generate.max_completion_length)
        ends = len(r.prompt_ids) + max(k + 1 for k, m in enumerate(r.mask) if m)     # (through its last turn)
        if ids != (r.prompt_ids + r.completion_ids)[:ends] or mask != ([0] * len(r.prompt_ids) + r.mask)[:ends]:
            unrendered += 1
            continue
        kept.append(row)
    return kept, unrendered


def _schemas(cfg: Config, row: dict) -> list[dict] | None:
    """The tools the environment declares (what the episodes' prompts were rendered with), from one more of its
    environments, opened on the first row and closed."""
    from tasks.envs.runtime.episodes import environments

    env = environments(cfg)(row)
    try:
        return list(env.tool_schemas) or None
    finally:
        closed = env.close()
        if inspect.isawaitable(closed):        # (an async environment's close: nothing was opened, it returns)
            asyncio.run(closed)


def write(rows: list[dict], out: Path) -> None:
    """JSON Lines, written under a temporary name of this writer's own, flushed to disk and renamed: a file that
    exists is whole (after a crash, or a power loss, too), two recordings to one file never write into one
    temporary file, and a failed write leaves the old file and no temporary one. What a killed writer of this
    machine left (its host and process id in the name, that process gone) is removed by the next."""
    import socket

    from tasks.core.processes import alive

    out.parent.mkdir(parents=True, exist_ok=True)
    ours = f".{out.name}.tmp-{socket.gethostname()}-"      # (a shared folder: other machines' writers are not ours)
    for left in out.parent.iterdir():
        pid = left.name[len(ours):].split("-")[0] if left.name.startswith(ours) else ""
        if pid.isdigit() and not alive(int(pid)):
            try:
                left.unlink()
            except OSError:                # (gone meanwhile, or another user's: left where it is)
                pass
    tmp = out.with_name(f"{ours}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class RecordingProgress:
    """`rlflow record`'s progress beside its --out (`.NAME.JOB.progress`, JOB naming the recording: a digest of the
    config, the policy and its module's source, the rows, --n, --split, --min-return), one JSON line per chunk of
    rows recorded (how many of the rows are done, their demonstrations, counts), each flushed to disk. A recording
    killed and run again with the same arguments goes on after its last whole chunk (a line cut short is dropped);
    with others it has its own file, and the other's is left until a recording to that --out completes. Locked
    while it records (the same recording twice at once is refused); removed once --out is written, and by one that
    fails before its first chunk or finds nothing to write."""

    def __init__(self, out: Path, job: str):
        self.out, self.job, self.path = out, job, out.with_name(f".{out.name}.{job[:16]}.progress")
        self.done = 0                               # rows of the recording's (in order) recorded
        self.kept: list[dict] = []
        self.episodes = self.unrendered = 0
        self.failed: str | None = None    # the first episode's error, as it said it

    def __enter__(self) -> RecordingProgress:
        missing = [p for p in (self.out.parent, *self.out.parent.parents) if not p.exists()]
        self.made = missing[-1] if missing else None        # the outermost folder this recording makes (see exit)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.file = self._locked(self.path)
        if self.file is None:
            raise UserError(f"--out: {self.out}: this recording is being made already (its progress, {self.path}, "
                            f"is locked); expected one recording per file at a time")
        self.file.seek(0)
        good = 0
        for line in self.file.read().split("\n")[:-1]:       # (lines ended by their newline: whole)
            try:
                self._take(json.loads(line))
            except (ValueError, KeyError, TypeError):
                break
            good += len(line.encode()) + 1
        self.file.truncate(good)
        return self

    @staticmethod
    def _locked(path: Path):
        """`path` opened and locked, None where another process holds it."""
        import fcntl

        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            f.close()
            return None

    def _take(self, chunk: dict) -> None:
        self.done = chunk["done"]
        self.kept += chunk["kept"]
        self.episodes += chunk["episodes"]
        self.unrendered += chunk["unrendered"]
        self.failed = self.failed or chunk.get("failed")

    def add(self, done: int, kept: list[dict], episodes: int, unrendered: int, failed: str | None = None) -> None:
        """One chunk recorded (record's on_chunk)."""
        chunk = {"done": done, "kept": kept, "episodes": episodes, "unrendered": unrendered, "failed": failed}
        self.file.write(json.dumps(chunk) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        self._take(chunk)

    def discard(self) -> None:
        """Nothing of it worth keeping (nothing to write)."""
        self.episodes = 0

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:                  # --out written: every recording's progress to it is done with
            for left in self.out.parent.iterdir():
                if left.name.startswith(f".{self.out.name}.") and left.name.endswith(".progress") and \
                        left != self.path and (theirs := self._locked(left)) is not None:
                    left.unlink(missing_ok=True)
                    theirs.close()
        if kind is None or not self.episodes:
            self.path.unlink(missing_ok=True)
        self.file.close()
        folder = self.out.parent        # a recording that leaves nothing leaves no folder it made either
        while self.made is not None and not self.out.exists():
            try:
                folder.rmdir()          # (only an empty one)
            except OSError:
                break
            if folder == self.made:
                break
            folder = folder.parent


def job_of(cfg: Config, policy: str, rows: list[int] | None, n: int, split: str, min_return: float | None) -> str:
    """What a recording is: its progress is taken up again only by a recording of the same."""
    import hashlib
    import importlib.util

    source = b""
    if ":" in policy:
        try:
            origin = importlib.util.find_spec(policy.split(":", 1)[0]).origin
            source = Path(origin).read_bytes()
        except Exception:  # noqa: BLE001 - (not found: record's own import says so, in its line)
            pass
    what = json.dumps([cfg.model_dump(mode="json"), policy, rows, n, split, min_return], sort_keys=True, default=str)
    return hashlib.sha256(what.encode() + hashlib.sha256(source).digest()).hexdigest()[:32]

