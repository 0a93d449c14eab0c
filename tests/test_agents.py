"""Agents as users write them (env.agent; tasks/envs/runtime/agents.py) against rlflow's endpoint
(tasks/envs/runtime/endpoint.py): the tokens recorded are the tokens sampled, turns merge or split step-wise, agents
that fail cost only their episode, 64 at once, the same rollouts when a stage is run again, every learner's mask,
and the demo through the flow with resume equality and overlap. The endpoint's routes with the real openai client
and an agent framework: tests/test_endpoint.py; verifiers 0.4 environments: tests/test_verifiers_v04.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import openai
import pytest
import torch

from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.contracts import Rollout, Sampled, SamplingParams
from tasks.core.errors import UserError
from tasks.core.store import Store
from tasks.engines.sampling import open_session
from tasks.envs.runtime.agents import agent_metrics, run_agents
from tasks.envs.runtime.endpoint import Endpoint
from tests.conftest import AT_LENGTH

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "configs" / "agent.yaml"
LETTERS = [{"prompt": "Say each letter I name.", "letters": s, "seed": i} for i, s in enumerate(["abc", "dcb", "bba",
                                                                                               "cad"])]


class Recorder:
    """A session that passes every `sample` to a real one and keeps what went in and came out."""

    def __init__(self, session):
        self.session, self.tokenizer, self.load_seconds = session, session.tokenizer, 0.0
        self.requests: list[tuple[list[list[int]], SamplingParams, Sampled]] = []

    def sample(self, prompt_ids, params, keys=None):
        out = self.session.sample(prompt_ids, params)
        self.requests.append(([list(p) for p in prompt_ids], params, out))
        return out

    def close(self):
        self.session.close()


def _cfg(agent: str, *more: str):
    return load_config(AGENT, [f"env.agent=tests.agent_examples:{agent}", "generate.max_completion_length=3", *more])


def _run(cfg, n: int = 2, rows=LETTERS, seed: int = 3):
    with open_session(cfg, "base") as real:
        session = Recorder(real)
        records, _ = run_agents(cfg, dict(enumerate(rows)), list(range(len(rows))), session, SamplingParams(
            n=n, max_new_tokens=cfg.generate.max_completion_length, temperature=1.0, top_p=1.0, seed=seed), "base")
    return records, session


# ------------------------------------------------------------------------------------------ tokens

def test_an_episodes_turns_merge_into_the_tokens_the_engine_sampled():
    """The letters game with the plain openai client on the real hf engine: each episode's three calls extend
    one another token for token, so they are one sample: the first call's prompt, then every token after it,
    mask 1 exactly on what the engine sampled (with its logprobs) and 0, logprob 0, on what the agent added."""
    cfg = _cfg("say_letters")
    records, session = _run(cfg)
    assert len(records) == 8 and all(r.part == 0 and r.env_error is None for r in records)
    sampled: dict[tuple, list] = {}                     # context -> what was sampled for it (a group's episodes
    for prompts, _, out in session.requests:           # start alike)
        for s in out.samples:
            sampled.setdefault(tuple(prompts[s.prompt]), []).append((s.completion_ids, s.logprobs))
    for r in records:
        assert len(r.mask) == len(r.completion_ids) == len(r.logprobs)
        assert sum(r.mask) >= 3 and r.env_state["calls"] == 3
        context, i = list(r.prompt_ids), 0
        while i < len(r.completion_ids):                 # walk the turns: each model span is a sampled completion
            if r.mask[i]:
                n = next(k for k in range(i, len(r.mask) + 1) if k == len(r.mask) or not r.mask[k]) - i
                span = (r.completion_ids[i:i + n], r.logprobs[i:i + n])
                assert span in [(ids[:n], lps[:n]) for ids, lps in sampled[tuple(context)]]
                ids = span[0]
                context += ids
                i += len(ids)
            else:
                assert r.logprobs[i] == 0.0
                context.append(r.completion_ids[i])
                i += 1
        said = [m["content"] for m in r.turns if m["role"] == "assistant"]
        letters = LETTERS[r.row]["letters"]
        assert r.env_return == pytest.approx(sum(s.strip()[:1] == want for s, want in zip(said, letters)) / 3)
    # lockstep: every episode's call of a turn is in one batch (8 episodes, 3 turns: 3 samplings, not 24)
    assert len(session.requests) == 3 and all(len(p) == 8 for p, _, _ in session.requests)


def test_an_agent_that_edits_its_history_splits_step_wise_and_shares_its_episodes_advantage():
    from tasks.algorithms.learners.registry import make
    from tasks.engines.training import episode_signal

    cfg = _cfg("editor", "generate.num_generations=2")
    records, _ = _run(cfg, n=2, rows=LETTERS[:2])
    assert [(r.group, r.part) for r in records] == [(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 1), (1, 0), (1, 1)]
    for lead, part in zip(records[::2], records[1::2]):
        assert part.env_return == lead.env_return == 1.0 and part.env_state["agent_info"] == {"edited": True}
        assert part.prompt_ids != lead.prompt_ids[:len(part.prompt_ids)]      # rendered fresh: its own prompt
    assert agent_metrics(records)["agent/split_episodes"] == 4
    for i, r in enumerate(records):
        r.reward = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0][i]
    scores = episode_signal(make(cfg, 1), records)
    assert scores[0] == scores[1] > 0 > scores[2] == scores[3]               # the group is 2 episodes, not 4 rows
    assert scores[4] == scores[5] == scores[6] == scores[7] == 0


def test_the_return_comes_from_set_reward_when_the_agent_returns_none():
    records, _ = _run(_cfg("sync_letters", "env.isolation=process"), n=1, rows=LETTERS[:2])
    assert [r.env_return for r in records] == [0.5, 0.5]
    assert records[0].env_state["agent_info"] == {"by": "set_reward"} and records[0].env_state["calls"] == 2


def test_reward_functions_score_the_final_transcript_beside_the_agents_return(tmp_path, monkeypatch):
    """With reward.functions the agent's return is the reward `env` beside them; each function gets the
    episode's final transcript after its first prompt, as TRL passes multi-turn completions (message lists)."""
    from tasks.scoring.functions import load_functions, score_records

    (tmp_path / "transcript_rewards.py").write_text(
        "def said(completions, letters, **kwargs):\n"
        "    return [sum(m['content'].strip()[:1] == want\n"
        "                for m, want in zip([m for m in c if m['role'] == 'assistant'], wanted)) / 3\n"
        "            for c, wanted in zip(completions, letters)]\n")
    monkeypatch.chdir(tmp_path)
    cfg = _cfg("say_letters", 'reward.functions=[{"fn": "transcript_rewards:said"}]', "env.reward_weight=1")
    records, _ = _run(cfg, n=2, rows=LETTERS[:2])
    assert all([m["role"] for m in r.turns] == ["assistant", "user", "assistant", "user", "assistant"]
               for r in records)
    score_records(load_functions(cfg), records, "sum")
    for r in records:                       # the function recounts what the agent counted, from the transcript
        assert r.rewards["said"] == pytest.approx(r.env_return) and r.reward == pytest.approx(2 * r.env_return)


