"""An S3 fault-injecting proxy on 127.0.0.1, in front of the S3 server of the tests (moto): what a flaky
network and an overloaded S3 do to a request, injected at a rate or on the requests a rule matches.

    proxy = FaultProxy(upstream="http://127.0.0.1:PORT", seed=0)
    proxy.rates = {"error": 0.05, "reset": 0.05, "truncate": 0.05, "delay": 0.05}     # of every request
    proxy.rules.append(Rule("applied_then_error", method="PUT", path="LEASE.json", times=1))
    ... boto3 / rlflow with endpoint_url=proxy.url ...
    proxy.counts      # faults injected, by kind

Faults:
  error               a 500 or 503 (S3's InternalError / SlowDown XML), the request never reaches S3
  applied_then_error  the request reaches S3 and is applied, the reply is replaced by a 500 (a lost reply)
  reset               the connection is reset before any reply (the request may or may not be applied: it is)
  truncate            the reply's headers (full Content-Length) and half its body, then the connection drops
  delay               the reply comes 0.2-1 s late
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

KINDS = ("error", "applied_then_error", "reset", "truncate", "delay")
_XML = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>injected</Message>"
        "<RequestId>fault</RequestId></Error>")


@dataclass
class Rule:
    kind: str
    method: str | None = None
    path: str | None = None        # a substring of the request path
    times: int = 1                 # how many matching requests get it (then the rule is spent)

    def matches(self, method: str, path: str) -> bool:
        return self.times > 0 and (self.method in (None, method)) and (self.path is None or self.path in path)


class FaultProxy:
    def __init__(self, upstream: str, seed: int = 0):
        up = urlparse(upstream)
        self.upstream = (up.hostname, up.port)
        self.rates: dict[str, float] = {}
        self.rules: list[Rule] = []
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.requests = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                kind = proxy._pick(self.command, self.path)
                if kind == "error":
                    return self._reply(proxy._rng.choice([500, 503]), b"", error=True)
                if kind == "reset":
                    proxy._forward(self.command, self.path, self.headers, body)      # applied, never answered
                    return self._reset()
                status, headers, data = proxy._forward(self.command, self.path, self.headers, body)
                if kind == "applied_then_error":
                    return self._reply(500, b"", error=True)
                if kind == "delay":
                    time.sleep(0.2 + 0.8 * proxy._rng.random())
                if kind == "truncate" and len(data) > 1:
                    self._reply(status, data[: len(data) // 2], headers, length=len(data))
                    return self._reset()
                return self._reply(status, data, headers)

            def _reply(self, status, data, headers=(), error=False, length=None):
                if error:
                    data = _XML.format(code="SlowDown" if status == 503 else "InternalError").encode()
                    headers = [("Content-Type", "application/xml")]
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(length if length is not None else len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                self.wfile.flush()

            def _reset(self):
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="s3-faults")
        self._thread.start()

    def _pick(self, method: str, path: str) -> str | None:
        with self._lock:
            self.requests += 1
            for rule in self.rules:
                if rule.matches(method, path):
                    rule.times -= 1
                    self.counts[rule.kind] += 1
                    return rule.kind
            for kind, rate in self.rates.items():
                if self._rng.random() < rate:
                    self.counts[kind] += 1
                    return kind
        return None

    def _forward(self, method, path, headers, body):
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(method, path, body=body or None,
                         headers={k: v for k, v in headers.items() if k.lower() not in ("connection",)})
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
