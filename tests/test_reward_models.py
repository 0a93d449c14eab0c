"""Rewards from models (reward.models; tasks/scoring/judges.py): a classifier reward model, a verdict model, an LLM
judge in its three modes, served in the stage, by a judge server the flow starts, or at an OpenAI-compatible URL;
answers cached in the store so a killed stage asks only what it had not asked; a real pretrained model as judge."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tasks.core import builtin_models
from tasks.core.config import load_config
from tasks.core.contracts import Rollout
from tasks.core.models import pin_of
from tasks.scoring.functions import RewardFunctionError, load_functions, score_records
from tests.conftest import AT_LENGTH, ROOT, TINY, free_ports, run_cli, user_module

TINY_LM = builtin_models.resolve("builtin:tiny-lm")
PIN = pin_of(TINY_LM)

PARSERS = """
def length(answer, n):          # pointwise: a number from any answer (the tiny model answers gibberish)
    return float(len(answer))

def first(answer, n):           # pairwise: A always wins
    return "A"

def ranks(answer, n):           # group: the k-th listed completion gets k
    return list(range(n))
"""


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    """A sequence-classification model saved and loaded as any reward model is (one logit)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tasks.core.models import load_tokenizer

    tok = load_tokenizer(TINY_LM)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_labels=1, pad_token_id=tok.pad_token_id))
    path = tmp_path_factory.mktemp("rm") / "classifier"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _records() -> list[Rollout]:
    out = []
    for group, (prompt, answer) in enumerate([("c=", "ddd"), ("e=", "fff")]):
        for completion in (answer, "xy", answer[:2] + "q"):
            out.append(Rollout(group=group, row=group, prompt=prompt, prompt_ids=[1], completion=completion,
                               completion_ids=[2, 3], logprobs=[-1.0, -1.0], truncated=False,
                               columns={"answer": answer}))
    return out


def _judges(classifier: Path, **extra) -> list[dict]:
    tiny = {"model": "builtin:tiny-lm", "sha256": PIN, "max_tokens": 3, **extra}
    return [
        {"name": "rm", "kind": "classifier", "model": str(classifier), "sha256": pin_of(str(classifier)), "weight": 0.5,
         **{k: v for k, v in extra.items() if k not in ("max_tokens",)}},
        {"name": "points", "kind": "judge", "template": "Is {completion} right for {prompt} ({answer})?",
         "parser": "judge_parsers:length", "weight": 0.25, **tiny},
        {"name": "pairs", "kind": "judge", "mode": "pairwise",
         "template": "{prompt}: A {completion_a} B {completion_b}",
         "parser": "judge_parsers:first", **tiny},
        {"name": "ranked", "kind": "judge", "mode": "group", "template": "{prompt} of {n}: {completions}",
         "parser": "judge_parsers:ranks", "weight": 2.0, **tiny},
    ]


def _cfg(tmp_path: Path, models: list[dict], *more: str):
    return load_config(TINY, [f"store.uri={tmp_path / 'store'}", f"reward.models={json.dumps(models)}", *more])


