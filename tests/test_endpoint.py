"""The agents' endpoint (tasks/envs/runtime/endpoint.py) as real clients see it: the `openai` client (chat completions,
completions, the Responses API; streamed and not) and one agent framework from PyPI (openai-agents: its
chat-completions and Responses models), against a scripted session (no weights: it answers from its context, so
it writes tool calls where the tiny model would not). Each call's recorded tokens are checked against what the
session sampled, and a continued conversation against the call it extends, token for token."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tasks.core.config import load_config
from tasks.core.contracts import Sample, Sampled, SamplingParams, SamplingSession
from tasks.envs.runtime.endpoint import Endpoint

ROOT = Path(__file__).resolve().parents[1]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
MAX_NEW = 200          # generate.max_completion_length: a tool call is ~70 tokens (the tiny tokenizer's ~1 a char)


class Scripted(SamplingSession):
    """Answers from a function of the context text, and keeps what it sampled (prompt ids, completion ids) to
    compare with what the endpoint recorded. Stops with EOS, or is cut at max_new_tokens (truncated)."""

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.sampled = tokenizer, reply, []

    def sample(self, prompt_ids, params: SamplingParams, keys=None) -> Sampled:
        tok, out = self.tokenizer, []
        for i, ids in enumerate(prompt_ids):
            toks = tok(self.reply(tok.decode(ids)), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            truncated = len(toks) > params.max_new_tokens
            toks = toks[:params.max_new_tokens]
            self.sampled.append((list(ids), toks))
            out.append(Sample(i, toks, [-0.25] * len(toks), truncated=truncated))
        return Sampled(out, 0.0, 0.0)


def adder(context: str) -> str:
    """A tool call to add until a tool's result is in its context, then the answer; plain text without tools."""
    if "tool\n5" in context or "tool: 5" in context:
        return "The sum is 5."
    if "Twice" in context:
        return CALL + "\n" + CALL.replace('"a": 2, "b": 3', '"a": 1, "b": 1')
    if "Explain" in context:
        return "I will add them. " + CALL
    if "add" in context:
        return CALL
    return "hello there"


@pytest.fixture
def endpoint(request):
    """An endpoint on the tiny tokenizer with a ChatML template (`chatml`: end of turn = EOS, Qwen's layout), or
    with its own template (`tokenizer`: a turn ends with a newline after the model's EOS) where a test asks."""
    tok = request.getfixturevalue(getattr(request, "param", "chatml"))
    cfg = load_config(ROOT / "configs" / "agent.yaml", [f"generate.max_completion_length={MAX_NEW}",
                                                      "env.max_tokens=2000", "env.max_turns=8",
                                                      "env.endpoint.temperature=[0.5,1.0]"])
    session = Scripted(tok, adder)
    params = SamplingParams(n=1, max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0, seed=1)
    with Endpoint(cfg, session, "base", params) as ep:
        yield ep


def client(ep: Endpoint, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.base_url, api_key=key, max_retries=0, timeout=30)


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
ASK = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 add 3?"}]


def test_models_lists_the_policy_and_refuses_others(endpoint):
    key = endpoint.open(0, seed=1)
    c = client(endpoint, key)
    assert [m.id for m in c.models.list().data] == ["base"]
    assert c.models.retrieve("base").id == c.models.retrieve("policy").id == "base"
    with pytest.raises(openai.NotFoundError, match="'other'"):
        c.models.retrieve("other")
    with pytest.raises(openai.NotFoundError, match="'other'"):
        c.chat.completions.create(model="other", messages=ASK)
    for name in ("base", "policy"):
        assert c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}]).choices[0] \
            .message.content == "hello there"
    with pytest.raises(openai.AuthenticationError):
        client(endpoint, "rl-not-a-key").models.list()
    endpoint.close(key)
    with pytest.raises(openai.AuthenticationError):
        c.chat.completions.create(model="policy", messages=ASK)


