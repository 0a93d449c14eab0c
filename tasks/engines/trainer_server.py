"""The trainer's processes: `python -m tasks.engines.trainer_server serve STATE_PATH CONFIG_PATH` (resident, started
by DetachedTrainer) or `... once CONFIG_PATH ITERATION FINGERPRINT` (process mode with deepspeed: each process of
a torchrun group started by GroupTrainer trains one iteration and exits; tasks/engines/detached.py). `serve` runs
the run's `Trainer` (tasks/engines/trainer.py) and answers requests over an authenticated Unix socket until
finished, idle or replaced:

    ping          at once, even while another request runs ("ok" only while the whole group is linked)
    train N       update(N), ckpt-N committed (a retried request whose first try committed it: at once)
    preload N     hold the state after iteration N now (restore and replay)
    finish        a full checkpoint of its last iteration, then exit

With deepspeed every process of the torchrun group (tasks/engines/trainer_group.py) runs this: process 0
answers and shares each request with the others (`follow`); on several nodes each other node's first process
also answers its node's stage, which waits until the group has committed ckpt-N.
More: docs/internals.md (tasks/engines/trainer_server.py): the requests, how it ends, the other nodes' parts.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
import traceback
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener
from pathlib import Path

from tasks.core import layout
from tasks.core.daemon import Watch, forget, leave, write_state
from tasks.core.errors import UserError, disk_full
from tasks.core.process_wide import take
from tasks.engines.trainer import Trainer, trainer_key
from tasks.engines.trainer_group import Group

FOLLOWER_GRACE = 30.0            # seconds a failed follower waits for process 0 to end the group (see follow)
REQUEST_WAIT = 600.0             # seconds another node's part waits for node 0's stage's train request to reach it


def serve(state_path: Path, config_path: Path) -> None:
    """The trainer's main loop: answer requests until finished, idle, or replaced (process 0 of a group; the
    others follow it, and on several nodes each other node's first process also answers its node's stage)."""
    from tasks.core.config import load_config
    from tasks.core.stage import quiet_progress_bars
    from tasks.core.store import open_store

    quiet_progress_bars()
    cfg = load_config(config_path)
    authkey = take("RLFLOW_TRAINER_AUTHKEY")
    key = take("RLFLOW_TRAINER_KEY", "") or trainer_key(cfg)
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
        try:
            conn = listener.accept()
        except (AuthenticationError, EOFError, ConnectionError):    # (a caller gone mid-handshake, or keyless)
            continue
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
            elif message["op"] == "preload":
                host.preload(message["iteration"])
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
        except (AuthenticationError, EOFError, ConnectionError):    # (a caller without the key: the next one)
            continue
        threading.Thread(target=_answer_node, args=(conn, host, group), daemon=True).start()


def _answer_node(conn, host: Trainer, group: Group) -> None:
    """Another node's first process answering its node's stage: a ping ("ok" while the group is whole); train
    N: once the group has committed ckpt-N (node 0's stage asked for it); preload: at once (node 0's asks)."""
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
        elif op == "preload":
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
        if message["op"] == "preload":
            group.share(message)
            return "ok", {"at": host.preload(message["iteration"])}
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
        full = disk_full(e)
        if full is not None:                 # the stage fails with this line, not retried
            return "disk_full", str(full)
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


def once(config_path: Path, iteration: int, fingerprint: str) -> None:
    """One process of a group that trains iteration `iteration` and ends (train.mode process with deepspeed): the
    same Trainer as a resident group's, made for one iteration (ckpt-N in full). The stage that started the group
    checked the inputs and the fingerprint; it reads a user error or a corrupt artifact from this output."""
    from tasks.core.config import load_config
    from tasks.core.errors import DiskFull, corrupt_line, disk_full_line, user_error_line
    from tasks.core.stage import quiet_progress_bars
    from tasks.core.store import CorruptArtifact, open_store

    quiet_progress_bars()
    try:
        cfg = load_config(config_path)
        group = Group(cfg, serving=False)
        trainer = Trainer(cfg, open_store(cfg), group.rank, resident=False)
        try:
            trainer.train(iteration, fingerprint)
        finally:
            trainer.close()
    except UserError as e:
        print(user_error_line(e), file=sys.stderr, flush=True)
        sys.exit(2)
    except CorruptArtifact as e:
        print(corrupt_line(e.key, str(e)), file=sys.stderr, flush=True)
        sys.exit(3)
    except Exception as e:
        full = disk_full(e)                  # (an OSError behind whatever wrapped it, as stage processes read it)
        if full is None:
            raise
        print(disk_full_line(full), file=sys.stderr, flush=True)
        sys.exit(DiskFull.exit_code)


USAGE = ("usage: python -m tasks.engines.trainer_server serve STATE_PATH CONFIG_PATH\n"
         "       python -m tasks.engines.trainer_server once CONFIG_PATH ITERATION FINGERPRINT")

if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(Path(sys.argv[2]), Path(sys.argv[3]))
    elif len(sys.argv) == 5 and sys.argv[1] == "once":
        once(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(USAGE)
