"""The agents' endpoint: an OpenAI-compatible server in front of the stage's sampling session, recording the exact
tokens of every call under its episode.

    with Endpoint(cfg, session, policy, params) as ep:       # serves on 127.0.0.1:<free port> while the stage runs
        key = ep.open(episode=3, seed=s)                     # one API key per episode
        ... the agent calls ep.base_url with `key` (openai.OpenAI(base_url=ep.base_url, api_key=key)) ...
        log = ep.close(key)                                  # its calls: prompt ids, completion ids, logprobs

Routes (routes.py; a Bearer key per episode): /v1/models, chat/completions, completions, responses,
/rl/set_reward, and the token routes integrations register. It serves only the scheduled policy, on whatever
engine the run samples with, and records what was sampled: a chat call that extends an earlier call of its
episode is rendered as that call's tokens followed by the new messages' tokens, never re-tokenized; sampled
in rounds (`lockstep`) or a call at a time, reproducibly.
Here the episodes, sampling and records; the HTTP side in routes.py, the plain records in calls.py.
More: docs/internals.md (tasks/envs/runtime/endpoint.py): the routes, rendering, sampling and limits, in full.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tasks.core.config_generate import MIN_TEMPERATURE
from tasks.core.contracts import SamplingParams, SamplingSession
from tasks.envs.runtime.calls import (
    Call,
    EpisodeLog,
    Refused,
    _extends,
    _same,
    normalise,
)
from tasks.envs.runtime.rendering import Renderer
from tasks.envs.runtime.tools import parse_tool_calls

if TYPE_CHECKING:
    from tasks.core.config import Config

CALL_SEED = 1_000_033          # call c of an episode samples with seed episode_seed + c * CALL_SEED
ROUND_SEED = 999_983           # lockstep round r samples with seed params.seed + r * ROUND_SEED
SHUTDOWN_SECONDS = 5           # a stopped endpoint's requests still open after this are cancelled (Endpoint.stop)
ALIAS = "policy"               # a model name every endpoint also answers to (the policy's own is in /v1/models)


@dataclass
class Waiting:
    """A call waiting for its round (lockstep)."""

    episode: int
    prompt_ids: list[int]
    budget: int
    temperature: float
    top_p: float
    done: threading.Event = field(default_factory=threading.Event)
    sample: Any = None                   # (completion ids, logprobs, truncated)
    error: BaseException | None = None


# ------------------------------------------------------------------------------------------------ endpoint

class Endpoint:
    """The stage's endpoint (the module's docstring): start it, open an episode per agent, close it for its log."""

    def __init__(self, cfg: Config, session: SamplingSession, policy: str, params: SamplingParams,
                 host: str = "127.0.0.1", port: int = 0):
        self.cfg, self.session, self.policy, self.params = cfg, session, policy, params
        self.tokenizer = session.tokenizer
        self.render = Renderer(self.tokenizer, cfg.generate.max_prompt_length)
        self.render_later = Renderer(self.tokenizer, cfg.generate.max_prompt_length + cfg.env.max_tokens)
        self.max_model_len = cfg.generate.max_prompt_length + cfg.env.max_tokens
        self.host, self.port = host, port
        self.episodes: dict[str, EpisodeLog] = {}
        self.pool = ThreadPoolExecutor(max_workers=max(cfg.env.concurrency, 1) + 4, thread_name_prefix="endpoint")
        self.sampler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="endpoint-round")
        self.server = None
        self.thread: threading.Thread | None = None
        self.lockstep = False             # calls wait for their round (settle); else each is sampled at once
        self.waiting: dict[int, Waiting] = {}
        self.rounds = 0
        self.in_round = False
        self._waiting = threading.Lock()
        self.sampling_seconds = 0.0
        self.load_seconds = 0.0
        self._count = threading.Lock()

    # -- lifetime
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def url(self) -> str:
        """The server's root: /rl/set_reward and /inference/v1/generate live there, beside /v1."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> Endpoint:
        import uvicorn

        from tasks.envs.runtime.routes import app

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app(self), log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=30, timeout_graceful_shutdown=SHUTDOWN_SECONDS)
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None          # (a thread: the stage's signals are its own)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="endpoint")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agents' endpoint did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """The server stopped: calls still waiting for a round answered with an error first, and a request still
        open SHUTDOWN_SECONDS later (a client gone quiet mid-request) cancelled rather than waited on."""
        with self._waiting:
            waiting, self.waiting = list(self.waiting.values()), {}
        for w in waiting:
            w.error = Refused(409, "episode_closed", "the episode has ended")
            w.done.set()
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(3 * SHUTDOWN_SECONDS)
            self.server = None
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sampler.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Endpoint:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- episodes
    def open(self, episode: int, seed: int) -> str:
        key = "rl-" + secrets.token_urlsafe(24)
        log = EpisodeLog(index=episode, seed=seed, key=key)
        with self._waiting:
            self.episodes[key] = log
        return key

    def close(self, key: str) -> EpisodeLog:
        """The episode's log; its key is refused from now on (a call of it still waiting for its round is
        answered with an error: its agent has ended)."""
        with self._waiting:
            log = self.episodes.pop(key)
            w = self.waiting.pop(log.index, None)
        if w is not None:
            w.error = Refused(409, "episode_closed", "the episode has ended")
            w.done.set()
        with log.lock:                                    # (waits for a call in progress to be recorded)
            return log

    # -- lockstep rounds
    def settle(self) -> bool:
        """Start a round if every open episode is waiting on a call (the runner calls this between its own
        opens and closes, so a round's calls never depend on timing). True if one started."""
        with self._waiting:
            if self.in_round or not self.waiting or len(self.waiting) < len(self.episodes):
                return False
            batch = [self.waiting[i] for i in sorted(self.waiting)]
            self.waiting, self.in_round = {}, True
            r, self.rounds = self.rounds, self.rounds + 1
        self.sampler.submit(self._round, batch, r)       # (not self.pool: its threads are the ones waiting)
        return True

    def _round(self, batch: list[Waiting], r: int) -> None:
        try:
            groups: dict[tuple[float, float], list[Waiting]] = {}
            for w in batch:
                groups.setdefault((w.temperature, w.top_p), []).append(w)
            for g, ((temperature, top_p), ws) in enumerate(sorted(groups.items())):
                try:
                    sampled = self.session.sample([w.prompt_ids for w in ws], SamplingParams(
                        n=1, max_new_tokens=max(w.budget for w in ws), temperature=temperature, top_p=top_p,
                        top_k=self.params.top_k, seed=(self.params.seed + r * ROUND_SEED + g) % (2 ** 63)),
                        keys=[self.route_key(w.episode) for w in ws])
                except BaseException as e:  # noqa: BLE001 - every call of the round gets it
                    for w in ws:
                        w.error = e
                    continue
                with self._count:
                    self.sampling_seconds += sampled.sampling_seconds
                    self.load_seconds += sampled.load_seconds
                for w, s in zip(ws, sampled.samples):
                    ids = s.completion_ids[:w.budget]
                    ended = not s.truncated and len(ids) == len(s.completion_ids)
                    w.sample = (list(ids), list(s.logprobs[:w.budget]), not ended)
        finally:
            with self._waiting:
                self.in_round = False
            for w in batch:
                w.done.set()

    def episode(self, authorization: str | None) -> tuple[str, EpisodeLog]:
        key = (authorization or "").removeprefix("Bearer ").strip()
        log = self.episodes.get(key)
        if log is None:
            raise Refused(401, "invalid_api_key", "unknown or closed API key: each episode has its own, valid "
                          "while its agent runs")
        return key, log

    def route_key(self, episode: int) -> str:
        """Episode `episode`'s key to the sampler: where replicas serve, its calls stay on one (its prefix cache)."""
        return f"{self.params.seed}/{episode}"

    def check_model(self, name: Any) -> None:
        if name not in (self.policy, ALIAS):
            raise Refused(404, "model_not_found", f"model {name!r}: this endpoint serves {self.policy!r} (the "
                          f"policy this iteration samples from; also called {ALIAS!r}) and nothing else")

    # -- sampling bounds
    def params_for(self, body: dict, max_key: tuple[str, ...]) -> SamplingParams:
        """The run's sampling settings, narrowed by the request within env.endpoint's bounds."""
        p, bounds = self.params, self.cfg.env.endpoint
        max_new = p.max_new_tokens
        for k in max_key:
            if body.get(k) is not None:
                v = body[k]
                if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= p.max_new_tokens:
                    raise Refused(400, "invalid_request_error", f"{k}: {v!r} is out of bounds (1 .. "
                                  f"{p.max_new_tokens}, generate.max_completion_length)")
                max_new = v
                break
        temperature = p.temperature
        if body.get("temperature") is not None and p.temperature > 0:     # (a greedy pass stays greedy)
            t = body["temperature"]
            lo, hi = bounds.temperature or (p.temperature, p.temperature)
            if not isinstance(t, int | float) or not lo <= t <= hi:
                raise Refused(400, "invalid_request_error", f"temperature: {t!r} is out of bounds ({lo} .. {hi}, "
                              "env.endpoint.temperature)")
            if 0 < t < MIN_TEMPERATURE:
                raise Refused(400, "invalid_request_error", f"temperature: {t!r} is below {MIN_TEMPERATURE:g} (the "
                              f"logits divided by it overflow); 0 samples greedily")
            temperature = float(t)
        top_p = p.top_p
        if body.get("top_p") is not None and p.temperature > 0:
            t = body["top_p"]
            if not isinstance(t, int | float) or not bounds.min_top_p <= t <= p.top_p:
                raise Refused(400, "invalid_request_error", f"top_p: {t!r} is out of bounds "
                              f"({bounds.min_top_p} .. {p.top_p}, env.endpoint.min_top_p .. generate.top_p)")
            top_p = float(t)
        if body.get("n", 1) not in (1, None):
            raise Refused(400, "invalid_request_error", "n: one completion per call (an agent's episode samples "
                          "its own group)")
        return SamplingParams(n=1, max_new_tokens=max_new, temperature=temperature, top_p=top_p, seed=0, top_k=p.top_k)

    # -- one call
    def chat_prompt(self, log: EpisodeLog, messages: list[dict],
                    tools: list[dict] | None) -> tuple[list[int], int | None]:
        """The prompt ids of a chat call, and the earlier call it extends token for token (None: rendered fresh)."""
        for i in range(len(log.calls) - 1, -1, -1):
            c = log.calls[i]
            if c.messages is None or c.reply is None or c.tools != tools:
                continue
            n = len(c.messages)
            if len(messages) <= n + 1 or not _same(messages[n], c.reply):
                continue
            if not all(_same(a, b) for a, b in zip(messages[:n], c.messages)):
                continue
            eos = self.tokenizer.eos_token_id           # (a reply cut at a stop string has none: its turn is
            ended = bool(c.completion_ids) and c.completion_ids[-1] == eos      # closed in full)
            try:
                obs = self.render.observation(messages[n + 1:], tools, ended)
            except ValueError:
                break                                  # (a template that cannot append: render fresh)
            return c.prompt_ids + c.completion_ids + obs, i
        try:
            return (self.render_later if log.calls else self.render).prompt(messages, tools), None
        except Exception as e:  # noqa: BLE001 - the template's own complaint, as the agent's error
            raise Refused(400, "invalid_request_error", f"messages: the chat template cannot render them ({e})") \
                from None

    def sample(self, log: EpisodeLog, prompt_ids: list[int], params: SamplingParams, stop: list[str],
               messages: list[dict] | None = None, tools: list[dict] | None = None,
               extends: int | None = None) -> Call:
        """Sample one completion for the episode (under its lock: an episode's calls are sampled in order)."""
        ec = self.cfg.env
        if len(log.calls) >= ec.max_turns:
            log.limited = log.limited or f"env.max_turns ({ec.max_turns}) calls"
            raise Refused(400, "episode_limit", f"the episode has made its env.max_turns ({ec.max_turns}) model "
                          "calls")
        used = 0                                       # tokens after the episode's first prompt so far
        if log.calls:
            first = len(log.calls[0].prompt_ids)
            used = len(prompt_ids) - first if extends is not None else \
                max(len(c.prompt_ids) + len(c.completion_ids) for c in log.calls) - first
        room = ec.max_tokens - max(used, 0)
        if room <= 0:
            log.limited = log.limited or f"env.max_tokens ({ec.max_tokens}) tokens"
            raise Refused(400, "episode_limit", f"the episode has used its env.max_tokens ({ec.max_tokens}) "
                          "tokens")
        budget = min(params.max_new_tokens, room)
        if self.lockstep:
            w = Waiting(log.index, list(prompt_ids), budget, params.temperature, params.top_p)
            with self._waiting:
                if log.index in self.waiting or self.episodes.get(log.key) is not log:
                    raise Refused(409, "episode_closed", "the episode has ended")
                self.waiting[log.index] = w
            w.done.wait()
            if w.error is not None:
                raise w.error
            ids, logprobs, truncated = w.sample
            versions = None
        else:
            seed = (log.seed + len(log.calls) * CALL_SEED) % (2 ** 63)
            sampled = self.session.sample([prompt_ids], SamplingParams(
                n=1, max_new_tokens=budget, temperature=params.temperature, top_p=params.top_p, seed=seed,
                top_k=params.top_k),
                keys=[self.route_key(log.index)])
            s = sampled.samples[0]
            ids, logprobs, truncated = list(s.completion_ids), list(s.logprobs), s.truncated
            versions = list(s.versions) if s.versions is not None else None     # (generate.streaming)
            with self._count:
                self.sampling_seconds += sampled.sampling_seconds
                self.load_seconds += sampled.load_seconds
        if stop:
            ids, logprobs, truncated = self.cut_at_stop(ids, logprobs, stop, truncated)
        own = (params.temperature, params.top_p) != (self.params.temperature, self.params.top_p)
        call = Call(prompt_ids=list(prompt_ids), completion_ids=ids, logprobs=logprobs, truncated=truncated,
                    messages=messages, tools=tools, extends=extends,
                    versions=versions[:len(ids)] if versions is not None else None,
                    temperature=params.temperature if own else None, top_p=params.top_p if own else None)
        if used + len(ids) >= ec.max_tokens:
            log.limited = log.limited or f"env.max_tokens ({ec.max_tokens}) tokens"
        return call

    def chat_call(self, log: EpisodeLog, messages: list[dict], tools: list[dict] | None, params: SamplingParams,
                  stop: list[str]) -> tuple[Call, str, list[dict]]:
        """A chat call (Chat Completions, Responses): rendered (onto an earlier call's tokens where it continues
        one), sampled, its reply parsed and recorded; the call, the reply's text and its tool calls."""
        prompt_ids, extends = self.chat_prompt(log, messages, tools)
        call = self.sample(log, prompt_ids, params, stop, messages, tools, extends)
        text, calls = _assistant(self, call, stop, tools)
        call.reply = normalise([{"role": "assistant", "content": text, "tool_calls": calls or None}])[0]
        log.calls.append(call)
        return call, text, calls

    def token_call(self, log: EpisodeLog, ids: list[int], params: SamplingParams, stop: list[str], field: str,
                   stop_token_ids: tuple[int, ...] | list[int] = ()) -> Call:
        """A call whose prompt is token ids (completions, the token route): checked against the vocabulary and
        the length bound unless it continues an earlier call, sampled, cut after a stop token other than EOS
        (vLLM's stop_token_ids), recorded."""
        vocab = len(self.tokenizer)
        if any(not 0 <= i < vocab for i in ids):
            raise Refused(400, "invalid_request_error", f"{field}: token ids must be in 0 .. {vocab - 1}")
        extends = _extends(log, ids)
        if extends is None:
            self.check_length(log, ids)
        call = self.sample(log, ids, params, stop, extends=extends)
        stops = set(stop_token_ids)
        end = next((i for i, t in enumerate(call.completion_ids) if t in stops), None)
        if end is not None and end + 1 < len(call.completion_ids):
            call.completion_ids, call.logprobs = call.completion_ids[:end + 1], call.logprobs[:end + 1]
            call.truncated = False
        log.calls.append(call)
        return call

    def check_length(self, log: EpisodeLog, ids: list[int]) -> None:
        """Token ids a caller gives (the completions and token routes): they are its own and never cut, so one
        longer than a chat prompt may be is refused. An episode's first prompt: generate.max_prompt_length; a later
        one: that and env.max_tokens (/v1/models' max_model_len)."""
        bound = self.max_model_len if log.calls else self.cfg.generate.max_prompt_length
        if len(ids) > bound:
            raise Refused(400, "context_length_exceeded", f"the prompt has {len(ids)} tokens, more than {bound} "
                          f"(generate.max_prompt_length{' + env.max_tokens' if log.calls else ''})")

    def cut_at_stop(self, ids: list[int], logprobs: list[float], stop: list[str],
                    truncated: bool) -> tuple[list[int], list[float], bool]:
        """Keep the tokens up to the one that completes a stop string (the text returned stops before it, as
        OpenAI's does; the tokens sampled after it are dropped and not trained on)."""
        if not any(s in self.tokenizer.decode(ids, skip_special_tokens=True) for s in stop):
            return ids, logprobs, truncated             # (the usual case: one decode, not one per token)
        for i in range(1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:i], skip_special_tokens=True)
            if any(s in text for s in stop):
                return ids[:i], logprobs[:i], False
        return ids, logprobs, truncated

    def text_of(self, ids: list[int], stop: list[str]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in stop:
            if s in text:
                text = text[:text.index(s)]
        return text

    def set_reward(self, log: EpisodeLog, body: dict) -> None:
        r = body.get("reward")
        if not isinstance(r, int | float) or isinstance(r, bool) or r != r:
            raise Refused(400, "invalid_request_error", f"reward: expected a number, got {r!r}")
        info = body.get("info") or {}
        if not isinstance(info, dict):
            raise Refused(400, "invalid_request_error", "info: expected an object")
        log.reward, log.info = float(r), {**log.info, **info}


def _assistant(ep: Endpoint, call: Call, stop: list[str], tools: list[dict] | None) -> tuple[str, list[dict]]:
    """The reply's text and tool calls ({id, type, function: {name, arguments: JSON text}}), parsed the way
    environments' replies are (tasks/envs/runtime/tools.py); a malformed call stays in the text."""
    text = ep.text_of(call.completion_ids, stop)
    if not tools:
        return text, []
    content, parsed = parse_tool_calls(text)
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
             for c in parsed if c.get("type") == "function"]
    if len(calls) != len(parsed):
        return text, []
    return content.strip() if calls else content, calls
