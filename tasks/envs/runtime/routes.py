"""The agents' endpoint's HTTP side: the OpenAI-compatible routes an Endpoint serves (app(ep)), each answer shaped
as OpenAI's API shapes it (chat completions, completions, responses; streamed as server-sent events on request),
and the token routes integrations register (register_token_route; verifiers 0.4's by its adapter). The routes
parse and bound a request, then call the Endpoint (tasks/envs/runtime/endpoint.py), which samples and records.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from tasks.envs.runtime.calls import Call, EpisodeLog, Refused, function_tools, normalise, response_messages

Endpoint = Any   # tasks/envs/runtime/endpoint.py's Endpoint, which imports this module (not imported back: no cycle)


def _stop_list(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise Refused(400, "invalid_request_error", "stop: expected a string or a list of strings")


def _finish(call: Call, calls: list[dict] | None = None) -> str:
    if calls:
        return "tool_calls"
    return "length" if call.truncated else "stop"


def _logprobs_block(ep: Endpoint, call: Call) -> dict:
    tok = ep.tokenizer
    return {"content": [{"token": tok.convert_ids_to_tokens(i), "logprob": lp, "bytes": None, "top_logprobs": []}
                        for i, lp in zip(call.completion_ids, call.logprobs)]}


def _usage(call: Call) -> dict:
    return {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.completion_ids),
            "total_tokens": len(call.prompt_ids) + len(call.completion_ids)}


async def _run(ep: Endpoint, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(ep.pool, fn, *args)


async def _call(ep: Endpoint, log: EpisodeLog, fn):
    """Run `fn` (sampling, recording) for the episode, its calls one at a time. The time from when a call is
    asked until the episode's last open call answers, its wait for the endpoint's threads included, is the
    endpoint's, not the agent's (env.timeout_seconds): a busy endpoint does not fail a waiting agent as hung.
    (Counted here, on the server's one event loop.)"""
    def locked():
        with log.lock:
            return fn()
    if log.open_calls == 0:
        log.in_call = time.monotonic()
    log.open_calls += 1
    try:
        return await _run(ep, locked)
    finally:
        log.open_calls -= 1
        if log.open_calls == 0:
            log.busy += time.monotonic() - log.in_call
            log.in_call = None


def app(ep: Endpoint):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def error(e: Refused) -> JSONResponse:
        return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "code": e.code,
                                       "param": None}}, status_code=e.status)

    async def body_of(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise Refused(400, "invalid_request_error", "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise Refused(400, "invalid_request_error", "the request body must be a JSON object")
        return body

    def handled(fn):
        async def route(request: Request):
            try:
                return await fn(request)
            except Refused as e:
                return error(e)
        return route

    def sse(events):
        async def gen():
            for e in events:
                yield f"data: {json.dumps(e)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    def sse_named(events):
        async def gen():
            for n, e in enumerate(events):
                e = {**e, "sequence_number": n}
                yield f"event: {e['type']}\ndata: {json.dumps(e)}\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    def response_events(out: dict) -> list[dict]:
        """A finished response as the Responses API streams one: each item added empty, its text or arguments
        as one delta, then done. Clients build the response from the deltas (the openai client's stream helper
        appends each delta to the item it was added as: an item added already filled reads twice)."""
        events: list[dict] = [{"type": "response.created", "response": {**out, "status": "in_progress",
                                                                        "output": [], "usage": None}},
                              {"type": "response.in_progress", "response": {**out, "status": "in_progress",
                                                                            "output": [], "usage": None}}]
        for i, item in enumerate(out["output"]):
            at = {"output_index": i, "item_id": item["id"]}
            if item["type"] == "message":
                part = item["content"][0]
                events += [{"type": "response.output_item.added", "output_index": i,
                            "item": {**item, "status": "in_progress", "content": []}},
                           {"type": "response.content_part.added", **at, "content_index": 0,
                            "part": {**part, "text": ""}},
                           {"type": "response.output_text.delta", **at, "content_index": 0, "delta": part["text"],
                            "logprobs": []},
                           {"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"],
                            "logprobs": []},
                           {"type": "response.content_part.done", **at, "content_index": 0, "part": part}]
            else:
                events += [{"type": "response.output_item.added", "output_index": i,
                            "item": {**item, "status": "in_progress", "arguments": ""}},
                           {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                           {"type": "response.function_call_arguments.done", **at, "name": item["name"],
                            "arguments": item["arguments"]}]
            events.append({"type": "response.output_item.done", "output_index": i, "item": item})
        # (a response cut at max_output_tokens ends as the API ends it: response.incomplete, not .completed)
        events.append({"type": f"response.{out['status']}", "response": out})
        return events

    async def models(request: Request):
        ep.episode(request.headers.get("authorization"))
        model = {"id": ep.policy, "object": "model", "created": 0, "owned_by": "rlflow",
                 "max_model_len": ep.max_model_len}
        name = request.path_params.get("model")
        if name is None:
            return JSONResponse({"object": "list", "data": [model]})
        ep.check_model(name)                  # (GET /v1/models/{name}: clients that check the model before use)
        return JSONResponse(model)

    async def chat(request: Request):
        _, log = ep.episode(request.headers.get("authorization"))
        body = await body_of(request)
        ep.check_model(body.get("model"))
        params = ep.params_for(body, ("max_completion_tokens", "max_tokens"))
        stop = _stop_list(body)
        messages = normalise(body.get("messages"))
        tools = function_tools(body.get("tools")) if body.get("tool_choice") != "none" else None

        call, text, calls = await _call(ep, log, lambda: ep.chat_call(log, messages, tools, params, stop))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        message = {"role": "assistant", "content": text if text or not calls else None,
                   **({"tool_calls": calls} if calls else {})}
        choice = {"index": 0, "message": message, "finish_reason": _finish(call, calls),
                  "logprobs": _logprobs_block(ep, call) if body.get("logprobs") else None,
                  "prompt_token_ids": call.prompt_ids, "token_ids": call.completion_ids}
        if not body.get("stream"):
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": ep.policy,
                                 "choices": [choice], "usage": _usage(call)})
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ep.policy}
        delta: dict[str, Any] = {"role": "assistant", "content": message["content"] or ""}
        if calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        events = [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                        "logprobs": choice["logprobs"]}]},
                  {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**head, "choices": [], "usage": _usage(call)})
        return sse(events)

    async def completions(request: Request):
        _, log = ep.episode(request.headers.get("authorization"))
        body = await body_of(request)
        ep.check_model(body.get("model"))
        params = ep.params_for(body, ("max_tokens",))
        stop = _stop_list(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = ep.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool)
                                                         for i in prompt):
            ids = list(prompt)
        else:
            raise Refused(400, "invalid_request_error", "prompt: expected one string or one list of token ids")
        if not ids:
            raise Refused(400, "invalid_request_error", "prompt: empty")
        call = await _call(ep, log, lambda: ep.token_call(log, ids, params, stop, "prompt"))
        text = ep.text_of(call.completion_ids, stop)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        lp = None
        if body.get("logprobs") is not None:
            lp = {"tokens": [ep.tokenizer.convert_ids_to_tokens(i) for i in call.completion_ids],
                  "token_logprobs": call.logprobs, "top_logprobs": None, "text_offset": None}
        choice = {"index": 0, "text": text, "finish_reason": _finish(call), "logprobs": lp,
                  "prompt_token_ids": call.prompt_ids, "token_ids": call.completion_ids}
        out = {"id": rid, "object": "text_completion", "created": created, "model": ep.policy,
               "choices": [choice], "usage": _usage(call)}
        if not body.get("stream"):
            return JSONResponse(out)
        return sse([{**out, "choices": [{**choice}]}])

    async def responses(request: Request):
        _, log = ep.episode(request.headers.get("authorization"))
        body = await body_of(request)
        ep.check_model(body.get("model"))
        params = ep.params_for(body, ("max_output_tokens",))
        messages = normalise(response_messages(body, log))
        tools = function_tools(body.get("tools")) if body.get("tool_choice") != "none" else None

        call, text, calls = await _call(ep, log, lambda: ep.chat_call(log, messages, tools, params, []))
        rid = f"resp_{uuid.uuid4().hex}"
        output: list[dict] = []
        if text or not calls:
            output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed",
                           "role": "assistant", "content": [{"type": "output_text", "text": text,
                                                             "annotations": [], "logprobs": []}]})
        for c in calls:
            output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c["id"],
                           "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                           "status": "completed"})
        usage = _usage(call)
        out = {"id": rid, "object": "response", "created_at": int(time.time()), "model": ep.policy,
               "status": "incomplete" if call.truncated and not calls else "completed",
               "incomplete_details": {"reason": "max_output_tokens"} if call.truncated and not calls else None,
               "output": output, "parallel_tool_calls": True, "tool_choice": body.get("tool_choice", "auto"),
               "tools": body.get("tools") or [], "temperature": params.temperature, "top_p": params.top_p,
               "error": None, "instructions": body.get("instructions"), "metadata": {},
               "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                         "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                         "output_tokens_details": {"reasoning_tokens": 0}}}
        log.responses[rid] = messages[1 if body.get("instructions") else 0:] + [call.reply]
        if not body.get("stream"):
            return JSONResponse(out)
        return sse_named(response_events(out))

    def token_route(respond):
        async def route(request: Request):
            key, log = ep.episode(request.headers.get("authorization"))
            body = await body_of(request)
            ep.check_model(body.get("model"))
            return JSONResponse(await _call(ep, log, lambda: respond(body, key, Tokens(ep, log))))
        return route

    async def set_reward(request: Request):
        _, log = ep.episode(request.headers.get("authorization"))
        ep.set_reward(log, await body_of(request))
        return JSONResponse({"ok": True})

    routes = [Route("/v1/models", handled(models), methods=["GET"]),
              Route("/v1/models/{model:path}", handled(models), methods=["GET"]),
              Route("/v1/chat/completions", handled(chat), methods=["POST"]),
              Route("/v1/completions", handled(completions), methods=["POST"]),
              Route("/v1/responses", handled(responses), methods=["POST"]),
              Route("/rl/set_reward", handled(set_reward), methods=["POST"])]
    routes += [Route(path, handled(token_route(respond)), methods=["POST"]) for path, respond in TOKEN_ROUTES.items()]
    return Starlette(routes=routes)


# An integration's token-in, token-out routes: path -> respond(body, the episode's key, a Tokens sampler) -> the
# JSON answer (a Refused it raises is answered as any call's). verifiers 0.4's /inference/v1/generate is registered
# by its adapter (tasks/envs/adapters/verifiers_v04.py); the endpoint names no integration.
TOKEN_ROUTES: dict[str, Any] = {}


def register_token_route(path: str, respond) -> None:
    TOKEN_ROUTES[path] = respond


class Tokens:
    """What a token route samples with (e.g. verifiers_v04.generate_response's sampler): token ids in, token ids out,
    within the same bounds as any call, recorded under the episode."""

    def __init__(self, ep: Endpoint, log: EpisodeLog):
        self.ep, self.log = ep, log

    def sample_tokens(self, key: str, prompt_ids: list[int], max_tokens=None, temperature=None, top_p=None,
                      stop_token_ids=(), stop=(), seed=None) -> tuple[list[int], list[float], str]:
        params = self.ep.params_for({"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p},
                                    ("max_tokens",))
        call = self.ep.token_call(self.log, prompt_ids, params, list(stop), "token_ids", stop_token_ids)
        return call.completion_ids, call.logprobs, "length" if call.truncated else "stop"
