"""Generation that never waits (generate.streaming, issue 42): one sampler per run decodes continuously, rows
joining and leaving a batch between decode steps and a newer policy loaded between them, each token tagged
with the version that drew it. What must hold: every token's behaviour logprob is exactly its version's (on
the whole prefix, whatever rows shared its batch); a streamed run trains on the same prompts as the stage
mode, each token within run.max_staleness, nothing decoded thrown away; a sampler stopped at any moment and
started again keeps every committed group and completes the rest, none twice; streaming it cannot do is one
line, exit 2, nothing written."""

from __future__ import annotations

import copy
import subprocess
import sys
import time

import pytest
import torch

from tasks.algorithms import dynamic_sampling
from tasks.core import curriculum, data, layout, rollout
from tasks.core.config import load_config
from tasks.core.contracts import SamplingParams
from tasks.core.models import base_path, load_model, load_tokenizer
from tasks.core.store import MANIFEST, Store, open_store
from tasks.engines.hf_stream import ContinuousSampler
from tasks.engines.streaming import Row, Stream
from tasks.scoring.functions import load_functions, score_records
from tasks.scoring.streamed import GroupScorer
from tasks.scoring.worker import RewardState
from tests.conftest import AT_LENGTH, ROOT, TINY, VLLM_PYTHON, read_summary, run_cli
from tests.test_interruption import _teacher_forced

AGENT = ROOT / "configs" / "agent.yaml"


def _overrides(tmp_path, name: str, *extra: str, iterations: int = 4) -> list[str]:
    return [f"run.name={name}", f"run.iterations={iterations}", "run.max_staleness=1", f"store.uri={tmp_path}/store",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "generate.prompts_per_iteration=4",
            "generate.num_generations=4", "train.lr=1e-2", "launcher.retry_backoff_seconds=0",
            "tracking.dashboard_every=0", "eval.every=0", *extra]


def test_rows_join_leave_and_change_policy_between_steps_and_each_token_is_its_versions():
    cfg = load_config(TINY, [])
    tok = load_tokenizer(base_path(cfg))
    old = load_model(base_path(cfg)).eval()
    new = copy.deepcopy(old)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    models = {0: old, 1: new}
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("c=", "hello x=", "abcdefg=", "q=")]
    limit = 10
    sampler = ContinuousSampler(tok, SamplingParams(n=3, max_new_tokens=limit, temperature=0.8, top_p=1.0, seed=3),
                                limit)
    model = copy.deepcopy(old)
    steps = {"n": 0}

    def after(k):                     # stop after k decode steps of this call
        steps["n"] = 0

        def stop(finished, rows):
            steps["n"] += 1
            return steps["n"] >= k
        return stop

    rows = [Row(0, prompts[0]) for _ in range(3)] + [Row(1, prompts[1]) for _ in range(2)]
    assert sampler.step_batch(model, rows, 0, after(3))               # stopped between steps
    assert all(len(r.tokens) == 3 for r in rows if not r.done)
    rows += [Row(2, prompts[2]) for _ in range(3)]                     # new rows join with no tokens
    assert sampler.step_batch(model, [r for r in rows if not r.done], 0, after(2))
    with torch.no_grad():                                              # a newer policy, loaded in place
        for name, t in new.state_dict().items():
            model.state_dict()[name].copy_(t)
    rows += [Row(3, prompts[3])]
    while any(not r.done for r in rows):
        sampler.step_batch(model, [r for r in rows if not r.done], 1, lambda finished, n: finished >= 1)
    eos = tok.eos_token_id
    mixed = 0
    for r in rows:
        assert len(r.tokens) == len(r.logprobs) == len(r.versions) and r.done
        assert r.tokens[-1] == eos or (len(r.tokens) == limit and r.truncated)
        assert r.versions == sorted(r.versions)
        for v in set(r.versions):          # each token's logprob is its version's, on the whole prefix
            want = _teacher_forced(models[v], r.prompt, r.tokens, 0.8)
            got = [(a, b) for a, b, w in zip(want, r.logprobs, r.versions) if w == v]
            assert max(abs(a - b) for a, b in got) < 1e-4, (r.group, v)
        if set(r.versions) == {0, 1}:
            mixed += 1
            stale = _teacher_forced(old, r.prompt, r.tokens, 0.8)
            assert max(abs(a - b) for a, b, w in zip(stale, r.logprobs, r.versions) if w == 1) > 1e-2
    assert mixed                            # some rows continued under the newer policy


def _cut_logprobs(model, prompt: list[int], completion: list[int], temperature: float, top_p: float) -> list[float]:
    """Each token's logprob under the distribution sampled from: logits / temperature, cut to top_p, renormalized
    (computed here from the full logits)."""
    from tasks.algorithms.logprobs import cut

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = cut(model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature, 0, top_p)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def test_rows_at_their_own_temperature_and_top_p_share_the_batch():
    """An agent's call may narrow temperature and top_p (env.endpoint): while streaming its row samples at its
    own settings in the batch the others share (Row.sampling). Each row's behaviour logprobs are those of the
    distribution it was drawn from, its own, against a reference from the full logits; not the run's."""
    cfg = load_config(TINY, [])
    tok = load_tokenizer(base_path(cfg))
    model = load_model(base_path(cfg)).eval()
    params = SamplingParams(n=1, max_new_tokens=12, temperature=0.8, top_p=1.0, seed=5)
    sampler = ContinuousSampler(tok, params, 12)
    settings = [None, {"temperature": 0.4}, {"top_p": 0.6}, {"temperature": 1.3, "top_p": 0.9}]
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("c=", "hello x=")]
    rows = [Row((k, j), prompts[j], sampling=own) for k, own in enumerate(settings) for j in range(2)]
    while any(not r.done for r in rows):
        sampler.step_batch(model, [r for r in rows if not r.done], 0, lambda finished, n: False)
    apart = 0
    for r in rows:
        temperature, top_p = r.settings(params)
        want = _cut_logprobs(model, r.prompt, r.tokens, temperature, top_p)
        assert len(r.tokens) == len(r.logprobs) and max(abs(a - b) for a, b in zip(want, r.logprobs)) < 1e-4, \
            (r.group, want, r.logprobs)
        runs = _cut_logprobs(model, r.prompt, r.tokens, 0.8, 1.0)
        apart += r.sampling is not None and max(abs(a - b) for a, b in zip(runs, r.logprobs)) > 1e-2
    assert apart == 6                       # every row at its own settings is not the run's distribution