def test_chat_text_streamed_and_not_agree(endpoint):
    a, b = endpoint.open(0, seed=1), endpoint.open(1, seed=1)
    messages = [{"role": "user", "content": "hi"}]
    reply = client(endpoint, a).chat.completions.create(model="policy", messages=messages)
    assert reply.choices[0].message.content == "hello there" and reply.choices[0].finish_reason == "stop"
    chunks = list(client(endpoint, b).chat.completions.create(model="policy", messages=messages, stream=True,
                                                              stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == "hello there" and finish == ["stop"]
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens == len(endpoint.session.sampled[0][1])
    la, lb = endpoint.close(a), endpoint.close(b)
    assert la.calls[0].completion_ids == lb.calls[0].completion_ids == endpoint.session.sampled[0][1]


def _tool_turn(endpoint, stream: bool):
    """A tool call, its result, the answer: the two calls' replies and the episode's log."""
    key = endpoint.open(0, seed=1)
    c = client(endpoint, key)
    if stream:
        chunks = list(c.chat.completions.create(model="policy", messages=ASK, tools=TOOLS, stream=True,
                                                stream_options={"include_usage": True}))
        calls: dict[int, dict] = {}
        for ch in chunks:
            for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                got = calls.setdefault(d.index, {"id": "", "type": "function", "function": {"name": "",
                                                                                          "arguments": ""}})
                got["id"] += d.id or ""
                got["function"]["name"] += d.function.name or ""
                got["function"]["arguments"] += d.function.arguments or ""
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert chunks[-1].usage is not None and not chunks[-1].choices
        assistant = {"role": "assistant", "tool_calls": [calls[i] for i in sorted(calls)]}
        first = (finish[0], assistant["tool_calls"])
    else:
        reply = c.chat.completions.create(model="policy", messages=ASK, tools=TOOLS)
        message = reply.choices[0].message
        assistant = message.model_dump(exclude_none=True)
        first = (reply.choices[0].finish_reason, [t.model_dump() for t in message.tool_calls])
    tool = {"role": "tool", "tool_call_id": first[1][0]["id"], "content": "5"}
    answer = c.chat.completions.create(model="policy", messages=[*ASK, assistant, tool], tools=TOOLS)
    return first, answer, endpoint.close(key)


@pytest.mark.parametrize("endpoint,stream", [("chatml", False), ("chatml", True), ("tokenizer", False)],
                         indirect=["endpoint"])
def test_chat_tool_calls_then_a_continuation_that_extends_the_first_call(endpoint, stream):
    (finish, calls), answer, log = _tool_turn(endpoint, stream)
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3} and calls[0]["id"]
    assert answer.choices[0].message.content == "The sum is 5." and answer.choices[0].finish_reason == "stop"
    first, second = log.calls
    assert second.extends == 0
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == \
        first.prompt_ids + first.completion_ids
    sampled = endpoint.session.sampled
    assert [(c.prompt_ids, c.completion_ids) for c in log.calls] == sampled        # exactly what was sampled
    tok = endpoint.tokenizer
    between = tok.decode(second.prompt_ids[len(first.prompt_ids) + len(first.completion_ids):])
    assert tok.decode(first.completion_ids[-1:]) == tok.eos_token           # the model ended its turn itself
    if tok.eos_token == "<|im_end|>":          # ChatML: the model's EOS closed the turn; then the tool's turn
        assert between == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    else:                                      # the tiny template closes a turn with a newline after the EOS
        assert between == "\n<s>tool: 5\n<s>assistant: "


def test_streamed_and_unstreamed_tool_calls_agree(endpoint):
    (f1, c1), a1, l1 = _tool_turn(endpoint, False)
    (f2, c2), a2, l2 = _tool_turn(endpoint, True)
    assert f1 == f2 and [c["function"] for c in c1] == [c["function"] for c in c2]
    assert a1.choices[0].message.content == a2.choices[0].message.content
    assert [(c.prompt_ids, c.completion_ids) for c in l1.calls] == [(c.prompt_ids, c.completion_ids)
                                                                     for c in l2.calls]


# ------------------------------------------------------------------------------------------ completions

def test_completions_text_and_token_prompts_and_stop_strings(endpoint):
    key = endpoint.open(0, seed=1)
    c = client(endpoint, key)
    tok = endpoint.tokenizer
    out = c.completions.create(model="policy", prompt="say hi")
    assert out.choices[0].text == "hello there" and out.choices[0].finish_reason == "stop"
    ids = tok("say hi", add_special_tokens=False)["input_ids"]
    again = c.completions.create(model="policy", prompt=ids)
    assert again.choices[0].text == "hello there"
    cut = c.completions.create(model="policy", prompt=ids, stop=["th"])
    assert cut.choices[0].text == "hello " and cut.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(model="policy", prompt="say hi", stop="th", stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == "hello "
    log = endpoint.close(key)
    assert log.calls[0].prompt_ids == log.calls[1].prompt_ids == ids
    sampled = endpoint.session.sampled[2][1]
    kept = log.calls[2].completion_ids                  # up to the token that completes the stop string
    assert kept == sampled[:len(kept)] and tok.decode(kept) == "hello th" and not log.calls[2].truncated
    assert log.calls[2].logprobs == [-0.25] * len(kept)


# ------------------------------------------------------------------------------------------ the Responses API

RTOOLS = [{"type": "function", "name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
    "strict": True}]


def test_responses_text_and_instructions(endpoint):
    key = endpoint.open(0, seed=1)
    c = client(endpoint, key)
    r = c.responses.create(model="policy", input="hi", instructions="Be brief.")
    assert r.output_text == "hello there" and r.status == "completed" and r.usage.output_tokens == 12
    log = endpoint.close(key)
    assert endpoint.tokenizer.decode(log.calls[0].prompt_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")


@pytest.mark.parametrize("previous", [False, True])
def test_responses_function_calls_and_their_outputs_continue_the_episode(endpoint, previous):
    key = endpoint.open(0, seed=1)
    c = client(endpoint, key)
    first_input = [{"role": "user", "content": "What is 2 add 3?"}]
    r = c.responses.create(model="policy", input=first_input, instructions="You add numbers.", tools=RTOOLS)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 2, "b": 3}
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}
    if previous:
        r2 = c.responses.create(model="policy", previous_response_id=r.id, input=[result],
                                instructions="You add numbers.", tools=RTOOLS)
    else:
        items = [*first_input, *[o.model_dump(exclude_none=True) for o in r.output], result]
        r2 = c.responses.create(model="policy", input=items, instructions="You add numbers.", tools=RTOOLS)
    assert r2.output_text == "The sum is 5."
    log = endpoint.close(key)
    first, second = log.calls
    assert second.extends == 0 and \
        second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == first.prompt_ids + first.completion_ids
    assert [(x.prompt_ids, x.completion_ids) for x in log.calls] == endpoint.session.sampled


def test_responses_previous_instructions_are_not_carried_over(endpoint):
    """As the API has it: a request chained by previous_response_id has its own instructions or none. Without
    them the model sees another conversation (no system turn), so the call is rendered fresh."""
    key = endpoint.open(0, seed=1)
    c = client(endpoint, key)
    r = c.responses.create(model="policy", input="hi", instructions="Be brief.")
    again = c.responses.create(model="policy", input="hi again", previous_response_id=r.id)
    c.responses.create(model="policy", input="and again", previous_response_id=again.id, instructions="Be kind.")
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        c.responses.create(model="policy", input="hi", previous_response_id="resp_unknown")
    log = endpoint.close(key)
    assert [x.extends for x in log.calls] == [None, None, None]
    tok = endpoint.tokenizer
    assert tok.decode(log.calls[1].prompt_ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" \
        "hello there<|im_end|>\n<|im_start|>user\nhi again<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(log.calls[2].prompt_ids).startswith("<|im_start|>system\nBe kind.<|im_end|>\n"
                                                          "<|im_start|>user\nhi<|im_end|>")


def test_responses_stream_as_the_api_streams(endpoint):
    """Items are added empty and filled by deltas, as OpenAI streams them: the openai client's stream helper
    appends each delta to the item it was added as (an item added already filled read twice in its snapshots)."""
    key = endpoint.open(0, seed=1)
    c = client(endpoint, key)
    events = list(c.responses.create(model="policy", input="Explain: what is 2 add 3?", tools=RTOOLS, stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert [o.type for o in done.output] == ["message", "function_call"] and done.output[1].name == "add"
    assert done.output_text == "I will add them." and json.loads(done.output[1].arguments) == {"a": 2, "b": 3}
    with c.responses.stream(model="policy", input="Explain: what is 2 add 3?", tools=RTOOLS) as s:
        snapshots = {e.type: e.snapshot for e in s if e.type.endswith(".delta")}
        final = s.get_final_response()
    assert snapshots == {"response.output_text.delta": "I will add them.",
                         "response.function_call_arguments.delta": '{"a": 2, "b": 3}'}
    assert final.output_text == "I will add them." and final.output[1].parsed_arguments == {"a": 2, "b": 3}
    with c.chat.completions.stream(model="policy", messages=ASK, tools=TOOLS) as s:
        chat = s.get_final_completion()
    call = chat.choices[0].message.tool_calls[0]
    assert chat.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    # cut at max_output_tokens: status incomplete, and the stream ends as the API's does
    cut = list(c.responses.create(model="policy", input="hi", stream=True, max_output_tokens=3))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.status == "incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens" and cut[-1].response.output_text == "hel"
    endpoint.close(key)


# ------------------------------------------------------------------------------------------ bounds, reward

def test_a_temperature_that_would_overflow_is_refused_and_zero_is_greedy(chatml):
    """With env.endpoint.temperature from 0, a request's temperature between 0 and 0.001 is refused (400): the
    sampler divides the logits by it, and 1e-300 made them inf and the draw NaN (the stage's crash); 0 is
    greedy and served."""
    cfg = load_config(ROOT / "configs" / "agent.yaml", [f"generate.max_completion_length={MAX_NEW}",
                                                      "env.endpoint.temperature=[0, 1.0]"])
    params = SamplingParams(n=1, max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0, seed=1)
    with Endpoint(cfg, Scripted(chatml, adder), "base", params) as ep:
        c = client(ep, ep.open(0, seed=1))
        hi = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.BadRequestError, match=r"temperature: 1e-300 is below 0.001") as e:
            c.chat.completions.create(model="policy", messages=hi, temperature=1e-300)
        assert e.value.status_code == 400
        assert c.chat.completions.create(model="policy", messages=hi, temperature=0).choices[0].message.content \
            == "hello there"


def test_requests_out_of_bounds_are_refused_naming_the_field(endpoint):
    key = endpoint.open(0, seed=1)
    c = client(endpoint, key)
    hi = [{"role": "user", "content": "hi"}]
    for kwargs, field in [({"max_tokens": MAX_NEW + 1}, "max_tokens"),
                          ({"max_completion_tokens": MAX_NEW + 1}, "max_completion_tokens"),
                          ({"temperature": 1.5}, "temperature"), ({"temperature": 0.1}, "temperature"),
                          ({"n": 2}, "n")]:
        with pytest.raises(openai.BadRequestError, match=field) as e:
            c.chat.completions.create(model="policy", messages=hi, **kwargs)
        assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="max_output_tokens"):
        c.responses.create(model="policy", input="hi", max_output_tokens=MAX_NEW + 1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model="policy", prompt="hi", max_tokens=MAX_NEW + 1)
    short = c.chat.completions.create(model="policy", messages=hi, max_tokens=4, temperature=0.7)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 4
    assert short.choices[0].message.content == "hell"
    log = endpoint.close(key)
    assert len(log.calls) == 1 and log.calls[0].truncated and len(log.calls[0].completion_ids) == 4


def test_calls_past_the_episode_limits_are_refused(endpoint):
    key = endpoint.open(0, seed=1)
    c = client(endpoint, key)
    for _ in range(endpoint.cfg.env.max_turns):
        c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="max_turns") as e:
        c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "episode_limit"
    log = endpoint.close(key)
    assert len(log.calls) == endpoint.cfg.env.max_turns and "max_turns" in log.limited


def test_a_turn_cut_at_a_stop_string_is_closed_before_the_next(endpoint):
    key = endpoint.open(0, seed=1)
    c = client(endpoint, key)
    hi = [{"role": "user", "content": "hi"}]
    reply = c.chat.completions.create(model="policy", messages=hi, stop=["there"])
    assert reply.choices[0].message.content == "hello " and reply.choices[0].finish_reason == "stop"
    c.chat.completions.create(model="policy", messages=[*hi, reply.choices[0].message.model_dump(exclude_none=True),
                                                        {"role": "user", "content": "again"}])
    first, second = endpoint.close(key).calls
    assert second.extends == 0
    after = endpoint.tokenizer.decode(second.prompt_ids[len(first.prompt_ids) + len(first.completion_ids):])
    assert after == "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


def test_an_integrations_token_route_is_served_with_the_endpoints_checks(chatml, monkeypatch):
    """A token route registered by an integration (as verifiers 0.4's adapter registers /inference/v1/generate):
    served with the episode's key and the model check, its sampler the endpoint's, its refusals answered as any
    call's; the endpoint itself names no integration."""
    from tasks.envs.runtime.calls import Refused
    from tasks.envs.runtime.routes import TOKEN_ROUTES

    def respond(body: dict, key: str, sampler) -> dict:
        if body.get("bad"):
            raise Refused(400, "unsupported_thing", "bad: not served")
        ids, logprobs, finish = sampler.sample_tokens(key, body["token_ids"], max_tokens=4)
        return {"ids": ids, "logprobs": logprobs, "finish": finish}

    monkeypatch.setitem(TOKEN_ROUTES, "/test/v1/tokens", respond)
    cfg = load_config(ROOT / "configs" / "agent.yaml", [f"generate.max_completion_length={MAX_NEW}",
                                                      "env.max_tokens=2000"])
    params = SamplingParams(n=1, max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0, seed=1)
    with Endpoint(cfg, Scripted(chatml, adder), "base", params) as ep:
        key = ep.open(0, seed=1)
        auth, url = {"Authorization": f"Bearer {key}"}, f"{ep.url}/test/v1/tokens"
        ok = httpx.post(url, json={"model": "base", "token_ids": [5, 6, 7]}, headers=auth)
        assert ok.status_code == 200 and ok.json()["ids"] and len(ok.json()["ids"]) == len(ok.json()["logprobs"])
        bad = httpx.post(url, json={"model": "base", "token_ids": [5], "bad": True}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "unsupported_thing"
        assert httpx.post(url, json={"model": "other", "token_ids": [5]}, headers=auth).status_code == 404
        assert httpx.post(url, json={"model": "base", "token_ids": [5]},
                          headers={"Authorization": "Bearer rl-no"}).status_code == 401
        log = ep.close(key)
    assert len(log.calls) == 1          # the served call is recorded under its episode; the refused ones are not


def test_a_stopped_endpoint_answers_a_waiting_call_and_does_not_wait_on_a_client_gone_quiet(chatml):
    """Stopped with a call waiting for its lockstep round and a client that sent half a request and went quiet
    (an agent whose loop stopped mid-send): the call is answered with an error, the quiet request cancelled
    rather than waited on, and the server's thread ends (before, either one held it for good)."""
    import socket
    import threading

    cfg = load_config(ROOT / "configs" / "agent.yaml", [f"generate.max_completion_length={MAX_NEW}"])
    params = SamplingParams(n=1, max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0, seed=1)
    ep = Endpoint(cfg, Scripted(chatml, adder), "base", params).start()
    ep.lockstep = True                       # (no runner settles a round: the call waits until the stop)
    key, got = ep.open(0, seed=1), {}

    def call() -> None:
        got["reply"] = httpx.post(f"{ep.base_url}/chat/completions", json={"model": "base", "messages": ASK},
                                  headers={"Authorization": f"Bearer {key}"}, timeout=120)
    caller = threading.Thread(target=call)
    caller.start()
    quiet = socket.create_connection((ep.host, ep.port))
    quiet.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 200\r\n\r\n{\"model\": ")
    while len(ep.waiting) < 1 or len(ep.server.server_state.connections) < 2:
        assert caller.is_alive()
        time.sleep(0.01)
    server = ep.thread
    ep.stop()
    caller.join(120)
    quiet.close()
    assert not server.is_alive()
    assert got["reply"].status_code == 409 and got["reply"].json()["error"]["code"] == "episode_closed"


def test_set_reward(endpoint):
    key = endpoint.open(0, seed=1)
    auth = {"Authorization": f"Bearer {key}"}
    bad = httpx.post(f"{endpoint.url}/rl/set_reward", json={"reward": "high"}, headers=auth)
    assert bad.status_code == 400 and "reward" in bad.json()["error"]["message"]
    ok = httpx.post(f"{endpoint.url}/rl/set_reward", json={"reward": 0.75, "info": {"why": "close"}}, headers=auth)
    assert ok.status_code == 200
    assert httpx.post(f"{endpoint.url}/rl/set_reward", json={"reward": 1}, headers={}).status_code == 401
    log = endpoint.close(key)
    assert log.reward == 0.75 and log.info == {"why": "close"}


# ------------------------------------------------------------------------------------------ openai-agents

def _framework_run(endpoint, model_class, question: str, stream: bool, chained: bool):
    """openai-agents' Agent with one function tool, run against the endpoint: (the tool's calls, the run's
    result, the episode's log, the request bodies the framework sent)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)          # (it would send traces to OpenAI)
    ran, sent = [], []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    async def keep(request: httpx.Request):
        sent.append(json.loads(request.content or b"{}"))

    key = endpoint.open(0, seed=1)
    http = httpx.AsyncClient(event_hooks={"request": [keep]})
    model = model_class(model="policy", openai_client=openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key,
                                                                         max_retries=0, http_client=http))
    agent = agents.Agent(name="adder", instructions="You add numbers.", tools=[add], model=model)

    async def run():
        if not stream:
            return await agents.Runner.run(agent, question, auto_previous_response_id=chained)
        streamed = agents.Runner.run_streamed(agent, question, auto_previous_response_id=chained)
        async for _ in streamed.stream_events():
            pass
        return streamed

    result = asyncio.run(run())
    return ran, result, endpoint.close(key), sent


# (the question, streamed, chained by previous_response_id): a tool call alone, text and a tool call, the same
# streamed (Runner.run_streamed), two tool calls in one reply (parallel), and the Responses API chained by id
FRAMEWORK = [("chat", "What is 2 add 3?", False, False), ("chat", "Explain: what is 2 add 3?", False, False),
             ("chat", "What is 2 add 3?", True, False), ("chat", "Twice: what is 2 add 3?", False, False),
             ("responses", "What is 2 add 3?", False, False), ("responses", "Explain: what is 2 add 3?", False, False),
             ("responses", "What is 2 add 3?", True, False), ("responses", "Twice: what is 2 add 3?", False, False),
             ("responses", "What is 2 add 3?", False, True), ("responses", "What is 2 add 3?", True, True)]


@pytest.mark.parametrize("api,question,stream,chained", FRAMEWORK)
def test_openai_agents(endpoint, api, question, stream, chained):
    """The framework runs its tool and answers; both calls are recorded, the second extending the first token for
    token. It does not rewrite its history: it sends back the assistant's turn as the endpoint returned it (its
    text, its tool calls with their arguments), then the tools' results, with the same instructions and tools; or
    (chained) only the results and the previous response's id, which the endpoint expands to the same messages."""
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel

    model = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    ran, result, log, sent = _framework_run(endpoint, model, question, stream, chained)
    assert ran == ([(2, 3), (1, 1)] if "Twice" in question else [(2, 3)]) and result.final_output == "The sum is 5."
    assert len(sent) == 2 and all(body.get("stream", False) == stream for body in sent)
    if chained:
        assert sent[1]["previous_response_id"] and [i["type"] for i in sent[1]["input"]] == ["function_call_output"]
    first, second = log.calls
    assert second.extends == 0 and \
        second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == first.prompt_ids + first.completion_ids
    assert [(x.prompt_ids, x.completion_ids) for x in log.calls] == endpoint.session.sampled



def test_an_episodes_call_waiting_for_the_endpoints_threads_is_the_endpoints_time_not_the_agents():
    """env.timeout_seconds counts the agent's own time: a call that waits in the endpoint's thread pool behind
    other episodes' calls is open from when it is asked, so a busy endpoint does not fail a waiting agent."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from tasks.envs.runtime.calls import EpisodeLog
    from tasks.envs.runtime.routes import _call

    ep, log = SimpleNamespace(pool=ThreadPoolExecutor(1)), EpisodeLog(index=0, seed=0)
    release, ran = threading.Event(), []
    blocker = ep.pool.submit(release.wait)          # another episode's call holds the one thread

    async def scenario():
        asked = asyncio.ensure_future(_call(ep, log, lambda: ran.append(True) or "done"))
        await asyncio.sleep(0)                      # asked: queued behind the blocker, not run
        assert not ran and log.open_calls == 1 and log.in_call is not None
        release.set()
        assert await asked == "done"

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        blocker.result()
        ep.pool.shutdown()
    assert ran and log.open_calls == 0 and log.in_call is None and log.busy > 0
