"""What every bench that runs rlflow keeps its runs in: a work folder under the system's temporary folder (the
runs' stores hold every policy version: a few GB for SmolLM2), removed when the bench exits unless `--keep`."""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
import time
from pathlib import Path


def keep_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--keep", action="store_true", help="keep the work folder (the runs' stores, logs, MLflow "
                    "database), e.g. to run RL again from a saved policy; by default it is removed at the end")


def work_folder(prefix: str, keep: bool) -> Path:
    """A new folder `prefix*`; at exit (a failure too, not a kill) it is removed unless `keep`, and the bench says
    where it was and how long the whole took."""
    work, t0 = Path(tempfile.mkdtemp(prefix=prefix)), time.perf_counter()

    def end() -> None:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        print(f"(all in {time.perf_counter() - t0:.0f} s; work folder {work}{' kept' if keep else ' removed'})",
              flush=True)
    atexit.register(end)
    return work