@pytest.mark.slow
@pytest.mark.parametrize(("on_update", "engine"), [
    ("interrupt", []), ("finish", []),
    pytest.param("interrupt", ["generate.replicas=2", "generate.replica_threads=1"], id="interrupt-replicas",
                 marks=AT_LENGTH),     # (CI's smoke of streaming on replicas: tests/test_replicas.py, ~25 s)
    pytest.param("interrupt", ["generate.engine=vllm", f"generate.vllm_python={VLLM_PYTHON}",
                               "generate.max_prompt_length=128"], id="interrupt-vllm",       # (the model's 256)
                 marks=pytest.mark.vllm)])
def test_a_streamed_run_trains_the_stage_modes_prompts_within_the_staleness(prefect_api, tmp_path, monkeypatch,
                                                                            on_update, engine):
    """The flow with generate.streaming (the hf engine's decoder, or one vLLM engine's: tasks/engines/
    vllm_stream.py): each iteration trains on the stage mode's prompts in order, every token within
    run.max_staleness, scored as each group completed; nothing discarded; the sampler stops with the flow."""
    from mlflow.tracking import MlflowClient

    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    overrides = _overrides(tmp_path, "stream", f"generate.streaming.on_update={on_update}", *engine)
    summary = train_flow(str(TINY), overrides)
    cfg = load_config(TINY, overrides)
    store = open_store(cfg)
    n_rows = len(data.load_prompts(cfg))
    for it in range(1, 5):
        records = rollout.load(store, layout.rollouts("stream", it))
        rows, _ = curriculum.prompts(cfg, store, it, 0, n_rows)          # the stage mode's prompts, in order
        assert [r.row for r in records[::4]] == rows and [r.group for r in records] == [j for j in range(4)
                                                                                        for _ in range(4)]
        oldest = layout.version_of(layout.behaviour_policy("stream", it, 1))
        for r in records:
            assert len(r.versions) == len(r.completion_ids) == len(r.logprobs)
            assert min(r.versions) >= oldest                          # within run.max_staleness
        # scored as each group completed (tasks/scoring/streamed.py): the rewards scoring it at once gives
        assert "reward/streamed_seconds" in store.manifest(layout.rewards("stream", it))["meta"]["metrics"]
        score_records(load_functions(cfg), records, cfg.reward.aggregate, RewardState(it - 1, 4))
        assert [r.reward for r in rollout.load(store, layout.rewards("stream", it))] == [r.reward for r in records]
    assert GroupScorer.RUNNING == {}
    client = MlflowClient(cfg.tracking.uri)
    run = summary["mlflow_run_id"]
    assert [m.value for m in client.get_metric_history(run, "generate/discarded_tokens")] == [0.0] * 4
    assert all(m.value <= 1 for m in client.get_metric_history(run, "generate/staleness"))
    assert Stream.RUNNING == {}                                      # stopped with the flow
    if on_update == "finish" and not engine:
        # extended with another learning rate: refused by the train stage of iteration 4, walked again, before
        # anything of iteration 5 is sampled (the look-ahead and the sampler wait for it: flows/schedule.py)
        from tasks.core.errors import UserError

        files = sorted(tmp_path.joinpath("store").rglob("*"))
        with pytest.raises(UserError, match="train.lr 0.01 -> 0.03"):
            train_flow(str(TINY), _overrides(tmp_path, "stream", "generate.streaming.on_update=finish",
                                             "train.lr=3e-2", iterations=6))
        assert sorted(tmp_path.joinpath("store").rglob("*")) == files


def test_a_stopped_sampler_keeps_its_groups_and_a_new_one_completes_the_rest(tmp_path):
    """A sampler stopped at any moment (a killed flow): what it committed stays as it was, a new one samples
    only the rest, and every group of every iteration is there once; a committed group the old scorer had not
    scored is scored by the new one. Partial sequences in flight are not kept: they are sampled again from their
    prompt (docs/design-notes.md)."""
    cfg = load_config(TINY, _overrides(tmp_path, "again", "generate.max_completion_length=8",
                                     "generate.streaming.on_update=interrupt", iterations=2))
    store = open_store(cfg)
    first = Stream.of(cfg, 1, lambda: GroupScorer.start(cfg))
    first.collect(1)                                                 # (some groups at least)
    assert Stream.stop_run("again") == first.counts["discarded_tokens"] and "again" not in Stream.RUNNING
    assert not first.thread.is_alive()
    kept = {(it, j): store.manifest(layout.stream_group("again", it, j))
            for it in (1, 2) for j in range(4) if store.manifest(layout.stream_group("again", it, j))}
    assert len(kept) >= 4
    for it, j in kept:                  # as if killed before the scorer got to them: scored again by the next
        store.delete_folder(layout.stream_scored("again", it, j))
    second = Stream(cfg, 1, GroupScorer.start(cfg))
    records = {it: second.collect(it)[0] for it in (1, 2)}
    second.stop()
    for it in (1, 2):
        assert [r.group for r in records[it]] == [j for j in range(4) for _ in range(4)]
        assert all(store.manifest(layout.stream_scored("again", it, j)) is not None for j in range(4))
    for (it, j), manifest in kept.items():                          # committed once, never again
        assert store.manifest(layout.stream_group("again", it, j)) == manifest


def test_groups_sampled_or_scored_under_another_config_are_not_taken(tmp_path):
    """A run stopped after its sampler committed and scored groups, resumed with its config edited: a group
    sampled under other generate settings is refused in one line (it would be trained on as this config's,
    tagged as this policy's), one scored under other reward settings is scored again."""
    from tasks.core.errors import UserError
    from tasks.core.stage import scored_here
    from tasks.scoring.streamed import assembled

    cfg = load_config(TINY, _overrides(tmp_path, "edited", "generate.max_completion_length=4",
                                       "generate.streaming.on_update=interrupt", iterations=2))
    store = open_store(cfg)
    first = Stream.of(cfg, 1, lambda: GroupScorer.start(cfg))
    records = first.collect(1)[0]
    assert assembled(cfg, store, 1, records) is not None         # (waits for the scorer to have scored them all)
    Stream.stop_run("edited")
    other = load_config(TINY, _overrides(tmp_path, "edited", "generate.max_completion_length=16",
                                         "generate.streaming.on_update=interrupt", iterations=2))
    second = Stream(other, 1)
    with pytest.raises(RuntimeError) as e:
        second.collect(1)
    second.stop()
    user = e.value.__cause__
    assert isinstance(user, UserError) and "was sampled under another config: generate.max_completion_length " \
        "4 -> 16" in str(user), e.value
    rescored = load_config(TINY, _overrides(tmp_path, "edited", "generate.max_completion_length=4",
                                            "generate.streaming.on_update=interrupt",
                                            'reward.functions=[{fn: "tasks.rewards.demo:stops_reward", weight: 1}]',
                                            iterations=2))
    manifest = store.manifest(layout.stream_scored("edited", 1, 0))
    assert scored_here(cfg, manifest) and not scored_here(rescored, manifest)
    assert assembled(cfg, store, 1, records) is not None and assembled(rescored, store, 1, records) is None


