"""How much of rlflow one iteration runs: the files and lines of tasks/ and flows/ whose functions one steady-state
iteration of `rlflow run` calls (issue 41's measure of the house: fewer files a reader must open to follow an
iteration is the goal).

    python bench/iteration_footprint.py                       # configs/tiny.yaml, the defaults (inline stages)
    python bench/iteration_footprint.py configs/smollm2-arith.yaml -o eval.every=0

The run is `rlflow run CONFIG` for 3 iterations in this process under a profiler (sys.setprofile and
threading.setprofile: every thread of the flow's process); what is counted is what is called between the start
of iteration 2's generate stage and the start of iteration 3's: one iteration after the first (no model
conversion, no first-time imports or server starts). Child processes (the reward worker, a stage in
`launcher.where: local`, servers) are not seen: the figure is the flow process's own. Prints the files (with
their lines and the functions called in each), and the totals: files, their lines, functions, and the lines of
the functions called.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")

PACKAGES = (str(ROOT / "tasks") + os.sep, str(ROOT / "flows") + os.sep)
MARK = (str(ROOT / "tasks" / "generate.py"), "generate")     # the generate stage's function: an iteration's start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(ROOT / "configs" / "tiny.yaml"))
    ap.add_argument("-o", "--override", action="append", default=[])
    ap.add_argument("--list", action="store_true", help="list every function called, file by file")
    args = ap.parse_args()

    starts = 0
    called: dict[str, set[tuple[str, int, int]]] = defaultdict(set)
    lock = threading.Lock()

    def profile(frame, event, arg):
        nonlocal starts
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGES):
            return
        if (code.co_filename, code.co_name) == MARK:
            with lock:
                starts += 1
        if starts == 2:
            last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
            called[code.co_filename].add((code.co_name, code.co_firstlineno, last))

    def report(rc: int | None = None) -> None:
        sys.setprofile(None)
        threading.setprofile(None)
        if starts < 3:
            print(f"the run ended (exit {rc}) after {starts} generate stages: nothing measured", file=sys.stderr)
            return
        total_lines = function_lines = functions = 0
        print(f"\none iteration of {Path(args.config).name} ({' '.join(args.override) or 'as shipped'}): "
              "files of tasks/ and flows/ whose functions it calls")
        for path in sorted(called):
            lines = len(Path(path).read_text().splitlines())
            spans = called[path]
            total_lines += lines
            functions += len(spans)
            function_lines += sum(last - first + 1 for _, first, last in spans)
            print(f"  {Path(path).relative_to(ROOT)}: {lines} lines, {len(spans)} functions")
            if args.list:
                for name, first, _ in sorted(spans, key=lambda s: s[1]):
                    print(f"      {first:5d} {name}")
        print(f"files: {len(called)}, their lines: {total_lines}, functions called: {functions}, "
              f"their lines: {function_lines}", flush=True)

    import atexit

    from flows.cli import main as rlflow

    tmp = tempfile.mkdtemp(prefix="rlflow-footprint-")
    given = {o.partition("=")[0].strip() for o in args.override}       # (the user's win: each key given once)
    overrides = [o for o in ("run.iterations=3", f"store.uri=file://{tmp}/store",
                             f"tracking.uri=sqlite:///{tmp}/mlflow.db") if o.partition("=")[0] not in given]
    overrides += args.override
    argv = ["run", args.config]
    for o in overrides:
        argv += ["-o", o]
    os.chdir(tmp)
    atexit.register(report)         # a finished `rlflow run` leaves by os._exit after the exit handlers
    threading.setprofile(profile)
    sys.setprofile(profile)
    rc = rlflow(argv)
    atexit.unregister(report)
    report(rc)


if __name__ == "__main__":
    main()
