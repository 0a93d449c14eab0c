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

On several nodes (NNODES > 1, NODE_RANK, MASTER_ADDR, MASTER_PORT: what sky/train.yaml exports; sky exec runs the
stage on every node) the group is one torchrun across them: each node's stage finds or starts its node's part
(`torchrun --nnodes=N --node_rank=r`, rendezvous at node 0's MASTER_ADDR:MASTER_PORT; its state file
<run>.node<r>.json on nodes after the first), and the parts wait for each other to form the group. Node 0's
stage sends the requests, as on one node; another node's stage asks its part only to wait until the group has
committed ckpt-N (the request must reach the part within REQUEST_WAIT s), and at the flow's end until the group
has run the finish node 0 asked for. Each node's first process keeps a link (TCP, heartbeats) with process 0:
a link that closes or falls silent for LINK_TIMEOUT s means a lost node, and both ends stop their node's part,
so losing any node ends the whole group (no collective waits for a dead peer); the group's state files stay,
naming dead processes, so each node's next stage stops what is left and starts a new part, and the new group
resumes by replay.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
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
from tasks.core.paths import cache_root
from tasks.core.processes import alive
from tasks.core.stage import by_hand, command
from tasks.engines.trainer import Trainer, trainer_key

if TYPE_CHECKING:
    from tasks.core.config import Config

START_TIMEOUT = 1800.0           # seconds a new trainer may take to import torch and answer (not to load a model)
MARKER = "tasks.engines.resident"
FOLLOWER_GRACE = 30.0            # seconds a failed follower waits for process 0 to end the group (see follow)
LINK_BEAT = 5.0                  # several nodes: seconds between heartbeats on a node's link with process 0
LINK_TIMEOUT = 120.0             # a link silent this long is a lost node (a machine that went away sends no FIN)
REQUEST_WAIT = 600.0             # seconds another node's part waits for node 0's stage's train request to reach it
FINISH_WAIT = START_TIMEOUT      # seconds another node's finish waits for the group to run node 0's finish


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


# ------------------------------------------------------------------------------------------ the stage's side

class ResidentTrainer:
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

    def prepare(self, iteration: int) -> int:
        """Have the trainer (started if none runs) hold the state after iteration `iteration` now: a new one
        restores and replays while the flow generates iteration + 1, not when its train request comes. Writes
        nothing. Returns the iteration it holds."""
        return self._request({"op": "prepare", "iteration": iteration}, start=True)["at"]

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
        address, authkey = self._ensure() if start else self._address(self.daemon.read())
        try:
            with Client(address, authkey=authkey) as conn:
                conn.send(message)
                status, payload = conn.recv()
        except (ConnectionError, EOFError, OSError) as e:
            raise RuntimeError(f"the resident trainer of run {self.cfg.run.name}"
                               f"{f' (node {self.node} of {self.nodes})' if self.nodes > 1 else ''} died or went "
                               f"away during {message['op']} ({type(e).__name__}); a retry starts a new one, which "
                               f"resumes by replay (log: {self.path.with_suffix('.log')})") from e
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
        """A ping, answered at once even while the trainer is busy with another request (on several nodes: "ok"
        only while the whole group is linked). A state file without a socket is a start whose caller died."""
        if "socket" not in state:
            return False
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


def _daemon(path: Path) -> Daemon:
    """A run's trainer as a daemon: its processes (a torchrun group's too) carry MARKER on their command lines."""
    return Daemon(path, MARKER, stop_wait=10.0)


def _stop(path: Path, state: dict) -> None:
    """Stop the trainer `state` names (SIGTERM, then SIGKILL) and forget it (what a test or a benchmark left)."""
    _daemon(path).stop(state)


# ------------------------------------------------------------------------------------------ the trainer's side