# ------------------------------------------------------------------------------------------ limits and failures

def test_limits_refuse_the_call_past_them_and_mark_the_episode_truncated():
    for more, limited in ((["env.max_turns=2"], "env.max_turns"), (["env.max_tokens=30"], "env.max_tokens")):
        records, _ = _run(_cfg("say_letters", *more), n=1, rows=LETTERS[:1])
        (r,) = records
        assert r.truncated and limited in r.env_state["limited"] and r.env_error is None   # (it raised: no return)
        assert r.env_state["calls"] <= 2 and len(r.completion_ids) <= 30


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_agents_that_crash_hang_or_return_garbage_cost_only_their_episode(isolation):
    modes = ["ok", "raise", "exit", "hang", "async_hang", "garbage", "huge", "tensor", "numpy", "chdir", "no_path",
             "child_exit", "ok"]
    if isolation == "thread":        # (a process's death, or a coroutine blocking the loop they share: process)
        modes[modes.index("hang")] = "sync_hang"
    here, path = os.getcwd(), list(sys.path)
    rows = [{"prompt": "p", "letters": "abc", "mode": m, "seed": i} for i, m in enumerate(modes)]
    # (20 s: on a loaded machine a process-isolated agent that raises at once took more than 6 s to start and say so)
    cfg = _cfg("unruly", f"env.isolation={isolation}", "env.timeout_seconds=20")
    records, _ = _run(cfg, n=1, rows=rows)      # (each hang is cut at its timeout: said in its own env_error)
    by_mode = {row["mode"]: r for row, r in zip(rows, records)}
    assert by_mode["ok"].env_error is None and by_mode["ok"].env_return == 1.0
    assert records[-1].env_error is None and records[-1].env_return == 1.0
    assert "ValueError: the agent broke" in by_mode["raise"].env_error
    if isolation == "process":
        assert "the agent's process died (exit 3)" in by_mode["exit"].env_error
    else:                           # (os._exit in the stage's own process: refused there, that episode failed)
        assert "ExitRefused: os._exit(3) refused" in by_mode["exit"].env_error
    for mode in {"hang", "async_hang", "sync_hang"} & set(by_mode):
        assert by_mode[mode].env_error == "the agent did not return within env.timeout_seconds"
    assert "expected a finite number" in by_mode["garbage"].env_error
    assert "the agent returned an int too large for a float: expected a finite" in by_mode["huge"].env_error
    assert by_mode["tensor"].env_error == "the agent returned Tensor: expected a finite number, (number, dict) or None"
    assert by_mode["numpy"].env_error is None and by_mode["numpy"].env_return == 0.5
    assert "SystemExit: 4" in by_mode["child_exit"].env_error   # (the loop they share goes on: the last is ok)
    if isolation == "process":
        assert by_mode["chdir"].env_error is None and by_mode["chdir"].env_return == 1.0
    else:                           # (the stage's working directory, which its relative paths read: refused)
        assert "ChdirRefused: os.chdir('/') refused" in by_mode["chdir"].env_error
    assert os.getcwd() == here
    assert by_mode["no_path"].env_error is None and set(path) <= set(sys.path)   # (emptied: every import failed)
    for mode in ("raise", "async_hang", "garbage"):
        assert by_mode[mode].env_return is None and by_mode[mode].env_state["calls"] == 1   # its tokens kept
        assert sum(by_mode[mode].mask) >= 1


