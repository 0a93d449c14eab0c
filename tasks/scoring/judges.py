"""Rewards from models (reward.models; docs/reward-models.md): a reward model (a sequence classifier, or a causal
LM read by the probability of a verdict token) and an LLM judge (a template, a parser; pointwise, pairwise or
group ranking as ART's RULER does), scored beside the reward functions and combined with them by weight.

Every model speaks one protocol, the OpenAI-compatible one: chat completions (judge, verdict: temperature 0,
`top_logprobs` for a verdict) and vLLM's /classify (classifier). It answers in the stage
(tasks/scoring/judge_engine.py), from a judge server the flow started (tasks/scoring/judge_server.py; where:
local | sky), or at any OpenAI-compatible URL. A model is pinned (the sha256 of its weights, a registered MLflow
version, at a URL the served name), and each question is cached in the store, so a retried stage or a resumed
run asks nothing twice. An answer that does not parse is that completion's missing score, counted, not a zero.
More: docs/internals.md (tasks/scoring/judges.py): where each model answers, pins, the cache, failures.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import string
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.core.contracts import Scored, content_text
from tasks.core.errors import UserError
from tasks.core.fleet import bearer
from tasks.core.placement import Services, placement_of
from tasks.scoring.judge_answers import BUILTIN, Unparsed, answer_text, scores_of
from tasks.scoring.shaping import NAME as SHAPING

if TYPE_CHECKING:
    from tasks.core.config import Config, RewardModel
    from tasks.core.contracts import Rollout
    from tasks.core.store import Store

READY = "RLFLOW_JUDGE_READY"           # the line a judge server prints once it answers: READY <url>
TOP_LOGPROBS = 20                      # verdict: the answer's likeliest first tokens asked for
ANSWERS = "answers.json"               # in each cache folder: {request hash: answer}
FIELDS = {"pointwise": {"completion"}, "pairwise": {"completion_a", "completion_b"}, "group": {"completions"}}


class JudgeUnavailable(RuntimeError):
    """A reward model's server did not answer after its retries: the stage fails and is retried (by the flow,
    after it started the server again); the answers already given are cached."""

    def __init__(self, message: str, response=None):
        super().__init__(message)
        self.response = response        # (an HTTP answer: its Retry-After is read before the next try)


# ------------------------------------------------------------------------------------------------ checks


def template_fields(spec: RewardModel) -> set[str]:
    return {f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(spec.template or "") if f}


def check_specs(cfg: Config, columns: set[str] | None, function_names: list[str]) -> None:
    """What a config alone tells (every stage, at load): names, template fields, parser imports."""
    names = [m.name for m in cfg.reward.models]
    for i, spec in enumerate(cfg.reward.models):
        what = f"reward.models[{i}] ({spec.name})"
        if spec.name in function_names or spec.name in names[:i] or spec.name in ("env", SHAPING):
            by = ("a reward function" if spec.name in function_names else
                  f"reward.models[{names.index(spec.name)}]" if spec.name in names[:i] else
                  "the episodes' return" if spec.name == "env" else "reward.overlong's shaping")
            raise UserError(f"{what}.name: {spec.name!r} is taken (by {by}); names key the scores, so each reward "
                            f"function and model needs its own")
        if spec.template is not None:
            try:
                fields = template_fields(spec)
            except ValueError as e:
                raise UserError(f"{what}.template: not a format string ({e}); double literal braces") from None
            needed = FIELDS[spec.mode] if spec.kind == "judge" else FIELDS["pointwise"]
            if not needed <= fields:
                raise UserError(f"{what}.template: has no field {{{sorted(needed - fields)[0]}}}; a {spec.mode} "
                                f"{spec.kind} template names {', '.join('{' + f + '}' for f in sorted(needed))}")
            known = {"prompt", "n", *FIELDS[spec.mode if spec.kind == "judge" else "pointwise"]}
            if columns is not None and (unknown := sorted(fields - known - set(columns))):
                raise UserError(f"{what}.template: field {{{unknown[0]}}} is neither a dataset column (the data has "
                                f"{sorted(columns)}) nor one of {sorted(known)}")
        if spec.parser != "auto":
            if spec.kind != "judge":
                raise UserError(f"{what}.parser: only a judge's answers are parsed")
            if spec.parser in BUILTIN.values() and spec.parser != BUILTIN[spec.mode]:
                raise UserError(f"{what}.parser: {spec.parser!r} reads another mode's answers; a {spec.mode} "
                                f"judge's built-in parser is {BUILTIN[spec.mode]!r} (or auto)")
            _parser_fn(spec, what)


def check_models(cfg: Config) -> None:
    """Preflight: what needs the outside world. Each model rlflow loads resolves and matches its pin (and is a
    classifier exactly when kind says so); a URL answers and serves the model; a key variable is set. One line,
    exit 2, before anything is written."""
    place = placement_of(cfg)
    for i, spec in enumerate(cfg.reward.models):
        what = f"reward.models[{i}] ({spec.name})"
        if spec.url is not None:
            if spec.api_key_env and not os.environ.get(spec.api_key_env):
                raise UserError(f"{what}.api_key_env: the variable {spec.api_key_env} is not set (it holds the "
                                f"key of {spec.url})")
            served = _served_models(spec, what)
            if served is not None and spec.model not in served:
                raise UserError(f"{what}.model: {spec.url} serves {sorted(served)}, not {spec.model!r}")
            continue
        where = place.judges[spec.name]
        if where == "local" and any(place.where(s) == "sky" for s in ("reward", "evaluate")):
            raise UserError(f"{what}.where: local serves the model on this machine, which a stage on a sky "
                            f"cluster cannot reach; use where: sky (a cluster of its own) or stage")
        if where == "sky" and not _here(cfg, spec.model):
            continue                      # a hub model this machine has not cached: its cluster checks the pin
        path = model_path(cfg, spec, what)
        from transformers import AutoConfig

        from tasks.scoring.judge_engine import fault_of_fit

        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise UserError(f"{what}.model: cannot read the model's config at {path}: "
                            f"{str(e).splitlines()[0][:200]}") from None
        fault_of_fit(spec, config, path, what)


def _here(cfg: Config, model: str) -> bool:
    """Whether this machine can resolve `model` without the hub: a path, a builtin, a store URI, a registered
    version, or a hub model in its cache."""
    if model.startswith(("models:/", "builtin:", "/", "./", "../", "~", "s3://", "file://")) or Path(model).exists():
        return True
    from tasks.core.models import in_hub_cache

    return in_hub_cache(model)


def _served_models(spec: RewardModel, what: str) -> set[str] | None:
    import httpx

    key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
    try:
        r = httpx.get(f"{spec.url.rstrip('/')}/v1/models", timeout=10,
                      headers=bearer(key))
    except httpx.HTTPError as e:
        raise UserError(f"{what}.where: {spec.url} does not answer ({type(e).__name__}: {e})") from None
    if r.status_code in (401, 403):
        raise UserError(f"{what}.where: {spec.url} refused the key ({r.status_code}); check "
                        f"{spec.api_key_env or 'api_key_env'}")
    if r.status_code != 200:
        raise UserError(f"{what}.where: {spec.url}/v1/models answered {r.status_code}; expected an OpenAI-compatible "
                        f"server")
    try:
        return {m["id"] for m in r.json()["data"]}
    except (ValueError, KeyError, TypeError):
        return None


def model_path(cfg: Config, spec: RewardModel, what: str) -> str:
    """The entry's model as a local folder, its pin checked (tasks/core/models.py: resolve, the one resolver)."""
    from tasks.core.models import resolve

    return resolve(cfg, spec.model, f"{what}.model", pin=spec.sha256)


