"""The resident trainer in a process of its own (`train.mode: resident`, train.host detached): one trainer per run
that stays alive across iterations on the train machine, holding model, optimizer and RNG in memory. The
stage's handle on it is `ResidentTrainer` (a TrainerHandle, tasks/engines/trainer.py, as the in-process one);
the process runs the same `Trainer` (tasks/engines/trainer.py) and answers over a socket (`serve`, below).

    train stage (any process on this machine)             resident trainer (python -m tasks.engines.resident)
      ResidentTrainer(cfg).prepare(N-1)           ───►      (the flow, while it generates N) restore now
      ResidentTrainer(cfg).train(N, fingerprint)  ───►      not at N-1 (new, or the request skips)? restore:
                                                            the newest full checkpoint, then the stored
                                                            iterations after it replayed (tasks/engines/
                                                            training.py: restore); update(N); ckpt-N lean (the
                                                            policy alone); every train.checkpoint_every: full-N,
                                                            written in the background
      ResidentTrainer(cfg).finish()               ───►      full checkpoint of its last iteration, exit

Lifecycle, as the vLLM server's (the daemon helper, tasks/core/daemon.py): a state file
$RLFLOW_CACHE/trainer/<run>.json {pid, socket, key, log} (mode 600: it also holds the socket's auth key),
written by the trainer once it listens; started detached on first use, so it outlives the stage process
(and a SkyPilot job's process tree); found again by later stage processes whose config gives the same key; a
dead, hung or differently configured one is replaced, and the new one restores by replay, so nothing is lost
but time. It exits by itself after `train.idle_timeout` seconds unused (after a full checkpoint), or at once
when the state file names another process. Requests travel over an authenticated Unix socket in the abstract
namespace (multiprocessing.connection; not TCP, whose small-message delays cost ~40 ms a round trip); train,
prepare and finish one at a time, a ping at once. Starting one is serialised per run by a lock file, so a
flow's prepare and a stage process asking at the same time start one trainer.

With the deepspeed engine the trainer is a torchrun group on this machine (the command the process-mode stage
runs, tasks/engines/deepspeed_engine.py: torchrun), its processes holding their ZeRO shards across iterations:
process 0 answers the stage and hands each train/finish request to the others (a broadcast on a gloo group of
their own, which may wait as long as the trainer idles) before all of them run it; the state file names the
torchrun process, so stopping it stops the group. A failure on any process ends the whole group (torchrun
stops the others), and the retried stage starts a new one, which resumes by replay.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from tasks.core import layout
from tasks.core.daemon import Daemon, Watch, forget, leave, write_state
from tasks.core.errors import UserError
from tasks.core.paths import REPO_ROOT, cache_root
from tasks.core.processes import alive
from tasks.engines.trainer import Trainer, trainer_key

if TYPE_CHECKING:
    from tasks.core.config import Config

START_TIMEOUT = 1800.0           # seconds a new trainer may take to import torch and answer (not to load a model)
MARKER = "tasks.engines.resident"
FOLLOWER_GRACE = 30.0            # seconds a failed follower waits for process 0 to end the group (see follow)


def state_dir() -> Path:
    return cache_root() / "trainer"


# ------------------------------------------------------------------------------------------ the stage's side

class ResidentTrainer:
    """train.host detached: the train stage's handle on its run's resident trainer process (on this machine)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.path = state_dir() / f"{cfg.run.name}.json"
        self.daemon = _daemon(self.path)
        self.key = trainer_key(cfg)

    def train(self, iteration: int, fingerprint: str) -> dict:
        """Have the trainer train iteration `iteration` (starting one if none runs); it commits ckpt-N."""
        return self._request({"op": "train", "iteration": iteration, "fingerprint": fingerprint}, start=True)

    def prepare(self, iteration: int) -> int:
        """Have the trainer (started if none runs) hold the state after iteration `iteration` now: a new one
        restores and replays while the flow generates iteration + 1, not when its train request comes. Writes
        nothing. Returns the iteration it holds."""
        return self._request({"op": "prepare", "iteration": iteration}, start=True)["at"]

    def finish(self, catch_up: bool = False) -> int | None:
        """A full checkpoint of the trainer's last iteration, then it exits. Returns that iteration, or None
        when no trainer of this run runs here (nothing to do; with `catch_up`, one is started when the run's
        newest iteration lacks a full checkpoint, and writes it)."""
        state = self.daemon.read()
        if state is not None and alive(state["pid"]) and state.get("key") != self.key:
            self.daemon.stop(state)     # made for another config: it cannot be asked to write our checkpoint
            state = None
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

    def close(self) -> None:
        """Nothing: the trainer outlives the stage (the flow finishes it; idle, it stops itself)."""

    def _request(self, message: dict, start: bool) -> dict:
        address, authkey = self._ensure() if start else self._address(self.daemon.read())
        try:
            with Client(address, authkey=authkey) as conn:
                conn.send(message)
                status, payload = conn.recv()
        except (ConnectionError, EOFError, OSError) as e:
            raise RuntimeError(f"the resident trainer of run {self.cfg.run.name} died or went away during "
                               f"{message['op']} ({type(e).__name__}); a retry starts a new one, which resumes "
                               f"by replay (log: {self.path.with_suffix('.log')})") from e
        if status == "user_error":
            raise UserError(payload)
        if status == "error":
            raise RuntimeError(f"resident trainer: {payload}")
        return payload

    @staticmethod
    def _address(state: dict) -> tuple[str, bytes]:
        return state["socket"], bytes.fromhex(state["authkey"])

    def _ensure(self) -> tuple[str, bytes]:
        """The address of this run's trainer with our key; started (detached) if none answers (the daemon
        helper, tasks/core/daemon.py: one caller at a time per run on this machine, so a flow's prepare and a
        stage process that ask together start one trainer, not two)."""
        return self._address(self.daemon.ensure(self.key, self._answers, self._start))

    def _answers(self, state: dict) -> bool:
        """A ping, answered at once even while the trainer is busy with another request."""
        address, authkey = self._address(state)
        try:
            with Client(address, authkey=authkey) as conn:
                conn.send({"op": "ping"})
                return conn.poll(30) and conn.recv()[0] == "ok"
        except (ConnectionError, EOFError, OSError):
            return False

    def _start(self) -> dict:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        config = self.path.with_suffix(".config.yaml")   # the resolved config: the same fingerprints there
        config.write_text(yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False))
        authkey = secrets.token_hex(16)
        if self.cfg.train.engine == "deepspeed":        # a torchrun group: its process 0 writes the state file
            from tasks.engines.deepspeed_engine import DeepSpeedEngine
            argv, env = DeepSpeedEngine.torchrun(self.cfg)
        else:
            argv, env = [sys.executable], dict(os.environ)
        from tasks.core.process_wide import rlflow_first

        # (`-m` from the user's folder: rlflow_first, so that it imports rlflow's tasks, not a tasks/ there)
        env = rlflow_first({**env, "RLFLOW_TRAINER_AUTHKEY": authkey, "PYTHONUNBUFFERED": "1",
                            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", ""))
                                                          if p)})

        def ready(spawned: dict) -> dict | None:       # it writes the state file once it listens
            state = self.daemon.read()
            return state if state is not None and state.get("pid") == spawned["pid"] else None

        return self.daemon.start([*argv, "-m", MARKER, "serve", str(self.path), str(config)], env, ready,
                                 START_TIMEOUT, f"the resident trainer of run {self.cfg.run.name}")


