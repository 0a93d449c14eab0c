"""The verifiers 0.4 agent (tasks/envs/adapters/verifiers_v04.py): real verifiers 0.4 environments (tests/vf04_envs,
built from the package as `vf-init` scaffolds them) run unmodified in .venv-verifiers through the bridge, against a
real HTTP server started here that speaks the endpoint's routes with scripted replies: the token route verifiers'
trainer client calls (POST /inference/v1/generate, served by `generate_response`), streamed Chat Completions for its
eval client, GET /v1/models. Checked: each episode's calls arrive under its own key, verifiers' trace holds exactly
the token ids the route served, the rubric's reward comes back, a multi-turn episode with an MCP tool, and a failed
model call costing its episode. Then end to end through rlflow's own machinery: run_agents and its endpoint
(tasks/envs/runtime/agents.py, endpoint.py) on the builtin tiny model (hf) or a scripted session, both verifiers
clients, rewards from verifiers' rubric, samples holding exactly the sampled tokens (merged turns or step-wise
parts, and why), failing episodes; and the training flow for two iterations (`make drills` only).

Cost (the CI budget): every episode runs verifiers' harness program, a Python importing openai (~1-2 s on 2 cores),
one per turn of vf04_chat, so each test runs as few episodes as what it checks needs; one bridge (verifiers'
import, each environment loaded once, its uv script environment prepared once) serves the whole module, and the
bridge tests share one set of episodes run together (the `sums` fixture).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import pytest

from tasks.envs.adapters.verifiers_v04 import (
    GenerateRefused,
    VerifiersError,
    _paths,
    _VerifiersClient,
    generate_response,
    run,
    taskset_rows,
    verifiers_python,
)
from tasks.envs.builtin.webshop import free_port
from tests.conftest import AT_LENGTH

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
ENVS = str(ROOT / "tests" / "vf04_envs")
SUBPROCESS = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
SUMS = {"taskset": {"id": "vf04_sums"}, "agent": SUBPROCESS}
CALC = {"taskset": {"id": "vf04_calc"}, "agent": SUBPROCESS}
MODEL = "tiny-policy"

needs_venv = pytest.mark.verifiers04      # (tests/conftest.py: skipped without .venv-verifiers, a failure in CI)


# ------------------------------------------------------------------------------------------------ the token route

class Fixed:
    """A sampler that returns the same completion to every request, and remembers what it was asked."""

    def __init__(self, ids, logprobs, finish="stop"):
        self.reply, self.asked = (ids, logprobs, finish), []

    def sample_tokens(self, key, prompt_ids, **params):
        self.asked.append((key, prompt_ids, params))
        return self.reply


def test_generate_response_is_vllms_shape():
    sampler = Fixed([7, 2], [-0.5, -0.25])
    body = {"model": MODEL, "token_ids": [1, 5, 9], "sampling_params": {
        "temperature": 0.7, "max_tokens": 16, "stop_token_ids": [2], "logprobs": 1, "skip_special_tokens": False,
        "top_k": -1}}
    out = generate_response(body, "k1", sampler)
    assert sampler.asked == [("k1", [1, 5, 9], {"max_tokens": 16, "temperature": 0.7, "top_p": None,
                                                "stop_token_ids": [2], "stop": [], "seed": None})]
    (choice,) = out["choices"]
    assert choice["token_ids"] == [7, 2] and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["content"] == [{"token": "token_id:7", "logprob": -0.5},
                                             {"token": "token_id:2", "logprob": -0.25}]
    assert out["prompt_token_ids"] == [1, 5, 9] and out["request_id"].startswith("gen-")
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    # No max_tokens (verifiers sends the run's sampling only): the endpoint's own limit.
    generate_response({"model": MODEL, "token_ids": [1]}, "k1", sampler)
    assert sampler.asked[-1][2]["max_tokens"] is None


@pytest.mark.parametrize("body, code", [
    ({"token_ids": []}, "invalid_token_ids"),
    ({"token_ids": [1, -2]}, "invalid_token_ids"),
    ({"token_ids": "1 2"}, "invalid_token_ids"),
    ({"token_ids": [1], "features": {"mm_hashes": {}}}, "unsupported_multimodal"),
    ({"token_ids": [1], "content_parts": [{"type": "image_url", "url": "x"}]}, "unsupported_multimodal"),
    ({"token_ids": [1], "sampling_params": {"n": 2}}, "unsupported_sampling_param"),
    ({"token_ids": [1], "sampling_params": {"top_k": 20}}, "unsupported_sampling_param"),
    ({"token_ids": [1], "sampling_params": {"repetition_penalty": 1.1}}, "unsupported_sampling_param"),
    ({"token_ids": [1], "sampling_params": {"guided_json": {}}}, "unsupported_sampling_param"),
])
def test_generate_response_refuses_what_it_would_not_honour(body, code):
    sampler = Fixed([2], [-0.1])
    with pytest.raises(GenerateRefused) as e:
        generate_response(body, "k1", sampler)
    assert (e.value.status, e.value.code) == (400, code) and sampler.asked == []


def test_generate_response_refuses_a_sampler_whose_logprobs_do_not_match():
    with pytest.raises(RuntimeError, match="2 tokens and 1"):
        generate_response({"token_ids": [1]}, "k1", Fixed([7, 2], [-0.1]))


# ------------------------------------------------------------------------------------------------ a scripted endpoint

class Scripted:
    """The endpoint's routes over HTTP (starlette + uvicorn on a free port), with scripted replies: a sum's
    answer (or a wrong one for a key holding 'wrong'), a calc_add tool call and then its result; a key holding
    'fail' gets HTTP 400 for its model calls. Every call is kept under its bearer key."""

    def __init__(self, tokenizer):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        self.tok, self.calls, self.lock = tokenizer, {}, threading.Lock()
        self.JSON, self.Stream = JSONResponse, StreamingResponse
        self.app = Starlette(routes=[Route("/v1/models", self.models),
                                     Route("/v1/chat/completions", self.chat, methods=["POST"]),
                                     Route("/inference/v1/generate", self.generate, methods=["POST"])])

    def key(self, request) -> str:
        return request.headers.get("authorization", "").removeprefix("Bearer ")

    def keep(self, key: str, call: dict) -> None:
        with self.lock:
            self.calls.setdefault(key, []).append(call)

    async def models(self, request):
        return self.JSON({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 512}]})

    def answer(self, key: str, text: str) -> str:
        a, b = map(int, re.findall(r"(\d+)\+(\d+)=", text)[-1])
        return "wrong" if "wrong" in key else str(a + b)

    def sample_tokens(self, key, prompt_ids, **params):
        text = self.tok.decode(prompt_ids)
        ids = self.tok.encode(self.answer(key, text), add_special_tokens=False) + [self.tok.eos_token_id]
        logprobs = [-0.25 - i / 100 for i in range(len(ids))]
        self.keep(key, {"route": "generate", "prompt_ids": prompt_ids, "completion_ids": ids, "logprobs": logprobs,
                        "text": text, "params": params})
        return ids, logprobs, "stop"

    async def generate(self, request):
        key, body = self.key(request), await request.json()
        if "hang" in key:                    # (a model call that never ends: until its caller goes away)
            self.keep(key, {"route": "generate", "state": "waiting"})
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not await request.is_disconnected():
                await asyncio.sleep(0.05)
            self.keep(key, {"route": "generate", "state": "disconnected"})
            return self.JSON({"error": "gone"}, status_code=499)
        if "fail" in key:
            return self.JSON({"error": "scripted failure"}, status_code=400)
        if body.get("model") not in (MODEL, "policy"):
            return self.JSON({"error": f"model {body.get('model')!r}"}, status_code=404)
        try:
            return self.JSON(generate_response(body, key, self))
        except GenerateRefused as e:
            return self.JSON({"error": {"code": e.code, "message": e.message}}, status_code=e.status)

    async def chat(self, request):
        key, body = self.key(request), await request.json()
        self.keep(key, {"route": "chat", "body": body})
        if "fail" in key:
            return self.JSON({"error": {"message": "scripted failure"}}, status_code=400)
        last = body["messages"][-1]
        if last["role"] == "tool":
            message, finish = {"role": "assistant", "content": last["content"]}, "stop"
        else:
            a, b = map(int, re.findall(r"\d+", last["content"])[:2])
            call = {"id": "call_0", "type": "function",
                    "function": {"name": "calc_add", "arguments": json.dumps({"a": a, "b": b})}}
            message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
        head = {"id": "chatcmpl-1", "created": 0, "model": MODEL}
        if not body.get("stream"):
            return self.JSON({**head, "object": "chat.completion",
                              "choices": [{"index": 0, "message": message, "finish_reason": finish}]})
        delta = {**message, "tool_calls": [{**c, "index": i} for i, c in enumerate(message.get("tool_calls", []))]}

        async def events():
            for choice in ({"index": 0, "delta": delta, "finish_reason": None},
                           {"index": 0, "delta": {}, "finish_reason": finish}):
                yield f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': [choice]})}\n\n"
            yield "data: [DONE]\n\n"

        return self.Stream(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    """The scripted endpoint's base_url, its calls and the tokenizer folder (rlflow's character-level tiny
    tokenizer, which verifiers' renderer loads in the bridge)."""
    if not PYTHON.exists():
        pytest.skip(f"verifiers 0.4's environment ({PYTHON}) is missing: make setup builds it")
    _VerifiersClient.of(verifiers_python(None), _paths(ENVS))   # (started now: verifiers imports while the rest starts)
    import uvicorn

    from tasks.core.builtin_models import build_tokenizer

    tok = build_tokenizer()
    folder = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(folder)
    scripted = Scripted(tok)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(scripted.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the scripted endpoint did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1", scripted, str(folder)
    server.should_exit = True
    thread.join(10)
    for bridge in list(_VerifiersClient.running.values()):
        bridge.stop()
    _VerifiersClient.running.clear()


def _episodes(*calls):
    async def together():
        return await asyncio.gather(*calls, return_exceptions=True)

    return asyncio.run(together())


# ------------------------------------------------------------------------------------------------ the bridge

@pytest.fixture(scope="module")
def sums(endpoint):
    """Train-client episodes of vf04_sums against the scripted endpoint, run once on the one bridge for the tests
    below (each harness program is a Python importing openai: ~1-2 s an episode on 2 cores). First an episode whose
    model call never ends, cancelled as rlflow cancels an agent past env.timeout_seconds; then, on the same bridge,
    these together: a row from taskset_rows (by index) and a bare task index, answered right and wrong; a row
    carrying its task's data; one whose model call fails; one run on the bridge directly with its tokens."""
    base_url, scripted, tokenizer = endpoint
    kw = dict(env=SUMS, client="train", tokenizer=tokenizer, path=ENVS)
    rows = taskset_rows(SUMS, path=ENVS)

    async def cut_short():
        task = asyncio.ensure_future(run({"task_idx": 1}, base_url, "ep-hang", **kw))
        deadline = time.monotonic() + 120
        while not scripted.calls.get("ep-hang") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        task.cancel()
        try:
            return await task
        except BaseException as e:  # noqa: BLE001 - what the cancelled agent raised, for the test
            return e

    cancelled = asyncio.run(cut_short())
    bridge = _VerifiersClient.of(verifiers_python(None), _paths(ENVS))
    sampled = dict(kw, sampling={"temperature": 1.0, "max_tokens": 8})
    keys = ("ep-right", "ep-wrong", "ep-data", "ep-fail", "ep-tokens")
    done = _episodes(run(rows[2], base_url, "ep-right", **sampled),
                     run({"task_idx": 2}, base_url, "ep-wrong", **sampled),
                     run({"prompt": "5+5=", "answer": "10", "source": "x"}, base_url, "ep-data", **kw),
                     run({"task_idx": 0}, base_url, "ep-fail", **kw),
                     bridge.call(300, op="run", env=SUMS, model=MODEL, key="ep-tokens", task_idx=1, tokens=True,
                                 client={"type": "train", "base_url": base_url, "renderer_model_name": tokenizer}))
    deadline = time.monotonic() + 30          # (the hung call's handler sees its caller gone within a poll)
    while [c.get("state") for c in scripted.calls.get("ep-hang", [])][-1:] != ["disconnected"] and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    return {"rows": rows, "cancelled": cancelled, **dict(zip(keys, done))}


@needs_venv
def test_train_client_calls_the_token_route_under_each_episodes_key(endpoint, sums):
    _, scripted, _ = endpoint
    right, wrong = sums["ep-right"], sums["ep-wrong"]
    assert right[0] == 1.0 and wrong[0] == 0.0, (right, wrong)
    (trace,) = right[1]["verifiers"]["traces"]
    assert trace["rewards"] == {"correct": {"score": 1.0, "weight": 1.0}} and trace["metrics"] == {"reply_chars": 1.0}
    assert trace["stop_condition"] == "agent_completed" and trace["calls"] == 1
    for key, reply in (("ep-right", "4"), ("ep-wrong", "wrong")):
        (call,) = scripted.calls[key]
        # verifiers rendered the task's prompt with the policy's chat template and asked for a generation prompt
        assert call["text"] == "<s>user: 2+2=\n<s>assistant: "
        assert call["params"]["max_tokens"] == 8 and call["params"]["temperature"] == 1.0
        assert call["params"]["stop_token_ids"] == [scripted.tok.eos_token_id]
        assert scripted.tok.decode(call["completion_ids"], skip_special_tokens=True) == reply


@needs_venv
def test_verifiers_trace_holds_exactly_the_tokens_the_route_served(endpoint, sums):
    _, scripted, _ = endpoint
    episode = sums["ep-tokens"]
    (call,) = scripted.calls["ep-tokens"]
    (branch,) = episode["traces"][0]["branches"]
    assert branch["token_ids"] == call["prompt_ids"] + call["completion_ids"]
    assert branch["sampled_mask"] == [False] * len(call["prompt_ids"]) + [True] * len(call["completion_ids"])
    assert branch["logprobs"][len(call["prompt_ids"]):] == pytest.approx(call["logprobs"])


@needs_venv
def test_eval_client_plays_a_multi_turn_tool_episode(endpoint):
    base_url, scripted, _ = endpoint
    (result,) = _episodes(run({"task_idx": 0}, base_url, "ep-tool", env=CALC, path=ENVS))
    reward, info = result
    assert reward == 1.0
    (trace,) = info["verifiers"]["traces"]
    assert trace["metrics"] == {"tool_calls": 1.0} and trace["turns"] == 2
    first, second = (c["body"] for c in scripted.calls["ep-tool"])
    assert first["model"] == MODEL and first["stream"] is True
    assert [t["function"]["name"] for t in first["tools"]] == ["calc_add"]
    assert second["messages"][-1]["role"] == "tool" and second["messages"][-1]["content"] == "42"


@needs_venv
def test_rows_name_their_task_by_index_or_carry_its_data(endpoint, sums):
    _, scripted, _ = endpoint
    rows = sums["rows"]
    assert [(r["task_idx"], r["prompt"], r["answer"]) for r in rows] == [(0, "0+0=", "0"), (1, "1+1=", "2"),
                                                                         (2, "2+2=", "4")]
    by_index, by_data = sums["ep-right"], sums["ep-data"]        # (rows[2]: its task_idx; a row of task data)
    assert by_index[0] == 1.0 and by_data[0] == 1.0, (by_index, by_data)
    assert [c["text"] for c in scripted.calls["ep-data"]] == ["<s>user: 5+5=\n<s>assistant: "]


@needs_venv
def test_a_failed_model_call_costs_its_episode_only(sums):
    failed = sums["ep-fail"]
    assert isinstance(failed, VerifiersError) and "scripted failure" in str(failed), failed
    # the episodes run beside it were scored
    assert [sums[k][0] for k in ("ep-right", "ep-wrong", "ep-data")] == [1.0, 0.0, 1.0]


@needs_venv
def test_a_cancelled_agent_stops_its_rollout(endpoint, sums):
    """rlflow cancels an agent past its time (env.timeout_seconds): the bridge cancels the rollout, whose model
    call is dropped (the endpoint sees its caller go), and the bridge serves the next episodes (the fixture's
    others, all started after the cancel)."""
    _, scripted, _ = endpoint
    assert isinstance(sums["cancelled"], asyncio.CancelledError), sums["cancelled"]
    hung = scripted.calls.get("ep-hang", [])
    assert [c["state"] for c in hung] == ["waiting", "disconnected"], hung     # (never called: [])
    assert sums["ep-right"][0] == 1.0 and sums["ep-tokens"]["ok"] and sums["ep-tokens"]["traces"][0]["reward"] == 1.0


# ------------------------------------------------------------------------------------------------ through rlflow

CHAT = {"taskset": {"id": "vf04_chat"}, "agent": SUBPROCESS}
SUM_ROWS = {0: {"prompt": "1+1=", "answer": "2", "task_idx": 1}, 1: {"prompt": "2+2=", "answer": "4", "task_idx": 2}}


def _agent_cfg(client: str, env: dict, *more: str, sampling: dict | None = None):
    """configs/agent.yaml with the verifiers 0.4 agent, as a user would write it (env.kwargs: a YAML mapping)."""
    from tasks.core.config import load_config

    kwargs = {"env": env, "client": client, "path": [ENVS], **({"sampling": sampling} if sampling else {}),
              **({"tokenizer": "builtin:tiny-lm"} if client == "train" else {})}
    return load_config(ROOT / "configs" / "agent.yaml", [
        "env.agent=tasks.envs.adapters.verifiers_v04:run", "env.isolation=thread", f"env.kwargs={json.dumps(kwargs)}",
        "env.concurrency=8", "env.max_turns=4", "env.max_tokens=200", "env.timeout_seconds=300",
        "generate.max_completion_length=64", *more])


class Recording:
    """A sampling session as run_agents gets it, keeping every call it sampled: (prompt ids, completion ids,
    logprobs). Wraps a real one, or answers from a script (`reply`: the context's text -> the reply's text,
    ended by EOS) where an episode needs a particular reply (the right answer, a tool call)."""

    def __init__(self, session=None, reply=None, tokenizer=None):
        self.session, self.reply = session, reply
        self.tokenizer = session.tokenizer if session is not None else tokenizer
        self.sampled: list[tuple[list[int], list[int], list[float]]] = []

    def sample(self, prompt_ids, params, keys=None):
        from tasks.core.contracts import Sample, Sampled

        if self.session is not None:
            out = self.session.sample(prompt_ids, params)
        else:
            tok, samples = self.tokenizer, []
            for i, ids in enumerate(prompt_ids):
                toks = tok(self.reply(tok.decode(ids)), add_special_tokens=False)["input_ids"]
                toks = toks[:params.max_new_tokens - 1] + [tok.eos_token_id]
                samples.append(Sample(i, toks, [-0.5 - k / 64 for k in range(len(toks))], truncated=False))
            out = Sampled(samples, 0.0, 0.0)
        self.sampled += [(list(prompt_ids[s.prompt]), list(s.completion_ids), list(s.logprobs)) for s in out.samples]
        return out


@pytest.fixture(scope="module")
def tiny():
    """The builtin tiny model on the hf engine: the session rlflow's generate stage opens."""
    if not PYTHON.exists():
        pytest.skip(f"verifiers 0.4's environment ({PYTHON}) is missing: make setup builds it")
    from tasks.engines.sampling import open_session

    with open_session(_agent_cfg("eval", SUMS), "base") as session:
        yield session
    for bridge in list(_VerifiersClient.running.values()):
        bridge.stop()
    _VerifiersClient.running.clear()


def _run_agents(cfg, rows: dict, session, n: int = 2, seed: int = 3):
    from tasks.core.contracts import SamplingParams
    from tasks.envs.runtime.agents import run_agents

    params = SamplingParams(n=n, max_new_tokens=cfg.generate.max_completion_length, temperature=1.0, top_p=1.0,
                            seed=seed)
    records, _ = run_agents(cfg, rows, sorted(rows), session, params, "base")
    return records


def _calls(record) -> list[tuple[list[int], list[int], list[float]]]:
    """The model calls a sample holds: each run of mask 1 is one call's completion, its prompt all before it."""
    ids, start, out, k = record.prompt_ids + record.completion_ids, len(record.prompt_ids), [], 0
    while k < len(record.mask):
        if not record.mask[k]:
            k += 1
            continue
        j = k
        while j < len(record.mask) and record.mask[j]:
            j += 1
        out.append((ids[:start + k], record.completion_ids[k:j], record.logprobs[k:j]))
        k = j
    return out


def _rubric(record) -> float:
    """The reward verifiers' rubric gave the episode (its one trace: Σ score · weight), from the agent's info."""
    (trace,) = record.env_state["agent_info"]["verifiers"]["traces"]
    return sum(r["score"] * r["weight"] for r in trace["rewards"].values())


def _episodes_of(records) -> dict[int, list]:
    """The samples of each episode, in order (an episode's lead sample, then its parts)."""
    out: dict[int, list] = {}
    for r in records:
        if not r.part:
            out[len(out)] = []
        out[len(out) - 1].append(r)
    return out


def _chat_ids(tok, messages: list[dict]) -> list[int]:
    return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


@needs_venv
@pytest.mark.parametrize("client", ["eval", "train"])
def test_a_verifiers_environment_trains_on_what_the_tiny_model_sampled(tiny, client):
    """vf04_chat (two model calls per episode) through run_agents and rlflow's endpoint on the tiny model (hf):
    every episode's reward is verifiers' rubric score, and its samples hold exactly the calls the session
    sampled, mask 1 on the model's tokens. eval: the chat program's calls through the endpoint's chat template;
    train: verifiers renders with the builtin tokenizer (its DefaultRenderer, over the chat template) and calls
    the token route."""
    session = Recording(tiny)
    records = _run_agents(_agent_cfg(client, CHAT, sampling={"max_tokens": 6}), SUM_ROWS, session, n=1)
    episodes = _episodes_of(records)
    assert len(episodes) == 2 and all(r.env_error is None for r in records), [r.env_error for r in records]
    recorded = sorted(c for r in records for c in _calls(r))
    assert recorded == sorted(session.sampled) and len(recorded) == 4       # (2 calls per episode, token for token)
    tok = tiny.tokenizer
    for samples in episodes.values():
        lead = samples[0]
        assert lead.env_return == _rubric(lead) and lead.env_state["calls"] == 2
        assert all(r.env_return == lead.env_return for r in samples)         # (parts share their episode's return)
        trace = lead.env_state["agent_info"]["verifiers"]["traces"][0]
        assert trace["metrics"] == {"turns": 2.0} and trace["stop_condition"] == "user_closed"
        # Both clients render the task's prompt as rlflow's own chat template does.
        question = SUM_ROWS[lead.row]["prompt"]
        assert lead.prompt_ids == _chat_ids(tok, [{"role": "user", "content": question}])
        first, second = (c for r in samples for c in _calls(r))
        if client == "eval":
            # The endpoint renders the continued conversation onto the first call's tokens: one sample.
            assert len(samples) == 1 and second[0][:len(first[0]) + len(first[1])] == first[0] + first[1]
        else:
            # verifiers' DefaultRenderer never bridges a turn (bridge_to_next_turn returns None: an opaque
            # template), so the second call is the whole conversation re-rendered from its messages. That extends
            # the first call only where the re-rendered reply is the sampled tokens again (no EOS, no special
            # token in it); a reply that ended with EOS is re-rendered as the template's turn end: step-wise parts.
            extends = second[0][:len(first[0]) + len(first[1])] == first[0] + first[1]
            assert len(samples) == (1 if extends else 2), (first, second)


def _sums_script(text: str) -> str:
    """The right sum for 1+1=, a wrong one for 2+2=, on every turn."""
    a, b = map(int, re.findall(r"(\d+)\+(\d+)=", text)[0])
    return str(a + b) if a == 1 else str(a + b + 1)


@needs_venv
@pytest.mark.parametrize("client", ["eval", "train"])
def test_scripted_replies_get_the_rubrics_rewards_and_their_turns_merge_or_split(tiny, client):
    """Replies that end with EOS, the right answer for one task and a wrong one for the other: rewards 1 and 0
    from verifiers' `correct`. eval: each episode is one sample, its turns merged (mask 1 on the two replies, 0
    on the environment's turn between them). train: two samples per episode (step-wise), since verifiers
    re-renders the history: the sampled EOS comes back as the template's turn end."""
    from tasks.envs.runtime.agents import agent_metrics

    tok = tiny.tokenizer
    session = Recording(reply=_sums_script, tokenizer=tok)
    records = _run_agents(_agent_cfg(client, CHAT), SUM_ROWS, session, n=1)
    episodes = _episodes_of(records)
    assert [samples[0].env_return for samples in episodes.values()] == [1.0, 0.0]
    assert all(s[0].env_return == _rubric(s[0]) for s in episodes.values())
    assert sorted(c for r in records for c in _calls(r)) == sorted(session.sampled)
    for samples in episodes.values():
        question = SUM_ROWS[samples[0].row]["prompt"]
        reply = _sums_script(question)
        if client == "eval":
            (one,) = samples
            gap = tok("\n<s>user: Sure?\n<s>assistant: ", add_special_tokens=False)["input_ids"]
            n = len(reply) + 1
            assert tok.decode(one.completion_ids) == f"{reply}</s>\n<s>user: Sure?\n<s>assistant: {reply}</s>"
            assert one.mask == [1] * n + [0] * len(gap) + [1] * n
        else:
            first, second = samples
            assert (first.part, second.part) == (0, 1)
            assert first.mask == [1] * (len(reply) + 1) and second.mask == [1] * (len(reply) + 1)
            assert second.prompt_ids == _chat_ids(tok, [{"role": "user", "content": question},
                                                        {"role": "assistant", "content": reply},
                                                        {"role": "user", "content": "Sure?"}])
            assert second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] != \
                first.prompt_ids + first.completion_ids
    assert agent_metrics(records)["agent/split_episodes"] == (2.0 if client == "train" else 0.0)