def _parser_fn(spec: RewardModel, what: str):
    """The user's parser (module:function); None for a built-in one (auto, or its mode's name)."""
    from tasks.core.paths import import_user

    if spec.parser == "auto" or spec.parser in BUILTIN.values():
        return None
    if ":" not in spec.parser:
        raise UserError(f"{what}.parser: expected 'number', 'choice', 'scores', 'auto' or module:function; "
                        f"{spec.parser!r} names nothing callable")
    return import_user(spec.parser, f"{what}.parser", noun="function")


# ------------------------------------------------------------------------------------------------ questions


def _text(value: Any) -> str:
    """A prompt or a multi-turn completion as a judge reads it: a lone user message as its text, else 'role:
    content' lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        return content_text(value[0].get("content"))
    return "\n\n".join(f"{m.get('role', '')}: {content_text(m.get('content'))}" for m in value or [])


def _completion(r: Rollout) -> str:
    return _text(r.turns) if r.turns is not None else r.completion


@dataclass
class Question:
    """One request to a model and the completions (record indices) its answer scores."""

    route: str                  # chat | classify
    body: dict                  # the protocol's request (model name and connection added when sent)
    records: list[int]
    key: str = ""


def questions(spec: RewardModel, records: list[Rollout], pin: str) -> list[Question]:
    """What to ask the model for `records`, by kind and mode (pairwise / group: per prompt group)."""
    out: list[Question] = []

    def fields(r: Rollout, **own) -> dict:
        # the dataset's columns, then the project's own fields over them: a column named `completion` (a TRL
        # prompt-completion dataset's reference answer) is not the policy's completion the template asks about
        return {**r.columns, "prompt": _text(r.prompt), **own}

    def chat(text: str) -> dict:
        body = {"messages": ([{"role": "system", "content": spec.system}] if spec.system else []) +
                [{"role": "user", "content": text}], "max_tokens": spec.max_tokens, "temperature": 0.0, "seed": 0}
        if spec.kind == "verdict":
            body.update(max_tokens=1, top_logprobs=TOP_LOGPROBS)
        return body

    if spec.kind == "classifier":
        for j, r in enumerate(records):
            conv = (r.prompt if isinstance(r.prompt, list) else [{"role": "user", "content": r.prompt}]) + \
                (r.turns if r.turns is not None else [{"role": "assistant", "content": r.completion}])
            out.append(Question("classify", {"messages": conv}, [j]))
    elif spec.kind == "verdict" or spec.mode == "pointwise":
        for j, r in enumerate(records):
            out.append(Question("chat", chat(spec.template.format(**fields(r, completion=_completion(r), n=1))), [j]))
    else:
        groups: dict[int, list[int]] = {}
        for j, r in enumerate(records):
            groups.setdefault(r.group, []).append(j)
        for members in groups.values():
            r = records[members[0]]
            if spec.mode == "group":
                listed = "\n\n".join(f"[{k + 1}]\n{_completion(records[j])}" for k, j in enumerate(members))
                out.append(Question("chat", chat(spec.template.format(**fields(r, completions=listed,
                                                                             n=len(members)))), members))
            elif len(members) > 1:           # pairwise: each against the next, so each is A once and B once
                for k, a in enumerate(members):
                    b = members[(k + 1) % len(members)]
                    out.append(Question("chat", chat(spec.template.format(**fields(
                        r, completion_a=_completion(records[a]), completion_b=_completion(records[b]), n=2))),
                        [a, b]))
    for q in out:
        # (the engine too: hf and vLLM round differently, and a run that switches must not mix their answers)
        q.key = hashlib.sha256(json.dumps([pin, spec.engine, spec.kind, spec.mode, q.route, q.body], sort_keys=True,
                                          default=str).encode()).hexdigest()
    return out


# ------------------------------------------------------------------------------------------------ the cache


class AnswerCache:
    """Answers already given for one stage (a prefix of the store): loaded once, new ones written as a folder per
    batch (manifest last: a crash mid-write leaves nothing half-visible)."""

    def __init__(self, store: Store | None, prefix: str | None):
        self.store, self.prefix = store, prefix
        self.answers: dict[str, dict] = {}
        self.pending: dict[str, dict] = {}
        if store is not None and prefix is not None:
            for name in store.list_folders(prefix):
                if store.manifest(f"{prefix}/{name}") is not None:
                    self.answers.update(store.get_json(f"{prefix}/{name}", ANSWERS))

    def get(self, key: str) -> dict | None:
        return self.answers.get(key)

    def put(self, key: str, answer: dict, keep: bool = True) -> None:
        """An answer for this stage; stored only if `keep` (one that gives no score is asked again next time: a
        server fixed since, or a malformed reply, must not be replayed forever)."""
        self.answers[key] = answer
        if keep:
            self.pending[key] = answer

    def flush(self) -> None:
        if not self.pending or self.store is None or self.prefix is None:
            self.pending.clear()
            return
        with tempfile.TemporaryDirectory(prefix="rlflow-judge-") as tmp:
            (Path(tmp) / ANSWERS).write_text(json.dumps(self.pending, sort_keys=True))
            self.store.put_folder(f"{self.prefix}/{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}",
                                  Path(tmp), meta={"answers": len(self.pending)}, give_up=True)
        self.pending.clear()


# ------------------------------------------------------------------------------------------------ asking


_engines: dict[tuple, Any] = {}        # where: stage: loaded once per process (the flow's inline stages reuse them),
_engines_lock = threading.Lock()       # once when the look-ahead stages' threads ask at once


class Asker:
    """Sends one model's questions: to its engine in this process, or over HTTP to its server."""

    def __init__(self, cfg: Config, spec: RewardModel, index: int, services: Services):
        self.cfg, self.spec = cfg, spec
        what = f"reward.models[{index}] ({spec.name})"
        self.url, self.key, self.model_name = None, None, spec.model
        if spec.url:
            self.url, self.key = spec.url.rstrip("/"), os.environ.get(spec.api_key_env) if spec.api_key_env else None
            if spec.api_key_env and not self.key:
                raise UserError(f"{what}.api_key_env: the variable {spec.api_key_env} is not set")
        elif (where := placement_of(cfg).judges[spec.name]) != "stage" and (url := services.judges.get(spec.name)):
            self.url, self.key, self.model_name = url.rstrip("/"), services.judge_token, spec.name
        elif where != "stage":
            print(f"note: {what} (where: {where}) has no server from the flow: loading it in this process",
                  file=sys.stderr)
        self.what = what
        self.pin = spec.sha256 or (spec.model if spec.model.startswith("models:/") else f"{spec.url}|{spec.model}")

    def ask(self, qs: list[Question], cache: AnswerCache, keep=lambda q, a: True) -> None:
        """Answers for `qs` into `cache` (flushed after each batch; stored where `keep(question, answer)`), each
        answer's text capped (judge_answers.MAX_TEXT: what is scored is what is stored)."""
        size = self.spec.batch_size
        if not qs:
            return
        if self.url is None:
            for start in range(0, len(qs), size):
                chunk = qs[start:start + size]
                for q, a in zip(chunk, self._local(chunk)):
                    a = _capped(a)
                    cache.put(q.key, a, keep(q, a))
                cache.flush()
            return
        asyncio.run(self._remote(qs, cache, keep))

    def _engine(self):
        """This process's engine for the model (loaded on the first question the cache does not answer)."""
        with _engines_lock:             # (resolving too: transformers' lazy imports are not safe in two threads)
            ident = (model_path(self.cfg, self.spec, self.what), self.spec.kind, self.spec.max_length)
            if ident not in _engines:
                from tasks.scoring.judge_engine import JudgeEngine
                if len(_engines) >= 2:
                    _engines.clear()
                _engines[ident] = JudgeEngine(*ident)
            return _engines[ident]

    def _local(self, chunk: list[Question]) -> list[dict]:
        engine = self._engine()
        out: dict[int, dict] = {}
        for route in ("chat", "classify"):
            idx = [i for i, q in enumerate(chunk) if q.route == route]
            if idx:
                for i, a in zip(idx, engine.answer(route, [chunk[i].body for i in idx])):
                    out[i] = a
        return [out[i] for i in range(len(chunk))]

    async def _remote(self, qs: list[Question], cache: AnswerCache, keep) -> None:
        import httpx
        import openai

        spec = self.spec
        # (retries here, not the client's: each try is bounded as a whole, see _tries)
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.key or "none",
                                    timeout=spec.timeout_seconds, max_retries=0)
        http = httpx.AsyncClient(timeout=spec.timeout_seconds, headers=bearer(self.key))
        gate = asyncio.Semaphore(spec.batch_size)

        async def one(q: Question) -> None:
            async with gate:
                a = _capped(await (self._chat(client, q) if q.route == "chat" else self._classify(http, q)))
                cache.put(q.key, a, keep(q, a))

        try:
            for start in range(0, len(qs), spec.batch_size * 4):   # a cache folder every few batches
                chunk = qs[start:start + spec.batch_size * 4]
                results = await asyncio.gather(*(one(q) for q in chunk), return_exceptions=True)
                cache.flush()
                failed = [e for e in results if isinstance(e, BaseException)]
                if failed:
                    raise JudgeUnavailable(f"reward model {spec.name!r} at {self.url}: {len(failed)} of "
                                           f"{len(chunk)} requests failed ({type(failed[0]).__name__}: "
                                           f"{str(failed[0])[:200]})") from failed[0]
        finally:
            await client.close()
            await http.aclose()

    async def _tries(self, send, again) -> Any:
        """`send()` tried up to retries + 1 times, each try bounded as a whole by timeout_seconds (the clients'
        timeouts are per read: a server dripping a byte at a time would hold the stage for ever); a try that
        fails where `again(error)` says is transient is tried again after a back-off (_backoff), else raised."""
        for attempt in range(self.spec.retries + 1):
            try:
                return await asyncio.wait_for(send(), self.spec.timeout_seconds)
            except Exception as e:  # noqa: BLE001 - again() decides; the last one is raised
                if attempt == self.spec.retries or not (isinstance(e, TimeoutError) or again(e)):
                    if isinstance(e, TimeoutError):
                        raise TimeoutError(f"no whole answer within timeout_seconds ({self.spec.timeout_seconds:g} "
                                           f"s)") from None
                    raise
                wait = _backoff(e, attempt)
            await asyncio.sleep(wait)

    async def _chat(self, client, q: Question) -> dict:
        import openai

        body = q.body
        extra = {"logprobs": True, "top_logprobs": body["top_logprobs"]} if body.get("top_logprobs") else {}

        def again(e: Exception) -> bool:     # (what the openai client retries: transport, 408, 409, 429, 5xx)
            return isinstance(e, openai.APIConnectionError) or (
                isinstance(e, openai.APIStatusError) and (e.status_code in (408, 409, 429) or e.status_code >= 500))

        reply = await self._tries(lambda: client.chat.completions.create(
            model=self.model_name, messages=body["messages"], max_tokens=body["max_tokens"], temperature=0.0, seed=0,
            **extra), again)
        choice = reply.choices[0]
        answer = {"text": answer_text(choice.message.content)}      # (a string, or a list of text parts)
        if extra and choice.logprobs and choice.logprobs.content:
            answer["top"] = {}
            for t in choice.logprobs.content[0].top_logprobs or []:
                answer["top"].setdefault(str(t.token), t.logprob)     # (judge_answers checks the numbers)
        return answer

    async def _classify(self, http, q: Question) -> dict:
        import httpx

        # one conversation, vLLM's chat form of /classify (the server renders it with the model's chat template)
        payload = {"model": self.model_name, "messages": q.body["messages"]}

        async def send():
            r = await http.post(f"{self.url}/classify", json=payload)
            if r.status_code in (408, 409, 429) or r.status_code >= 500:      # (as the chat route's `again`)
                raise JudgeUnavailable(f"{self.url}/classify answered {r.status_code}", response=r)
            r.raise_for_status()
            return r.json()["data"][0]

        return await self._tries(send, lambda e: isinstance(e, (httpx.TransportError, JudgeUnavailable)))


