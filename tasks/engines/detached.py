"""The train stage's handles on a trainer in processes of its own (TrainerHandles, as tasks/engines/trainer.py's
in-process one; the processes, tasks/engines/trainer_server.py, run the same `Trainer`). `GroupTrainer`: process
mode with deepspeed, a torchrun group that trains one iteration and ends. `DetachedTrainer` (`train.mode:
resident`, train.host detached): one trainer per run that stays alive across iterations on the train machine,
holding model, optimizer and RNG in memory.

    DetachedTrainer(cfg).preload(N-1)            # (the flow, while it generates N) restore now
    DetachedTrainer(cfg).train(N, fingerprint)   # update(N); ckpt-N lean; a full one every checkpoint_every
    DetachedTrainer(cfg).finish()                # a full checkpoint of its last iteration, then exit

A daemon (tasks/core/daemon.py), found again by later stage processes with the same config and replaced when
dead, hung or configured otherwise (the new one restores by replay); requests over an authenticated Unix
socket. With deepspeed it is a torchrun group whose process 0 answers; on several nodes one group across
them, node 0's stage driving it, and losing any node ends the group (the next one resumes by replay).
More: docs/internals.md (tasks/engines/detached.py): the requests, the lifecycle, a group on one node or more.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import layout
from tasks.core.config_yaml import dump_yaml
from tasks.core.daemon import Daemon, forget
from tasks.core.errors import DiskFull, UserError
from tasks.core.paths import cache_root
from tasks.core.processes import alive, stream
from tasks.core.stage import by_hand, command, raise_failure
from tasks.engines.trainer import trainer_key

if TYPE_CHECKING:
    from tasks.core.config import Config

START_TIMEOUT = 1800.0           # seconds a new trainer may take to import torch and answer (not to load a model)
MARKER = "tasks.engines.trainer_server"     # the module the trainer's processes run (tasks/engines/trainer_server.py)
FINISH_WAIT = START_TIMEOUT      # seconds another node's finish waits for the group to run node 0's finish
# A request's watch: while it runs, the trainer is pinged every WATCH_SECONDS (its pings are answered at once, by
# a thread of their own, even mid-update); HUNG_AFTER pings in a row unanswered within PING_TIMEOUT s each (a
# SIGSTOPped or wedged process, a machine that froze) and it is stopped as hung: the request fails, and the
# retry starts a new one, which resumes by replay. A slow update is not hung: its pings are answered.
WATCH_SECONDS = 30.0
PING_TIMEOUT = 30.0
HUNG_AFTER = 4


def state_dir() -> Path:
    return cache_root() / "trainer"


def node_layout() -> tuple[int, int]:
    """(nodes, this node's rank) of the train stage, from the environment sky/train.yaml sets (NNODES, NODE_RANK);
    (1, 0) on one machine."""
    nodes = int(os.environ.get("NNODES") or 1)
    return (nodes, int(os.environ.get("NODE_RANK") or 0)) if nodes > 1 else (1, 0)


def group_key(cfg: Config) -> str:
    """What this node's part of the run's trainer must have been started with: the config (trainer_key) and, on
    several nodes, the group's layout (node count and rendezvous address: a relaunched cluster's new addresses
    replace it)."""
    nodes, _ = node_layout()
    if nodes == 1:
        return trainer_key(cfg)
    where = f"{nodes}@{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT') or 29500}"
    return f"{trainer_key(cfg)}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"


class GroupTrainer:
    """train.mode process with train.engine deepspeed: each train request starts this node's part of a torchrun
    group (`trainer_server once`; on several nodes one group across them, rendezvous at MASTER_ADDR), whose
    processes train the iteration (ckpt-N in full, written by process 0) and end; the call returns when they
    have. A user error, a corrupt artifact or a full disk in a process is raised here as the stage's own."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def train(self, iteration: int, fingerprint: str) -> dict:
        from tasks.engines.deepspeed_engine import DeepSpeedEngine

        argv, env = DeepSpeedEngine.torchrun(self.cfg)
        with tempfile.TemporaryDirectory(prefix="rlflow-train-") as tmp:
            config = Path(tmp) / "config.yaml"     # the resolved config: the same fingerprints in every process
            config.write_text(dump_yaml(self.cfg.model_dump(mode="json")))
            argv += ["-m", MARKER, "once", str(config), str(iteration), fingerprint]
            ran = stream(argv, env, sink=lambda line: print(line, file=sys.stderr, flush=True))
        if ran.code == 0:
            return {"key": layout.checkpoint(self.cfg.run.name, iteration)}
        raise_failure(ran, f"train[iter {iteration}]: the deepspeed group (torchrun)")

    def preload(self, iteration: int) -> int:
        """Nothing to hold: the group of the next train request restores then."""
        return iteration

    def finish(self, catch_up: bool = False) -> int | None:
        """Nothing: each ckpt-N is full."""
        return None

    def close(self) -> None:
        """Nothing: the group ended with its iteration."""


