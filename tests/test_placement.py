"""Placement computed once from the config, and a stage's context (Services) handed as an argument: the flow never
puts a stage's servers in its own environment (tasks/core/placement.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tasks.core.config import load_config
from tasks.core.contracts import Rollout
from tasks.core.errors import UserError
from tasks.core.placement import ENV_URL_VAR, JUDGES_VAR, REPLICA_LAUNCH_VAR, Services, placement_of
from tasks.envs.runtime.server import server_of

ROOT = Path(__file__).resolve().parents[1]
TINY, LETTERS = ROOT / "configs" / "tiny.yaml", ROOT / "configs" / "letters.yaml"


def test_the_defaults_run_every_stage_inline_with_no_service():
    p = placement_of(load_config(TINY))
    assert set(p.stages) == {"generate", "reward", "train", "publish", "evaluate"}
    assert all(p.where(s) == "inline" and not p.launched(s) and not p.routes(s) for s in p.stages)
    assert (p.replicas, p.replicas_where, p.env, p.judges, p.on_sky()) == (0, "none", "none", {}, [])


def test_where_each_stage_and_service_runs():
    p = placement_of(load_config(TINY, ["launcher.where=local", "launcher.stages={train: sky}",
                                        "generate.replicas=2"]))
    assert (p.where("reward"), p.where("train")) == ("local", "sky")
    assert p.routes("generate") and p.routes("evaluate") and not p.launched("generate")   # the replicas sample
    assert p.launched("reward") and p.launched("train") and p.on_sky() == ["train"]
    assert (p.replicas, p.replicas_where) == (2, "local")
    on_sky = placement_of(load_config(TINY, ["launcher.stages={generate: sky}", "generate.replicas=3"]))
    assert on_sky.replicas_where == "sky" and on_sky.on_sky() == []     # (routed: its replicas are the clusters)


@pytest.mark.parametrize(("overrides", "env", "servers"), [
    ([], "stage", 1),
    (["env.where=local", "env.servers=3"], "local", 3),
    (["env.where=sky"], "sky", 1),
    (["env.where=http://127.0.0.1:9"], "yours", 1),
])
def test_the_environment_server(overrides, env, servers):
    p = placement_of(load_config(LETTERS, overrides))
    assert (p.env, p.env_servers) == (env, servers)


def test_one_word_per_idea_and_the_old_keys_read_with_a_line(tmp_path, capsys, monkeypatch):
    """Issue 41: where something runs is `where` (launcher.where, env.where, reward.models[].where; a service at an
    http(s):// URL is yours), how long an engine lives is `mode` (train.mode and generate.mode: process |
    resident). The keys before (launcher.mode, env.server_url, reward.models[].url, generate.mode offline |
    server) are read as the new ones with one line each, give the same config and the same fingerprints; both
    spellings at once are refused; a where that is neither a place nor a URL is one line."""
    from tasks.core import config_base

    monkeypatch.setattr(config_base, "_SAID", set())
    judge = {"name": "j", "kind": "judge", "model": "m", "template": "{completion}"}
    old_tree = {"launcher": {"mode": "local"}, "env": {"server_url": "http://127.0.0.1:9"},
                "generate": {"engine": "vllm", "mode": "server"},
                "reward": {"models": [{**judge, "url": "http://127.0.0.1:8"}]}}
    new_tree = {"launcher": {"where": "local"}, "env": {"where": "http://127.0.0.1:9"},
                "generate": {"engine": "vllm", "mode": "resident"},
                "reward": {"models": [{**judge, "where": "http://127.0.0.1:8"}]}}
    capsys.readouterr()
    old = load_config(LETTERS, base_overrides(old_tree))
    said = capsys.readouterr().err
    new = load_config(LETTERS, base_overrides(new_tree))
    assert capsys.readouterr().err == ""
    assert old == new and new.launcher.where == "local" and new.env.url == "http://127.0.0.1:9"
    assert new.reward.models[0].url == "http://127.0.0.1:8" and new.generate.mode == "resident"
    for line in ("launcher.mode is now launcher.where", "env.server_url is now env.where",
                 "reward.models[].url is now reward.models[].where", "generate.mode server is now generate.mode "
                 "resident"):
        assert f"warning: config: {line}" in said
    p = placement_of(new)
    assert (p.where("train"), p.env, p.judges) == ("local", "yours", {"j": "yours"})
    sections = ("generate", "env", "reward", "launcher")
    assert old.section_values(*sections) == new.section_values(*sections)
    # generate.mode is fingerprinted with the names runs stored before the rename wrote
    assert new.section_values("generate")["generate"]["mode"] == "server"
    assert load_config(TINY).section_values("generate")["generate"]["mode"] == "offline"
    with pytest.raises(UserError, match="launcher: mode is now where; give where alone"):
        load_config(TINY, ["launcher.mode=local", "launcher.where=sky"])
    with pytest.raises(UserError, match="env.where: expected stage, local, sky, or the http.*got \"elsewhere\""):
        load_config(LETTERS, ["env.where=elsewhere"])
    with pytest.raises(UserError, match=r"reward.models.0.where: expected stage, local, sky"):
        load_config(LETTERS, base_overrides({"reward": {"models": [{**judge, "where": "elsewhere"}]}}))


def base_overrides(tree: dict) -> list[str]:
    return [f"{section}.{key}={json.dumps(value)}" for section, keys in tree.items() for key, value in keys.items()]


def test_a_stage_context_crosses_a_process_boundary_as_variables_and_back():
    services = Services(env_url="http://127.0.0.1:1", env_token="t", judges={"j": "http://127.0.0.1:2"},
                        judge_token="k", replica_launch={"start": ["x", "{i}"], "port_base": 8340})
    variables = services.variables()
    assert json.loads(variables[JUDGES_VAR]) == {"j": "http://127.0.0.1:2"}
    assert json.loads(variables[REPLICA_LAUNCH_VAR])["port_base"] == 8340
    assert Services.from_environment(variables) == services
    assert Services().variables() == {} and Services.from_environment({}) == Services()
    merged = Services(env_url="http://a") | Services(judges={"j": "http://b"}, judge_token="k")
    assert (merged.env_url, dict(merged.judges), merged.judge_token) == ("http://a", {"j": "http://b"}, "k")


def test_an_inline_stage_uses_its_argument_not_the_process_environment(monkeypatch):
    """Two inline stages of one process (run.max_staleness: the look-ahead threads) each see their own servers;
    the process's environment, what a stage process is given, is read only when no context is passed."""
    cfg = load_config(LETTERS, ["env.where=local"])
    monkeypatch.setenv(ENV_URL_VAR, "http://127.0.0.1:7")
    seen = {}

    def stage(name: str, url: str) -> None:
        seen[name] = server_of(cfg, Services(env_url=url, env_token=name))

    threads = [threading.Thread(target=stage, args=(n, f"http://127.0.0.1:{p}/")) for n, p in (("a", 1), ("b", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": ("http://127.0.0.1:1", "a"), "b": ("http://127.0.0.1:2", "b")}
    assert server_of(cfg) == ("http://127.0.0.1:7", "")             # no context: a stage process's variables
    monkeypatch.delenv(ENV_URL_VAR)
    with pytest.raises(UserError, match="no environment server given"):
        server_of(cfg, Services())


# ------------------------------------------------------------------------------------------------ episode sources

def _failed(error: str | None) -> Rollout:
    return Rollout(group=0, row=0, prompt="p", prompt_ids=[1], completion="", completion_ids=[], logprobs=[],
                   truncated=False, env_error=error)


def test_the_source_is_chosen_once_from_the_config():
    from tasks.envs.runtime.sources import Agents, Environments, Prompts, source_of

    assert isinstance(source_of(load_config(TINY)), Prompts)
    assert isinstance(source_of(load_config(LETTERS)), Environments)
    assert isinstance(source_of(load_config(ROOT / "configs" / "agent.yaml")), Agents)


def test_only_episodes_can_all_fail_and_the_line_names_their_source():
    """Prompts never fail as a whole (a completion has no error); environments' and agents' stages stop with one
    line naming env.factory / env.agent when every episode failed, and go on when one did not."""
    from tasks.envs.runtime.sources import Agents, Environments, Prompts

    failed = [_failed("step raised ValueError: no"), _failed("reset raised KeyError: x")]
    Prompts().require_some(load_config(TINY), failed, "iteration 1")
    Environments().require_some(load_config(LETTERS), [*failed, _failed(None)], "iteration 1")
    with pytest.raises(UserError, match=r"^env\.factory: every episode of iteration 1 failed \(2 of 2\)"):
        Environments().require_some(load_config(LETTERS), failed, "iteration 1")
    with pytest.raises(UserError, match=r"^env\.agent: every episode of iteration 1 failed"):
        Agents().require_some(load_config(ROOT / "configs" / "agent.yaml"), failed, "iteration 1")


def test_reward_functions_without_reward_models_never_import_the_judges():
    """The reward loader enters tasks/scoring/judges.py only when reward.models has models (a default iteration
    does not call into it): checked in a fresh interpreter, where nothing imported it before."""
    code = ("import sys; from tasks.core.config import load_config; from tasks.scoring.functions import "
            f"load_functions; load_functions(load_config({str(TINY)!r})); "
            "print('tasks.scoring.judges' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