def _backoff(e: Exception, attempt: int) -> float:
    """Seconds before the next try: what the server's answer said (Retry-After in seconds or as an HTTP date,
    OpenAI's retry-after-ms) where it says more than 0 and at most 60 s, as the openai client honours it;
    else 0.5 s, doubling."""
    headers = getattr(getattr(e, "response", None), "headers", None)
    said = None
    try:
        if headers is not None and (ms := headers.get("retry-after-ms")) is not None:
            said = float(ms) / 1000
        elif headers is not None and (text := headers.get("retry-after")) is not None:
            try:
                said = float(text)
            except ValueError:
                from datetime import datetime, timezone
                from email.utils import parsedate_to_datetime
                said = (parsedate_to_datetime(text) - datetime.now(timezone.utc)).total_seconds()
    except (TypeError, ValueError, OverflowError, AttributeError):     # (a naive date, garbage: not said)
        said = None
    return said if said is not None and 0 < said <= 60 else 0.5 * 2 ** attempt


def _capped(answer: Any) -> Any:
    """An answer with its text cut to judge_answers.MAX_TEXT characters (a server may ignore max_tokens)."""
    if isinstance(answer, dict) and isinstance(answer.get("text"), str) and len(answer["text"]) > len(
            text := answer_text(answer["text"])):
        return {**answer, "text": text, "capped": len(answer["text"])}
    return answer