def test_an_agents_own_process_writes_a_bounded_amount(capfd, monkeypatch):
    """env.isolation: process: what an agent writes to its descriptors (os.write here) reaches the stage's
    output within $RLFLOW_USER_OUTPUT_BYTES per process, said once each."""
    monkeypatch.setenv("RLFLOW_USER_OUTPUT_BYTES", "100000")
    rows = [{"prompt": "p", "letters": "abc", "mode": "chatty_fd", "seed": i} for i in range(2)]
    records, _ = _run(_cfg("unruly", "env.isolation=process", "env.timeout_seconds=60"), n=1, rows=rows)
    assert [r.env_return for r in records] == [1.0, 1.0], [r.env_error for r in records]
    out, err = capfd.readouterr()
    printed = sum(len(line) for line in (out + err).splitlines() if line and set(line) == {"x"})
    assert 2 * 99_000 < printed <= 2 * 100_000, printed
    assert (out + err).count("[rlflow: a user's code printed more than 100000 bytes in an agent's process") == 2


def test_an_agent_calling_on_past_its_limit_is_named_when_nothing_is_scored():
    """An agent that calls on past env.max_turns and returns nothing: its episodes are truncated, unscored; the
    stage's one line says so (it said only "every score was None")."""
    from tasks.scoring.functions import load_functions, require_some_score, score_records

    cfg = _cfg("calls_on", "env.max_turns=2", "env.isolation=thread")
    records, _ = _run(cfg, n=2, rows=LETTERS[:1])
    assert len(records) == 4 and all(r.truncated and r.env_state["calls"] == 2 for r in records)   # (2 calls,
    #                                                                 the second not extending the first: 2 each)
    scored = score_records(load_functions(cfg), records, "sum")
    with pytest.raises(UserError, match=r"^reward: no completion of iteration 1 was scored .*every score was None "
                       r"\(no function scored any completion\): 4 of 4 completions are of episodes cut at "
                       r"env.max_turns \(2\) calls before the agent gave a return; expected"):
        require_some_score(records, scored, "iteration 1")


def test_64_agents_at_once_sample_in_one_batch_per_turn():
    rows = [{"prompt": "Say each letter I name.", "letters": "abcd"[i % 4] * 3, "seed": i} for i in range(8)]
    records, session = _run(_cfg("say_letters", "env.concurrency=64", "env.isolation=thread"), n=8, rows=rows)
    assert len(records) == 64 and all(r.env_error is None and r.env_state["calls"] == 3 for r in records)
    assert [len(p) for p, _, _ in session.requests] == [64, 64, 64]


