"""The OpenEnv adapter's and the verifiers 0.4 agent's preflight: what their env.kwargs name (the client and action
classes, the action's field, the reset columns, the taskset) looked for before the run starts, one line naming the
key, instead of a run whose every episode fails after the MLflow run, the store and the lease exist."""

from __future__ import annotations

import pytest

from tasks.core.errors import UserError
from tasks.envs.adapters.openenv_adapter import OpenEnv, OpenEnvError
from tests.conftest import TINY, run_cli
from tests.test_openenv import FACTORY, ROOT, _serve

NOBODY = "http://127.0.0.1:9"            # (nothing answers: what is checked first must say its own line)
openenv = pytest.mark.openenv            # (tests/conftest.py: skipped without .venv-openenv, a failure in CI)
verifiers04 = pytest.mark.verifiers04    # (skipped without .venv-verifiers, a failure in CI)


@pytest.fixture(scope="module")
def game():
    proc, url = _serve()
    yield url
    proc.kill()
    proc.wait()


@openenv
@pytest.mark.parametrize("kwargs, line", [
    ({"client": "nosuchmod:Client"}, r"^env.kwargs.client: importing it raised ModuleNotFoundError: No module named "
                                     r"'nosuchmod'; expected module:Class naming an OpenEnv client class"),
    ({"client": "openenv.core:Action"}, r"^env.kwargs.client: openenv.core:Action is a class without connect, reset, "
                                        r"step"),
    ({"client": "GenericEnvClient"}, r"^env.kwargs.client: 'GenericEnvClient' is not module:Class"),
    ({"action": "nosuchmod:Act"}, r"^env.kwargs.action: importing it raised ModuleNotFoundError: No module named "
                                  r"'nosuchmod'; expected module:Class naming the environment's action class"),
    ({"action": "openenv.core:NoSuchAction"}, r"^env.kwargs.action: module 'openenv.core' has no 'NoSuchAction'"),
    ({"reset_columns": "seed"}, r"^env.kwargs.reset_columns: expected a list of the data's column names, e.g. "
                                r"\[seed\]; got 'seed'"),
    ({"reset_columns": [1]}, r"^env.kwargs.reset_columns: expected a list"),
])
def test_the_classes_and_columns_env_kwargs_name_are_checked_before_the_server(kwargs, line):
    """They were looked for only by each episode's reset (a run of failed episodes, then exit 2 naming none of
    them); a string of reset columns became its letters."""
    with pytest.raises(UserError, match=line):
        OpenEnv.preflight(base_url=NOBODY, **kwargs)


@openenv
def test_an_action_field_the_action_lacks_is_refused_with_its_fields(game, monkeypatch):
    """The server's own schema (GET /schema) when env.kwargs.action is not given, else the action class's; the
    step that would send it says the key too."""
    with pytest.raises(UserError, match=r"^env.kwargs.action_field: 'guess' is not a field of the server's action "
                                        r"\(http://127.0.0.1:\d+/schema\), which has \['message', 'metadata'\]"):
        OpenEnv.preflight(base_url=game, action_field="guess")
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    with pytest.raises(UserError, match=r"^env.kwargs.action_field: 'guess' is not a field of env.kwargs.action "
                                        r"openenv_game:GuessAction, which has \['message', 'metadata'\]"):
        OpenEnv.preflight(base_url=game, action="openenv_game:GuessAction", action_field="guess")
    OpenEnv.preflight(base_url=game, action="openenv_game:GuessAction")          # (what is right passes)
    env = OpenEnv(base_url=game, action_field="guess")
    try:
        env.reset({"prompt": "Guess.", "seed": 1})
        with pytest.raises(OpenEnvError, match=r"VALIDATION_ERROR.*env.kwargs.action_field"):
            env.step({"role": "assistant", "content": "3"})
    finally:
        env.close()


@openenv
def test_a_reset_column_the_data_lacks_is_the_configs_mistake():
    """Preflight is not given the data: the first row read says it (a UserError: the run's one line, exit 2)
    instead of the column left out of every reset. The default (seed) is passed where a row has it."""
    env = OpenEnv(base_url=NOBODY, reset_columns=["level"])
    with pytest.raises(UserError, match=r"^env.kwargs.reset_columns: 'level' is not a column of the data \(its rows "
                                        r"have \['prompt', 'seed'\]\)"):
        env.reset({"prompt": "Guess.", "seed": 1})


@openenv
def test_a_client_that_is_not_there_is_one_line_exit_2_and_nothing_written(prefect_api, tmp_path):
    out = run_cli(["run", str(TINY), "-o", f"env.factory={FACTORY}", "-o",
                   f'env.kwargs={{"base_url": "{NOBODY}", "client": "nosuchmod:Client"}}'], tmp_path, prefect_api)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("error: env.kwargs.client: importing it raised ModuleNotFoundError"), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())