def _publish_adapter(cfg, version: int, tmp_path):
    """Publish a random LoRA adapter on the base as policy `version` of cfg's run (LATEST moved to it); returns the
    model it makes (base + adapter), to check the tokens sampled under it."""
    from tasks.core.models import add_lora, load_policy

    torch.manual_seed(version)
    model = add_lora(load_model(base_path(cfg)), cfg.train)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)          # (B too: a fresh adapter's B is 0)
    model.save_pretrained(tmp_path / f"a{version}")
    store, run = open_store(cfg), cfg.run.name
    store.put_folder(layout.policy(run, version), tmp_path / f"a{version}")
    store.set_pointer(layout.latest(run, "policy"), layout.policy(run, version))
    return load_policy(cfg, str(tmp_path / f"a{version}"), "cpu").eval()


def test_a_lora_run_streams_each_adapter_loaded_in_place(tmp_path):
    """train.lora_r: a run publishes adapters on the base; the sampler loads each in place between decode steps
    (the resident keeps base + adapter), and every token's behaviour logprob is its version's: the base's at v0,
    base + adapter N's at vN. Iterations 1-2 are v0's, 3 v1's, 4 v2's (run.max_staleness 1)."""
    cfg = load_config(TINY, _overrides(tmp_path, "lora", "train.lora_r=4", "generate.max_completion_length=8",
                                     "generate.temperature=0.8", "generate.top_p=1.0",
                                     "generate.streaming.on_update=interrupt"))
    models = {0: load_model(base_path(cfg)).eval()}
    stream = Stream.of(cfg, 1)
    try:
        records = {it: stream.collect(it)[0] for it in (1, 2)}
        for version in (1, 2):
            models[version] = _publish_adapter(cfg, version, tmp_path)
            records[version + 2] = stream.collect(version + 2)[0]
    finally:
        Stream.stop_run("lora")
    for it, group in records.items():
        assert {v for r in group for v in r.versions} == {max(0, it - 2)}
        for r in group:
            want = _teacher_forced(models[max(0, it - 2)], r.prompt_ids, r.completion_ids, 0.8)
            assert max(abs(a - b) for a, b in zip(want, r.logprobs)) < 1e-4, (it, r.group)


def test_episodes_stream_turn_by_turn_and_each_token_is_its_versions(tmp_path, monkeypatch):
    """env.factory with streaming (tasks/envs/runtime/streamed.py): each turn of an episode is a row of the
    continuous batch, its next turn joining once its environment has stepped. A policy published during an
    environment's step (here: at the first one) is loaded before the next decode step, so the episodes then in
    flight take their later turns under it: every model token's behaviour logprob is its recorded version's on
    the episode's whole context (observations included, mask 0), the versions differ within some episodes,
    replaying each episode's replies in a fresh game gives its rewards, and the iterations' prompts are the
    stage mode's, each group once, nothing discarded."""
    from tasks.envs.builtin.games import SayTheLetters
    from tasks.envs.runtime import streamed

    letters = ROOT / "configs" / "letters.yaml"
    cfg = load_config(letters, _overrides(tmp_path, "eps", "train.lora_r=4", "generate.max_completion_length=2",
                                          "generate.temperature=0.8", "generate.top_p=1.0",
                                          "generate.streaming.on_update=interrupt", "generate.streaming.max_rows=8",
                                          iterations=2))
    models = {0: load_model(base_path(cfg)).eval()}
    steps = []
    real_step = streamed.step

    def step_and_publish_once(*args):
        real_step(*args)
        steps.append(len(args[2]))
        if len(steps) == 1:                     # (in the sampler's thread, between two decode steps)
            models[1] = _publish_adapter(cfg, 1, tmp_path)
    monkeypatch.setattr(streamed, "step", step_and_publish_once)
    records = _two_iterations_streamed(cfg, streamed.StreamedEpisodes, monkeypatch)
    assert len(steps) > 1
    for r in _episodes_each_token_its_versions(cfg, records, models):
        game = SayTheLetters()
        game.reset(r.columns | {"prompt": ""})
        replies = [m for m in r.turns if m["role"] == "assistant"]
        assert [game.step(m).reward for m in replies] == r.turn_rewards


def _two_iterations_streamed(cfg, source, monkeypatch) -> dict:
    """Iterations 1 and 2 collected from cfg's run streamed from `source` (StreamedEpisodes, StreamedAgents),
    the policy pointer read at every step; the sampler stopped after, nothing in flight discarded."""
    monkeypatch.setattr("tasks.engines.streaming.WAIT_SECONDS", 0.0)
    stream = Stream.of(cfg, 1, groups=source.given(None))
    try:
        records = {it: stream.collect(it) for it in (1, 2)}
    finally:
        discarded = Stream.stop_run(cfg.run.name)
    assert discarded == 0
    return records


def _episodes_each_token_its_versions(cfg, collected: dict, models: dict) -> list:
    """Streamed episodes' checks (StreamedEpisodes, StreamedAgents): each iteration's prompts are the stage
    mode's, each group once, nothing discarded; every model token's behaviour logprob is its recorded version's
    on the episode's whole context (turns, and tokens between them with mask 0); the versions differ within
    some episodes (later turns under the newer policy). The records, for the source's own checks."""
    store, n_rows, mixed, out = open_store(cfg), len(data.load_prompts(cfg)), 0, []
    for it, (group, metrics, rows, _) in collected.items():
        assert rows == curriculum.prompts(cfg, store, it, 0, n_rows)[0] == [r.row for r in group[::4]]
        assert [r.group for r in group] == [j for j in range(4) for _ in range(4)]
        assert metrics["generate/discarded_tokens"] == 0.0
        for r in group:
            assert r.env_error is None and len(r.versions) == len(r.completion_ids) == len(r.logprobs) == len(r.mask)
            model_tokens = [t for t, m in enumerate(r.mask) if m]
            assert len(model_tokens) >= 2 and sum(1 - m for m in r.mask) > 0
            mixed += {r.versions[t] for t in model_tokens} == {0, 1}
            for t in model_tokens:
                want = _teacher_forced(models[r.versions[t]], r.prompt_ids + r.completion_ids[:t],
                                       [r.completion_ids[t]], 0.8)[0]
                assert abs(want - r.logprobs[t]) < 1e-4, (it, r.group, t)
            out.append(r)
    assert mixed > 0
    return out


