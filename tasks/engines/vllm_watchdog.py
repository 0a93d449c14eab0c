"""The vLLM server's watchdog: a process started beside the server, in its process group, that stops the
server once the run has forgotten it or no generate has used it for a while (a flow killed before its
teardown must not leave a server holding the machine). Standard library only: it runs under the vLLM
environment's interpreter, where it should not cost a torch import.

    python -m tasks.engines.vllm_watchdog STATE_PATH IDLE_SECONDS POLL_SECONDS SERVER_PID
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tasks.core.processes import alive, terminate_members


def watch(state_path: Path, idle_seconds: float, poll: float, pid: int) -> str:
    """The server's watchdog (its own process, in the server's group): returns once the server has exited,
    after stopping it if the state file no longer names it (the run forgot it, or started another) or if no
    generate has used it (the state file's mtime) for `idle_seconds`. The stage writes the state file just
    after starting us: until it has named the server once, a missing file only counts after `idle_seconds`.
    Returns why it ended."""
    started, named_once = time.time(), False
    while alive(pid):
        time.sleep(poll)
        try:
            used, named = state_path.stat().st_mtime, json.loads(state_path.read_text()).get("pid")
        except (OSError, ValueError):
            used, named = None, None
        named_once = named_once or named == pid
        if named != pid and (named_once or named is not None or time.time() - started > idle_seconds):
            why = "the run's state file no longer names it"
        elif named == pid and time.time() - used > idle_seconds:
            why = f"no generate used it for {idle_seconds:.0f} s (generate.server_idle_timeout)"
        else:
            continue
        print(f"rlflow watchdog: stopping vLLM server pid {pid}: {why}", flush=True)
        if named == pid:
            state_path.unlink(missing_ok=True)      # first: a stage starting now starts a new server
        terminate_group(os.getpgid(0))
        return why
    return "the server exited"


def terminate_group(pgid: int | None) -> None:
    """SIGTERM the vLLM processes of process group `pgid` (and this watchdog's siblings: `vllm` is in every
    command line there), SIGKILL after 30 s; never this process."""
    terminate_members(pgid, "vllm", 30.0)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: python -m tasks.engines.vllm_watchdog STATE_PATH IDLE_SECONDS POLL_SECONDS SERVER_PID")
    watch(Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