def test_the_same_stage_samples_the_same_rollouts_whatever_the_timing(tmp_path):
    """Lockstep rounds depend on the agents alone: with fewer slots than episodes (agents ending and starting at
    different times) a rerun of the stage gives the same tokens, what a killed and retried generate needs."""
    cfg = _cfg("jittery", "env.concurrency=5", "env.isolation=thread")
    runs = [_run(cfg, n=4) for _ in range(2)]
    seen = [[(r.completion_ids, r.logprobs, r.env_return) for r in records] for records, _ in runs]
    # (said where they differ: each run's rounds, as (size, seed), and its episodes' errors, to tell a round made
    # of other episodes from an episode that failed)
    how = [([(len(p), q.seed) for p, q, _ in session.requests], [r.env_error for r in records])
           for records, session in runs]
    # (an episode that failed, whatever the cause, changes the size of every round after it, so every later
    # episode's tokens: said as that failure, not as a token diff)
    assert [[(i, e) for i, e in enumerate(errors) if e] for _, errors in how] == [[], []], how
    assert seen[0] == seen[1], f"each run's rounds and errors: {how}"


def test_a_stopped_runner_lets_its_agents_unwind_before_its_loop_stops():
    """An async agent still at work when its stage ends is killed and unwinds (its `finally` runs, with an await
    in it, as a client closing its connection has) before the loop stops; the loop's thread ends. Stopped at once
    instead, a client was left mid-request and the endpoint's server waited on it for good."""
    import asyncio
    import threading

    from tasks.envs.runtime.agents import Running, Threads

    started, unwound = threading.Event(), threading.Event()

    async def agent(row, base_url, key):
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0)
            unwound.set()
    runner = Threads(agent, {})
    run = Running(0, "rl-key", time.monotonic())
    runner.start(run, {}, "http://127.0.0.1:9/v1")
    assert started.wait(60)
    run.kill()
    runner.stop()
    assert unwound.is_set() and not runner.thread.is_alive()


def test_calls_into_the_agents_loop_from_another_threads_loop_run_there_at_once():
    """openai's AsyncClient.__del__ closes an ended episode's connections on the loop running where the garbage
    collector ran: the endpoint's server thread. What that does to the agents' loop (a transport aborted, a
    timer set) runs on the agents' loop's own thread and wakes it. A plain loop kept it for its next wake-up
    and could lose timers (seen under load: an agent's asyncio.sleep never ended and its lockstep round
    waited env.timeout_seconds)."""
    import asyncio
    import threading

    from tasks.envs.runtime.loops import run_forever, users_loop

    loop = users_loop()
    threading.Thread(target=run_forever, args=(loop,), daemon=True).start()
    lost, fired, soon = threading.Event(), threading.Event(), threading.Event()

    class Client(asyncio.Protocol):
        def connection_lost(self, exc):
            lost.set()

    async def connect():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        transport, _ = await loop.create_connection(Client, "127.0.0.1", server.sockets[0].getsockname()[1])
        return server, transport

    server, transport = asyncio.run_coroutine_threadsafe(connect(), loop).result(60)

    async def finalizer_elsewhere():             # (another thread, its own loop running: the endpoint's)
        transport.abort()
        loop.call_later(0.01, fired.set)
        loop.call_soon(soon.set)

    try:
        asyncio.run(finalizer_elsewhere())
        assert lost.wait(60) and fired.wait(60) and soon.wait(60)
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)


def test_the_connections_an_agent_leaves_open_are_closed_with_its_loop():
    """An agent that never closes its client (kept_open: it keeps them, as a cache of clients would): its
    connections are aborted on the agents' loop before that closes, so the client's finalizer, run later on
    another loop, has nothing left to close. They stayed open until then, and that close failed on the closed
    loop: a traceback printed for each client ('Event loop is closed')."""
    import asyncio
    import gc

    from tests import agent_examples

    records, _ = _run(_cfg("kept_open", "env.isolation=thread"), n=1, rows=LETTERS[:2])
    assert [r.env_error for r in records] == [None, None] and len(agent_examples.KEPT) == 2

    async def finalized() -> list:
        gc.collect()                    # (clients earlier stages in this process left: not counted below)
        earlier = asyncio.all_tasks()
        agent_examples.KEPT.clear()
        gc.collect()                    # (openai's AsyncClient.__del__: its aclose() on this running loop)
        assert len(asyncio.all_tasks() - earlier) == 2
        return await asyncio.gather(*(asyncio.all_tasks() - {asyncio.current_task()}), return_exceptions=True)

    assert [repr(r) for r in asyncio.run(finalized()) if isinstance(r, BaseException)] == []


