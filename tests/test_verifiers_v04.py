"""The verifiers 0.4 agent (tasks/envs/verifiers_v04.py): real verifiers 0.4 environments (tests/vf04_envs, built
from the package as `vf-init` scaffolds them) run unmodified in .venv-verifiers through the bridge, against a real
HTTP server started here that speaks the endpoint's routes with scripted replies: the token route verifiers'
trainer client calls (POST /inference/v1/generate, served by `generate_response`), streamed Chat Completions for
its eval client, GET /v1/models. Checked: each episode's calls arrive under its own key, verifiers' trace holds
exactly the token ids the route served, the rubric's reward comes back, a multi-turn episode with an MCP tool,
and a failed model call costing its episode. The end-to-end test through rlflow's own endpoint comes with it.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import pytest

from tasks.envs.verifiers_v04 import (
    GenerateRefused,
    VerifiersError,
    _Bridge,
    _paths,
    generate_response,
    run,
    taskset_rows,
    verifiers_python,
)
from tasks.envs.webshop import free_port

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
ENVS = str(ROOT / "tests" / "vf04_envs")
SUBPROCESS = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
SUMS = {"taskset": {"id": "vf04_sums"}, "agent": SUBPROCESS}
CALC = {"taskset": {"id": "vf04_calc"}, "agent": SUBPROCESS}
MODEL = "tiny-policy"

needs_venv = pytest.mark.skipif(not PYTHON.exists(), reason=f"verifiers 0.4's environment ({PYTHON}) is missing: "
                                "make setup builds it (make .venv-verifiers/.ready)")


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
    for bridge in list(_Bridge.running.values()):
        bridge.stop()
    _Bridge.running.clear()


def _episodes(*calls):
    async def together():
        return await asyncio.gather(*calls, return_exceptions=True)

    return asyncio.run(together())


# ------------------------------------------------------------------------------------------------ the bridge

@needs_venv
def test_train_client_calls_the_token_route_under_each_episodes_key(endpoint):
    base_url, scripted, tokenizer = endpoint
    kw = dict(env=SUMS, client="train", tokenizer=tokenizer, path=ENVS, sampling={"temperature": 1.0,
              "max_tokens": 8})
    right, wrong = _episodes(run({"task_idx": 2}, base_url, "ep-right", **kw),
                             run({"task_idx": 2}, base_url, "ep-wrong", **kw))
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
def test_verifiers_trace_holds_exactly_the_tokens_the_route_served(endpoint):
    base_url, scripted, tokenizer = endpoint
    bridge = _Bridge.of(verifiers_python(None), _paths(ENVS))
    episode = asyncio.run(bridge.call(300, op="run", env=SUMS, model=MODEL, key="ep-tokens", task_idx=1, tokens=True,
                                      client={"type": "train", "base_url": base_url, "renderer_model_name": tokenizer}))
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
def test_rows_name_their_task_by_index_or_carry_its_data(endpoint):
    base_url, _, tokenizer = endpoint
    rows = taskset_rows(SUMS, path=ENVS)
    assert [(r["task_idx"], r["prompt"], r["answer"]) for r in rows] == [(0, "0+0=", "0"), (1, "1+1=", "2"),
                                                                         (2, "2+2=", "4")]
    kw = dict(env=SUMS, client="train", tokenizer=tokenizer, path=ENVS)
    by_index, by_data = _episodes(run(rows[1], base_url, "ep-row", **kw),
                                  run({"prompt": "5+5=", "answer": "10", "source": "x"}, base_url, "ep-data", **kw))
    assert by_index[0] == 1.0 and by_data[0] == 1.0, (by_index, by_data)


@needs_venv
def test_a_failed_model_call_costs_its_episode_only(endpoint):
    base_url, _, tokenizer = endpoint
    kw = dict(env=SUMS, client="train", tokenizer=tokenizer, path=ENVS)
    failed, fine = _episodes(run({"task_idx": 0}, base_url, "ep-fail", **kw),
                             run({"task_idx": 0}, base_url, "ep-fine", **kw))
    assert isinstance(failed, VerifiersError) and "scripted failure" in str(failed), failed
    assert fine[0] == 1.0


@needs_venv
def test_a_cancelled_agent_stops_its_rollout(endpoint):
    """rlflow cancels an agent past its time (env.timeout_seconds): the bridge cancels the rollout, whose model
    call is dropped (the endpoint sees its caller go), and the bridge serves the next episode."""
    base_url, scripted, tokenizer = endpoint
    kw = dict(env=SUMS, client="train", tokenizer=tokenizer, path=ENVS)

    async def cut_short():
        task = asyncio.ensure_future(run({"task_idx": 1}, base_url, "ep-hang", **kw))
        deadline = time.monotonic() + 120
        while not scripted.calls.get("ep-hang"):
            assert time.monotonic() < deadline, "the episode never called the model"
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cut_short())
    deadline = time.monotonic() + 30
    while [c["state"] for c in scripted.calls["ep-hang"]] != ["waiting", "disconnected"]:
        assert time.monotonic() < deadline, scripted.calls["ep-hang"]
        time.sleep(0.05)
    (after,) = _episodes(run({"task_idx": 1}, base_url, "ep-after", **kw))
    assert after[0] == 1.0
