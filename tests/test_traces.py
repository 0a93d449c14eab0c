"""Episodes as MLflow traces (tasks/core/traces.py): the span tree of a letters-game episode and of an agent's
episode (its calls merged into one sample, and split step-wise) against the rollout record it came from, then
written to an MLflow server and read back through MLflow's own client. The flow's side (which records, the samples
table's links, the console's link, the Traces tab in a browser) is in tests/test_ui.py."""

from __future__ import annotations

import pytest

from tasks.core import layout, rollout
from tasks.core.config import load_config
from tasks.core.contracts import Rollout
from tasks.core.store import open_store
from tasks.core.traces import _runs, episode_tree, log_trees, sample_rows, trace_to
from tests.test_envs import LETTERS


def _check(r: Rollout, tree: dict) -> None:
    """The tree says what the record says: one model call per assistant turn, its reply and its tokens; the
    environment's answer to each in order, with that step's reward; the rewards as assessments."""
    said = [m for m in r.turns if m["role"] == "assistant"]
    calls = [s for s in tree["spans"] if s["span_type"] == "LLM"]
    steps = [s for s in tree["spans"] if s["span_type"] != "LLM"]
    assert [s["outputs"] for s in calls] == said
    assert sum(s["attributes"]["completion_tokens"] for s in calls) == sum(r.mask)         # tokens equal
    assert [s["attributes"]["turn"] for s in calls] == list(range(1, len(said) + 1))
    first = next((i for i, m in enumerate(r.turns) if m["role"] == "assistant"), len(r.turns))
    assert [m for s in steps for m in s["outputs"]["observation"]] == [
        m for m in r.turns[first:] if m["role"] != "assistant"]
    if calls:                          # (what came before the first reply: the first call's input, after the prompt)
        assert calls[0]["inputs"]["messages"] == (r.prompt or []) + r.turns[:first]
    assert [s["attributes"]["reward"] for s in steps] == (r.turn_rewards or [None] * len(steps))[:len(steps)]
    mean = [s["attributes"]["mean_logprob"] for s in calls]
    k = 0
    for (start, end), m in zip(_runs(r.mask), mean):                  # each call's logprobs: its own tokens'
        assert m == pytest.approx(sum(r.logprobs[start:end]) / (end - start))
        k += 1
    assert k == len(calls)
    want = {name: v for name, v in r.rewards.items() if v is not None} | {"reward": r.reward}
    if r.env_return is not None:
        want["env_return"] = r.env_return
    assert tree["assessments"] == want
    assert tree["inputs"]["prompt"] == r.prompt and tree["attributes"]["part"] == r.part


def _read_back(mlflow_server: str, trees: list[dict], tag: str) -> list:
    """Log the trees as traces of a new run; MLflow's client reads them back, in the same order."""
    import mlflow
    from mlflow import MlflowClient

    trace_to(mlflow_server)
    client = MlflowClient(mlflow_server)
    exp = client.create_experiment(f"traces-{tag}")
    run = client.create_run(exp).info.run_id
    ids = log_trees(client, exp, run, trees, {"rlflow.split": "train", "rlflow.iteration": "1"})
    mlflow.flush_trace_async_logging()
    got = {t.info.trace_id: t for t in client.search_traces(locations=[exp], run_id=run, max_results=100)}
    assert set(got) == set(ids)
    return [got[i] for i in ids]


def _compare(trace, tree: dict) -> None:
    """A trace read back from the server holds the tree: its spans (names, types, outputs), its assessments,
    its tags, linked to the run."""
    spans = sorted(trace.data.spans, key=lambda s: s.start_time_ns)
    root, children = spans[0], spans[1:]
    assert root.name == tree["name"] and root.parent_id is None
    assert [(s.name, s.span_type) for s in children] == [(s["name"], s["span_type"]) for s in tree["spans"]]
    assert [s.outputs for s in children] == [s["outputs"] for s in tree["spans"]]
    assert {a.name: a.value for a in trace.info.assessments} == pytest.approx(tree["assessments"])
    assert trace.info.tags["rlflow.split"] == "train" and trace.info.trace_metadata["mlflow.sourceRun"]


