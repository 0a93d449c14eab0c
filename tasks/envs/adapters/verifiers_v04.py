"""verifiers 0.4 environments, unmodified, as an rlflow agent (env.agent; tasks/envs/runtime/agents.py), and the token
route verifiers 0.4's trainer client calls on the endpoint (tasks/envs/runtime/endpoint.py).

    env:
      agent: "tasks.envs.adapters.verifiers_v04:run"
      isolation: thread                # one bridge process per rlflow process serves every episode
      kwargs:
        env: {taskset: {id: my_taskset}, agent: {harness: {id: "null"}, runtime: {type: subprocess}}}
        client: train                  # or eval (the default)
        tokenizer: builtin:tiny-lm     # client train: the policy's tokenizer, which verifiers renders prompts with
        path: [envs]                   # folders the environment's packages are imported from

verifiers 0.4 runs in `.venv-verifiers`, in a bridge process (tasks/envs/adapters/verifiers_v04_bridge.py); its model
calls reach rlflow's endpoint under the episode's API key, which records them, and its rubric gives the reward.
More: docs/internals.md (tasks/envs/adapters/verifiers_v04.py): the two clients, the bridge, rows, rewards, failures.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Literal

from tasks.core.errors import UserError
from tasks.core.paths import sibling_python
from tasks.envs.adapters.bridge import LineBridge
from tasks.envs.runtime.calls import Refused
from tasks.envs.runtime.isolation import EnvironmentDied
from tasks.envs.runtime.routes import register_token_route

VENV = ".venv-verifiers"
BRIDGE = Path(__file__).with_name("verifiers_v04_bridge.py")
ROW_KEYS = ("task_idx",)          # a row's columns that are rlflow's, not the task's


class VerifiersError(RuntimeError):
    """verifiers refused or failed an episode: the text is its own."""


# ------------------------------------------------------------------------------------------------ token route

class GenerateRefused(Refused, ValueError):
    """A /inference/v1/generate request the endpoint cannot serve as asked: answered with `status` (400) and
    `code` (as any refused call), never served with the offending field dropped."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(status, code, message)
        self.message = message


# Sampling parameters verifiers' TrainClient sends (renderers.client.generate: the run's SamplingConfig, plus
# stop_token_ids, logprobs=1 and skip_special_tokens) that change nothing of what is sampled, or that rlflow does.
SERVED = {"max_tokens", "temperature", "top_p", "seed", "stop", "stop_token_ids", "logprobs", "skip_special_tokens",
          "spaces_between_special_tokens", "include_stop_str_in_output", "detokenize", "routed_experts_prompt_start"}
# Parameters that change the distribution sampled from, served only at the value that leaves it as it is.
NEUTRAL = {"top_k": (-1, 0, None), "min_p": (0, 0.0, None), "repetition_penalty": (1, 1.0, None),
           "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "min_tokens": (0, None),
           "n": (1, None), "prompt_logprobs": (None, 0)}