class Group:
    """The trainer's processes: this one alone (torch engine), or a torchrun group (deepspeed engine) whose
    process 0 answers the stage and shares each request with the others before all of them run it. On several
    nodes each other node's first process also answers its node's stage (which waits for the group) and holds a
    link with process 0 (`_link`)."""

    def __init__(self, cfg: Config):
        self.rank, self.size = int(os.environ.get("RANK") or 0), int(os.environ.get("WORLD_SIZE") or 1)
        self.torchrun = "RANK" in os.environ
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        self.node = int(os.environ.get("GROUP_RANK") or self.rank // per_node)
        self.nodes = max(1, self.size // per_node)
        self.leads = int(os.environ.get("LOCAL_RANK") or 0) == 0     # answers its node's stage (has a state file)
        self.control = None
        self.broken = False            # ending after a failure or a lost node: pings are refused
        self.ending = False            # leaving on purpose (finish): a link that closes then is no loss
        self.failed: tuple[str, str] | None = None     # a follower's failure, told to its node's waiting stage
        self.seen = self.done = 0      # the newest iteration whose train request this process got / finished
        self.state_path: Path | None = None            # another node's first process: its state file (see serve)
        self.state: dict | None = None
        self.links: dict[int, socket.socket] = {}
        self.parent = os.getppid()     # (torchrun's process)
        if self.torchrun:
            threading.Thread(target=self._orphaned, daemon=True).start()
            from tasks.engines.deepspeed_engine import join_group

            join_group(cfg)
            if self.size > 1:   # its own gloo group: an idle trainer's followers wait in it for days, not 30 min
                import torch.distributed as dist
                self.control = dist.new_group(backend="gloo", timeout=timedelta(days=7, minutes=10))
            if self.nodes > 1:
                self._link()

    @property
    def pid(self) -> int:
        """The process the state file names: torchrun (stopping it stops the group), or this one."""
        return self.parent if self.torchrun else os.getpid()

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
        if self.torchrun and self.size > 1 and os.getppid() == self.parent:    # (never a process that adopted us)
            import signal
            try:
                os.kill(self.parent, signal.SIGTERM)
            except ProcessLookupError:
                pass
        os._exit(code)

    def _orphaned(self) -> None:
        """A worker whose torchrun is gone ends too: torchrun stops its workers when it lives to, but it starts
        each in a session of its own, so a SIGKILLed torchrun (or a stop that reached only it) left them running,
        and on several nodes still in the group."""
        while os.getppid() == self.parent:
            time.sleep(1.0)
        print(f"resident trainer: process {self.rank}'s torchrun is gone; exiting", flush=True)
        os._exit(1)

    # -------------------------------------------------------------------- several nodes: the links

    def _link(self) -> None:
        """Process 0 and every other node's first process hold a TCP connection on which each end sends a
        heartbeat every LINK_BEAT s. A killed node's connection closes at once, a machine that went away falls
        silent: after LINK_TIMEOUT s without a word either end takes the other's node for lost and stops its own
        node's part (`lost`), so losing any node ends the whole group, none of it left waiting in a collective
        for a peer that is gone. The port is any free one of process 0's, handed out on the control group with
        a token that a connection must show."""
        if self.rank == 0:
            token = secrets.token_hex(16)
            dual = socket.has_dualstack_ipv6()
            server = socket.create_server(("", 0), family=socket.AF_INET6 if dual else socket.AF_INET,
                                          dualstack_ipv6=dual)
            with server:
                self.share({"link": server.getsockname()[1], "token": token})
                deadline = time.monotonic() + LINK_TIMEOUT
                while len(self.links) < self.nodes - 1:
                    server.settimeout(max(0.1, deadline - time.monotonic()))
                    conn, _ = server.accept()      # (socket.timeout: a node never came; the group does not start)
                    conn.settimeout(LINK_TIMEOUT)
                    try:
                        node, _, theirs = _read_line(conn).partition(" ")
                    except OSError:
                        node, theirs = "", ""
                    if theirs != token or not node.isdigit() or not 0 < int(node) < self.nodes:
                        conn.close()
                        continue
                    self.links[int(node)] = conn
        else:
            link = self.receive()
            if self.leads:
                address = (os.environ.get("RLFLOW_LINK_ADDR") or os.environ["MASTER_ADDR"], link["link"])
                conn = socket.create_connection(address, timeout=LINK_TIMEOUT)
                conn.sendall(f"{self.node} {link['token']}\n".encode())
                self.links[0] = conn
        for node, conn in self.links.items():
            threading.Thread(target=self._beat, args=(conn,), daemon=True).start()
            threading.Thread(target=self._watch_link, args=(node, conn), daemon=True).start()

    def linked(self) -> bool:
        return not self.broken

    @staticmethod
    def _beat(conn: socket.socket) -> None:
        while True:
            time.sleep(LINK_BEAT)
            try:
                conn.sendall(b".")
            except OSError:
                return                  # (its watcher sees the link go)

    def _watch_link(self, node: int, conn: socket.socket) -> None:
        while True:
            try:
                data = conn.recv(64)
            except OSError:             # (socket.timeout among them: silent for LINK_TIMEOUT s)
                data = b""
            if not data:
                break
        if not self.ending:
            self.lost(f"node {node}" if self.rank == 0 else "node 0")

    def lost(self, what: str) -> None:
        """A node of the group is gone: this node's part ends now, and with it the group. The state file stays,
        naming processes that are gone or going: the next stage on this node stops what is left (and waits
        for it to be gone, so that a new part can take the rendezvous port) before it starts a new one."""
        self.broken = True
        print(f"resident trainer: lost the link with {what}; the group ends (a new one resumes by replay)",
              flush=True)
        if self.failed is not None:
            time.sleep(1.0)             # (its node's waiting stage hears this process's own failure first)
        self.stop(1)


def _read_line(conn: socket.socket, limit: int = 256) -> str:
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = conn.recv(limit - len(data))
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def serve(state_path: Path, config_path: Path) -> None:
    """The trainer's main loop: answer requests until finished, idle, or replaced (process 0 of a group; the
    others follow it, and on several nodes each other node's first process also answers its node's stage)."""
    from tasks.core.config import load_config
    from tasks.core.stage import quiet_progress_bars
    from tasks.core.store import open_store

    quiet_progress_bars()
    cfg = load_config(config_path)
    authkey = os.environ.pop("RLFLOW_TRAINER_AUTHKEY")
    key = os.environ.pop("RLFLOW_TRAINER_KEY", "") or trainer_key(cfg)
    group = Group(cfg)
    host = Trainer(cfg, open_store(cfg), group.rank)
    if not group.leads:
        follow(host, group)
    address = f"\0rlflow-trainer-{secrets.token_hex(8)}"         # abstract: no file, no path length limit
    listener = Listener(address, family="AF_UNIX", authkey=bytes.fromhex(authkey))
    # (pgid: torchrun's, the group the start made; torch starts each worker in a session of its own)
    state = {"pid": group.pid, "pgid": os.getpgid(group.pid), "socket": address, "authkey": authkey, "key": key,
             "log": str(state_path.with_suffix(".log")), "started": time.time(), "processes": group.size}
    if group.nodes > 1:
        state.update(nodes=group.nodes, node=group.node)
    write_state(state_path, state)                               # mode 600: it holds the socket's key
    print(f"resident trainer of run {cfg.run.name}: pid {group.pid}, {group.size} process(es)"
          + (f", node {group.node} of {group.nodes}" if group.nodes > 1 else ""), flush=True)
    if group.rank != 0:         # another node's first process: it follows process 0, and its node's stage waits
        group.state_path, group.state = state_path, state
        threading.Thread(target=_serve_node, args=(listener, host, group), daemon=True).start()
        threading.Thread(target=_watch_node, args=(group, state_path), daemon=True).start()
        follow(host, group)
    busy, last_used = threading.Lock(), [time.monotonic()]
    threading.Thread(target=_watch, args=(host, group, state_path, busy, last_used), daemon=True).start()
    while True:
        conn = listener.accept()
        threading.Thread(target=_answer, args=(conn, host, group, state_path, busy, last_used), daemon=True).start()


def follow(host: Trainer, group: Group) -> None:
    """A group's process other than 0: run each request process 0 shares, in step with it. Any failure ends the
    group (process 0 reports it to the stage; another node's waiting stage hears it from its first process)."""
    while True:
        try:
            message = group.receive()
        except BaseException:  # noqa: BLE001 - process 0 is gone: so is the group
            group.stop(1)
        try:
            if message["op"] == "train":
                group.seen = max(group.seen, message["iteration"])
                host.train(message["iteration"], message["fingerprint"])
                group.done = max(group.done, message["iteration"])
            elif message["op"] == "prepare":
                host.prepare(message["iteration"])
            elif message["op"] == "finish":
                group.ending = True
                full = host.final_checkpoint()
                host.close()
                if group.state is not None:     # another node's first process: its stage reads what was finished
                    write_state(group.state_path, {**group.state, "finished": full})
                sys.stdout.flush()
                os._exit(0)                     # (process 0 exits once it has answered; then torchrun)
        except BaseException as e:  # noqa: BLE001 - the group is out of step now: end it
            traceback.print_exc()
            group.failed = (("user_error", str(e)) if isinstance(e, UserError)
                            else ("error", f"node {group.node}, process {group.rank}: {type(e).__name__}: {e}"))
            # Process 0, if it failed the same way (a user error), answers the stage and then ends the group
            # (torchrun stops us during this wait); if only this process failed, process 0 waits in a
            # collective, and this ends the group.
            time.sleep(FOLLOWER_GRACE)
            group.stop(1)


def _serve_node(listener: Listener, host: Trainer, group: Group) -> None:
    while True:
        try:
            conn = listener.accept()
        except Exception:  # noqa: BLE001 - a caller without the key: refused, the next one is served
            continue
        threading.Thread(target=_answer_node, args=(conn, host, group), daemon=True).start()


def _answer_node(conn, host: Trainer, group: Group) -> None:
    """Another node's first process answering its node's stage: a ping ("ok" while the group is whole); train
    N: once the group has committed ckpt-N (node 0's stage asked for it); prepare: at once (node 0's asks)."""
    with conn:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        op = message.get("op")
        if op == "ping":
            reply = ("ok", None) if group.linked() else ("error", "the group is ending")
        elif op == "train":
            reply = _await_iteration(host, group, message["iteration"])
        elif op == "prepare":
            reply = ("ok", {"at": message["iteration"]})
        else:
            reply = ("error", f"node {group.node}'s part of the group does not take {op!r} (node 0's stage sends it)")
        try:
            conn.send(reply)
        except OSError:
            pass


def _await_iteration(host: Trainer, group: Group, iteration: int) -> tuple[str, object]:
    """Wait until ckpt-`iteration` is committed (process 0 writes it once the group has trained it). The train
    request for it must reach this part within REQUEST_WAIT s (node 0's stage sends it); after that the group's
    life bounds the wait: a failure here is answered, a lost node ends this process (the stage hears EOF)."""
    key = layout.checkpoint(host.cfg.run.name, iteration)
    deadline, check = time.monotonic() + REQUEST_WAIT, 0.0
    while True:
        if group.failed is not None:
            return group.failed
        now = time.monotonic()
        if now >= check:
            if host.store.manifest(key) is not None:
                return "ok", {"key": key}
            check = now + (0.25 if group.done >= iteration else 2.0)
        if group.seen < iteration and now > deadline:
            return "error", (f"node {group.node}: no train request for iteration {iteration} reached this node's "
                             f"part of the group in {REQUEST_WAIT:.0f} s (node 0's train stage sends it: see its "
                             f"log)")
        time.sleep(0.1)


def _watch_node(group: Group, state_path: Path) -> None:
    """Another node's first process: exit when its state file names another process (replaced). Idle exits are
    process 0's (it shares a finish)."""
    Watch(group.pid, state_path).wait(30.0)
    print("resident trainer: the state file no longer names this process; exiting", flush=True)
    group.stop(0)


def _answer(conn, host: Trainer, group: Group, state_path: Path, busy: threading.Lock, last_used: list[float]) -> None:
    """One request: a ping at once; train and finish one at a time (a retried request waits for the first)."""
    with conn:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message.get("op") == "ping":
            reply = ("ok", None) if group.linked() else ("error", "the group is ending")
        else:
            with busy:
                t0 = time.perf_counter()
                reply = _handle(host, group, message)
                last_used[0] = time.monotonic()
            print(f"{message['op']} {message.get('iteration', '')}: {reply[0]} in {time.perf_counter() - t0:.3f} s",
                  flush=True)
        # After finish, and after a failure in a group (whose processes may be out of step: a retry starts a new
        # group), this trainer exits: it is forgotten first, so no stage finds it on its way out (on several
        # nodes a failed group's state file stays, refusing pings: see Group.lost).
        ending = message.get("op") == "finish" or (reply[0] != "ok" and group.size > 1)
        if ending:
            group.broken = reply[0] != "ok"
            if group.nodes == 1 or not group.broken:
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
            group.ending = True
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
                group.ending = True
                group.share({"op": "finish"})
                host.final_checkpoint()
            finally:
                _exit(state_path, group, 0)


def _exit(state_path: Path, group: Group, code: int) -> None:
    if code == 0:
        leave(state_path, group.pid)       # the others exit by themselves (they ran the same finish)
    if group.nodes == 1:                   # (several nodes: a failed group's state file stays, see Group.lost)
        forget(state_path, group.pid)
    group.stop(code)


if __name__ == "__main__":     # python -m tasks.engines.resident serve STATE_PATH CONFIG_PATH
    if len(sys.argv) != 4 or sys.argv[1] != "serve":
        sys.exit("usage: python -m tasks.engines.resident serve STATE_PATH CONFIG_PATH")
    serve(Path(sys.argv[2]), Path(sys.argv[3]))
