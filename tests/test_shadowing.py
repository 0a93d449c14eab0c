"""A user's own `tasks` or `flows` package in the working directory never shadows rlflow's: every child Python
rlflow starts with `-m tasks...` / `-m flows...` gets PYTHONSAFEPATH=1 and rlflow's root first on PYTHONPATH
(tasks/core/process_wide.py), so `python -m` does not put the working directory first on its path. And only
those children: the child drops it as it starts (tasks/__init__.py), so what user code starts there, or in the
flow's own process, is a Python like any other (`python script.py` has its folder first on its path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import AT_LENGTH, ROOT, TINY


def _shadowing(folder: Path) -> Path:
    """`folder` with a `tasks` and a `flows` package of the user's that leave a mark and fail when imported."""
    for name in ("tasks", "flows"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(
            f"open({str(folder / 'IMPORTED')!r}, 'a').write({name!r} + '\\n')\n"
            f"raise RuntimeError('the working directory\\'s {name} package was imported, not rlflow\\'s')\n")
    return folder / "IMPORTED"


def test_a_child_gets_rlflows_root_first_and_no_working_directory(tmp_path, monkeypatch):
    from tasks.core.processes import children_import_rlflow, rlflow_first, runs_rlflow

    assert runs_rlflow([sys.executable, "-m", "tasks.train"]) and runs_rlflow([sys.executable, "-c", "import sys; "
                                                                                "from flows.cli import main"])
    assert not runs_rlflow([sys.executable, "-c", "import importlib.util"]) and not runs_rlflow(["python", "x.py"])
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


@AT_LENGTH
@pytest.mark.slow
def test_rlflow_run_from_a_folder_with_its_own_tasks_and_flows(tmp_path, prefect_api):
    """`rlflow run` of the demo from there: the reward worker (`-m tasks.scoring.worker`), the train stage as its
    recipe's subprocess (`python -m tasks.train`, the local launcher) and the resident trainer it starts
    (`-m tasks.engines.trainer_server`) all import rlflow's packages."""
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


def _script_with_sibling(folder: Path) -> Path:
    """`folder/tool/script.py`, which imports its sibling module: what a user's `python script.py` expects."""
    (folder / "tool").mkdir(parents=True)
    (folder / "tool" / "sibling.py").write_text("NAME = 'sibling'\n")
    (folder / "tool" / "script.py").write_text("import sibling\nprint(sibling.NAME)\n")
    return folder / "tool" / "script.py"


def test_what_an_rlflow_child_starts_does_not_inherit_the_safe_path(tmp_path, monkeypatch):
    """A child started with rlflow_first drops the variables as it imports rlflow (the marker says they are
    rlflow's); a `python script.py` it starts then finds the script's sibling. A user's own PYTHONSAFEPATH (no
    marker) is theirs: kept, in os.environ and in what rlflow_first makes."""
    from tasks.core.processes import SAFEPATH_MARK, rlflow_first

    script = _script_with_sibling(tmp_path)
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    monkeypatch.delenv(SAFEPATH_MARK, raising=False)
    env = rlflow_first(os.environ)
    assert env["PYTHONSAFEPATH"] == "1" and env[SAFEPATH_MARK] == "1"
    code = ("import os, subprocess, sys, tasks; "
            "print(os.environ.get('PYTHONSAFEPATH'), os.environ.get('RLFLOW_SAFEPATH')); sys.stdout.flush(); "
            f"sys.exit(subprocess.run([sys.executable, {str(script)!r}]).returncode)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["None", "None", "sibling"]

    own = {**os.environ, "PYTHONSAFEPATH": "1"}                 # the user's own: no marker
    assert SAFEPATH_MARK not in rlflow_first(own)
    out = subprocess.run([sys.executable, "-c", "import os, tasks; print(os.environ.get('PYTHONSAFEPATH'))"],
                         cwd=tmp_path, env=rlflow_first(own), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["1"], out.stderr[-2000:]


USER_CODE = {
    "userspawn.py": """
import json, os, subprocess, sys


def spawn(when):
    ran = subprocess.run([sys.executable, {script!r}], capture_output=True, text=True)
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"argv0": sys.argv[0], "when": when, "code": ran.returncode, "out": ran.stdout.strip(),
                            "safepath": os.environ.get("PYTHONSAFEPATH")}}) + "\\n")
""",
    "userreward.py": """
from userspawn import spawn

spawn("import")


def zero(completions, **kwargs):
    spawn("call")
    return [0.0] * len(completions)
""",
    "userenv.py": """
from tasks.envs.builtin.games import SayTheLetters
from userspawn import spawn

_made = []


def make(**kwargs):
    if not _made:
        _made.append(spawn("factory"))
    return SayTheLetters(**kwargs)
"""}


FORKSERVER = """
from tasks.core.config import load_config
from tasks.envs.runtime.episodes import environments

if __name__ == "__main__":
    cfg = load_config({config!r}, ["env.factory=userenv:make", "env.isolation=process"])
    environments(cfg)({{"prompt": "Say each letter I name.", "letters": "abc"}}).close()
"""


def test_an_environments_forkserver_imports_rlflow_and_its_episodes_start_python_as_anywhere_else(tmp_path):
    """env.isolation process from a process without the safe path (the flow's: `rlflow`'s script is not run from
    the working directory): the forkserver, started with this process's environment, imports rlflow's tasks, not
    the working directory's; the episode it forks makes the user's environment, whose `python script.py` has the
    script's folder first on its path and no PYTHONSAFEPATH."""
    out, spawned = _driven_from_a_shadowing_folder(tmp_path, FORKSERVER)
    assert [(s["when"], s["code"], s["out"], s["safepath"]) for s in spawned] == [("factory", 0, "sibling", None)]


def _driven_from_a_shadowing_folder(tmp_path: Path, driver_text: str) -> tuple[subprocess.CompletedProcess, list]:
    """`driver_text` (letters.yaml's environment from the user's userenv) run by path, as `rlflow` is (no -P, no
    working directory on its path), from a folder with its own `tasks` and `flows`: none of them imported, exit 0;
    its output and what the user's code started."""
    work = tmp_path / "project"
    mark = _shadowing(work)
    script, log = _script_with_sibling(tmp_path / "user"), tmp_path / "spawned.jsonl"
    for name in ("userspawn.py", "userenv.py"):
        (work / name).write_text(USER_CODE[name].format(script=str(script), log=str(log)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("PYTHONSAFEPATH", None)
    driver = tmp_path / "driver" / "flow.py"
    driver.parent.mkdir()
    driver.write_text(driver_text.format(config=str(ROOT / "configs" / "letters.yaml")))
    out = subprocess.run([sys.executable, str(driver)], cwd=work, env=env, capture_output=True, text=True,
                         timeout=120)
    assert not mark.exists(), mark.read_text()
    assert out.returncode == 0, out.stderr[-3000:]
    return out, [json.loads(line) for line in log.read_text().splitlines()]


FORKSERVER_ENDED = """
import os
import signal
from multiprocessing import forkserver

from tasks.core.config import load_config
from tasks.envs.runtime.episodes import environments

if __name__ == "__main__":
    cfg = load_config({config!r}, ["env.factory=userenv:make", "env.isolation=process"])
    make, row = environments(cfg), {{"prompt": "Say each letter I name.", "letters": "abc"}}
    make(row).close()
    first = forkserver._forkserver._forkserver_pid
    os.kill(first, signal.SIGKILL)
    os.waitid(os.P_PID, first, os.WEXITED | os.WNOWAIT)       # (until it has ended; left for multiprocessing to reap)
    make(row).close()
    assert forkserver._forkserver._forkserver_pid != first
"""


def test_a_forkserver_that_ended_starts_again_importing_rlflow(tmp_path):
    """The environments' forkserver killed between two episodes (the OOM killer, a stray kill): the next episode
    starts it again the way the first was started, where multiprocessing's own restart would put the working
    directory first on its path and import the user's `tasks` package."""
    out, spawned = _driven_from_a_shadowing_folder(tmp_path, FORKSERVER_ENDED)
    assert "the environments' forkserver had ended: starting it again" in out.stderr
    assert [(s["when"], s["code"], s["out"]) for s in spawned] == [("factory", 0, "sibling")] * 2


SPAWNED_BY_USER_CODE = """
import multiprocessing
import sys

from tasks.core.paths import import_user


def where_tasks_is():
    import tasks
    return tasks.__file__


if __name__ == "__main__":
    sys.path.insert(0, "")                                  # (as `python -c` has it: the working directory by name)
    assert import_user("usermod:make", "env.factory")() == "made"     # (found in the working directory)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print(pool.apply(where_tasks_is))
"""


def test_a_process_user_code_spawns_imports_rlflows_tasks(tmp_path):
    """User code in rlflow's process (an environment factory, a reward function) that starts a multiprocessing
    pool by spawn: its child copies the parent's sys.path and runs the main module (`rlflow`) again, importing
    rlflow's packages. The working directory, where rlflow finds user modules, is on that path behind rlflow's
    root, so a user's `tasks` package there is not what the child imports."""
    work = tmp_path / "project"
    mark = _shadowing(work)
    (work / "usermod.py").write_text("def make():\n    return 'made'\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}   # (as `rlflow` runs)
    driver = tmp_path / "driver" / "flow.py"
    driver.parent.mkdir()
    driver.write_text(SPAWNED_BY_USER_CODE)
    out = subprocess.run([sys.executable, str(driver)], cwd=work, env=env, capture_output=True, text=True,
                         timeout=120)
    assert not mark.exists(), mark.read_text()
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(ROOT / "tasks" / "__init__.py")]


@AT_LENGTH
@pytest.mark.slow
def test_user_code_starts_python_scripts_as_anywhere_else(tmp_path, prefect_api):
    """User code that runs `python script.py` (its folder holds a sibling module the script imports): an
    environment factory called in the flow's own process (inline generate, env.isolation thread), a reward module
    imported in a local reward stage's process and its function called in that stage's reward worker. In each
    the script's folder is first on the script's path, and the process has no PYTHONSAFEPATH of rlflow's."""
    work = tmp_path / "project"
    work.mkdir()
    script, log = _script_with_sibling(tmp_path / "user"), tmp_path / "spawned.jsonl"
    for name, text in USER_CODE.items():
        (work / name).write_text(text.format(script=str(script), log=str(log)))
    rlflow = Path(sys.executable).with_name("rlflow")
    argv = [str(rlflow)] if rlflow.exists() else [sys.executable, "-P", "-m", "flows.cli"]
    overrides = [f"store.uri={tmp_path}/store", "run.iterations=1", "eval.every=0", "env.factory=userenv:make",
                 "reward.functions=[{fn: 'userreward:zero', weight: 1.0}]", "generate.prompts_per_iteration=2",
                 "generate.num_generations=2", "launcher.stages={reward: local}", f"launcher.recipes={ROOT / 'sky'}",
                 f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.sample_completions=0"]
    env = {**os.environ, "PREFECT_API_URL": prefect_api,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("PYTHONSAFEPATH", None)
    proc = subprocess.run([*argv, "run", str(ROOT / "configs" / "letters.yaml"),
                           *[a for o in overrides for a in ("-o", o)]], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spawned = [json.loads(line) for line in log.read_text().splitlines()]
    flow = "rlflow" if rlflow.exists() else "cli.py"
    assert {(flow, "factory"), ("reward.py", "import"), ("worker.py", "call")} <= {
        (Path(s["argv0"]).name, s["when"]) for s in spawned}, spawned
    assert all(s["code"] == 0 and s["out"] == "sibling" and s["safepath"] is None for s in spawned), spawned


@pytest.mark.slow
def test_replicas_a_pool_and_a_judge_started_from_a_folder_with_its_own_tasks(tmp_path, monkeypatch):
    """The services' processes (the generate router and its replicas, an environment pool's servers and its front,
    a judge server) import rlflow's packages when started from a folder whose own tasks/ and flows/ would break
    them: every one goes through tasks/core/processes.py: spawn (issue 41: the router and its replicas did not)."""
    from flows.services import EnvServer, JudgeServers
    from tasks.core import builtin_models
    from tasks.core.config import load_config
    from tasks.core.models import pin_of
    from tasks.engines.sampling import sampling_engine
    from tasks.envs.runtime.server import TOKEN_VAR, URL_VAR
    from tasks.generate import generate

    work = tmp_path / "project"
    mark = _shadowing(work)
    monkeypatch.chdir(work)
    for var in (URL_VAR, TOKEN_VAR):
        monkeypatch.delenv(var, raising=False)
    replicas = load_config(TINY, ["generate.replicas=2", f"store.uri={tmp_path}/store", "generate.batch_size=4",
                                  "generate.replica_threads=1", "run.name=shadow"])
    try:
        assert generate(replicas, 1)["metrics"]["generate/router/new"] == 4
    finally:
        sampling_engine(replicas).stop(lambda _line: None)
    letters = ROOT / "configs" / "letters.yaml"
    pool_overrides = ["env.where=local", "env.servers=2", "env.isolation=thread"]
    pool = EnvServer(load_config(letters, pool_overrides), str(letters), pool_overrides, None)
    try:
        assert pool.services(lambda _line: None).env_url.startswith("http://127.0.0.1:")
        assert all(m["url"] for m in pool.members)
    finally:
        pool.stop()
    judge = {"name": "j", "kind": "judge", "model": "builtin:tiny-lm", "where": "local", "max_tokens": 2,
             "sha256": pin_of(builtin_models.resolve("builtin:tiny-lm")), "template": "{prompt} {completion}?"}
    judged = load_config(TINY, [f"reward.models={json.dumps([judge])}"])
    servers = JudgeServers(judged, str(TINY), [f"reward.models={json.dumps([judge])}"], None)
    try:
        assert set(servers.services(lambda _line: None).judges) == {"j"}
    finally:
        servers.stop()
    assert not mark.exists(), mark.read_text()


def test_the_sky_bridge_imports_rlflows_tasks_before_a_users_on_pythonpath(tmp_path):
    """flows/sky_bridge.py runs by path in SkyPilot's environment, which does not have rlflow installed: it puts
    the checkout first while it imports rlflow's `tasks` (a user's on PYTHONPATH came first), then off the path's
    front, where the checkout's sky/ folder would shadow SkyPilot's `sky`."""
    sky_python = ROOT / ".venv-sky" / "bin" / "python"
    if not sky_python.exists():
        pytest.skip("no .venv-sky (make setup builds it)")
    mark = _shadowing(tmp_path / "user")
    bridge = ROOT / "flows" / "sky_bridge.py"           # (its --help, then what the path it left imports)
    code = (f"import runpy, sys\nsys.argv = [{str(bridge)!r}, '--help']\n"
            f"try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
            f"import sky, tasks\nprint(tasks.__file__)\nprint('sky' if hasattr(sky, 'launch') else sky.__path__)")
    out = subprocess.run([str(sky_python), "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "user")})
    assert not mark.exists(), mark.read_text()
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == [str(ROOT / "tasks" / "__init__.py"), "sky"]
