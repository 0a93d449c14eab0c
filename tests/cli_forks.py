"""Many `rlflow` command lines from one process that imports the CLI's modules once (`python -m tests.cli_forks`).

Each command line runs in a forked child: its own working directory (first on sys.path, as `python -m flows.cli`
puts it), its own copy of the modules, its own stdout and stderr files, and its exit code is what
`flows.cli.main` returns. A fresh `python -m flows.cli` spends ~8 s importing torch, transformers, datasets,
Prefect and MLflow before it finds a mistake; a fork finds it in a fraction of that, when the parent has also
named the parts transformers imports lazily (a bad `rlflow sft` file: ~0.2 s a fork, ~2.8 s without them).
What the imports print is not checked here: the tests that run `python -m flows.cli` itself (tests/conftest.py:
run_cli) check that.

stdin: a JSON list of {"args": [...], "cwd": DIR};
stdout: a JSON list of {"rc": N, "seconds": S, "stdout": ..., "stderr": ...}.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time


def _child(args: list[str], cwd: str, out: str, err: str) -> None:
    os.chdir(cwd)
    sys.path[0] = cwd
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    code = 1
    try:
        from flows import cli

        code = cli.main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - what python would print, then its exit code
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    cases = json.load(sys.stdin)
    parallel = int(os.environ.get("RLFLOW_FORKS", "2"))
    import datasets  # noqa: F401 - what every `rlflow run` imports before it can find a mistake
    import mlflow  # noqa: F401
    import transformers  # noqa: F401
    from mlflow.utils import validation  # noqa: F401
    from prefect.server.api import server  # noqa: F401 - (flows.cli shields its temporary server)

    # transformers imports its parts when they are first named: name them here, once, not in every fork
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel  # noqa: F401
    from transformers.models import gpt2, llama, qwen2  # noqa: F401
    from transformers.models.llama import configuration_llama  # noqa: F401

    import flows.cli  # noqa: F401
    import flows.plan  # noqa: F401
    import flows.preflight  # noqa: F401
    import flows.training  # noqa: F401
    import tasks.evaluate  # noqa: F401
    import tasks.scoring.judges  # noqa: F401
    import tasks.sft  # noqa: F401

    results: list[dict | None] = [None] * len(cases)
    running: dict[int, tuple[int, str, str, float]] = {}
    # (a folder no finalizer removes: a process forked inside a case that ends as Python does would run
    # TemporaryDirectory's, removing the other cases' output files; seen: a case's .out file gone)
    tmp, parent = tempfile.mkdtemp(), os.getpid()
    try:
        def reap() -> None:
            pid, status = os.wait()
            i, out, err, start = running.pop(pid)
            results[i] = {"rc": os.waitstatus_to_exitcode(status), "seconds": round(time.monotonic() - start, 2),
                          "stdout": open(out, errors="replace").read(), "stderr": open(err, errors="replace").read()}

        for i, case in enumerate(cases):
            while len(running) >= parallel:
                reap()
            out, err = f"{tmp}/{i}.out", f"{tmp}/{i}.err"
            start = time.monotonic()
            pid = os.fork()
            if pid == 0:
                _child(case["args"], case["cwd"], out, err)
            running[pid] = (i, out, err, start)
        while running:
            reap()
    finally:
        if os.getpid() == parent:
            shutil.rmtree(tmp, ignore_errors=True)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