def test_every_kind_and_mode_scores_as_its_model_does(tmp_path, monkeypatch, classifier):
    """Scores equal what the models give when run directly; pairwise = share of comparisons won (each completion
    is A once and B once); group = the parser's list in the group's order; combined with the function by weight."""
    from transformers import AutoModelForSequenceClassification

    from tasks.core.models import load_tokenizer

    user_module(tmp_path, monkeypatch, "judge_parsers", PARSERS)
    cfg = _cfg(tmp_path, _judges(classifier))
    records = _records()
    scored = score_records(load_functions(cfg, columns={"answer"}), records, "sum", judge_cache="r/judge-cache/iter-1")

    tok = load_tokenizer(str(classifier))
    rm = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    for r in records:
        conv = [{"role": "user", "content": r.prompt}, {"role": "assistant", "content": r.completion}]
        ids = tok.apply_chat_template(conv, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        with torch.no_grad():
            want = rm(input_ids=torch.tensor([list(ids)])).logits[0, 0].item()
        assert r.rewards["rm"] == pytest.approx(want, abs=1e-5)
        assert r.rewards["pairs"] == 0.5
        assert r.rewards["points"] is not None and r.rewards["points"] >= 0
    assert [r.rewards["ranked"] for r in records] == [0.0, 1.0, 2.0] * 2
    for r in records:
        parts = {"successor_reward": 1.0, "rm": 0.5, "points": 0.25, "pairs": 1.0, "ranked": 2.0}
        assert r.reward == pytest.approx(sum(w * r.rewards[n] for n, w in parts.items()))
    assert scored.metrics["points/requests"] == 6 and scored.metrics["pairs/requests"] == 6
    assert scored.metrics["ranked/requests"] == 2 and not scored.errors

    # asked again with the same cache: nothing is asked, the same scores come back
    again = _records()
    scored = score_records(load_functions(cfg, columns={"answer"}), again, "sum", judge_cache="r/judge-cache/iter-1")
    assert [r.rewards for r in again] == [r.rewards for r in records]
    assert scored.metrics["points/requests"] == 0 and scored.metrics["points/cached"] == 6


def test_two_stages_asking_at_once_load_one_engine(tmp_path, monkeypatch):
    """where: stage judges are loaded once per process; two threads (look-ahead stages of run.max_staleness)
    asking at once get the same engine, loaded once (the load is slow enough for both to be inside it)."""
    import threading

    from tasks.core.placement import Services
    from tasks.scoring import judge_engine, judges

    made = []

    class Slow:
        def __init__(self, *args):
            made.append(args)
            time.sleep(0.3)

    monkeypatch.setattr(judge_engine, "JudgeEngine", Slow)
    monkeypatch.setattr(judges, "_engines", {})
    cfg = _cfg(tmp_path, [{"name": "judge", "kind": "judge", "model": "builtin:tiny-lm", "sha256": PIN,
                           "template": "{prompt} {completion}", "parser": "judge_parsers:length"}])
    askers = [judges.Asker(cfg, cfg.reward.models[0], 0, Services()) for _ in range(2)]
    got: list = [None, None]

    def ask(i: int) -> None:
        try:
            got[i] = askers[i]._engine()
        except BaseException as e:  # noqa: BLE001 - said by the assert below
            got[i] = e

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and got[0] is got[1] and isinstance(got[0], Slow)


def test_an_answer_that_does_not_parse_is_a_counted_error_not_a_zero(tmp_path):
    judge = {"name": "judge", "kind": "judge", "model": "builtin:tiny-lm", "sha256": PIN, "max_tokens": 3,
             "template": "Rate {completion} from 0 to 10.", "scale": [0, 10]}
    cfg = _cfg(tmp_path, [judge])
    records = _records()
    scored = score_records(load_functions(cfg, columns={"answer"}), records, "sum")
    unparsed = [r for r in records if r.rewards["judge"] is None]
    assert unparsed, "the tiny model's answers hold no number on a 0-10 scale"
    assert scored.metrics["judge/failed"] == len(unparsed) and "judge" in scored.errors
    for r in unparsed:          # the function still counts; the judge's missing score adds nothing
        assert r.reward == pytest.approx(r.rewards["successor_reward"])
    with pytest.raises(RewardFunctionError, match="reward model 'judge': .* completions got an answer that gives "
                                                  "no score"):
        score_records(load_functions(_cfg(tmp_path, [judge], "reward.strict=true"), columns={"answer"}),
                      _records(), "sum")


@pytest.mark.slow
def test_a_judge_server_and_a_url_answer_as_the_stage_does(tmp_path, monkeypatch, classifier):
    """The judge server (hf engine, batched) behind the OpenAI-compatible routes, reached through `url` with the
    key in a variable (the openai client): the same scores as the model in the stage's process."""
    user_module(tmp_path, monkeypatch, "judge_parsers", PARSERS)
    local = _cfg(tmp_path, _judges(classifier))
    want = _records()
    score_records(load_functions(local, columns={"answer"}), want, "sum")

    config = tmp_path / "judges.yaml"
    config.write_text(json.dumps({**_yaml(TINY), "reward": {**_yaml(TINY)["reward"], "models": _judges(classifier)}}))
    servers, urls = [], {}
    env = {**os.environ, "RLFLOW_JUDGE_TOKEN": "s3cret"}
    try:
        for name in ("rm", "points", "pairs", "ranked"):
            proc = subprocess.Popen([sys.executable, "-m", "tasks.scoring.judge_server", "--config", str(config),
                                     "--model", name, "--port", "0"], stdout=subprocess.PIPE, text=True, env=env,
                                    cwd=ROOT, start_new_session=True)
            servers.append(proc)
        for name, proc in zip(("rm", "points", "pairs", "ranked"), servers):
            line = proc.stdout.readline()
            assert line.startswith("RLFLOW_JUDGE_READY "), line
            urls[name] = line.split()[1]
        monkeypatch.setenv("JUDGE_KEY", "s3cret")
        at_url = [{**{k: v for k, v in m.items() if k != "sha256"}, "where": urls[m["name"]],
                   "api_key_env": "JUDGE_KEY", "model": m["name"]} for m in _judges(classifier)]
        got = _records()
        scored = score_records(load_functions(_cfg(tmp_path, at_url), columns={"answer"}), got, "sum")
        for g, w in zip(got, want):
            for name in w.rewards:
                assert g.rewards[name] == pytest.approx(w.rewards[name], abs=1e-5), name
        assert scored.metrics["points/requests"] == 6 and not scored.errors
        import httpx

        assert httpx.get(f"{urls['points']}/health").json()["requests"] == 6
        assert httpx.get(f"{urls['points']}/v1/models").status_code == 401       # the token guards every route
        monkeypatch.setenv("JUDGE_KEY", "wrong")
        from tasks.scoring.judges import JudgeUnavailable

        with pytest.raises(JudgeUnavailable):
            score_records(load_functions(_cfg(tmp_path, at_url[1:2]), columns={"answer"}), _records(), "sum")
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()


def _yaml(path: Path) -> dict:
    import yaml

    data = yaml.safe_load(path.read_text())
    data["data"]["path"] = str(path.parent / data["data"]["path"])
    return data


def _real_judge_config(tmp_path: Path, where: str) -> Path:
    from tasks.core.hashing import known_sha256 as _sha256

    gguf = Path(builtin_models.resolve("builtin:smollm2-135m"))
    data = _yaml(TINY)
    question = ("A student was asked to continue '{prompt}' with the next letter of the alphabet written three times "
                "({answer}). The student wrote: '{completion}'.")
    data.update(run={"name": "judged", "iterations": 2},
                generate={"prompts_per_iteration": 4, "num_generations": 2, "max_completion_length": 4},
                store={"uri": str(tmp_path / "store")}, tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
                eval={"every": 0})
    data["reward"]["models"] = [
        {"name": "judge", "kind": "judge", "model": "builtin:smollm2-135m", "sha256": _sha256(gguf), "where": where,
         "template": question + " Rate the answer from 0 (wrong) to 10 (right). Reply with the number only.",
         "scale": [0, 10], "max_tokens": 4, "batch_size": 1},
        {"name": "right", "kind": "verdict", "model": "builtin:smollm2-135m", "sha256": _sha256(gguf),
         "template": question + " Is that right? Answer Yes or No.", "batch_size": 1}]
    path = tmp_path / f"judged-{where}.yaml"
    path.write_text(json.dumps(data))
    return path


@AT_LENGTH               # (~50 s; the judges' kinds, server and url tests above are CI's)
@pytest.mark.slow
@pytest.mark.drill
def test_a_real_model_judges_a_run_and_a_killed_stage_asks_only_the_rest(prefect_api, tmp_path):
    """SmolLM2-135M-Instruct (a real pretrained model, CPU) judges a GRPO run through the flow, served by a judge
    server the flow starts (and a verdict read in the stage). Then that run's iteration-2 reward stage, killed
    while it asks and run again: the second asks only what the first had not, and the scores equal the run's."""
    import shutil

    (tmp_path / "a").mkdir()
    cfg = _real_judge_config(tmp_path / "a", "local")
    out = run_cli(["run", str(cfg)], tmp_path / "a", prefect_api, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no server from the flow" not in out.stderr          # the stages asked the flow's judge server
    rewards = tmp_path / "a/store/judged/iter-000002/rewards"
    clean = [json.loads(line) for line in (rewards / "rollouts.jsonl").read_text().splitlines()]
    scores = [r["rewards"]["right"] for r in clean]
    assert all(0 < s < 1 for s in scores) and len(set(scores)) > 1     # a probability, not a constant
    assert any(r["rewards"]["judge"] is not None for r in clean)
    metrics = json.loads((rewards / "MANIFEST.json").read_text())["meta"]["metrics"]
    assert metrics["reward/judge/requests"] == 8 and metrics["reward/right/requests"] == 8

    # the policy this run registered can judge the next run, pinned by its MLflow version
    from tasks.core.policy import materialize
    from tasks.core.store import open_store
    from tasks.scoring.judges import model_path

    run_cfg = load_config(cfg)
    entry = run_cfg.reward.models[1].model_copy(update={"model": "models:/judged/1", "sha256": None})
    published = materialize(open_store(run_cfg), "judged/policy/v000002")
    assert pin_of(model_path(run_cfg, entry, "reward.models[1]")) == pin_of(str(published))

    # the same store without iteration 2's scores and answers: the stage, killed while it asks, then run again
    shutil.copytree(tmp_path / "a/store", tmp_path / "b/store")
    shutil.rmtree(tmp_path / "b/store/judged/iter-000002/rewards")
    shutil.rmtree(tmp_path / "b/store/judged/judge-cache/iter-000002")
    cfg = tmp_path / "b/judged.yaml"
    cfg.write_text((tmp_path / "a/judged-local.yaml").read_text().replace(str(tmp_path / "a"), str(tmp_path / "b")))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    stage = [sys.executable, "-m", "tasks.reward", "--config", str(cfg), "--iteration", "2"]
    cache = tmp_path / "b/store/judged/judge-cache/iter-000002"
    proc = subprocess.Popen(stage, cwd=tmp_path / "b", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not cache.exists() or len([p for p in cache.iterdir()
                                                                       if not p.name.startswith(".")]) < 3):
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "b/store/judged/iter-000002/rewards/MANIFEST.json").exists(), "killed too late"
    asked_before = sum(json.loads((p / "MANIFEST.json").read_text())["meta"]["answers"]
                       for p in cache.iterdir() if (p / "MANIFEST.json").exists())
    again = subprocess.run(stage, cwd=tmp_path / "b", env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    metrics = json.loads(again.stdout.strip().splitlines()[-1])["metrics"]
    asked = metrics["reward/judge/requests"] + metrics["reward/right/requests"]
    assert asked_before >= 3 and asked == 16 - asked_before
    resumed = [json.loads(line) for line in
               (tmp_path / "b/store/judged/iter-000002/rewards/rollouts.jsonl").read_text().splitlines()]
    assert [r["rewards"] for r in resumed] == [r["rewards"] for r in clean]
    assert [r["reward"] for r in resumed] == [r["reward"] for r in clean]


@AT_LENGTH
@pytest.mark.slow
@pytest.mark.drill
def test_a_judge_on_its_own_cluster_is_launched_again_after_a_preemption(tmp_path, prefect_api, monkeypatch,
                                                                         fake_cloud):
    """where: sky: the flow launches sky/judge.yaml's cluster for the judge, hands its URL and token to the reward
    stage, finds it preempted before iteration 2 and launches it again; both iterations are scored there (the
    same answers as the model in the stage gives), and the cluster is torn down at the end."""
    from flows.training import train_flow
    from tasks.core import layout
    from tasks.core.store import Store
    monkeypatch.chdir(tmp_path)
    user_module(tmp_path, monkeypatch, "judge_parsers", PARSERS)
    port = free_ports(1)
    judge = {"name": "points", "kind": "judge", "model": "builtin:tiny-lm", "sha256": PIN, "max_tokens": 3,
             "template": "Is {completion} right for {prompt}?", "parser": "judge_parsers:length", "where": "sky",
             "port": port}
    store = Store.open(str(tmp_path / "store"))
    cluster = "rlflow-tiny-demo-judge-points"

    watcher = fake_cloud.preempt_once_written(store, layout.rewards("tiny-demo", 1), cluster)
    common = ["run.iterations=2", "generate.prompts_per_iteration=2", "generate.num_generations=4", "eval.every=0",
              f"store.uri={tmp_path}/store", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    out = train_flow(str(TINY), [*common, f"reward.models={json.dumps([judge])}",
                                 f"launcher.sky_python={fake_cloud.python}", f"launcher.recipes={ROOT / 'sky'}"])
    watcher.join(5)
    assert out["iterations_completed"] == 2
    calls = [c["call"] for c in fake_cloud.calls() if c.get("cluster") == cluster]
    assert calls == ["launch", "preempted", "exec", "launch", "down"], calls
    for it in (1, 2):
        metrics = store.manifest(layout.rewards("tiny-demo", it))["meta"]["metrics"]
        assert metrics["reward/points/requests"] == 8 and metrics["reward/points/failed"] == 0
    # the cluster's answers are the stage's: the same records scored in this process give the same scores
    from tasks.core import rollout

    records = rollout.load(store, layout.rewards("tiny-demo", 2))
    here = rollout.load(store, layout.rewards("tiny-demo", 2))
    judge_here = {**judge, "where": "stage"}
    score_records(load_functions(_cfg(tmp_path, [judge_here]), columns={"answer"}), here, "sum")
    assert [r.rewards["points"] for r in here] == [r.rewards["points"] for r in records]


def test_a_classifier_label_past_its_outputs_is_refused_before_the_run(tmp_path, classifier):
    """`label: 5` of a classifier with one output was a warning each iteration and a run trained without that
    reward (exit 0): refused by the preflight now, naming the outputs it has."""
    from tasks.core.errors import UserError
    from tasks.scoring.judges import check_models

    rm = {"name": "rm", "kind": "classifier", "model": str(classifier), "sha256": pin_of(str(classifier))}
    check_models(_cfg(tmp_path, [{**rm, "label": 0}]))
    with pytest.raises(UserError, match=r"^reward.models\[0\] \(rm\).label: 1: the classifier .* has 1 output\(s\); "
                                        r"expected 0 to 0$"):
        check_models(_cfg(tmp_path, [{**rm, "label": 1}]))