def _daemon(path: Path) -> Daemon:
    """A run's trainer as a daemon: its processes (a torchrun group's too) carry MARKER on their command lines."""
    return Daemon(path, MARKER, stop_wait=10.0)


def _stop(path: Path, state: dict) -> None:
    """Stop the trainer `state` names (SIGTERM, then SIGKILL) and forget it (what a test or a benchmark left)."""
    _daemon(path).stop(state)


# ------------------------------------------------------------------------------------------ the trainer's side

class Group:
    """The trainer's processes: this one alone (torch engine), or a torchrun group (deepspeed engine) whose
    process 0 answers the stage and shares each request with the others before all of them run it."""

    def __init__(self, cfg: Config):
        self.rank, self.size = int(os.environ.get("RANK") or 0), int(os.environ.get("WORLD_SIZE") or 1)
        self.torchrun = "RANK" in os.environ
        self.control = None
        if self.torchrun:
            from tasks.engines.deepspeed_engine import join_group

            join_group(cfg)
            if self.size > 1:   # its own gloo group: an idle trainer's followers wait in it for days, not 30 min
                import torch.distributed as dist
                self.control = dist.new_group(backend="gloo", timeout=timedelta(days=7, minutes=10))

    @property
    def pid(self) -> int:
        """The process the state file names: torchrun (stopping it stops the group), or this one."""
        return os.getppid() if self.torchrun else os.getpid()

    def share(self, message: dict) -> None:
        """Process 0: hand a request to the others (they wait for it in `follow`)."""
        if self.control is not None:
            import torch.distributed as dist
            dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> dict:
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def stop(self, code: int) -> None:
        """End every process of the group now (torchrun stops the others when one fails)."""
        sys.stdout.flush()
        if self.torchrun and self.size > 1:
            import signal
            try:
                os.kill(os.getppid(), signal.SIGTERM)
            except ProcessLookupError:
                pass
        os._exit(code)