def test_a_bad_agent_spec_is_one_line_before_any_episode():
    for spec, expected in (("tests.no_such_module:run", "env.agent: cannot import module 'tests.no_such_module'"),
                           ("tests.agent_examples:nothing", "has no callable 'nothing'"),
                           ("tests.agent_examples:two_args", "cannot be called as run(row, base_url, api_key)")):
        cfg = load_config(AGENT, [f"env.agent={spec}"])
        with pytest.raises(UserError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            _run(cfg, n=1, rows=LETTERS[:1])
    with pytest.raises(Exception, match="set env.agent or env.factory, not both"):
        load_config(AGENT, ["env.factory=tasks.envs.builtin.games:SayTheLetters"])


# ------------------------------------------------------------------------------------------ the endpoint itself

def test_the_endpoint_refuses_other_models_bounds_and_closed_keys():
    cfg = _cfg("say_letters", "env.endpoint.temperature=[0.5, 1.0]")
    with open_session(cfg, "base") as session, Endpoint(cfg, session, "run/policy-v2", SamplingParams(
            n=1, max_new_tokens=3, temperature=1.0, top_p=1.0, seed=1)) as ep:
        key = ep.open(0, 1)
        client = openai.OpenAI(base_url=ep.base_url, api_key=key, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["run/policy-v2"]
        hi = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.NotFoundError, match="serves 'run/policy-v2'"):
            client.chat.completions.create(model="run/policy-v1", messages=hi)
        for kw, field in (({"max_tokens": 4}, "max_tokens"), ({"temperature": 0.2}, "temperature"),
                          ({"top_p": 1.5}, "top_p"), ({"n": 2}, "n")):
            with pytest.raises(openai.BadRequestError, match=field):
                client.chat.completions.create(model="policy", messages=hi, **kw)
        ok = client.chat.completions.create(model="run/policy-v2", messages=hi, max_tokens=1, temperature=0.5)
        assert ok.usage.completion_tokens == 1
        log = ep.close(key)
        assert len(log.calls) == 1 and len(log.calls[0].completion_ids) == 1
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model="policy", messages=hi)


def test_the_trainer_scores_each_call_at_the_temperature_and_top_p_it_was_sampled_at():
    """An agent asks each call for its own settings within env.endpoint's bounds (greedy, 0.5 at top_p 0.8, the
    run's 0.9, 1.4 at top_p 0.6): the rollout carries each token's, and the trainer's logprobs of the sampled tokens
    equal the sampler's (the mismatch is numerics); scored at the run's settings alone they do not."""
    from tasks.algorithms.batching import prepare_batches
    from tasks.algorithms.logprobs import Distribution, completion_logprobs
    from tasks.algorithms.update import logprobs
    from tasks.core.models import base_path, load_model

    cfg = _cfg("picky_letters", "env.endpoint.temperature=[0, 1.5]", "env.endpoint.min_top_p=0.5",
               "generate.temperature=0.9")
    with open_session(cfg, "base") as session:
        records, _ = run_agents(cfg, dict(enumerate(LETTERS)), list(range(len(LETTERS))), session, SamplingParams(
            n=2, max_new_tokens=3, temperature=0.9, top_p=1.0, seed=5), "base")
    drawn = {(t, p) for r in records for t, p, m in zip(r.temperatures, r.top_ps, r.mask) if m}
    assert drawn == {(1.0, 1.0), (0.5, 0.8), (0.9, 1.0), (1.4, 0.6)}      # (greedy: the logprobs at temperature 1)
    model = load_model(base_path(cfg)).eval()
    batches = prepare_batches(records, torch.zeros(len(records)), session.tokenizer.pad_token_id, cfg.train, "cpu")
    run_only = []
    with torch.no_grad():
        for b in batches:
            mine = logprobs(model, b, Distribution.of(cfg))[0]
            assert float(((mine - b.behaviour) * b.mask).abs().max()) < 1e-4
            plain = completion_logprobs(model, b.ids, b.attention, b.positions, b.width, Distribution.of(cfg))[0]
            run_only.append(float(((plain - b.behaviour) * b.mask).abs().max()))
    assert max(run_only) > 0.1