# ------------------------------------------------------------------------------------------------ scoring


_shown: set[str] = set()


def score_models(cfg: Config, records: list[Rollout], cache_prefix: str | None, strict: bool,
                 services: Services | None = None) -> Scored:
    """Every reward model's scores for `records` (None: no score), asking only what the cache lacks; `errors`:
    model name -> the first failed answer, said. `services`: the judge servers the flow started (None: this
    process's environment says, as a stage process is given them)."""
    from tasks.core.placement import Services
    from tasks.core.store import open_store

    services = Services.given(services)

    out = Scored()
    if not cfg.reward.models or not records:
        for spec in cfg.reward.models:
            out.scores[spec.name] = [None] * len(records)
        return out
    cache = AnswerCache(open_store(cfg) if cache_prefix else None, cache_prefix)
    for i, spec in enumerate(cfg.reward.models):
        t0 = time.perf_counter()
        asker = Asker(cfg, spec, i, services)
        qs = questions(spec, records, asker.pin)
        parser = _parser_fn(spec, spec.name)

        def parses(q: Question, answer: Any, spec=spec, parser=parser) -> bool:
            try:
                scores_of(spec, len(q.records), answer, parser)
                return True
            except Unparsed:
                return False

        # (an answer stored before that gives no score is asked again: stores from before answers were checked)
        todo = [q for q in {q.key: q for q in qs}.values()
                if (a := cache.get(q.key)) is None or not parses(q, a)]
        asker.ask(todo, cache, parses)
        sums: list[list[float]] = [[] for _ in records]
        failed: set[int] = set()
        first_error = None
        for q in qs:
            answer = cache.get(q.key)
            try:
                values = scores_of(spec, len(q.records), answer, parser)
            except Unparsed as e:
                failed.update(q.records)
                first_error = first_error or str(e)
                continue
            for j, v in zip(q.records, values):
                sums[j].append(v)
        scores = [None if j in failed or not sums[j] else sum(sums[j]) / len(sums[j]) for j in range(len(records))]
        out.scores[spec.name] = scores
        # a pairwise judge has nothing to compare in a group of one (eval.greedy, eval.num_generations 1): no
        # score, counted and said once, not an error (the sampled groups beside it are judged)
        asked = {j for q in qs for j in q.records}
        alone = sum(j not in asked for j in range(len(records))) if spec.kind == "judge" else 0
        if alone and f"{spec.name}/alone" not in _shown:
            _shown.add(f"{spec.name}/alone")
            print(f"warning: reward model {spec.name!r} ({spec.mode}): {alone} of {len(records)} completions are "
                  f"alone in their prompt's group (eval.greedy, eval.num_generations 1): they get no score "
                  f"(reward/{spec.name}/alone)", file=sys.stderr)
        if failed:
            message = (f"reward model {spec.name!r}: {len(failed)} of {len(records)} completions got an answer that "
                       f"gives no score (first: {first_error})")
            out.errors[spec.name] = message
            if strict:
                return out              # (the caller fails the stage with this line: reward.strict)
            if spec.name not in _shown:
                _shown.add(spec.name)
                print(f"warning: {message}; those scores are missing (reward/{spec.name}/failed; reward.strict: "
                      f"true makes it fail the run)", file=sys.stderr)
        out.metrics.update({f"{spec.name}/failed": float(len(failed)), f"{spec.name}/requests": float(len(todo)),
                            f"{spec.name}/cached": float(len(qs) - len(todo)),
                            f"{spec.name}/truncated": float(sum(isinstance(a := cache.get(q.key), dict) and
                                                                bool(a.get("truncated")) for q in qs)),
                            **({f"{spec.name}/alone": float(alone)} if alone else {}),
                            f"{spec.name}/seconds": time.perf_counter() - t0})
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m tasks.scoring.judges pin MODEL`: the sha256 to pin a model with (reward.models[].sha256).
    `python -m tasks.scoring.judges path --config F [--overrides-json J] --model NAME`: that entry's model as a
    local folder, pin checked (what a judge server on vLLM is given: sky/judge.yaml)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["path"]:
        import argparse

        from tasks.core.config import load_config
        from tasks.core.errors import user_error_line
        from tasks.core.stage import parse_overrides_json

        ap = argparse.ArgumentParser(prog="python -m tasks.scoring.judges path")
        ap.add_argument("--config", required=True)
        ap.add_argument("--overrides-json", default="[]")
        ap.add_argument("--model", required=True)
        args = ap.parse_args(argv[1:])
        try:
            cfg = load_config(args.config, parse_overrides_json(args.overrides_json))
            found = [(i, m) for i, m in enumerate(cfg.reward.models) if m.name == args.model]
            if not found:
                raise UserError(f"--model: {args.model!r} is not one of reward.models")
            print(model_path(cfg, found[0][1], f"reward.models[{found[0][0]}] ({args.model})"))
        except UserError as e:
            print(user_error_line(e), file=sys.stderr)
            return 2
        return 0
    if len(argv) != 2 or argv[0] != "pin":
        print("usage: python -m tasks.scoring.judges pin MODEL   (a folder, a .gguf file, builtin:NAME)\n"
              "       python -m tasks.scoring.judges path --config F [--overrides-json J] --model NAME",
              file=sys.stderr)
        return 2
    from tasks.core import builtin_models
    from tasks.core.models import pin_of

    print(pin_of(builtin_models.resolve(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
