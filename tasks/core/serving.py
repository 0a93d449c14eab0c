"""What rlflow's servers bind and parse: a free port, a listening socket and its URL, the shared command line. The
environment server, its pool's front, a generate replica and a judge server. Standard library only.
"""

from __future__ import annotations


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (for a server this process starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_socket(host: str, port: int):
    """A TCP socket bound to (host, port) (port 0: a free one) for a server to serve on, and the URL that reaches
    it from this machine (0.0.0.0 is reached at 127.0.0.1). What the environment server, its pool's front, a
    generate replica and a judge server bind before they print their READY line. Listening already: uvicorn
    prints that line from its lifespan's startup, before it serves the socket, and a client that connects in
    between (a loaded machine makes that gap long) waits in the backlog instead of being refused, which the
    pool's front and the flow read as a lost member."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock, f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{sock.getsockname()[1]}"


def server_arguments(prog: str, doc: str, port: int):
    """The command line the environment server and the pool's front share: --config, -o, --overrides-json,
    --host, --port, --idle-minutes, --exit-with-parent."""
    import argparse

    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--overrides-json", default="[]", metavar="JSON")
    ap.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to answer other machines (a cluster's port)")
    ap.add_argument("--port", type=int, default=port, help="0: a free one (printed on the READY line)")
    ap.add_argument("--idle-minutes", type=float, default=30.0, help="leave after this long without a request "
                    "(0: never)")
    ap.add_argument("--exit-with-parent", action="store_true", help="leave when the process that started it ends "
                    "(the flow's own, env.where: local)")
    return ap