def generate_response(body: dict, key: str, sampler) -> dict:
    """POST /inference/v1/generate (vLLM's token-in, token-out route, as verifiers 0.4's TrainClient calls it
    through renderers.client.generate): `body` is the parsed JSON, `key` the episode's bearer key, `sampler` has
    `sample_tokens(key, prompt_ids, max_tokens=, temperature=, top_p=, stop_token_ids=, stop=, seed=) ->
    (completion_ids, logprobs, finish_reason)` (None: the endpoint's own setting; the completion as sampled, a stop
    token that ended it included, as vLLM returns it: verifiers' renderer parses it off).

        {"model": "policy", "token_ids": [1, 33, ...],
         "sampling_params": {"temperature": 1.0, "max_tokens": 16, "stop_token_ids": [2], "logprobs": 1,
                             "skip_special_tokens": false}}
        -> {"request_id": "gen-…", "prompt_token_ids": [1, 33, ...],
            "choices": [{"index": 0, "token_ids": [7, 2], "finish_reason": "stop",
                         "logprobs": {"content": [{"token": "token_id:7", "logprob": -0.41}, ...]}}],
            "usage": {"prompt_tokens": 25, "completion_tokens": 2, "total_tokens": 27}}

    The caller checks `model` (and answers 404 for another). Refused (GenerateRefused): token ids that are not a
    non-empty list of non-negative integers, images (`features`, `content_parts`: verifiers' multimodal renderers),
    `n` > 1, and sampling parameters rlflow does not sample with at other than their neutral value."""
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                       for t in ids):
        raise GenerateRefused(400, "invalid_token_ids", "token_ids: expected a non-empty list of token ids")
    for field in ("features", "content_parts"):
        if body.get(field):
            raise GenerateRefused(400, "unsupported_multimodal", f"{field}: multimodal prompts are not served")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise GenerateRefused(400, "invalid_sampling_params", "sampling_params: expected an object")
    for name, value in params.items():
        if name in SERVED or (name in NEUTRAL and value in NEUTRAL[name]):
            continue
        raise GenerateRefused(400, "unsupported_sampling_param", f"sampling_params.{name}={value!r}: not served "
                              f"(rlflow samples with max_tokens, temperature, top_p, seed, stop, stop_token_ids)")
    stop = params.get("stop")
    completion, logprobs, finish = sampler.sample_tokens(
        key, list(ids), max_tokens=params.get("max_tokens"), temperature=params.get("temperature"),
        top_p=params.get("top_p"), stop_token_ids=list(params.get("stop_token_ids") or []),
        stop=[stop] if isinstance(stop, str) else list(stop or []), seed=params.get("seed"))
    completion, logprobs = [int(t) for t in completion], [float(x) for x in logprobs]
    if len(logprobs) != len(completion) or not all(math.isfinite(x) for x in logprobs):
        # (verifiers refuses a reply whose logprobs do not match its tokens one for one: MalformedGenerateResponse)
        raise RuntimeError(f"sampler returned {len(completion)} tokens and {len(logprobs)} finite logprobs")
    return {
        "request_id": f"gen-{uuid.uuid4().hex}",
        "prompt_token_ids": list(ids),
        "choices": [{"index": 0, "token_ids": completion, "finish_reason": finish,
                     "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": x}
                                              for t, x in zip(completion, logprobs)]}}],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": len(completion),
                  "total_tokens": len(ids) + len(completion)},
    }


# ------------------------------------------------------------------------------------------------ the bridge

class _VerifiersClient(LineBridge):
    """The bridge process of one Python and import path (one per rlflow process, started at first use, again if
    it died)."""

    what = "the verifiers bridge process"
    error = VerifiersError
    keep_stderr = 50

    def __init__(self, python: str, path: tuple[str, ...]) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*path, *filter(None, [env.get("PYTHONPATH")])])
        self.start(python, BRIDGE, env)

    async def call(self, timeout: float, **request: Any) -> Any:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.ready)), timeout)   # (verifiers' imports: ~4 s)
        rid, future = self.send(**request)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except (asyncio.CancelledError, TimeoutError):
            try:
                self.send(op="cancel", target=rid)       # (the rollout stops calling the model, its programs end)
            except EnvironmentDied:
                pass
            raise

    def stop(self, wait: float = 10.0) -> None:
        super().stop(wait)


def verifiers_python(python: str | None) -> str:
    exe = python or sibling_python(VENV)
    if exe is None or not os.access(exe, os.X_OK):
        where = f"{python!r} is not an executable" if python else f"no {VENV} was found"
        raise UserError(f"env.kwargs.python: {where}; the verifiers 0.4 agent runs verifiers in a Python of its own "
                        f"(make setup builds {VENV})")
    return exe


def _paths(path: str | list[str] | None) -> tuple[str, ...]:
    return tuple(os.path.abspath(p) for p in ([path] if isinstance(path, str) else path or []))


