"""The resident trainer's processes as one group (`Group`, for tasks/engines/trainer_server.py): that process
alone (torch engine), or a torchrun group (deepspeed engine) whose process 0 shares each request with the others
on a gloo group of their own (`share`, `receive`) and whose processes end together (`stop`; a worker whose
torchrun is gone ends too). On several nodes process 0 and each other node's first process hold a TCP link with
heartbeats (`_link`): a link that closes or falls silent for LINK_TIMEOUT s is a lost node, and the group ends.
More: docs/internals.md (tasks/engines/trainer_group.py): the group, its links, why a lost node ends it.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.core.config import Config

LINK_BEAT = 5.0                  # several nodes: seconds between heartbeats on a node's link with process 0
LINK_TIMEOUT = 120.0             # a link silent this long is a lost node (a machine that went away sends no FIN)


class Group:
    """The trainer's processes: this one alone (torch engine), or a torchrun group (deepspeed engine) whose
    process 0 answers the stage and shares each request with the others before all of them run it. On several
    nodes each other node's first process also answers its node's stage (which waits for the group) and holds a
    link with process 0 (`_link`)."""

    def __init__(self, cfg: Config, serving: bool = True):
        """Join the group. `serving`: a resident group, which shares requests (a control group) and, on several
        nodes, holds the links; a group of one iteration (trainer_server.once) needs neither: its processes train
        in step and end together, and torchrun ends the group when one of them fails."""
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
        self.state_path: Path | None = None  # another node's first process: its state file (trainer_server: serve)
        self.state: dict | None = None
        self.links: dict[int, socket.socket] = {}
        self.parent = os.getppid()     # (torchrun's process)
        if self.torchrun:
            threading.Thread(target=self._orphaned, daemon=True).start()
            from tasks.engines.deepspeed_engine import join_group

            join_group(cfg)
            if self.size > 1 and serving:  # its own gloo group: idle followers wait in it for days, not 30 min
                import torch.distributed as dist
                self.control = dist.new_group(backend="gloo", timeout=timedelta(days=7, minutes=10))
            if self.nodes > 1 and serving:
                self._link()

    @property
    def pid(self) -> int:
        """The process the state file names: torchrun (stopping it stops the group), or this one."""
        return self.parent if self.torchrun else os.getpid()

    def share(self, message: dict) -> None:
        """Process 0: hand a request to the others (they wait for it in trainer_server.follow)."""
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