def test_a_stopped_sampler_closes_the_episodes_in_flight_and_a_new_one_completes_their_groups(tmp_path,
                                                                                              monkeypatch):
    """Stopped at any moment, the episodes' sampler closes every environment it opened (those of episodes in
    flight too); what it committed stays, and a new sampler samples only the rest: every group of every
    iteration once."""
    from tasks.envs.runtime import streamed

    letters = ROOT / "configs" / "letters.yaml"
    cfg = load_config(letters, _overrides(tmp_path, "epsagain", "generate.streaming.max_rows=8", iterations=2))
    opened, closed = [], []
    real_begin, real_close = streamed.begin, streamed.close

    def begin(caller, episodes, *args):
        opened.extend(id(e) for e in episodes)
        real_begin(caller, episodes, *args)

    def close(caller, episodes, stop=True):
        closed.extend(id(e) for e in episodes)
        real_close(caller, episodes, stop)
    monkeypatch.setattr(streamed, "begin", begin)
    monkeypatch.setattr(streamed, "close", close)
    records = _stopped_then_resumed(cfg, "epsagain", streamed.StreamedEpisodes,
                                    lambda: sorted(opened) == sorted(closed) and len(opened) >= 16)
    assert all(r.env_return is not None for it in (1, 2) for r in records[it])


def _stopped_then_resumed(cfg, run: str, source, after_stop) -> dict:
    """Iteration 1 collected, the run's sampler stopped (`after_stop()` must then hold), a new sampler collecting
    iterations 1 and 2: every group once, in order; what the first committed never committed again."""
    store = open_store(cfg)
    Stream.of(cfg, 1, groups=source.given(None)).collect(1)
    Stream.stop_run(run)
    assert after_stop()
    kept = {(it, j): m for it in (1, 2) for j in range(4)
            if (m := store.manifest(layout.stream_group(run, it, j))) is not None}
    second = Stream(cfg, 1, None, source.given(None))
    records = {it: second.collect(it)[0] for it in (1, 2)}      # (no policy is published here: v0's iterations)
    second.stop()
    for it in (1, 2):
        assert [r.group for r in records[it]] == [j for j in range(4) for _ in range(4)]
    for (it, j), manifest in kept.items():                          # committed once, never again
        assert store.manifest(layout.stream_group(run, it, j)) == manifest
    return records


def test_agents_calls_stream_one_row_each_and_each_token_is_its_versions(tmp_path, monkeypatch):
    """env.agent with streaming (tasks/envs/runtime/streamed.py: StreamedAgents): each call an agent makes to its
    endpoint joins the continuous batch as it comes and is answered when its row finishes, the agents at work
    meanwhile. A policy published after the first calls are answered is loaded before the next decode step, so
    later calls of the episodes then in flight are the newer policy's: every model token's behaviour logprob is
    its recorded version's on the episode's context, the versions differ within some episodes, each return is
    the letters its replies got right, the iterations' prompts are the stage mode's, nothing discarded."""
    from tasks.envs.runtime import streamed

    cfg = load_config(AGENT, _overrides(tmp_path, "agents", "train.lora_r=4", "generate.max_completion_length=2",
                                        "generate.temperature=0.8", "generate.top_p=1.0", "env.concurrency=8",
                                        "generate.streaming.on_update=interrupt", "generate.streaming.max_rows=8",
                                        iterations=2))
    models = {0: load_model(base_path(cfg)).eval()}
    answered = []
    real_advance = streamed.StreamedAgents.advance

    def advance_and_publish_once(self, finished):
        out = real_advance(self, finished)
        answered.append(len(finished))
        if len(answered) == 1:                  # (in the sampler's thread, between two decode steps)
            models[1] = _publish_adapter(cfg, 1, tmp_path)
        return out
    monkeypatch.setattr(streamed.StreamedAgents, "advance", advance_and_publish_once)
    records = _two_iterations_streamed(cfg, streamed.StreamedAgents, monkeypatch)
    assert len(answered) > 1
    for r in _episodes_each_token_its_versions(cfg, records, models):
        assert r.env_state["calls"] >= 2
        letters = str(r.columns["letters"])
        said = [m["content"] for m in r.turns if m["role"] == "assistant"]
        assert r.env_return == pytest.approx(sum(a.strip() == b for a, b in zip(said, letters)) / len(letters))


def test_a_stopped_sampler_ends_the_agents_at_work_and_a_new_one_completes_their_groups(tmp_path):
    """Stopped at any moment, the agents' sampler ends every agent still at work (their calls answered with an
    error, none left waiting) and stops its endpoint; what it committed stays, and a new sampler samples only the
    rest: every group of every iteration once, each episode's return its agent's."""
    import threading

    cfg = load_config(AGENT, _overrides(tmp_path, "agentsagain", "generate.streaming.max_rows=8", "env.concurrency=8",
                                        iterations=2))
    from tasks.envs.runtime import streamed

    threads = set(threading.enumerate())
    records = _stopped_then_resumed(cfg, "agentsagain", streamed.StreamedAgents, lambda: True)
    assert all(r.env_error is None and r.env_return is not None for it in (1, 2) for r in records[it])
    left = [t for t in set(threading.enumerate()) - threads if t.is_alive() and t.name in ("endpoint", "agents")]
    assert left == []


def _arrived(calls, n: int, threads) -> list:
    """The rows of the n calls the threads make, as they join (the calls wait meanwhile)."""
    rows = []
    while len(rows) < n:
        assert any(t.is_alive() for t in threads)
        rows += calls.arrived()
        time.sleep(0.01)
    return rows


def test_a_call_ended_while_its_row_decodes_has_its_tokens_counted_as_discarded():
    """An agent ended mid-call (a client-side timeout, say): its call is answered with an error at once, its row
    finishes in the batch unread, and its tokens are counted as discarded (generate/discarded_tokens); a call
    answered as usual counts nothing."""
    import threading

    from tasks.envs.runtime.calls import Refused
    from tasks.envs.runtime.streamed import _Calls

    params = SamplingParams(n=1, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=0)
    calls, got = _Calls(None, params), {}

    def call(key: str) -> None:
        try:
            got[key] = calls.sample([[1, 2, 3]], params, keys=[key]).samples[0].completion_ids
        except Refused as e:
            got[key] = e
    threads = [threading.Thread(target=call, args=(k,)) for k in ("ended", "kept")]
    for t in threads:
        t.start()
    rows = _arrived(calls, 2, threads)
    for r in rows:
        r.tokens += [5, 6, 7]
    calls.cancel("ended")
    threads[0].join(60)
    for r in rows:
        r.done = True
        calls.answer(r)
    threads[1].join(60)
    assert isinstance(got["ended"], Refused) and got["ended"].status == 409 and got["kept"] == [5, 6, 7]
    assert calls.discarded == 3