@verifiers04
def test_a_taskset_verifiers_cannot_find_is_named_before_the_run():
    """verifiers resolved env.kwargs.env only in each episode (a run of failed episodes); the agent's check asks
    the bridge (op check: the taskset's class imported, the config validated, nothing loaded) once."""
    from tasks.envs.adapters.verifiers_v04 import check
    from tests.test_verifiers_v04 import ENVS, SUBPROCESS, SUMS

    with pytest.raises(UserError, match=r"^env.kwargs.env.taskset.id: 'nosuch_taskset': ModuleNotFoundError: taskset "
                                        r"'nosuch_taskset' not found"):
        check(env={"taskset": {"id": "nosuch_taskset"}, "agent": SUBPROCESS}, path=[ENVS])
    check(env=SUMS, path=[ENVS])                                               # (a taskset that is there passes)


@openenv
def test_a_preflight_that_passed_is_not_probed_again_in_the_process(game, monkeypatch):
    """run_episodes calls the factory's preflight at every rollout and evaluation: the probe (a process importing
    openenv and the user's modules, up to 60 s) and GET /schema ran each time. Once passed, they are not again;
    the server is still asked whether it answers (a server gone is one line)."""
    from tasks.envs.adapters import openenv_adapter

    probes, schemas = [], []
    real_run, real_schema = openenv_adapter.run, openenv_adapter._server_schema
    monkeypatch.setattr(openenv_adapter, "_CHECKED", set(), raising=False)
    monkeypatch.setattr(openenv_adapter, "run", lambda argv, **kw: probes.append(argv) or real_run(argv, **kw))
    monkeypatch.setattr(openenv_adapter, "_server_schema", lambda url: schemas.append(url) or real_schema(url))
    for _ in range(3):
        OpenEnv.preflight(base_url=game, reset_columns=["seed"])
    assert len(probes) == 1 and "--probe" in probes[0] and len(schemas) == 1, (probes, schemas)
    with pytest.raises(UserError, match=r"^env.kwargs.action_field: 'guess' is not a field"):     # (other kwargs:
        OpenEnv.preflight(base_url=game, action_field="guess", reset_columns=["seed"])            # looked for)
    assert len(probes) == 2
    with pytest.raises(UserError, match=r"^env.kwargs.base_url: no OpenEnv server answers at http://127.0.0.1:9"):
        OpenEnv.preflight(base_url=NOBODY)


@openenv
def test_a_client_module_that_exits_as_it_is_imported_is_named(tmp_path, monkeypatch):
    """A sys.exit in the user's module escaped the probe's `except Exception`: the probe's process exited 1 with
    nothing said, which read as 'has no openenv-core'."""
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(1)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(UserError) as e:
        OpenEnv.preflight(base_url=NOBODY, client="exits_on_import:Client")
    assert str(e.value).startswith("env.kwargs.client: importing it raised SystemExit: 1; expected module:Class "
                                   "naming an OpenEnv client class"), str(e.value)
    with pytest.raises(UserError, match=r"^env.kwargs.action: importing it raised SystemExit: 1; "):
        OpenEnv.preflight(base_url=NOBODY, action="exits_on_import:Act")


@openenv
def test_a_reset_column_the_data_lacks_is_one_line_before_the_run(game, prefect_api, tmp_path):
    """The column was looked for at the first episode's reset only: after the MLflow run, the store and the lease
    (and in an environment server's process). Preflight gives the factory's check_row each split's first row."""
    out = run_cli(["run", str(TINY), "-o", f"env.factory={FACTORY}", "-o",
                   f'env.kwargs={{"base_url": "{game}", "reset_columns": ["answer", "level"]}}'], tmp_path, prefect_api)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("error: env.kwargs.reset_columns: 'level' is not a column of the training data (its "
                               "rows have ["), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())


@openenv
def test_a_client_module_that_ends_its_process_as_it_is_imported_is_named_not_openenv_missing(tmp_path, monkeypatch):
    """An os._exit(1) as the user's module was imported ended the probe with no answer and exit 1, which read as
    'has no openenv-core' (the probe's own exit code for that is now one of its own)."""
    (tmp_path / "ends_on_import.py").write_text("import os\nos._exit(1)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(UserError, match=r"^env.kwargs.client: importing ends_on_import:Client in .* ended its "
                                        r"process \(exit 1\) before an answer"):
        OpenEnv.preflight(base_url=NOBODY, client="ends_on_import:Client")