@pytest.mark.slow
def test_a_letters_episode_is_a_trace_of_its_turns(tmp_path, mlflow_server):
    from tasks.generate import generate
    from tasks.reward import reward

    cfg = load_config(LETTERS, [f"store.uri={tmp_path}/store", "generate.prompts_per_iteration=2",
                                "generate.num_generations=2"])
    generate(cfg, 1)
    reward(cfg, 1)
    records = rollout.load(open_store(cfg), layout.rewards(cfg.run.name, 1))
    assert len(records) == 4 and all(len(r.timings) == 3 for r in records)       # 3 turns each, timed
    trees = [episode_tree(r, policy="base") for r in records]
    for r, tree in zip(records, trees):
        _check(r, tree)
        assert [s["name"] for s in tree["spans"]] == ["model call 1", "environment step 1", "model call 2",
                                                     "environment step 2", "model call 3", "environment step 3"]
        assert tree["seconds"] == pytest.approx(sum(t["model"] + t["env"] for t in r.timings))
    for trace, tree in zip(_read_back(mlflow_server, trees, "letters"), trees):
        _compare(trace, tree)


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["say_letters", "editor"])
def test_an_agents_episode_is_a_trace_merged_or_step_wise(agent, mlflow_server):
    """say_letters' three calls merge into one sample; editor's history edit splits it step-wise (two
    records, `part` 0 and 1): a trace each, every call's reply and tokens as the record holds them."""
    from tests.test_agents import _cfg, _run

    records, _ = _run(_cfg(agent, "generate.num_generations=2"), n=2)
    for r in records:
        r.rewards, r.reward = {"letters": r.env_return}, r.env_return
    assert {r.part for r in records} == ({0} if agent == "say_letters" else {0, 1})
    trees = [episode_tree(r, policy="base") for r in records]
    for r, tree in zip(records, trees):
        _check(r, tree)
    for trace, tree in zip(_read_back(mlflow_server, trees[:4], agent), trees[:4]):
        _compare(trace, tree)


def test_a_tool_call_is_a_tool_span_and_an_environments_failure_an_error():
    r = Rollout(group=0, row=3, prompt=[{"role": "user", "content": "weather in Oslo?"}], prompt_ids=[1, 2, 3],
                completion="", completion_ids=[5, 6, 7, 9, 9, 8, 8], logprobs=[-1.0, -2.0, 0.0, 0.0, 0.0, -0.5, -0.5],
                truncated=False, mask=[1, 1, 0, 0, 0, 1, 1],
                turns=[{"role": "assistant", "content": "", "tool_calls": [{"name": "weather", "arguments": {}}]},
                       {"role": "tool", "content": "rain"}, {"role": "assistant", "content": "It rains."}],
                turn_rewards=[0.0], rewards={"judge": 1.0}, reward=1.0, env_return=None,
                env_error="step: the environment raised", timings=[{"model": 0.5, "env": 0.25}, {"model": 0.5}])
    tree = episode_tree(r, policy="run/policy/v000002")
    assert [(s["name"], s["span_type"]) for s in tree["spans"]] == [
        ("model call 1", "LLM"), ("tool call 1", "TOOL"), ("model call 2", "LLM"), ("environment step 2", "CHAIN")]
    assert tree["spans"][1]["inputs"] == {"action": [{"name": "weather", "arguments": {}}]}
    assert tree["spans"][1]["outputs"] == {"observation": [{"role": "tool", "content": "rain"}]}
    assert [s["attributes"].get("completion_tokens") for s in tree["spans"][::2]] == [2, 2]
    assert tree["spans"][3]["error"] == "step: the environment raised" and tree["error"]
    assert tree["seconds"] == 1.25 and tree["assessments"] == {"judge": 1.0, "reward": 1.0}
    assert tree["spans"][0]["attributes"]["policy"] == "run/policy/v000002"


def test_the_samples_table_and_the_training_traces_pick_the_same_records():
    assert sample_rows(64, 8) == [0, 8, 16, 24, 32, 40, 48, 56]
    assert sample_rows(5, 8) == [0, 1, 2, 3, 4] and sample_rows(10, 0) == []


def test_sending_traces_somewhere_leaves_the_processs_environment_as_it_was(monkeypatch):
    """mlflow.set_tracking_uri sets MLFLOW_TRACKING_URI, which tracking.uri's default, every stage process and a
    later run read: after an in-process run it pointed the next run (here: the next tests) at the last one's
    database."""
    import os

    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trace_to("http://127.0.0.1:1")
    assert "MLFLOW_TRACKING_URI" not in os.environ and mlflow.get_tracking_uri() == "http://127.0.0.1:1"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mine.db")
    trace_to("http://127.0.0.1:2")
    assert os.environ["MLFLOW_TRACKING_URI"] == "sqlite:///mine.db"
