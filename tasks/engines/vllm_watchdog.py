"""The vLLM server's watchdog: a process started beside the server, in its process group, that stops the
server once the run has forgotten it or no generate has used it for a while (a flow killed before its
teardown must not leave a server holding the machine). The reasons to leave are the daemon helper's
(tasks/core/daemon.py: Watch); idle time is the state file's age, which every generate touches. Standard
library and tasks.core only: it runs under the vLLM environment's interpreter, where it should not cost a
torch import.

    python -m tasks.engines.vllm_watchdog STATE_PATH IDLE_SECONDS POLL_SECONDS SERVER_PID
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from tasks.core.daemon import Daemon, Watch, forget

MARKER, STOP_WAIT = "vllm", 30.0        # in every command line of a server's group; seconds to exit on SIGTERM


def watch(state_path: Path, idle_seconds: float, poll: float, pid: int) -> str:
    """The server's watchdog (its own process, in the server's group): returns once the server has exited,
    after stopping it if the state file no longer names it (the run forgot it, or started another) or if no
    generate has used it (the state file's mtime) for `idle_seconds`. The stage writes the state file just
    after starting us: until it has named the server once, a missing file only counts after `idle_seconds`.
    Returns why it ended."""
    def unused() -> float | None:
        try:
            return time.time() - state_path.stat().st_mtime
        except OSError:
            return None

    reason = Watch(pid, state_path, wait_named=idle_seconds, idle=idle_seconds, unused=unused).wait(poll, pid)
    if reason == "exited":
        return "the server exited"
    why = ("the run's state file no longer names it" if reason == "replaced" else
           f"no generate used it for {idle_seconds:.0f} s (generate.server_idle_timeout)")
    print(f"rlflow watchdog: stopping vLLM server pid {pid}: {why}", flush=True)
    forget(state_path, pid)                  # first: a stage starting now starts a new server
    # The server's group (this watchdog's): its processes that say `vllm`, SIGKILL after 30 s; never this one.
    Daemon(state_path, MARKER, STOP_WAIT).stop({"pid": pid, "pgid": os.getpgid(0)})
    return why


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: python -m tasks.engines.vllm_watchdog STATE_PATH IDLE_SECONDS POLL_SECONDS SERVER_PID")
    watch(Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