def serve(state_path: Path, config_path: Path) -> None:
    """The trainer's main loop: answer requests until finished, idle, or replaced (process 0 of a group; the
    others follow it)."""
    from tasks.core.config import load_config
    from tasks.core.stage import quiet_progress_bars
    from tasks.core.store import open_store

    quiet_progress_bars()
    cfg = load_config(config_path)
    authkey = os.environ.pop("RLFLOW_TRAINER_AUTHKEY")
    group = Group(cfg)
    host = Trainer(cfg, open_store(cfg), group.rank)
    if group.rank != 0:
        follow(host, group)
    address = f"\0rlflow-trainer-{secrets.token_hex(8)}"         # abstract: no file, no path length limit
    listener = Listener(address, family="AF_UNIX", authkey=bytes.fromhex(authkey))
    state = {"pid": group.pid, "socket": address, "authkey": authkey, "key": trainer_key(cfg),
             "log": str(state_path.with_suffix(".log")), "started": time.time(), "processes": group.size}
    write_state(state_path, state)                               # mode 600: it holds the socket's key
    print(f"resident trainer of run {cfg.run.name}: pid {group.pid}, {group.size} process(es)", flush=True)
    busy, last_used = threading.Lock(), [time.monotonic()]
    threading.Thread(target=_watch, args=(host, group, state_path, busy, last_used), daemon=True).start()
    while True:
        conn = listener.accept()
        threading.Thread(target=_answer, args=(conn, host, group, state_path, busy, last_used), daemon=True).start()


def follow(host: Trainer, group: Group) -> None:
    """A group's process other than 0: run each request process 0 shares, in step with it. Any failure ends the
    group (process 0 reports it to the stage)."""
    while True:
        try:
            message = group.receive()
        except BaseException:  # noqa: BLE001 - process 0 is gone: so is the group
            group.stop(1)
        try:
            if message["op"] == "train":
                host.train(message["iteration"], message["fingerprint"])
            elif message["op"] == "prepare":
                host.prepare(message["iteration"])
            elif message["op"] == "finish":
                host.final_checkpoint()
                host.close()
                sys.stdout.flush()
                os._exit(0)                     # (process 0 exits once it has answered; then torchrun)
        except BaseException:  # noqa: BLE001 - the group is out of step now: end it
            traceback.print_exc()
            # Process 0, if it failed the same way (a user error), answers the stage and then ends the group
            # (torchrun stops us during this wait); if only this process failed, process 0 waits in a
            # collective, and this ends the group.
            time.sleep(FOLLOWER_GRACE)
            group.stop(1)