# ------------------------------------------------------------------------------------------ every learner

@pytest.fixture(scope="module")
def agent_records() -> list[Rollout]:
    """Real agent rollouts, step-wise parts and merged episodes, with rewards."""
    records = _run(_cfg("editor"), n=2, rows=LETTERS[:2])[0] + _run(_cfg("say_letters"), n=2, rows=LETTERS[:2])[0]
    for i, r in enumerate(records):
        r.reward = float(i % 3 == 0)
    return records


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "vtrace_awr"])
def test_every_learner_trains_agent_rollouts_through_their_mask(algorithm, agent_records):
    """Real agent rollouts (merged and step-wise): whatever the behaviour logprobs at the tokens the agent
    added (mask 0) say, an update ends at the same weights."""
    from tasks.algorithms.batching import prepare_batches
    from tasks.algorithms.learners.registry import make
    from tasks.algorithms.update import optimise
    from tasks.engines.torch_engine import TorchEngine
    from tasks.engines.training import episode_signal

    records = agent_records

    def trained(added: float) -> dict[str, torch.Tensor]:
        # (train.share_prompts off: its gathered prompt cache's backward is not bit-reproducible on CPU from one
        # run to the next, masks or not; see the note in docs/environments.md)
        cfg = _cfg("editor", f"train.algorithm={algorithm}", "train.num_iterations=2", "train.beta=0.05",
                   "generate.num_generations=2", "train.share_prompts=false")
        engine = TorchEngine.open(cfg, None, None)
        rows = [Rollout(**{**vars(r), "logprobs": [lp if m else added for lp, m in zip(r.logprobs, r.mask)]})
                for r in records]
        scores = episode_signal(make(cfg, 1), rows)
        optimise(engine, prepare_batches(rows, scores, engine.tokenizer.pad_token_id, cfg.train, "cpu"), cfg)
        state = {f"policy.{k}": v for k, v in engine.model.state_dict().items()}
        if engine.critic is not None:
            state.update({f"critic.{k}": v for k, v in engine.critic.state_dict().items()})
        return state

    a, b = trained(0.0), trained(-7.5)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------ through the flow

@pytest.mark.slow
def test_the_agent_demo_runs_through_the_flow_and_resumes_to_the_same_weights(tmp_path, prefect_api, monkeypatch):
    """configs/agent.yaml, 2 iterations: the agent's return is the reward; stopped after 1 and resumed, the run
    publishes the same v2 as an uninterrupted one."""
    from tests.test_envs import stopped_and_resumed_equals_whole

    monkeypatch.chdir(tmp_path)
    a = stopped_and_resumed_equals_whole(AGENT, tmp_path)
    meta = a.manifest(layout.rollouts("whole", 1))["meta"]["metrics"]
    assert meta["env/episodes"] == 16 and meta["env/turns_mean"] == 3 and meta["env/errors"] == 0
    assert meta["agent/calls_mean"] == 3 and meta["agent/split_episodes"] == 0
    assert "reward/env/mean" in a.manifest(layout.rewards("whole", 1))["meta"]["metrics"]


WHICH_MODEL = """
import openai


def which_model(row, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = client.models.list().data[0].id
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["prompt"]}])
    return 1.0, {"model": model}
"""


@AT_LENGTH
@pytest.mark.slow
def test_agents_on_a_sky_cluster_under_overlap_see_only_the_scheduled_policy(tmp_path, prefect_api, monkeypatch,
                                                                             s3_endpoint, bucket, fake_cloud):
    """generate on the (fake) cloud, a stage process on its cluster serving the endpoint to its agents, and
    run.max_staleness 1: iteration N's agents are served v(N-2) (the base model before iteration 3) by name, and
    nothing else."""
    from flows.training import train_flow
    from tasks.core import rollout
    from tests.conftest import user_module
    from tests.test_launchers import _sky

    monkeypatch.chdir(tmp_path)
    user_module(tmp_path, monkeypatch, "served", WHICH_MODEL)          # (importable in the stage's process too)
    overrides = _sky(tmp_path, s3_endpoint, bucket, fake_cloud, "overlap", [
        "run.iterations=3", "run.max_staleness=1", "launcher.where=inline", "launcher.stages={generate: sky}",
        "env.agent=served:which_model", "env.isolation=process"])
    out = train_flow(str(AGENT), overrides)
    assert out["iterations_completed"] == 3
    assert [c["task"] for c in fake_cloud.calls() if c["call"] in ("launch", "exec")].count("rlflow-generate") == 3
    store = Store.open(load_config(AGENT, overrides).store)
    for it, want in ((1, layout.BASE), (2, layout.BASE), (3, layout.policy("overlap", 1))):
        seen = {r.env_state["agent_info"]["model"] for r in rollout.load(store, layout.rollouts("overlap", it))}
        assert seen == {want}, (it, seen)


