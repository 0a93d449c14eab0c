"""What a new sqlite tracking database costs (tasks/core/tracking_db.py): made by MLflow's migrations (the
reference: what every new database cost before the environment kept an empty one) and as a copy of the kept
empty one, alternating, in one process with MLflow imported, each timed to the database an MlflowClient has
opened (the tables and the Default experiment there).

    python bench/tracking_db.py --repeats 7

Prints the median seconds of each and the ratio copy / migrations.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tracking-db-"))
    os.environ["RLFLOW_CACHE"] = str(work / "cache")          # (its own kept database: made by the first call)
    import mlflow  # noqa: F401 - (imported before the clock starts: every run imports it anyway)

    from tasks.core import tracking_db

    kept = tracking_db._empty_database

    def made(n: int, copy: bool) -> float:
        tracking_db._empty_database = kept if copy else (lambda: None)
        t0 = time.perf_counter()
        tracking_db.create_whole(f"sqlite:///{work}/{'copy' if copy else 'migrated'}-{n}.db")
        return time.perf_counter() - t0

    made(0, True)                                              # the environment's first: migrated, then kept
    times: dict[bool, list[float]] = {False: [], True: []}
    for n in range(1, args.repeats + 1):
        for copy in (False, True):
            times[copy].append(made(n, copy))
    migrated, copied = statistics.median(times[False]), statistics.median(times[True])
    print(f"new sqlite tracking database, median of {args.repeats}: MLflow's migrations {migrated:.2f} s, "
          f"a copy of the kept empty one {copied:.3f} s, ratio {copied / migrated:.3f}x")


if __name__ == "__main__":
    main()