def test_a_call_that_narrows_its_sampling_joins_the_batch_at_its_own():
    """A call within env.endpoint's bounds (the endpoint checks them) becomes a row sampled at its own temperature
    and top_p (the batch samples it so: test_rows_at_their_own_temperature_and_top_p_share_the_batch); a call at
    the run's settings, a row at the sampler's."""
    import dataclasses
    import threading

    from tasks.envs.runtime.streamed import _Calls

    run = SamplingParams(n=1, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=0)
    calls = _Calls(None, run)
    asked = {"run": run, "cooler": dataclasses.replace(run, temperature=0.5),
             "narrower": dataclasses.replace(run, top_p=0.7, max_new_tokens=4)}
    threads = [threading.Thread(target=calls.sample, args=([[1, 2]], p), kwargs={"keys": [k]})
               for k, p in asked.items()]
    for t in threads:
        t.start()
    rows = _arrived(calls, 3, threads)
    assert {r.owner: (r.sampling, r.limit) for r in rows} == {
        "run": (None, 8), "cooler": ({"temperature": 0.5}, 8), "narrower": ({"top_p": 0.7}, 4)}
    for r in rows:
        r.tokens, r.done = [5], True
        calls.answer(r)
    for t in threads:
        t.join(60)


def test_streamed_agents_that_fail_or_hang_cost_only_their_episode(tmp_path):
    """Agents that raise, hang (past env.timeout_seconds) or return garbage while streaming: each is ended and its
    episode failed with the stage mode's words, its call's tokens kept; the others' groups are unharmed."""
    import json

    modes = ["ok", "raise", "async_hang", "garbage"]
    path = tmp_path / "unruly.jsonl"
    path.write_text("".join(json.dumps({"prompt": "p", "letters": "abc", "mode": m}) + "\n" for m in modes))
    cfg = load_config(AGENT, _overrides(tmp_path, "unruly", "env.agent=tests.agent_examples:unruly",
                                        f"data.path={path}", "env.timeout_seconds=3", "generate.num_generations=2",
                                        "generate.max_completion_length=3", "generate.streaming.max_rows=8",
                                        iterations=1))
    from tasks.envs.runtime.streamed import StreamedAgents

    stream = Stream.of(cfg, 1, groups=StreamedAgents.given(None))
    try:
        records, metrics, _, _ = stream.collect(1)
    finally:
        assert Stream.stop_run("unruly") == 0
    by_mode = {r.columns["mode"]: r for r in records}
    assert len(records) == 8 and by_mode["ok"].env_error is None and by_mode["ok"].env_return == 1.0
    assert "ValueError: the agent broke" in by_mode["raise"].env_error
    assert by_mode["async_hang"].env_error == "the agent did not return within env.timeout_seconds"
    assert "expected a finite number" in by_mode["garbage"].env_error
    for r in records:
        assert r.env_state["calls"] == 1 and sum(r.mask) >= 1 and len(r.versions) == len(r.completion_ids)


@pytest.mark.slow
@pytest.mark.parametrize(("config", "where"), [("letters.yaml", []), ("agent.yaml", []),
                                               ("letters.yaml", ["env.where=local", "env.servers=2",
                                                                 "env.isolation=process"])],
                         ids=["environments", "agents", "environment-pool"])
def test_the_letters_game_streams_through_the_flow_and_learns_from_the_environments_return(prefect_api, tmp_path,
                                                                                            monkeypatch, config,
                                                                                            where):
    """configs/letters.yaml (environments in the stage, or on a pool of two environment servers of the flow's,
    each episode in a process of its own) and configs/agent.yaml (the same game as an agent) with
    generate.streaming, 3 iterations: each trains on the stage mode's prompts, its episodes' tokens within
    run.max_staleness, the reward the episode's return (scored as each group completed), the episodes' metrics
    logged (on the pool: which server ran each, env/pool_*); the sampler stops with the flow, nothing
    discarded."""
    from mlflow.tracking import MlflowClient

    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    letters = ROOT / "configs" / config
    overrides = _overrides(tmp_path, "game", "generate.streaming.on_update=interrupt", *where, iterations=3)
    summary = train_flow(str(letters), overrides)
    cfg = load_config(letters, overrides)
    store = open_store(cfg)
    n_rows = len(data.load_prompts(cfg))
    for it in range(1, 4):
        records = rollout.load(store, layout.rollouts("game", it))
        assert [r.row for r in records[::4]] == curriculum.prompts(cfg, store, it, 0, n_rows)[0]
        oldest = layout.version_of(layout.behaviour_policy("game", it, 1))
        assert all(min(r.versions) >= oldest and r.env_return is not None and r.mask for r in records)
        scored = rollout.load(store, layout.rewards("game", it))
        assert [r.reward for r in scored] == pytest.approx([r.env_return for r in records])
        assert "reward/streamed_seconds" in store.manifest(layout.rewards("game", it))["meta"]["metrics"]
        if cfg.env.servers > 1:                 # each episode's server, counted in the iteration's metrics
            served = [r.env_server for r in records]
            meta = store.manifest(layout.rollouts("game", it))["meta"]["metrics"]
            assert set(served) <= {"0", "1"} and meta["env/pool_lost"] == 0, (served, meta)
            assert [meta[f"env/pool_server{i}_episodes"] for i in (0, 1)] == [served.count(s) for s in "01"], meta
    history = MlflowClient(cfg.tracking.uri).get_metric_history
    assert [m.value for m in history(summary["mlflow_run_id"], "generate/discarded_tokens")] == [0.0] * 3
    assert [m.value for m in history(summary["mlflow_run_id"], "env/episodes")] == [16.0] * 3
    if cfg.env.agent:
        assert all(m.value >= 2 for m in history(summary["mlflow_run_id"], "agent/calls_mean"))
    assert Stream.RUNNING == {} and GroupScorer.RUNNING == {}


@pytest.mark.slow
def test_a_streamed_run_takes_the_curriculums_picks(tmp_path):
    """data.curriculum with streaming: the sampler picks iteration N's prompts once v(N-1-S) is loaded, by when
    the groups the curriculum learns from (iterations up to N-1-S) are stored, so each iteration trains on the
    rows the curriculum's rule gives from the stored rewards (recomputed here from nothing) whatever the timing;
    and the rule did defer rows (the prompts answered before 'e' always score 1: constant groups)."""
    from tests.test_dynamic_sampling import _iterations

    cfg = load_config(TINY, _overrides(tmp_path, "cur", "data.curriculum={defer: 2}", "generate.streaming.on_update"
                                     "=interrupt", 'reward.functions=[{"fn": "tests.reward_examples:'
                                     'early_letters_constant"}]', iterations=6))
    try:
        _iterations(cfg, 1, 6)
    finally:
        Stream.stop_run("cur")
    store = open_store(cfg)
    n_rows = len(data.load_prompts(cfg))
    meta = [store.manifest(layout.rollouts("cur", it))["meta"] for it in range(1, 7)]
    for it in range(1, 7):
        assert [r.row for r in rollout.load(store, layout.rollouts("cur", it))[::4]] == meta[it - 1]["rows"]
    for k in range(1, 6):
        store.delete_folder(layout.curriculum("cur", k))
    assert [curriculum.prompts(cfg, store, it, 0, n_rows)[0] for it in range(1, 7)] == [m["rows"] for m in meta]
    assert any(m["metrics"]["curriculum/deferred"] > 0 for m in meta)
    plain = [data.indices(n_rows, cfg.run.seed, data.cursor(it, 4), 4, cfg.data.shuffle) for it in range(1, 7)]
    assert [m["rows"] for m in meta] != plain