def test_what_an_agent_returns_is_named_as_it_is():
    """A NaN or a string is what the agent returned, not something it raised (was: 'agent raised TypeError: the
    agent returned float: expected a number' for a NaN, a float)."""
    from tasks.envs.runtime.agents import outcome

    for value, shown in [(float("nan"), "nan"), (float("inf"), "inf"), ("1", "str"), ((1.0, "x"), r"\(float, str\)")]:
        with pytest.raises(TypeError, match=rf"^the agent returned {shown}: expected a finite number, \(number, dict\) "
                                            r"or None$"):
            outcome(value)
    assert outcome((1, {"a": 1})) == (1, {"a": 1}) and outcome(None) == (None, {})


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_users_error_an_agent_raises_is_the_stages_one_line_not_its_episodes_failure(isolation):
    """An environment's UserError was the run's one line (exit 2); an agent's cost its episode alone, and a run
    whose evaluation's agents all raised it finished with exit 0, the line never said. The other agents end."""
    from tasks.core.errors import UserError

    rows = [{"prompt": "p", "letters": "abc", "mode": m, "seed": i} for i, m in enumerate(["ok", "user_error", "ok"])]
    cfg = _cfg("unruly", f"env.isolation={isolation}", "env.timeout_seconds=20")
    with pytest.raises(UserError, match=r"^env.agent: the agent needs a column 'level'$"):
        _run(cfg, n=1, rows=rows)


def test_a_coroutine_that_blocks_the_agents_loop_fails_its_episodes_with_why_and_the_next_get_a_loop_of_their_own():
    """env.isolation: thread: `time.sleep` inside an `async def` agent stops the loop every agent's coroutine runs
    on. Was: each episode on it ran out its time as if the endpoint stalled ("did not return within
    env.timeout_seconds"), which a stage reads as the environment's infrastructure failing and retries three
    times; the episodes started after it ran on the same blocked loop and failed too. Now they fail saying that
    the loop was blocked (the user's code: a stage whose every episode fails so is one line, exit 2), and the
    episode after it runs on a new loop and succeeds."""
    from tasks.envs.runtime.episodes import STALLED, require_some_episode

    rows = [{"prompt": "p", "letters": "abc", "mode": m, "seed": i} for i, m in enumerate(["ok", "hang", "ok"])]
    cfg = _cfg("unruly", "env.isolation=thread", "env.timeout_seconds=10", "env.concurrency=1")
    records, _ = _run(cfg, n=1, rows=rows)
    assert [r.env_return for r in records] == [1.0, None, 1.0]
    assert records[1].env_error.startswith("the event loop the agents share (env.isolation: thread) ran nothing for")
    assert STALLED not in records[1].env_error and records[1].env_state["calls"] == 1     # (its tokens kept)
    with pytest.raises(UserError, match=r"^env.agent: every episode of .* failed \(1 of 1\).*the event loop"):
        require_some_episode(cfg, records[1:2], "iteration 1")


def test_an_agent_that_empties_sys_path_has_it_put_back_as_its_coroutine_ends():
    """env.isolation: thread: `sys.path[:] = []` in an async agent emptied the stage's process's import path for
    as long as the agents' loop ran (its thread's user_code ends with it): every import of rlflow's after it
    failed, the run with a traceback. The entries it removed are put back as its coroutine ends (what it added
    stays)."""
    from tasks.envs.runtime.agents import Running, Threads

    async def agent(row, base_url, key):
        sys.path[:] = ["/added-by-the-agent"]
        return 1.0
    before = list(sys.path)
    runner = Threads(agent, {})
    try:
        run = Running(0, "rl-key", time.monotonic())
        runner.start(run, {}, "http://127.0.0.1:9/v1")
        assert run.result() == 1.0                  # (waits for it: the loop goes on running after)
        assert sys.path[:len(before) + 1] == ["/added-by-the-agent", *before]
    finally:
        sys.path[:] = before
        runner.stop()
