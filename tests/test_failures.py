"""Failures that are not the user's (issue 44, items 12 and 13): a stage whose every episode timed out is an
infrastructure fault (EnvironmentsStalled: retried, the environment server started again first), not a user
error; one whose environment's own code raised every time is the user's (one line, exit 2). An evaluation whose
every episode or reward call fails stops the run the same way, and records no held-out score of 0."""

from __future__ import annotations

import pytest

from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.errors import UserError
from tasks.core.store import open_store
from tests.conftest import ROOT, TINY

LETTERS = ROOT / "configs" / "letters.yaml"


def _cfg(tmp_path, *more: str):
    return load_config(LETTERS, [f"store.uri={tmp_path}/store", "env.isolation=thread", "env.timeout_seconds=1",
                                 "generate.prompts_per_iteration=2", "generate.num_generations=2", *more])


def test_every_episode_timing_out_is_an_infrastructure_fault(tmp_path):
    from tasks.envs.runtime.episodes import EnvironmentsStalled
    from tasks.generate import generate

    cfg = _cfg(tmp_path, "env.factory=tests.env_classes:Stalls")
    with pytest.raises(EnvironmentsStalled, match=r"^every episode of iteration 1 timed out \(4 of 4\): the "
                                                  r"environment does not answer within env.timeout_seconds \(1 s\)"):
        generate(cfg, 1, layout.BASE)
    assert not isinstance(EnvironmentsStalled("x"), UserError)
    assert open_store(cfg).manifest(layout.rollouts(cfg.run.name, 1)) is None


def test_every_episode_raising_is_the_users_mistake(tmp_path):
    from tasks.generate import generate

    cfg = _cfg(tmp_path, "env.factory=tests.env_classes:Flaky", 'env.kwargs={mode: raise}')
    with pytest.raises(UserError, match=r"^env.factory: every episode of iteration 1 failed \(4 of 4\), nothing to "
                                        r"train on; the first: step raised ValueError: step blew up"):
        generate(cfg, 1, layout.BASE)


def test_an_evaluation_whose_every_call_fails_records_no_score(tmp_path, monkeypatch):
    from tasks.evaluate import evaluate
    from tests.conftest import user_module

    user_module(tmp_path, monkeypatch, "broken_reward", "def boom(completions, **kw):\n    raise ValueError('no')\n")
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", 'reward.functions=[{"fn": "broken_reward:boom"}]',
                             "eval.every=1"])
    with pytest.raises(UserError, match=r"^reward: every reward call of the evaluation of v000000 failed, no "
                                        r"completion was scored \(nothing to evaluate\); the first: reward function "
                                        r"'boom' raised ValueError: no"):
        evaluate(cfg, 0)
    assert open_store(cfg).manifest(layout.evaluation(cfg.run.name, 0)) is None
    stalled = _cfg(tmp_path, "env.factory=tests.env_classes:Stalls", "eval.every=1", "eval.max_prompts=2",
                   "eval.num_generations=1", "eval.k=1", "eval.split=train")
    from tasks.envs.runtime.episodes import EnvironmentsStalled

    with pytest.raises(EnvironmentsStalled, match=r"^every episode of the evaluation of v000000 timed out"):
        evaluate(stalled, 0)


@pytest.mark.slow
def test_a_stalled_environment_server_is_started_again_before_the_retry(tmp_path, monkeypatch):
    """The flow marks the server after a stalled stage; its next check starts it again (a new process)."""
    from flows.services import EnvServer
    from tasks.core.daemon import answers_http
    from tasks.envs.runtime.server import TOKEN_VAR, URL_VAR

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    for var in (URL_VAR, TOKEN_VAR):
        monkeypatch.delenv(var, raising=False)
    overrides = ["env.where=local", "env.isolation=thread"]
    server = EnvServer(load_config(LETTERS, overrides), str(LETTERS), overrides, None)
    said = []
    try:
        server.services(said.append)
        first = server.proc.pid
        server.stalled = True
        server.services(said.append)
        # (answers with a long timeout: on a loaded machine a new server's first /health may take > 10 s)
        assert server.proc.pid != first and answers_http(f"{server.url}/health", timeout=120)
        assert any("every episode of the last stage timed out" in line for line in said), said
    finally:
        server.stop()