def test_a_scorer_that_failed_leaves_the_reward_stage_to_say_it(tmp_path):
    """Groups are scored as they complete; with reward.strict a function that raises stops that scorer, and the
    reward stage, scoring the iteration itself, fails with the function's one line (a user error), as without
    streaming."""
    from tasks.generate import generate
    from tasks.reward import reward
    from tasks.scoring.functions import RewardFunctionError

    cfg = load_config(TINY, _overrides(tmp_path, "strict", "reward.strict=true", "generate.streaming.on_update="
                                     "interrupt", 'reward.functions=[{"fn": "tests.reward_examples:refuses"}]',
                                     iterations=2))
    try:
        generate(cfg, 1, layout.BASE)
        with pytest.raises(RewardFunctionError, match="^reward function 'refuses' raised ValueError: cannot parse"):
            reward(cfg, 1)
        assert isinstance(Stream.RUNNING["strict"].listener.error, RewardFunctionError)   # (its scorer)
    finally:
        Stream.stop_run("strict")
    assert GroupScorer.RUNNING == {}


def _dynamic(tmp_path, name: str, iterations: int):
    return load_config(TINY, _overrides(
        tmp_path, name, "generate.dynamic_sampling={max_rounds: 3, prompts_per_round: 2}",
        "generate.max_completion_length=8", "generate.streaming.on_update=interrupt",
        'reward.functions=[{"fn": "tests.reward_examples:early_letters_constant"}]', iterations=iterations))


def _check_dropped_as_they_complete(cfg, store, it: int, groups: dict) -> int:
    """Iteration `it`'s streamed groups: its prompts' (the stage mode's rows), then one extra group per constant
    group, on the rows the stage mode's rounds 1.. take, in order, at most as many; returns the extra groups."""
    n_rows = len(data.load_prompts(cfg))
    extra_rows = [row for r in (1, 2) for row in curriculum.prompts(cfg, store, it, r, n_rows)[0]]
    flags = {j: dynamic_sampling.constant_groups(rows, 1e-6)[j] for j, rows in groups.items()}
    extra = len(groups) - 4
    assert list(groups) == list(range(4 + extra))
    assert extra == min(sum(flags.values()), len(extra_rows)), (it, flags)
    assert [groups[j][0].row for j in range(4)] == curriculum.prompts(cfg, store, it, 0, n_rows)[0]
    assert [groups[j][0].row for j in range(4, 4 + extra)] == extra_rows[:extra]
    return extra


def test_an_iteration_before_the_samplers_first_is_taken_from_the_store_or_refused(tmp_path):
    """A sampler started by iteration 2's stage (iteration 1 reused on a resume) never picks iteration 1: its
    stage run again (a repair of its rollouts) takes its groups as the store holds them, and says so in one error
    where they are not there, instead of waiting for ever."""
    cfg = load_config(TINY, _overrides(tmp_path, "before", "generate.max_completion_length=4",
                                       "generate.streaming.on_update=interrupt", iterations=3))
    try:
        first = Stream.of(cfg, 1).collect(1)[0]
    finally:
        Stream.stop_run("before")
    try:
        later = Stream.of(cfg, 2)
        later.collect(2)
        again = Stream.of(cfg, 1).collect(1)[0]
        assert [(r.group, r.row, r.completion_ids) for r in again] == \
            [(r.group, r.row, r.completion_ids) for r in first]
        open_store(cfg).delete_folder(layout.stream_group("before", 1, 2))
        later.taken.pop(1)
        with pytest.raises(RuntimeError, match=r"^generate.streaming: iteration 1 comes before this sampler's "
                                               r"first \(2\) and its groups are not all in the store"):
            later.collect(1)
    finally:
        Stream.stop_run("before")


def test_a_failed_samplers_tokens_in_flight_are_counted_as_discarded(tmp_path, monkeypatch):
    """A sampler that fails mid-batch (an environment server or the replicas' router gone) leaves its groups in
    flight to be decoded again by the next: their tokens are discarded, and the retried stage's
    generate/discarded_tokens says so (it read 0)."""
    from tasks.engines.hf_stream import HFDecoder

    cfg = load_config(TINY, _overrides(tmp_path, "failed", "generate.max_completion_length=16",
                                       "generate.streaming.on_update=interrupt", "generate.streaming.refill_share=0.1",
                                       "generate.temperature=3.0", iterations=3))
    real, lost = HFDecoder.step_batch, {}

    def flaky(self, rows, version, stop):
        if sum(len(r.tokens) for r in rows):
            lost["tokens"] = sum(len(r.tokens) for r in rows)
            raise ConnectionError("server gone")
        return real(self, rows, version, stop)

    monkeypatch.setattr(HFDecoder, "step_batch", flaky)
    try:
        failed = Stream.of(cfg, 1)
        with pytest.raises(RuntimeError, match="the sampler failed: server gone"):
            failed.collect(1)
        failed.thread.join()
        assert failed.counts["discarded_tokens"] >= lost["tokens"] > 0
        monkeypatch.undo()
        metrics = Stream.of(cfg, 1).collect(1)[1]
    finally:
        Stream.stop_run("failed")
    assert metrics["generate/discarded_tokens"] >= lost["tokens"]


def test_an_iteration_collected_again_is_the_same_groups(tmp_path):
    """A generate stage run again for an iteration its sampler already gave (a retry after the rollouts' write
    failed, a repair): the same groups, dynamic sampling's extra ones included (they were popped once taken)."""
    cfg = _dynamic(tmp_path, "again", 2)
    try:
        stream = Stream.of(cfg, 1, lambda: GroupScorer.start(cfg))
        first = stream.collect(1)[0]
        again = stream.collect(1)[0]
    finally:
        Stream.stop_run("again")
    assert len({r.group for r in first}) > 4                      # (extra groups: the check means something)
    assert [(r.group, r.row, r.completion_ids) for r in again] == [(r.group, r.row, r.completion_ids) for r in first]