class DetachedTrainer:
    """train.host detached: the train stage's handle on its run's resident trainer process (on this machine; on
    several nodes, on each node its part of the group: node 0's stage drives it, another node's waits for it)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.nodes, self.node = node_layout()
        name = cfg.run.name if self.node == 0 else f"{cfg.run.name}.node{self.node}"
        self.path = state_dir() / f"{name}.json"
        self.daemon = _daemon(self.path)
        self.key = group_key(cfg)

    def train(self, iteration: int, fingerprint: str) -> dict:
        """Have the trainer train iteration `iteration` (starting one if none runs); it commits ckpt-N. (Another
        node: this node's part joins the group if none runs, and this returns once the group committed ckpt-N.)"""
        return self._request({"op": "train", "iteration": iteration, "fingerprint": fingerprint}, start=True)

    def preload(self, iteration: int) -> int:
        """Have the trainer (started if none runs) hold the state after iteration `iteration` now: a new one
        restores and replays while the flow generates iteration + 1, not when its train request comes. Writes
        nothing. Returns the iteration it holds."""
        return self._request({"op": "preload", "iteration": iteration}, start=True)["at"]

    def finish(self, catch_up: bool = False) -> int | None:
        """A full checkpoint of the trainer's last iteration, then it exits. Returns that iteration, or None
        when no trainer of this run runs here (nothing to do; with `catch_up`, one is started when the run's
        newest iteration lacks a full checkpoint, and writes it)."""
        if self.node:
            return self._finish_part(catch_up)
        state = self.daemon.read()
        if state is not None and alive(state["pid"]) and (state.get("key") != self.key or "socket" not in state):
            self.daemon.stop(state)     # made for another config (it cannot be asked to write our checkpoint), or
            state = None                # its starter died before it answered
        if state is None or not alive(state["pid"]):
            if not catch_up:
                return None
            self._ensure()                  # a new one: on finish it restores what lacks a full checkpoint
            state = self.daemon.read()
        full = self._request({"op": "finish"}, start=False)["full"]
        deadline = time.monotonic() + 30
        while alive(state["pid"]) and time.monotonic() < deadline:     # it exits once it has answered
            time.sleep(0.05)
        return full

    def _finish_part(self, catch_up: bool) -> int | None:
        """Another node than the first: its part runs the finish node 0's stage asks the group for, then records
        the full checkpoint's iteration in its state file and exits; this waits for that (whether it came before
        or after this call). With `catch_up` and no part here, one is started to join node 0's new group (node 0
        decides the same from the same store: nothing runs there either once a node is gone)."""
        state = self.daemon.read()
        if state is not None and "finished" in state and not alive(state["pid"]):
            forget(self.path, state["pid"])
            return state["finished"]
        if state is not None and (state.get("key") != self.key or "socket" not in state or not alive(state["pid"])):
            self.daemon.stop(state)
            state = None
        if state is None:
            if not catch_up:
                return None
            self._ensure()
            state = self.daemon.read()
        deadline = time.monotonic() + FINISH_WAIT
        while alive(state["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        now = self.daemon.read() or {}
        if now.get("pid") == state["pid"] and "finished" in now and not alive(state["pid"]):
            forget(self.path, state["pid"])
            return now["finished"]
        # The group ended without a finish (a node was lost), or outlived the wait: as node 0 finds nothing to
        # finish then, None (finish_trainer then catches up, as node 0 does, when the newest iteration lacks one).
        print(f"node {self.node}'s part of the resident trainer of run {self.cfg.run.name} ended without the "
              f"group's finish (log: {self.path.with_suffix('.log')})", file=sys.stderr, flush=True)
        self.daemon.stop(state)
        return None

    def close(self) -> None:
        """Nothing: the trainer outlives the stage (the flow finishes it; idle, it stops itself)."""

    def _request(self, message: dict, start: bool) -> dict:
        """Send `message` and return the answer's payload, watching the trainer meanwhile (WATCH_SECONDS): one
        that stops answering pings is stopped as hung and the request fails (a retry starts a new one)."""
        state = self._ensure() if start else self.daemon.read()
        address, authkey = self._address(state)
        asked = _Asked(address, authkey, message)
        misses = 0
        while not asked.done.wait(WATCH_SECONDS):
            misses = 0 if _ping(address, authkey, PING_TIMEOUT) is not None else misses + 1
            if misses >= HUNG_AFTER:
                self.daemon.stop(state)
                raise RuntimeError(f"{self._who()} answered none of {HUNG_AFTER} pings during {message['op']} "
                                   f"(stopped by a signal, or hung): it was stopped; a retry starts a new one, "
                                   f"which resumes by replay (log: {self.path.with_suffix('.log')})")
        if (e := asked.error) is not None:
            if not isinstance(e, (ConnectionError, EOFError, OSError)):       # (a refused key, an unreadable answer)
                raise RuntimeError(f"{self._who()}: {message['op']} failed: {type(e).__name__}: {e} (log: "
                                   f"{self.path.with_suffix('.log')})") from e
            raise RuntimeError(f"{self._who()} died or went away during {message['op']} ({type(e).__name__}); a "
                               f"retry starts a new one, which resumes by replay (log: "
                               f"{self.path.with_suffix('.log')})") from e
        status, payload = asked.answer
        if status == "user_error":
            raise UserError(payload)
        if status == "disk_full":
            raise DiskFull(payload)
        if status == "error":
            raise RuntimeError(f"resident trainer: {payload}")
        return payload

    def _who(self) -> str:
        return (f"the resident trainer of run {self.cfg.run.name}"
                + (f" (node {self.node} of {self.nodes})" if self.nodes > 1 else ""))

    @staticmethod
    def _address(state: dict) -> tuple[str, bytes]:
        return state["socket"], bytes.fromhex(state["authkey"])

    def _ensure(self) -> dict:
        """The state of this run's trainer with our key; started (detached) if none answers (the daemon
        helper, tasks/core/daemon.py: one caller at a time per run on this machine, so a flow's preload and a
        stage process that ask together start one trainer, not two)."""
        return self.daemon.ensure(self.key, self._answers, self._start)

    def _answers(self, state: dict) -> bool:
        """A ping, answered at once even while the trainer is busy with another request (on several nodes: "ok"
        only while the whole group is linked). A state file without a socket is a start whose caller died."""
        if "socket" not in state:
            return False
        answer = _ping(*self._address(state), PING_TIMEOUT)
        return answer is not None and answer[0] == "ok"

    def _start(self) -> dict:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        config = self.path.with_suffix(".config.yaml")   # the resolved config: the same fingerprints there
        config.write_text(dump_yaml(self.cfg.model_dump(mode="json")))
        authkey = secrets.token_hex(16)
        if self.cfg.train.engine == "deepspeed":        # a torchrun group: its process 0 writes the state file
            from tasks.engines.deepspeed_engine import DeepSpeedEngine
            argv, env = DeepSpeedEngine.torchrun(self.cfg)
        else:
            argv, env = [sys.executable], dict(os.environ)
        # (`-m tasks...` from the user's folder: spawn's safe path imports rlflow's tasks, not a tasks/ there)
        env = {**env, "RLFLOW_TRAINER_AUTHKEY": authkey, "RLFLOW_TRAINER_KEY": self.key, "PYTHONUNBUFFERED": "1"}
        if self.nodes > 1:          # where the other nodes' first processes reach process 0 (its link server)
            env["RLFLOW_LINK_ADDR"] = os.environ["MASTER_ADDR"]

        def ready(spawned: dict) -> dict | None:       # it writes the state file (with its socket) once it listens
            state = self.daemon.read()
            return state if state is not None and state.get("pid") == spawned["pid"] and "socket" in state else None

        # The state file is written now (without a socket) and rewritten by the trainer once it listens: a stage
        # killed during the start leaves it, and the next one stops that trainer before it starts another (on
        # several nodes a second part of one node would join the rendezvous beside the first).
        state = self.daemon.start([*argv, "-m", MARKER, "serve", str(self.path), str(config)], env, ready,
                                  START_TIMEOUT, f"the resident trainer of run {self.cfg.run.name}"
                                  + (f" (node {self.node} of {self.nodes})" if self.nodes > 1 else ""),
                                  state={"key": self.key, "node": self.node})
        if by_hand():       # no flow will finish it: say that it stays, until when, and how to stop it now
            idle = self.cfg.train.idle_timeout
            print(f"train: started the resident trainer of run {self.cfg.run.name} (pid {state['pid']}, log "
                  f"{self.path.with_suffix('.log')}): it keeps the model for the next iterations and stops by itself "
                  + (f"after {idle:.0f} s unused (train.idle_timeout)" if idle else "never (train.idle_timeout 0)")
                  + f"; to stop it now, after a full checkpoint: {command('train finish', 0)}",
                  file=sys.stderr, flush=True)
        return state


class _Asked:
    """One request on a thread of its own (`done` set once it is answered or failed): connecting alone can hang,
    on a stopped trainer (the socket accepts; the authentication waits for it)."""

    def __init__(self, address: str, authkey: bytes, message: dict):
        self.answer: tuple | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        threading.Thread(target=self._ask, args=(address, authkey, message), daemon=True).start()

    def _ask(self, address: str, authkey: bytes, message: dict) -> None:
        try:
            with Client(address, authkey=authkey) as conn:
                conn.send(message)
                self.answer = conn.recv()
        except Exception as e:  # noqa: BLE001 - given to the caller (a refused key, an answer it cannot read)
            self.error = e
        finally:
            self.done.set()


def _ping(address: str, authkey: bytes, timeout: float) -> tuple | None:
    """The trainer's answer to a ping, or None when none came within `timeout` s (connecting included) or it is
    gone. (A thread left waiting on a stopped trainer ends once that one is stopped for good.)"""
    asked = _Asked(address, authkey, {"op": "ping"})
    return asked.answer if asked.done.wait(timeout) and asked.error is None else None


def _daemon(path: Path) -> Daemon:
    """A run's trainer as a daemon: its processes (a torchrun group's too) carry MARKER on their command lines."""
    return Daemon(path, MARKER, stop_wait=10.0)


def _stop(path: Path, state: dict) -> None:
    """Stop the trainer `state` names (SIGTERM, then SIGKILL) and forget it (what a test or a benchmark left)."""
    _daemon(path).stop(state)