def _calc_script(text: str) -> str:
    """A calc_add call for the task, then the tool's result as the answer."""
    if "<s>tool: " in text:
        return text.rsplit("<s>tool: ", 1)[1].split("\n", 1)[0]
    a, b = map(int, re.findall(r"Add (\d+) and (\d+)", text)[0])
    return "<tool_call>" + json.dumps({"name": "calc_add", "arguments": {"a": a, "b": b}}) + "</tool_call>"


@needs_venv
def test_a_tool_episode_through_the_endpoint_is_one_sample(tiny):
    """vf04_calc (an MCP tool server verifiers runs for the environment, both episodes' calls on it at once) with
    the eval client: the reply's tool call is parsed by the endpoint, run by verifiers' chat program, and its result
    comes back as a tool message that the endpoint renders onto the episode's tokens: one sample, mask 0 on the
    tool's result."""
    tok = tiny.tokenizer
    session = Recording(reply=_calc_script, tokenizer=tok)
    rows = {0: {"prompt": "Add 12 and 30 with the tool.", "answer": "42", "task_idx": 0},
            1: {"prompt": "Add 7 and 8 with the tool.", "answer": "15", "task_idx": 1}}
    records = _run_agents(_agent_cfg("eval", CALC, "generate.max_completion_length=96"), rows, session, n=1)
    assert [r.part for r in records] == [0, 0], [(r.part, r.env_error) for r in records]
    assert sorted(c for r in records for c in _calls(r)) == sorted(session.sampled)
    for r, answer in zip(records, ("42", "15")):
        assert r.env_error is None and r.env_return == 1.0 == _rubric(r)
        (trace,) = r.env_state["agent_info"]["verifiers"]["traces"]
        assert trace["metrics"] == {"tool_calls": 1.0} and trace["turns"] == 2
        call, result = _calls(r)
        assert tok.decode(call[1]).startswith("<tool_call>") and tok.decode(result[1]) == f"{answer}</s>"
        gap = r.completion_ids[len(call[1]):len(r.completion_ids) - len(result[1])]
        assert tok.decode(gap) == f"\n<s>tool: {answer}\n<s>assistant: "
        assert r.mask == [1] * len(call[1]) + [0] * len(gap) + [1] * len(result[1])
        assert [m["role"] for m in r.turns] == ["assistant", "tool", "assistant"]