def test_a_streamed_run_drops_constant_groups_as_they_complete(tmp_path):
    """generate.dynamic_sampling with streaming: each group scored constant starts one more of its iteration
    (prompts answered before 'e' always score 1: constant), on the stage mode's extra rows in order; the reward
    stage keeps the first useful groups by the stage mode's rule (select over the same rounds); nothing decoded
    is thrown away."""
    from tests.test_dynamic_sampling import _iterations

    cfg = _dynamic(tmp_path, "dyn", 3)
    try:
        _iterations(cfg, 1, 3)
        discarded = Stream.RUNNING["dyn"].counts["discarded_tokens"]
    finally:
        Stream.stop_run("dyn")
    store, extras = open_store(cfg), 0
    for it in range(1, 4):
        scored = rollout.load(store, layout.scored("dyn", it, 0))
        assert [(r.row, r.completion_ids) for r in scored] == \
            [(r.row, r.completion_ids) for r in rollout.load(store, layout.rollouts("dyn", it))]
        extras += _check_dropped_as_they_complete(cfg, store, it, dynamic_sampling.groups_of(scored))
        want, _ = dynamic_sampling.select(dynamic_sampling.as_rounds(scored, 4, 2), 4, 1e-6)
        kept = rollout.load(store, layout.rewards("dyn", it))
        assert [(r.group, r.row, r.completion_ids, r.reward) for r in kept] == \
            [(r.group, r.row, r.completion_ids, r.reward) for r in want]
        metrics = store.manifest(layout.rewards("dyn", it))["meta"]["metrics"]
        assert metrics["dynamic/groups_sampled"] == len(dynamic_sampling.groups_of(scored))
        assert "reward/streamed_seconds" in metrics                  # scored as they completed, not at once
    assert extras > 0 and discarded == 0


def test_a_stopped_sampler_with_dynamic_sampling_keeps_its_verdicts(tmp_path):
    """A sampler stopped mid-run and a new one: the groups committed before are kept, their verdicts taken
    again (scored ones read, unscored ones scored again), and each iteration's groups are its prompts' then one
    extra per constant group, each once."""
    cfg = _dynamic(tmp_path, "dynagain", 2)
    store = open_store(cfg)
    first = Stream.of(cfg, 1, lambda: GroupScorer.start(cfg))
    first.collect(1)
    Stream.stop_run("dynagain")
    kept = {(it, j): store.manifest(layout.stream_group("dynagain", it, j)) for it in (1, 2) for j in range(8)}
    kept = {k: v for k, v in kept.items() if v is not None}
    second = Stream(cfg, 1, GroupScorer.start(cfg))
    records = {it: second.collect(it)[0] for it in (1, 2)}
    second.stop()
    for it in (1, 2):
        groups = dynamic_sampling.groups_of(records[it])
        assert all(len(rows) == 4 for rows in groups.values())
        scored = {j: rollout.load(store, layout.stream_scored("dynagain", it, j)) for j in groups}
        _check_dropped_as_they_complete(cfg, store, it, scored)
    for (it, j), manifest in kept.items():
        assert store.manifest(layout.stream_group("dynagain", it, j)) == manifest
    assert GroupScorer.RUNNING == {}


@pytest.mark.parametrize(("extra", "says"), [
    (["generate.engine=vllm", "generate.mode=resident"], "generate.mode: resident with generate.streaming"),
    (["generate.dynamic_sampling={}", "launcher.stages.reward=local"],
     "generate.dynamic_sampling with generate.streaming drops a group as soon as the reward functions have scored "
     "it, in the flow's process, but reward runs local (launcher)"),
    (["run.max_staleness=0"], "generate.streaming needs run.max_staleness >= 1"),
    (["generate.streaming.buffer=3"], "generate.streaming.buffer: 3 groups is smaller than one iteration's "
                                      "(generate.prompts_per_iteration 4)"),
    (["generate.streaming.max_rows=2"], "generate.streaming.max_rows: 2 rows cannot hold one group "
                                        "(generate.num_generations 4: a group decodes at once); expected at least 4"),
    (["launcher.stages.generate=local"], "generate.streaming: the sampler runs in the flow's process, but "
                                         "generate runs local"),
])
def test_streaming_it_cannot_do_is_one_line_and_exit_2(tmp_path, extra, says):
    overrides = _overrides(tmp_path, "bad", "generate.streaming.on_update=interrupt", *extra)
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(TINY), *[a for o in overrides
                                                                               for a in ("-o", o)]],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], out.stderr
    assert not (tmp_path / "store").exists() and not (tmp_path / "mlflow.db").exists()


def test_streaming_from_a_hub_id_on_the_hf_engine_is_refused_in_the_preflight(tmp_path, monkeypatch):
    """Where the Hub answers, a hub id resolves to itself, which the streaming hf sampler cannot load in place:
    said before the run starts, not as a retried failure of its first stage."""
    from flows.preflight import preflight
    from tasks.core.errors import UserError

    monkeypatch.setattr("flows.preflight.base_path", lambda cfg: "HuggingFaceTB/SmolLM2-135M-Instruct")
    cfg = load_config(TINY, _overrides(tmp_path, "hub", "generate.streaming.on_update=interrupt",
                                       "model.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct"))
    with pytest.raises(UserError, match=r"^model.name_or_path: HuggingFaceTB/SmolLM2-135M-Instruct is a hub id, "
                                        r"and generate.streaming's hf sampler loads each policy in place"):
        preflight(cfg)
    assert not (tmp_path / "store").exists()


def test_streaming_takes_generate_elsewhere_when_replicas_decode_there(tmp_path):
    """generate on sky (or local) with generate.replicas: the sampler stays in the flow's process and the
    replicas run there, each decoding the rows placed on it (the drill: tests/test_replicas.py, a preempted
    replica cluster while streaming)."""
    from tasks.core.placement import placement_of

    for where in ("sky", "local"):
        cfg = load_config(TINY, _overrides(tmp_path, "routed", "generate.replicas=2",
                                           f"launcher.stages.generate={where}"))
        assert placement_of(cfg).replicas_where == where and placement_of(cfg).routes("generate")


def trained_each_prompt_once(store_uri, args: list[str], name: str, iterations: int, groups: int = 4,
                             per_group: int = 4, staleness: int = 1) -> None:
    """Every iteration of streamed run `name` trained on the stage mode's prompts (the curriculum's picks, in
    order), each group once and whole, every token within the staleness of the iteration's policy."""
    cfg = load_config(TINY, [a for a in args if a != "-o"] + [f"store.uri={store_uri}"])
    store = Store.open(str(store_uri))
    n_rows = len(data.load_prompts(cfg))
    for it in range(1, iterations + 1):
        records = rollout.load(store, layout.rollouts(name, it))
        rows, _ = curriculum.prompts(cfg, store, it, 0, n_rows)
        assert [r.row for r in records[::per_group]] == rows, f"iteration {it}"
        assert [r.group for r in records] == [j for j in range(groups) for _ in range(per_group)], f"iteration {it}"
        oldest = layout.version_of(layout.behaviour_policy(name, it, staleness))
        assert all(min(r.versions) >= oldest for r in records), f"iteration {it}"


