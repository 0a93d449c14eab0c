"""Evaluation: unbiased pass@k, held-out scoring every eval.every iterations, and policy/BEST following the
best evaluated policy."""

from __future__ import annotations

import itertools
import math
import re

import pytest

from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.errors import UserError
from tasks.core.store import Store
from tasks.evaluate import pass_at_k
from tests.conftest import TINY


@pytest.mark.parametrize("n,c,k", [(4, 0, 1), (4, 1, 1), (4, 2, 2), (5, 3, 2), (6, 6, 3), (3, 1, 3)])
def test_pass_at_k_is_the_probability_a_random_k_subset_has_a_pass(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert math.isclose(pass_at_k(n, c, k), brute)


def test_k_above_n_is_a_user_error():
    with pytest.raises(UserError, match="eval"):
        load_config(TINY, ["eval.k=5", "eval.num_generations=4"])


def test_a_greedy_only_evaluation_skips_the_sampled_pass_and_scores_as_the_two_pass_one(tmp_path, monkeypatch):
    """eval.num_generations 0: the greedy pass alone, its figures those of an evaluation that also samples; nothing
    sampled stored or logged. Without greedy (or with a metric of the sampled pass) it is a user error."""
    from tasks.core import rollout
    from tasks.evaluate import evaluate

    monkeypatch.chdir(tmp_path)
    both = ["eval.split=test", "eval.max_prompts=4", "eval.greedy=true", "eval.metric=greedy_pass_at_1",
            "tracking.uri=sqlite:///unused.db"]
    two = evaluate(load_config(TINY, ["run.name=two", "eval.num_generations=2", *both]), 0)
    cfg = load_config(TINY, ["run.name=one", "eval.num_generations=0", *both])
    one = evaluate(cfg, 0)
    assert "eval/reward_mean" in two["metrics"] and not {"eval/reward_mean", "eval/pass_at_1"} & set(one["metrics"])
    for key in ("eval/greedy_pass_at_1", "eval/greedy_reward_mean"):
        assert one["metrics"][key] == two["metrics"][key]
    store = Store.open(cfg.store)
    assert rollout.load(store, layout.evaluation("one", 0)) == []
    greedy = rollout.load(store, layout.evaluation("one", 0), layout.GREEDY)
    assert [r.completion for r in greedy] == \
        [r.completion for r in rollout.load(store, layout.evaluation("two", 0), layout.GREEDY)] and len(greedy) == 4
    for bad in (["eval.greedy=false", "eval.metric=reward_mean"], ["eval.metric=reward_mean"]):
        with pytest.raises(UserError, match="num_generations: 0"):
            load_config(TINY, ["eval.num_generations=0", "eval.greedy=true", *bad])


@pytest.mark.slow
def test_flow_evaluates_and_keeps_the_best(prefect_api, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = ["run.name=ev", "run.iterations=5", "generate.prompts_per_iteration=8", "train.lr=1e-2",
                 "eval.every=2", "eval.num_generations=4", "eval.k=2", "eval.split=test",
                 f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.sample_completions=0"]
    cfg = load_config(TINY, overrides)
    from flows.training import train_flow

    summary = train_flow(str(TINY), overrides)
    store = Store.open(cfg.store)
    evaluated = store.list_folders("ev/eval")
    assert evaluated == ["v000002", "v000004", "v000005"]              # every 2, and after the last
    scores = {int(v[1:]): store.manifest(f"ev/eval/{v}")["meta"]["metrics"] for v in evaluated}
    assert all(set(m) >= {"eval/reward_mean", "eval/pass_at_2"} for m in scores.values())
    best = max(sorted(scores), key=lambda i: (scores[i]["eval/reward_mean"], -i))
    assert store.get_pointer(layout.best("ev")) == layout.policy("ev", best) == summary["best_policy"]
    store.verify(layout.evaluation("ev", 5))

    from mlflow.tracking import MlflowClient
    history = MlflowClient(cfg.tracking.uri).get_metric_history(summary["mlflow_run_id"], "eval/pass_at_2")
    assert [m.step for m in history] == [2, 4, 5]
    # the promotion gate: MLflow's `champion` alias is on the best evaluated policy's model version
    client = MlflowClient(cfg.tracking.uri)
    champion = client.get_model_version_by_alias("ev", "champion")
    assert champion.tags["rlflow.policy_uri"] == store.uri(layout.policy("ev", best))
    assert float(champion.tags["rlflow.eval/reward_mean"]) == scores[best]["eval/reward_mean"]

    # a nightly-style run starts from that champion, under a dated run name, in the same registered model
    nightly = ["run.name=ev", "run.iterations=1", "generate.prompts_per_iteration=8", "eval.every=1",
               "eval.num_generations=4", "eval.split=test", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
               "tracking.sample_completions=0"]
    night = train_flow(str(TINY), nightly, start_from="champion", run_name_suffix="date")
    assert re.fullmatch(r"ev-\d{8}", night["run"])
    params = client.get_run(night["mlflow_run_id"]).data.params
    assert params["model.name_or_path"] == champion.tags["rlflow.policy_uri"]
    assert params["publish.registered_model_name"] == "ev"


def test_promotion_gate_moves_champion_only_on_improvement(tmp_path):
    from mlflow.tracking import MlflowClient

    from tasks.core.registry import ensure_registered_model, promote_if_better

    client = MlflowClient(f"sqlite:///{tmp_path}/m.db", registry_uri=f"sqlite:///{tmp_path}/m.db")
    ensure_registered_model(client, "m")
    versions = [client.create_model_version("m", source=f"file:///p/v{i}").version for i in range(4)]
    metric = "eval/reward_mean"
    assert promote_if_better(client, "m", versions[0], metric, 0.3)          # none yet: promoted
    assert not promote_if_better(client, "m", versions[1], metric, 0.2)      # worse
    assert not promote_if_better(client, "m", versions[2], metric, 0.3)      # a tie keeps the champion
    assert client.get_model_version_by_alias("m", "champion").version == versions[0]
    assert promote_if_better(client, "m", versions[3], metric, 0.5)
    assert client.get_model_version_by_alias("m", "champion").version == versions[3]


def test_an_evaluation_of_the_training_file_is_not_called_held_out():
    """A local data file is one split whatever eval.split says: without an eval.path of its own (or with that same
    file) the evaluation reads the training prompts, and the console says train-set; another file, another split of
    a hub dataset, or a reasoning-gym task's eval split is held out."""
    from flows.training import eval_label
    from tasks.core.config import load_config
    from tests.conftest import ROOT, TINY

    data = ROOT / "configs" / "data"
    assert eval_label(load_config(TINY)) == "train-set"
    assert eval_label(load_config(TINY, ["eval.split=test"])) == "train-set"
    assert eval_label(load_config(TINY, [f"eval.path={data / 'successor.jsonl'}"])) == "train-set"
    assert eval_label(load_config(TINY, [f"eval.path={data / 'letters.jsonl'}"])) == "held-out"
    hub = ["data.path=openai/gsm8k", "data.name=main"]
    assert eval_label(load_config(TINY, [*hub, "eval.split=test"])) == "held-out"
    assert eval_label(load_config(TINY, [*hub, "eval.split=train"])) == "train-set"
    assert eval_label(load_config(ROOT / "configs" / "smollm2-arith.yaml")) == "held-out"


LOGS = '''
def logs_batch(completions, log_metric, **kw):
    log_metric("batch", float(len(completions)))
    log_metric("reward_mean", -1.0)               # (one of the evaluation's own names)
    return [1.0] * len(completions)


def fails(completions, **kw):
    raise ValueError("no grader")
'''


def test_the_evaluations_log_metric_values_and_error_counts_are_its_metrics(tmp_path, monkeypatch):
    """The evaluation threw its scoring's report away: what the functions logged with log_metric (TRL logs it in
    eval mode too) and each function's errors were in none of its metrics."""
    from tasks.evaluate import evaluate

    (tmp_path / "eval_logs.py").write_text(LOGS)
    monkeypatch.chdir(tmp_path)
    fns = "[{fn: 'eval_logs:logs_batch'}, {fn: 'eval_logs:fails'}]"
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=lm", f"reward.functions={fns}",
                             "eval.max_prompts=3", "eval.num_generations=2", "eval.greedy=true"])
    m = evaluate(cfg, 0)["metrics"]
    assert m["eval/batch"] == 6.0 and m["eval/greedy_batch"] == 3.0          # each pass's one call
    assert m["eval/reward_mean"] == 1.0 and m["eval/log_metric/reward_mean"] == -1.0
    assert m["eval/greedy_reward_mean"] == 1.0 and m["eval/greedy_log_metric/reward_mean"] == -1.0
    assert m["eval/fails/errors"] == m["eval/greedy_fails/errors"] == 1.0
    assert m["eval/logs_batch/errors"] == m["eval/logs_batch/nan"] == 0.0


def test_an_evaluation_whose_every_score_failed_after_one_that_scored_is_skipped_not_the_run(tmp_path, monkeypatch,
                                                                                           capsys):
    """reward.strict off: an evaluation where every reward call failed, the one before it scored (a passing fault,
    a judge's network), has no numbers (not 0s), a warning, BEST unchanged, and the run goes on, as an
    iteration's rewards do; a second in a row, or the first evaluation of the run, stops it (one line, exit 2).
    It stopped the run at once, hours into training."""
    from tasks.evaluate import evaluate
    from tasks.generate import generate
    from tasks.publish import publish
    from tasks.reward import reward
    from tasks.train import train

    bug, calls = tmp_path / "bug", tmp_path / "calls"
    monkeypatch.setenv("RLFLOW_TEST_BUG", str(bug))
    monkeypatch.setenv("RLFLOW_TEST_CALLS", str(calls))
    fns = "[{fn: 'tests.reward_examples:fails_until_fixed'}]"
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=ev", f"reward.functions={fns}",
                             "eval.every=1", "eval.baseline=true", "eval.max_prompts=3", "eval.num_generations=2",
                             "eval.greedy=true", "eval.metric=greedy_pass_at_1", "generate.prompts_per_iteration=2",
                             "generate.num_generations=2", "train.mode=process"])
    assert "eval/greedy_pass_at_1" in evaluate(cfg, 0)["metrics"]
    for it in (1, 2):
        generate(cfg, it, layout.BASE if it == 1 else layout.policy("ev", 1))
        reward(cfg, it)
        train(cfg, it)
        publish(cfg, it)
    store = Store.open(cfg.store)
    before = store.get_pointer(layout.best("ev"))
    bug.touch()
    m = evaluate(cfg, 1)["metrics"]
    assert m["eval/unscored_passes"] == 2.0 and m["eval/greedy_fails_until_fixed/errors"] == 1.0
    assert not {"eval/greedy_pass_at_1", "eval/pass_at_1", "eval/reward_mean", "eval/greedy_reward_mean"} & set(m)
    assert "has no numbers (eval/unscored_passes" in capsys.readouterr().err
    assert store.get_pointer(layout.best("ev")) == before
    with pytest.raises(UserError, match="every reward call of the evaluation of v000002 failed"):
        evaluate(cfg, 2)                                 # (the one before has no numbers: two in a row)
    first = load_config(TINY, [f"store.uri={tmp_path}/store2", "run.name=ev", f"reward.functions={fns}",
                               "eval.max_prompts=3"])
    with pytest.raises(UserError, match="every reward call of the evaluation of v000000 failed"):
        evaluate(first, 0)