@needs_venv
@pytest.mark.parametrize("client", ["eval", "train"])
def test_a_failing_episode_costs_only_itself(tiny, client):
    """Episodes verifiers cannot run or score: a task index past the taskset, task data its type refuses (no
    answer), and (train) a prompt longer than the endpoint's model length (verifiers' pre-flight check against
    /v1/models' max_model_len fails the model call). Each gets no return (env_error) and keeps what tokens it
    has; the good episode beside them is scored."""
    session = Recording(reply=_sums_script, tokenizer=tiny.tokenizer)
    rows = {0: {"prompt": "1+1=", "answer": "2", "task_idx": 1}, 1: {"task_idx": 99},
            2: {"prompt": "1+1=", "no_answer": "x"}, 3: {"prompt": "1+1=" * 200, "answer": "2"}}
    records = _run_agents(_agent_cfg(client, SUMS), rows, session, n=1)
    by_row = {r.row: r for r in records}
    assert by_row[0].env_error is None and by_row[0].env_return == 1.0
    for row, why in ((1, "IndexError: task_idx 99: the taskset has 3 tasks"), (2, "ValidationError")):
        assert by_row[row].env_return is None and why in by_row[row].env_error, by_row[row].env_error
        assert by_row[row].env_state["calls"] == 0
    if client == "train":
        # verifiers renders 820 tokens, more than the endpoint's card says it takes (max_model_len: 512 + 200), and
        # refuses the call itself; its harness ends without a reply, which verifiers would score 0: no return here.
        assert by_row[3].env_return is None and by_row[3].env_state["calls"] == 0
        assert "Prompt length (820) exceeds maximum context length (712)" in by_row[3].env_error
    else:
        # The chat route left-truncates a prompt to generate.max_prompt_length, as rlflow does any prompt.
        assert by_row[3].env_error is None and len(by_row[3].prompt_ids) == 512