@AT_LENGTH
@pytest.mark.slow
@pytest.mark.drill
def test_a_streamed_run_killed_and_resumed_trains_every_prompt_once(prefect_api, tmp_path):
    """SIGKILL of the whole flow (its streaming sampler inside) once iteration 3's first group is committed, then
    the same command to the end: every iteration trains on the stage mode's prompts, each group once, every token
    within the staleness, and the groups committed before the kill are the ones trained on (never sampled
    again)."""
    from tests.test_resume import _kill, _start, _wait_for

    args = [a for o in ["run.name=killed", "run.iterations=4", "run.max_staleness=1",
                        "generate.prompts_per_iteration=4", "generate.num_generations=4", "train.lr=1e-2",
                        "eval.every=0", "generate.streaming.on_update=interrupt"] for a in ("-o", o)]
    store_dir = tmp_path / "rlflow-store" / "killed"
    proc = _start(tmp_path, prefect_api, {}, args)
    _wait_for(store_dir / "iter-000003" / "stream" / "group-00000" / MANIFEST, proc)
    _kill(proc)
    store = Store.open(str(tmp_path / "rlflow-store"))
    before = {f"{it}/{j}": store.manifest(layout.stream_group("killed", it, j)) for it in range(1, 5)
              for j in range(4)}
    before = {k: v for k, v in before.items() if v is not None}
    done = run_cli(["run", str(TINY), *args, "--summary-json", "s.json"], tmp_path, prefect_api)
    assert done.returncode == 0, done.stderr
    assert read_summary(tmp_path / "s.json")["iterations_completed"] == 4
    trained_each_prompt_once(tmp_path / "rlflow-store", args, "killed", 4)
    for key, manifest in before.items():
        it, j = map(int, key.split("/"))
        assert store.manifest(layout.stream_group("killed", it, j)) == manifest


def test_a_streamed_environment_that_hangs_in_a_thread_costs_only_its_episodes(tmp_path):
    """env.isolation: thread, one slot (env.concurrency 1), a group whose environment's step hangs past
    env.timeout_seconds while streaming: its episodes fail at their time, the other groups' are unharmed. Was: the
    sampler's one caller, kept for the whole run, left the slot to the hung thread, and every later call waited
    out its own episode's time for it (the healthy groups failed as stalled)."""
    import json

    from tasks.envs.runtime.streamed import StreamedEpisodes

    modes = ["hang", "ok", "ok", "ok"]
    path = tmp_path / "hangs.jsonl"
    path.write_text("".join(json.dumps({"prompt": "Say each letter I name.", "letters": "abc", "seed": i,
                                        "mode": m}) + "\n" for i, m in enumerate(modes)))
    cfg = load_config(ROOT / "configs" / "letters.yaml", _overrides(
        tmp_path, "hangs", f"data.path={path}", "env.factory=tests.env_classes:Flaky", "env.isolation=thread",
        "env.concurrency=1", "env.timeout_seconds=3", "generate.num_generations=2", "env.max_tokens=400",
        "generate.max_completion_length=3", "generate.streaming.max_rows=8", iterations=1))
    stream = Stream.of(cfg, 1, groups=StreamedEpisodes.given(None))
    try:
        records, _, _, _ = stream.collect(1)
    finally:
        assert Stream.stop_run("hangs") == 0
    errors = sorted(((r.columns["mode"], r.env_error) for r in records), key=str)
    assert errors == [("hang", "step did not return within env.timeout_seconds")] * 2 + [("ok", None)] * 6, errors


def test_a_function_that_fails_while_streaming_is_called_once_an_iteration_and_scored_again_once_fixed(
        tmp_path, monkeypatch):
    """A reward function that raises while groups are scored as they complete: its first group is not stored and
    the rest of the iteration is left to the reward stage, which calls it once on the whole batch and says its
    one line (2 calls, not one a group: a function that hangs cost its timeout once a group, 16 of them at the
    default). Fixed and run again, the iteration is scored (was: the failed scoring was stored and reused, so the
    same error came back whatever the user fixed)."""
    from tasks.core.errors import UserError
    from tasks.generate import generate
    from tasks.reward import reward

    bug, calls = tmp_path / "bug", tmp_path / "calls"
    bug.write_text("")
    monkeypatch.setenv("RLFLOW_TEST_BUG", str(bug))
    monkeypatch.setenv("RLFLOW_TEST_CALLS", str(calls))
    cfg = load_config(TINY, _overrides(tmp_path, "fixed", "generate.streaming.on_update=interrupt",
                                       'reward.functions=[{"fn": "tests.reward_examples:fails_until_fixed"}]',
                                       "generate.max_completion_length=4", iterations=2))
    try:
        generate(cfg, 1, layout.BASE)
        with pytest.raises(UserError, match=r"^reward: every reward call of iteration 1 failed.*KeyError"):
            reward(cfg, 1)
    finally:
        Stream.stop_run("fixed")
    ones = [c for c in calls.read_text().split() if c.startswith("1:")]     # (iteration 2's groups stream too)
    assert ones == ["1:4", "1:16"]                 # (a group of 4, then the stage's whole batch)
    bug.unlink()
    done = reward(cfg, 1)
    assert done["metrics"]["reward/fails_until_fixed/errors"] == 0.0, done["metrics"]
    assert done["metrics"].get("reward/missing_share", 0.0) == 0.0, done["metrics"]


def test_what_a_function_prints_in_one_iterations_groups_shares_one_budget(tmp_path, monkeypatch, capfd):
    """Groups scored as they complete: what the functions print gets $RLFLOW_USER_OUTPUT_BYTES an iteration, as
    the stage mode's one call does (was: a budget a group, 16 of them a batch at the defaults)."""
    from tasks.generate import generate
    from tasks.reward import reward

    monkeypatch.setenv("RLFLOW_USER_OUTPUT_BYTES", "100000")
    cfg = load_config(TINY, _overrides(tmp_path, "chatty", "generate.streaming.on_update=interrupt",
                                       'reward.functions=[{"fn": "tests.reward_examples:chatty_in_iteration_1"}]',
                                       "generate.max_completion_length=4", iterations=2))
    try:
        generate(cfg, 1, layout.BASE)
        done = reward(cfg, 1)
    finally:
        Stream.stop_run("chatty")
    assert "reward/streamed_seconds" in done["metrics"]              # (scored as the groups completed)
    printed = capfd.readouterr()
    assert 80_000 <= (printed.out + printed.err).count("x" * 1000) * 1000 <= 100_000