def _answer(conn, host: Trainer, group: Group, state_path: Path, busy: threading.Lock, last_used: list[float]) -> None:
    """One request: a ping at once; train and finish one at a time (a retried request waits for the first)."""
    with conn:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message.get("op") == "ping":
            reply = ("ok", None)
        else:
            with busy:
                t0 = time.perf_counter()
                reply = _handle(host, group, message)
                last_used[0] = time.monotonic()
            print(f"{message['op']} {message.get('iteration', '')}: {reply[0]} in {time.perf_counter() - t0:.3f} s",
                  flush=True)
        # After finish, and after a failure in a group (whose processes may be out of step: a retry starts a new
        # group), this trainer exits: it is forgotten first, so no stage finds it on its way out.
        ending = message.get("op") == "finish" or (reply[0] != "ok" and group.size > 1)
        if ending:
            forget(state_path, group.pid)
        try:
            conn.send(reply)
        except OSError:
            pass
    if ending:
        _exit(state_path, group, 0 if message.get("op") == "finish" else 1)


def _handle(host: Trainer, group: Group, message: dict) -> tuple[str, object]:
    try:
        if message["op"] == "train":
            key = layout.checkpoint(host.cfg.run.name, message["iteration"])
            if host.store.manifest(key) is not None:    # a retried request whose first try committed it
                return "ok", {"key": key}
            group.share(message)
            return "ok", host.train(message["iteration"], message["fingerprint"])
        if message["op"] == "prepare":
            group.share(message)
            return "ok", {"at": host.prepare(message["iteration"])}
        if message["op"] == "finish":
            group.share(message)
            full = host.final_checkpoint()
            host.close()
            return "ok", {"full": full}
        return "error", f"unknown request {message['op']!r}"
    except UserError as e:
        return "user_error", str(e)
    except Exception as e:  # noqa: BLE001 - reported to the stage, which fails (and is retried)
        traceback.print_exc()
        return "error", f"{type(e).__name__}: {e}"


def _watch(host: Trainer, group: Group, state_path: Path, busy: threading.Lock, last_used: list[float]) -> None:
    """Exit when the state file names another process (replaced: write nothing), or after idle_timeout unused
    (a full checkpoint first, so a later resume needs no replay)."""
    idle = host.cfg.train.idle_timeout
    watch = Watch(group.pid, state_path, idle=idle, unused=lambda: time.monotonic() - last_used[0])
    while True:
        reason = watch.wait(min(30.0, idle / 4) if idle else 30.0)
        if reason == "replaced":
            print("resident trainer: the state file no longer names this process; exiting", flush=True)
            group.stop(0)
        if reason == "idle" and busy.acquire(blocking=False):    # (busy: a request is running, not idle)
            print(f"resident trainer: unused for {idle:.0f} s (train.idle_timeout); a full checkpoint, then exit",
                  flush=True)
            try:
                group.share({"op": "finish"})
                host.final_checkpoint()
            finally:
                _exit(state_path, group, 0)


def _exit(state_path: Path, group: Group, code: int) -> None:
    if code == 0:
        leave(state_path, group.pid)       # the others exit by themselves (they ran the same finish)
    forget(state_path, group.pid)
    group.stop(code)


if __name__ == "__main__":     # python -m tasks.engines.resident serve STATE_PATH CONFIG_PATH
    if len(sys.argv) != 4 or sys.argv[1] != "serve":
        sys.exit("usage: python -m tasks.engines.resident serve STATE_PATH CONFIG_PATH")
    serve(Path(sys.argv[2]), Path(sys.argv[3]))