def _model_at(base_url: str, api_key: str) -> str:
    """The model the endpoint serves (the first of GET /v1/models), so verifiers' requests name it as listed (and
    its renderer finds the card's max_model_len). Asked per episode: each iteration's endpoint serves another."""
    request = urllib.request.Request(base_url.rstrip("/") + "/models", headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def _tokenizer_path(tokenizer: str) -> str:
    from tasks.core.builtin_models import resolve

    return resolve(tokenizer)


async def run(row: dict, base_url: str, api_key: str, *, env: dict, client: Literal["eval", "train"] = "eval",
              tokenizer: str | None = None, model: str | None = None, sampling: dict | None = None,
              path: str | list[str] | None = None, python: str | None = None,
              timeout: float = 3600.0) -> tuple[float, dict]:
    """One episode of a verifiers 0.4 environment (`env`: its config, as `vf-eval`'s [env] table) against rlflow's
    endpoint at `base_url` with the episode's `api_key`. `client`: `eval` (the harness's calls relayed) or `train`
    (verifiers renders with `tokenizer` and calls /inference/v1/generate). `sampling`: verifiers' SamplingConfig
    (max_tokens, temperature, ...), imposed on every call. `path`: folders the bridge imports packages from."""
    _check_kwargs(env=env, client=client, tokenizer=tokenizer, model=model, sampling=sampling, path=path,
                  python=python, timeout=timeout)
    bridge = _VerifiersClient.of(verifiers_python(python), _paths(path))
    name = model or await asyncio.to_thread(_model_at, base_url, api_key)
    wire = {"type": client, "base_url": base_url}
    if client == "train":
        wire["renderer_model_name"] = _tokenizer_path(tokenizer)
    task = {"task_idx": row["task_idx"]} if row.get("task_idx") is not None else \
        {"task_data": {k: v for k, v in row.items() if k not in ROW_KEYS}}
    episode = await bridge.call(timeout, op="run", env=env, model=name, client=wire, key=api_key,
                                sampling=sampling or {}, **task)
    return outcome(episode)


def check(*, env: dict, client: str = "eval", tokenizer: str | None = None, model: str | None = None,
          sampling: dict | None = None, path: str | list[str] | None = None, python: str | None = None,
          timeout: float = 3600.0) -> None:
    """What this agent accepts as env.kwargs, checked before the run starts (tasks/envs/runtime/agents.py: agent_of
    calls an agent's `check`): one line naming the key. Each episode checks the kwargs' shape again; the
    environment config is resolved by verifiers itself (its taskset imported, not loaded) once per process."""
    _check_kwargs(env=env, client=client, tokenizer=tokenizer, model=model, sampling=sampling, path=path,
                  python=python, timeout=timeout)
    _check_env(env, path, python)


_RESOLVED: set[str] = set()       # the environment configs verifiers resolved in this process (check)


def _check_env(env: dict, path: str | list[str] | None, python: str | None, timeout: float = 300.0) -> None:
    """env.kwargs.env resolved in the bridge (op check: the taskset's class imported, the config validated as
    verifiers validates it when it loads the environment); one line naming what it refused."""
    key = json.dumps([env, _paths(path), python], sort_keys=True, default=str)
    if key in _RESOLVED:
        return
    bridge = _VerifiersClient.of(verifiers_python(python), _paths(path))
    try:
        bridge.ready.result(timeout=timeout)
        fault = bridge.send(op="check", env=env)[1].result(timeout=timeout)
    except TimeoutError:
        raise UserError(f"env.kwargs.env: verifiers did not resolve the environment config in {timeout:g} s "
                        f"(its taskset's import waits or loops)") from None
    except (VerifiersError, EnvironmentDied) as e:
        raise UserError(f"env.kwargs.env: the verifiers bridge could not resolve it: {e}") from None
    if fault is None:
        _RESOLVED.add(key)
        return
    if fault.get("field") == "taskset.id":
        raise UserError(f"env.kwargs.env.taskset.id: {env['taskset']['id']!r}: {fault['error'].rstrip('.')}; "
                        f"expected a taskset installed in {verifiers_python(python)} or in a folder of env.kwargs.path")
    raise UserError(f"env.kwargs.env: verifiers refused the environment config: {fault['error']}")


def _check_kwargs(*, env: dict, client: str = "eval", tokenizer: str | None = None, model: str | None = None,
                  sampling: dict | None = None, path: str | list[str] | None = None, python: str | None = None,
                  timeout: float = 3600.0) -> None:
    """The shape of env.kwargs (check's first part; each episode's check)."""
    if not isinstance(env, dict) or not env:
        raise UserError(f"env.kwargs.env: verifiers' environment config (vf-eval's [env] table: {{taskset: ..., "
                        f"agent: ...}}); got {json.dumps(env, default=str)[:80]}")
    if client not in ("eval", "train"):
        raise UserError(f"env.kwargs.client: {client!r}; expected eval or train")
    if client == "train" and not tokenizer:
        raise UserError("env.kwargs.tokenizer: client train renders prompts with the policy's tokenizer (a folder, "
                        "a hub id or builtin:NAME)")
    if tokenizer:
        path_of = _tokenizer_path(tokenizer)
        if path_of.startswith(("/", ".", "~")) and not Path(path_of).expanduser().exists():
            raise UserError(f"env.kwargs.tokenizer: {tokenizer}: no such folder")
    if sampling is not None and not isinstance(sampling, dict):
        raise UserError(f"env.kwargs.sampling: verifiers' SamplingConfig as a mapping (max_tokens, temperature, ...); "
                        f"got {type(sampling).__name__}")
    if model is not None and not isinstance(model, str):
        raise UserError(f"env.kwargs.model: a model name; got {type(model).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise UserError(f"env.kwargs.timeout: seconds, above 0; got {timeout!r}")
    for folder in _paths(path):
        if not Path(folder).is_dir():
            raise UserError(f"env.kwargs.path: {folder}: no such folder (the environment's packages are imported "
                            f"from these)")
    verifiers_python(python)


run.check = check


def outcome(episode: dict) -> tuple[float, dict]:
    """(reward, info) of a bridge's episode summary; raises where verifiers recorded no reward, or scored an
    episode one of whose model calls failed (verifiers' train client refuses a prompt longer than the endpoint's
    max_model_len before sending it, and the harness ends with no reply: a score the policy did not earn)."""
    traces = episode["traces"]
    scored = [t["reward"] for t in traces if t["reward"] is not None]
    if not traces or len(scored) < len(traces):
        errors = episode["errors"] + [e for t in traces for e in t["errors"]]
        raise VerifiersError(f"verifiers scored no reward for the episode: {errors[-1] if errors else 'no trace'}")
    failed = [e for t in traces for e in t.get("call_errors", [])]
    if failed:
        raise VerifiersError(f"a model call of the episode failed: {failed[-1]}")
    info = {"verifiers": {"ok": episode["ok"], "errors": episode["errors"],
                          "traces": [{k: t.get(k) for k in ("agent", "rewards", "metrics", "stop_condition",
                                                            "turns", "calls", "errors", "call_errors", "is_timeout")}
                                     for t in traces]}}
    return sum(scored) / len(scored), info


def taskset_rows(env: dict, path: str | list[str] | None = None, python: str | None = None,
                 timeout: float = 600.0) -> list[dict]:
    """The environment's taskset as rows (its tasks' data, each with its `task_idx`): a dataset for the agent."""
    bridge = _VerifiersClient.of(verifiers_python(python), _paths(path))
    tasks = asyncio.run(bridge.call(timeout, op="tasks", env=env))
    return [{**data, "task_idx": i} for i, data in enumerate(tasks)]


register_token_route("/inference/v1/generate", generate_response)     # (the endpoint serves it to every episode)
