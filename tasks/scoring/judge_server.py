"""A judge server: one reward model (reward.models[i]) behind the OpenAI-compatible routes the judges speak
(tasks/scoring/judges.py), on the hf engine (tasks/scoring/judge_engine.py) with concurrent requests batched into
one forward pass, or on vLLM (reward.models[].engine: vllm: LLM.chat / LLM.classify, in the vLLM environment's
interpreter). The flow starts it for reward.models[].where: local (a process on its machine) or sky (a job on a
cluster of its own: sky/judge.yaml), or run it yourself and give its URL as reward.models[].where.

    python -m tasks.scoring.judge_server --config FILE --model judge [--host 0.0.0.0] [--port 8350]

Routes: GET /health, GET /v1/models, POST /v1/chat/completions (OpenAI's), POST /classify and /v1/classify
(vLLM's); every one but /health needs `Authorization: Bearer <RLFLOW_JUDGE_TOKEN>` when that is set.
It prints `RLFLOW_JUDGE_READY <url>` once it answers.
More: docs/internals.md (tasks/scoring/judge_server.py): each route's fields.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import uuid

from tasks.core.fleet import authorized
from tasks.core.placement import JUDGE_TOKEN_VAR as TOKEN_VAR
from tasks.scoring.judges import READY


def app(spec, batcher, token: str | None, parent: int | None, idle: float | None, on_ready=None):
    import contextlib

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from tasks.core.daemon import Watch, leave

    state = {"used": time.monotonic(), "busy": 0}

    def denied(request: Request):
        if not authorized(request.headers, token):
            return JSONResponse({"error": {"message": "unauthorized"}}, status_code=401)
        return None

    def refused(message: str, status: int = 400):
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)

    async def answer(route: str, requests: list[dict]) -> list[dict]:
        state["busy"] += 1
        state["used"] = time.monotonic()
        try:
            return await asyncio.gather(*(asyncio.wrap_future(batcher.submit(route, r)) for r in requests))
        finally:
            state["busy"] -= 1

    async def health(request: Request):
        return JSONResponse({"model": spec.name, "kind": spec.kind, "requests": batcher.requests,
                             "batches": batcher.batches, "pid": os.getpid()})

    async def models(request: Request):
        if (no := denied(request)) is not None:
            return no
        return JSONResponse({"object": "list", "data": [{"id": spec.name, "object": "model", "owned_by": "rlflow"}]})

    async def chat(request: Request):
        if (no := denied(request)) is not None:
            return no
        if spec.kind == "classifier":
            return refused(f"{spec.name} is a classifier: POST /classify")
        body = await request.json()
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return refused("messages: expected a non-empty list")
        if float(body.get("temperature") or 0.0) != 0.0 or int(body.get("n") or 1) != 1:
            return refused("a judge server answers greedily: temperature 0, n 1")
        top = int(body.get("top_logprobs") or 0) if body.get("logprobs") else 0
        most = int(body.get("max_tokens") or body.get("max_completion_tokens") or 64)
        (a,) = await answer("chat", [{"messages": body["messages"], "max_tokens": most, "top_logprobs": top}])
        choice = {"index": 0, "message": {"role": "assistant", "content": a["text"]},
                  "finish_reason": "length" if a["tokens"] >= most else "stop",
                  "logprobs": None}
        if top:
            choice["logprobs"] = {"content": [{"token": next(iter(a["top"]), ""), "logprob": next(iter(
                a["top"].values()), 0.0), "bytes": None, "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": None} for t, lp in a["top"].items()]}]}
        return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion",
                             "created": int(time.time()), "model": spec.name, "choices": [choice],
                             "usage": {"prompt_tokens": 0, "completion_tokens": a["tokens"],
                                       "total_tokens": a["tokens"]},
                             "rlflow": {"truncated": a["truncated"]}})

    async def classify(request: Request):
        if (no := denied(request)) is not None:
            return no
        if spec.kind != "classifier":
            return refused(f"{spec.name} is a {spec.kind}: POST /v1/chat/completions")
        body = await request.json()
        items = [body["messages"]] if isinstance(body.get("messages"), list) else body.get("input")
        items = [items] if isinstance(items, str) else items
        if not isinstance(items, list) or not items:
            return refused("input: expected a text or a list of texts (or messages: a conversation)")
        requests = [{"messages": x} if isinstance(x, list) else {"text": str(x)} for x in items]
        answers = await answer("classify", requests)
        return JSONResponse({"id": f"classify-{uuid.uuid4().hex[:12]}", "object": "list", "created": int(time.time()),
                             "model": spec.name, "data": [{"index": i, "probs": a["probs"], "logits": a["logits"],
                                                           "num_classes": len(a["probs"]), "truncated": a["truncated"]}
                                                          for i, a in enumerate(answers)]})

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        def watch() -> None:           # the flow that started it is gone, or nobody asked for a while
            Watch(parent=parent, idle=idle,
                  unused=lambda: None if state["busy"] else time.monotonic() - state["used"]).wait(1.0)
            leave(code=0)
        threading.Thread(target=watch, daemon=True).start()
        if on_ready is not None:
            on_ready()
        yield

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/classify", classify, methods=["POST"]),
                             Route("/v1/classify", classify, methods=["POST"])], lifespan=lifespan)


def main(argv: list[str] | None = None) -> int:
    from tasks.core.config import load_config
    from tasks.core.errors import UserError, user_error_line
    from tasks.core.serving import listening_socket, server_arguments
    from tasks.core.stage import parse_overrides_json, quiet_progress_bars
    from tasks.scoring.judge_engine import Batcher, JudgeEngine
    from tasks.scoring.judges import model_path

    ap = server_arguments("python -m tasks.scoring.judge_server", __doc__, 8350)
    ap.add_argument("--model", required=True, help="the reward.models entry's name")
    ap.add_argument("--model-path", default=None, help="its folder, resolved and pin-checked already (engine vllm: "
                    "by rlflow's environment, `python -m tasks.scoring.judges path`; the vLLM environment cannot "
                    "resolve builtin or GGUF models)")
    args = ap.parse_args(argv)
    quiet_progress_bars()
    try:
        cfg = load_config(args.config, args.override + parse_overrides_json(args.overrides_json))
        specs = {m.name: (i, m) for i, m in enumerate(cfg.reward.models)}
        if args.model not in specs:
            raise UserError(f"--model: {args.model!r} is not one of reward.models ({', '.join(specs) or 'none'})")
        i, spec = specs[args.model]
        path = args.model_path or model_path(cfg, spec, f"reward.models[{i}] ({spec.name})")
        if spec.engine == "vllm":
            from tasks.scoring.judge_engine import VLLMJudgeEngine

            engine = VLLMJudgeEngine(path, spec.kind, spec.max_length, spec.max_tokens)
        else:
            engine = JudgeEngine(path, spec.kind, spec.max_length)
    except UserError as e:
        print(user_error_line(e), file=sys.stderr, flush=True)
        return 2
    import uvicorn

    sock, url = listening_socket(args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(
        app(spec, Batcher(engine, spec.batch_size), os.environ.get(TOKEN_VAR) or None,
            os.getppid() if args.exit_with_parent else None, args.idle_minutes * 60 or None,
            lambda: print(f"{READY} {url}", flush=True)),
        log_level="warning", access_log=False, lifespan="on"))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
