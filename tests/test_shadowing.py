"""A user's own `tasks` or `flows` package in the working directory never shadows rlflow's: every child Python
rlflow starts with `-m tasks...` / `-m flows...` gets PYTHONSAFEPATH=1 and rlflow's root first on PYTHONPATH
(tasks/core/process_wide.py), so `python -m` does not put the working directory first on its path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY


def _shadowing(folder: Path) -> Path:
    """`folder` with a `tasks` and a `flows` package of the user's that leave a mark and fail when imported."""
    for name in ("tasks", "flows"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(
            f"open({str(folder / 'IMPORTED')!r}, 'a').write({name!r} + '\\n')\n"
            f"raise RuntimeError('the working directory\\'s {name} package was imported, not rlflow\\'s')\n")
    return folder / "IMPORTED"


def test_a_child_gets_rlflows_root_first_and_no_working_directory(tmp_path, monkeypatch):
    from tasks.core.process_wide import children_import_rlflow, rlflow_first

    mark = _shadowing(tmp_path)
    env = rlflow_first({**os.environ, "PYTHONPATH": f"/elsewhere{os.pathsep}{ROOT}"})
    assert env["PYTHONSAFEPATH"] == "1" and env["PYTHONPATH"] == f"{ROOT}{os.pathsep}/elsewhere"
    code = "import tasks, flows; print(tasks.__file__); print(flows.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(ROOT / "tasks" / "__init__.py"), str(ROOT / "flows" / "__init__.py")]
    assert not mark.exists()
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    with children_import_rlflow():                     # a flow run: its children inherit it ...
        assert os.environ["PYTHONSAFEPATH"] == "1" and os.environ["PYTHONPATH"].startswith(str(ROOT))
    assert "PYTHONSAFEPATH" not in os.environ and os.environ["PYTHONPATH"] == "/elsewhere"   # ... and no more


@pytest.mark.slow
def test_rlflow_run_from_a_folder_with_its_own_tasks_and_flows(tmp_path, prefect_api):
    """`rlflow run` of the demo from there: the reward worker (`-m tasks.scoring.worker`), the train stage as its
    recipe's subprocess (`python -m tasks.train`, the local launcher) and the resident trainer it starts
    (`-m tasks.engines.resident`) all import rlflow's packages."""
    work = tmp_path / "project"
    mark = _shadowing(work)
    rlflow = Path(sys.executable).with_name("rlflow")
    argv = [str(rlflow)] if rlflow.exists() else [sys.executable, "-P", "-m", "flows.cli"]
    overrides = [f"store.uri={tmp_path}/store", "run.iterations=2", "eval.every=0", "train.mode=resident",
                 "launcher.stages={train: local}", f"launcher.recipes={ROOT / 'sky'}",
                 f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.sample_completions=0"]
    env = {**os.environ, "PREFECT_API_URL": prefect_api,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([*argv, "run", str(TINY), *[a for o in overrides for a in ("-o", o)],
                           "--summary-json", str(tmp_path / "s.json")], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert not mark.exists(), mark.read_text()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "s.json").read_text())["iterations_completed"] == 2
