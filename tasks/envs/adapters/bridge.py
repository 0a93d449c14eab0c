"""A process in another Python environment, driven over JSON lines: what the OpenEnv adapter (its client in
.venv-openenv) and the verifiers 0.4 agent (verifiers in .venv-verifiers) share. Their packages pin what rlflow's
environment cannot hold, so each runs a script of its own under that environment's Python; requests are one JSON
object a line on its stdin ({"id": n, ...}), replies one a line on its stdout ({"id": n, "ok": ...} or
{"id": n, "error": "..."}; id None: the script is ready). One process per Python (and import path) per rlflow
process, started at first use and again if it died; a death fails every request in flight, never hangs one.
"""

from __future__ import annotations

import atexit
import itertools
import json
import subprocess
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tasks.core.processes import spawn
from tasks.envs.runtime.isolation import EnvironmentDied


class LineBridge:
    what = "the bridge process"          # in messages: what died
    error: type[Exception] = RuntimeError   # what an {"error": ...} reply raises
    keep_stderr = 20                     # its last lines of stderr, for the message when it dies

    running: dict[tuple, LineBridge]     # (each subclass its own: by Python and import path)
    made: threading.Lock

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.running, cls.made = {}, threading.Lock()

    @classmethod
    def of(cls, *key: Any) -> LineBridge:
        with cls.made:
            bridge = cls.running.get(key)
            if bridge is None or bridge.proc.poll() is not None:
                bridge = cls.running[key] = cls(*key)
            return bridge

    def start(self, python: str, script: Path, env: dict | None = None) -> None:
        self.proc = spawn([python, "-u", str(script)], env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, bufsize=1)
        self.pending: dict[int, Future] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.ready: Future = Future()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True, name=f"{type(self).__name__}-out").start()
        threading.Thread(target=self._errors, daemon=True, name=f"{type(self).__name__}-err").start()
        atexit.register(self.stop)

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            future = self.ready if reply["id"] is None else self.pending.pop(reply["id"], None)
            if future is None or future.done():
                continue
            if "error" in reply:
                future.set_exception(self.error(reply["error"]))
            else:
                future.set_result(reply["ok"])
        code = self.proc.wait()
        tail = "".join(self.stderr).strip().splitlines()[-1:] or [""]
        died = EnvironmentDied(f"{self.what} exited ({code}) {tail[0]}".strip())
        with self.lock:
            left, self.pending = [*self.pending.values(), self.ready], {}
        for future in left:
            if not future.done():
                future.set_exception(died)

    def _errors(self) -> None:
        for line in self.proc.stderr:
            self.stderr = [*self.stderr, line][-self.keep_stderr:]

    def send(self, **request: Any) -> tuple[int, Future]:
        """Write one request; its id and the future of its reply."""
        future: Future = Future()
        with self.lock:
            request["id"] = next(self.ids)
            self.pending[request["id"]] = future
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                self.pending.pop(request["id"], None)
                raise EnvironmentDied(f"{self.what} is gone") from None
        return request["id"], future

    def stop(self, wait: float = 5.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(wait)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