@needs_venv
@pytest.mark.slow
@AT_LENGTH
def test_a_verifiers_environment_trains_through_the_flow(tmp_path, prefect_api, monkeypatch):
    """configs/agent.yaml with vf04_sums on the tiny model, 2 iterations of the training flow (the generate stage
    runs the verifiers agent against its endpoint; the train client): the rewards are verifiers' scores. ~50 s
    (a Prefect API, a bridge of its own in the stage's process, 8 episodes): `make drills` only; `make test` keeps
    the end to end runs through run_agents and the endpoint above."""
    from flows.training import train_flow
    from tasks.core import layout
    from tasks.core.store import Store

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(4)))
    kwargs = {"env": SUMS, "client": "train", "tokenizer": "builtin:tiny-lm", "path": [ENVS],
              "sampling": {"max_tokens": 4}}
    out = train_flow(str(ROOT / "configs" / "agent.yaml"), [
        f"data.path={data}", "env.agent=tasks.envs.adapters.verifiers_v04:run", f"env.kwargs={json.dumps(kwargs)}",
        "generate.prompts_per_iteration=2", "generate.num_generations=2", "generate.max_completion_length=4",
        "env.concurrency=4", "train.micro_batch_size=4", "run.name=vf04", "run.iterations=2", "store.uri=store",
        f"tracking.uri=sqlite:///{tmp_path}/m.db"])
    assert out["iterations_completed"] == 2
    store = Store.open(str(tmp_path / "store"))
    meta = store.manifest(layout.rollouts("vf04", 1))["meta"]["metrics"]
    assert meta["env/episodes"] == 4 and meta["env/errors"] == 0 and meta["agent/calls_mean"] == 1
    assert "reward/env/mean" in store.manifest(layout.rewards("vf04", 1))["meta"]["metrics"]
