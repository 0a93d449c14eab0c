"""The environment protocol: what one multi-turn episode talks to (docs/environments.md).

    class Guess:                                   # env.factory: "mymodule:Guess", env.kwargs: {...}
        tools = []                                 # optional: Python functions the model may call (tools.py)
        def reset(self, row: dict) -> list[dict]:  # the dataset row -> the first messages (the prompt)
            ...
        def step(self, message: dict) -> Step:     # the model's message (tool calls parsed) -> what comes back
            return Step(observation=[{"role": "user", "content": "higher"}], reward=0.0, done=False)
        def close(self): ...                       # optional

`reset` and `step` may be `async def`. `step` may return a Step or a tuple (observation, reward, done[, info]).
One instance serves one episode: the factory is called once per episode, so state never leaks between them.
An episode ends when the environment says done, at env.max_turns, or when env.max_tokens would be passed. The
return is the sum of the turn rewards (env.returns: sum) or the last one (final).
More: docs/internals.md (tasks/envs/runtime/protocol.py): adapters for other APIs, and `environment(cfg)`.
"""

from __future__ import annotations

import json
import math
import reprlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tasks.core.contracts import Environment, Step
from tasks.core.errors import UserError
from tasks.core.paths import import_user, user_code_seconds
from tasks.core.process_wide import DeadlinePassed, ExitRefused, deadline, signals_kept, user_code

MAX_STATE_CHARS = 65_536       # an attribute of the environment kept in the record (env_state), as JSON, at most
PICTURES = "screens"           # (but its pictures, screens.py: the evaluate stage takes them out of the record)

if TYPE_CHECKING:
    from tasks.core.config import Config


def as_step(value: Any) -> Step:
    """A Step from what `step` returned: a Step, or (observation, reward, done[, info]); an observation may be
    one message or a string (a user message). Anything else is a TypeError naming what came back."""
    if isinstance(value, tuple) and len(value) in (3, 4):
        value = Step(value[0], value[1], value[2], value[3] if len(value) == 4 else {})
    if not isinstance(value, Step):
        raise TypeError(f"step returned {type(value).__name__}, not a Step or (observation, reward, done[, info])")
    value.observation = as_messages(value.observation, "step's observation")
    reward, done = _plain(value.reward), _plain(value.done)
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise TypeError(f"step returned reward {reward!r}, not a finite number")
    if done is not None and (not isinstance(done, bool | int | float) or done not in (0, 1)):
        raise TypeError(f"step returned done {done!r}, not a bool")     # ("no" read as true before; None: not done)
    value.reward, value.done = float(reward), bool(done)
    return value


def _plain(value: Any) -> Any:
    """A numpy scalar or 0-d tensor as its Python number (what gymnasium-style environments return); else as is."""
    return value.item() if type(value).__module__ in ("numpy", "torch") and getattr(value, "ndim", None) == 0 \
        else value


def as_messages(value: Any, what: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                              for m in value):
        raise TypeError(f"{what} is {type(value).__name__}, not chat messages ([{{'role': ..., 'content': ...}}])")
    return value


ENVIRONMENT_COLUMN = "environment"    # TRL's multi-environment form: the row's column that names its environment


def factories_of(cfg: Config) -> dict[str | None, Callable[..., Any]]:
    """env.factory imported: {None: the callable}, or TRL's multi-environment form, a dict of callables by name
    (`GRPOTrainer(environment_factory={...})`), each row's `environment` column naming the one that makes its
    episode's environment (the tools in its prompt are that environment's)."""
    given = import_user(cfg.env.factory, "env.factory", by_name=True)
    return dict(given) if isinstance(given, dict) else {None: given}


def environment_name(cfg: Config, factories: dict, row: dict | None) -> str | None:
    """The name of the factory that makes `row`'s environment (None: env.factory is one callable)."""
    if None in factories:
        return None
    name = (row or {}).get(ENVIRONMENT_COLUMN)
    if not isinstance(name, str) or name not in factories:
        raise UserError(f"env.factory: {cfg.env.factory} is a dict of environments by name, and a row's "
                        f"{ENVIRONMENT_COLUMN!r} is {name!r}; expected one of {sorted(factories)}")
    return name


def factory_of(cfg: Config, preflight: bool = True) -> Callable[[dict | None], Any]:
    """env.factory imported (a user error naming it if it cannot be), called with env.kwargs per episode (once
    per process for an environment that serves many: adapters.shared); a dict of factories by name is called
    with the row, whose `environment` picks one (environment_name). A factory with a `preflight(**kwargs)` (the
    browser's) has it called first: what it lacks is one line before any episode starts."""
    factories = factories_of(cfg)
    kwargs = dict(cfg.env.kwargs)
    for make in factories.values() if preflight else ():
        if callable(getattr(make, "preflight", None)):
            make.preflight(**kwargs)
    kept: dict = {}                   # name -> the instance every episode of it shares (adapters.shared), once made
    first = threading.Lock()          # (held while a name's first is made: is it one to share?)
    known: set = set()

    def new(name: str | None) -> Any:
        with signals_kept():
            return factories[name](**kwargs)

    def made(row: dict | None = None) -> Any:
        from tasks.envs.adapters.kinds import shared

        name = environment_name(cfg, factories, row)
        if name not in known:
            with first:
                if name not in known:
                    instance = new(name)
                    if shared(instance):
                        kept[name] = instance
                    known.add(name)
                    return instance
        return kept[name] if name in kept else new(name)
    return made


def require_answer(url: str, what: str, hint: str = "", field: str = "base_url", key: str | None = None) -> None:
    """A UserError naming env.kwargs.<field> (or `key`) unless something answers at `url` (any HTTP status will
    do): a factory's preflight for an environment that is a server."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=10).close()
    except urllib.error.HTTPError:
        pass
    except (OSError, ValueError) as e:
        raise UserError(f"{key or 'env.kwargs.' + field}: no {what} answers at {url} ({getattr(e, 'reason', e)})"
                        f"{hint}") from None


def require_env_server(url: str, key: str = "env.where") -> dict:
    """The /health answer of an rlflow environment server at `url` (tasks/envs/runtime/server.py: a JSON object with
    "factory" and "episodes"; a pool's front, tasks/envs/runtime/pool.py: "pool" and "episodes"); a UserError naming
    `key` if nothing answers there, or something that is not one
    (an HTTP error, or another shape), whose 404s the flow would later take for a dead server."""
    import urllib.error
    import urllib.request

    health = f"{url.rstrip('/')}/health"
    try:
        with urllib.request.urlopen(health, timeout=10) as response:
            body = response.read(65_536)
    except urllib.error.HTTPError as e:
        raise UserError(f"{key}: {url} is not an rlflow environment server (GET /health answered HTTP {e.code}; "
                        f"start one with python -m tasks.envs.runtime.server)") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{key}: no environment server answers at {url} ({getattr(e, 'reason', e)})") from None
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if not (isinstance(answer, dict) and "episodes" in answer and ("factory" in answer or answer.get("pool"))):
        raise UserError(f"{key}: {url} is not an rlflow environment server (GET /health answered "
                        f"{body[:60].decode('utf-8', 'replace')!r}, not {{\"factory\": ..., \"episodes\": n}}; "
                        f"start one with python -m tasks.envs.runtime.server)")
    return answer


def _binds(fn: Any, *args: Any, **kwargs: Any) -> str | None:
    """Why `fn` cannot be called so (None if it can, or if its signature cannot be read)."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        return str(e)
    return None


def _reset_reads_the_row(cfg: Config, env, row: dict, what: str, steps: bool = False) -> None:
    """The environment reset on the data's first row and then (`steps`: rlflow's protocol) stepped once with an empty
    assistant message, as an episode's first turn would, in one thread waited for at most min(env.timeout_seconds,
    10) s (a slow one is the run's to time out; an `async def` one awaited there): a KeyError or TypeError in reset
    is a column the environment reads that the data lacks, or holds another type of; reset must return at least one
    chat message whose roles a template renders (data.ROLES), and step what the episodes take (as_step): one line
    now instead of every episode failing. Other failures (step's own exceptions among them) are the episodes' to
    report (a row-dependent one, a resource the run provides)."""
    import asyncio
    import inspect

    from tasks.core.data import message_fault

    failed: list[BaseException] = []
    returned: list = []
    stepped: list = []

    def check() -> None:
        loop = asyncio.new_event_loop()           # (one for both: what an async reset opens, its step may use)

        def called(method: str, arg: Any) -> Any:
            with user_code():
                value = getattr(env, method)(arg)
                return loop.run_until_complete(value) if inspect.isawaitable(value) else value
        try:
            try:
                returned.append(called("reset", row))
            except ExitRefused as e:                # (os._exit in it: said as the check's line, below)
                failed.append(e)
            except (KeyError, TypeError) as e:
                failed.append(e)
            except Exception:  # noqa: BLE001, S110 - not a column's: left to the run's episodes
                pass
            if steps and returned:
                try:
                    stepped.append(called("step", {"role": "assistant", "content": ""}))
                except ExitRefused as e:
                    failed.append(e)
                except Exception:  # noqa: BLE001, S110 - the environment's own failure: the episodes' to report
                    pass
        finally:
            try:        # (what reset or step left running on it: cancelled, not "destroyed but pending" at close)
                if pending := asyncio.all_tasks(loop):
                    for task in pending:
                        task.cancel()
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            except BaseException:  # noqa: BLE001, S110 - the check's answer is had: the loop is closed regardless
                pass
            finally:
                loop.close()

    t = threading.Thread(target=check, name="rlflow-preflight-reset", daemon=True)
    t.start()
    t.join(min(cfg.env.timeout_seconds, 10.0))
    failed, returned, stepped = list(failed), list(returned), list(stepped)     # (the thread may go on)
    if failed and isinstance(failed[0], ExitRefused):
        raise failed[0]
    if failed:
        e = failed[0]
        raise UserError(f"env.factory: {what}.reset on the data's first row raised {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}; expected the columns it reads "
                        f"(the data has {sorted(row)})")
    if not returned:
        return
    try:
        messages = as_messages(returned[0], f"{what}.reset's return")
    except TypeError as e:
        raise UserError(f"env.factory: {e}") from None
    if not messages:
        _renders_none(cfg, env, what)
    for j, m in enumerate(messages):
        if (fault := message_fault(m)) is not None:
            raise UserError(f"env.factory: {what}.reset's message {j}: {fault}")
    if stepped:
        try:
            as_step(stepped[0])
        except (TypeError, ValueError) as e:
            raise UserError(f"env.factory: {what}.step(message) on the first turn: {e}; expected a Step or "
                            f"(observation: chat messages, reward: a finite number, done[, info])") from None


def _renders_none(cfg: Config, env: Any, what: str) -> None:
    """A reset that returned no messages: the episode's prompt is what the policy's chat template renders from
    none (a template with a default system prompt renders one; transformers' apply_chat_template refuses an empty
    conversation in its recent versions): one line where it renders nothing or cannot. A warning on stderr where
    the policy's tokenizer cannot be had here."""
    import sys

    said = f"env.factory: {what}.reset on the data's first row returned no messages"
    try:
        from tasks.core.models import base_path, load_tokenizer

        tokenizer = load_tokenizer(base_path(cfg))       # (preflight loaded it just before: cached)
    except Exception as e:  # noqa: BLE001 - no tokenizer here (it is the run's preflight to say why)
        print(f"warning: {said}; the policy's tokenizer could not be loaded to check that its chat template "
              f"renders a prompt from none ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})",
              file=sys.stderr)
        return
    try:
        from tasks.envs.runtime.rendering import chat_text
        from tasks.envs.runtime.tools import tool_schemas

        text = chat_text(tokenizer, [], tool_schemas(env), True)        # (as the episodes render a prompt)
        why = None if isinstance(text, str) and text.strip() else f"it renders {text!r}"
    except Exception as e:  # noqa: BLE001 - the template's (or transformers') refusal is the answer
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    if why is not None:
        raise UserError(f"{said}; expected at least one chat message (the episode's prompt: the policy's chat "
                        f"template renders none from no messages, {why})")


def check_here(cfg: Config, datasets: list | tuple) -> None:
    """Preflight's check in this process: env.factory imported and its own preflight run (factory_of: what cannot
    be is one line, exit 2), then its environments checked with the data's first rows (check_environment)."""
    factory_of(cfg)
    check_environment(cfg, dict(datasets[0][0]), datasets)


def check_environment(cfg: Config, row: dict, datasets: list | tuple = ()) -> None:
    """Preflight (_check_environment), the user's code marked as such: an os._exit it calls is one line too.
    With a dict of factories each is checked with the first row that names it, and every row of `datasets` (the
    splits a run reads) must name one (else `row`'s name alone is checked)."""
    factories = factories_of(cfg)
    firsts: dict = {}

    def spec_of(name: str | None) -> str:             # (env.factory as the lines name it: the dict's entry)
        return cfg.env.factory if name is None else f"{cfg.env.factory}[{name!r}]"

    def as_users(spec: str, check: Callable[..., None], /, *args, **kwargs) -> None:   # (env.kwargs: any names)
        try:
            with user_code():
                check(*args, **kwargs)
        except ExitRefused as e:
            raise UserError(f"env.factory: {spec}: {e}") from None
        except SystemExit as e:          # (it ended `rlflow run` with its code, 0 read as success, and no word)
            raise UserError(f"env.factory: {spec}: the environment's code called sys.exit({e.code!r}) in preflight's "
                            f"check of it (made with env.kwargs, then reset and stepped with the data's first row, "
                            f"or its own check); expected it to return (or raise an exception)") from None

    for split, ds in enumerate(datasets if None not in factories else ()):
        which = ("training", "evaluation")[min(split, 1)]
        if ENVIRONMENT_COLUMN not in ds.column_names:
            raise UserError(f"env.factory: {cfg.env.factory} is a dict of environments by name; expected a column "
                            f"{ENVIRONMENT_COLUMN!r} naming each row's (one of {sorted(factories)}), and the "
                            f"{which} data has {ds.column_names}")
        for i, name in enumerate(ds[ENVIRONMENT_COLUMN]):
            if not isinstance(name, str) or name not in factories:
                raise UserError(f"env.factory: {cfg.env.factory} is a dict of environments by name, and row {i + 1} "
                                f"of the {which} data has {ENVIRONMENT_COLUMN} {name!r}; expected one of "
                                f"{sorted(factories)}")
            if name not in firsts:
                firsts[name] = dict(ds[i])
    for name, first in (firsts or {environment_name(cfg, factories, row): row}).items():
        as_users(spec_of(name), _check_environment, cfg, factories[name], spec_of(name), first)
    for split, ds in enumerate(datasets):        # (a factory's check_row: the columns it reads, in every split)
        make = factories[name := environment_name(cfg, factories, ds[0])] if len(ds) else None
        if callable(getattr(make, "preflight", None)) and callable(check_row := getattr(make, "check_row", None)):
            as_users(f"{spec_of(name)}.check_row", check_row, dict(ds[0]),
                     ("training", "evaluation")[min(split, 1)] + " data", **cfg.env.kwargs)


def _check_environment(cfg: Config, make: Callable[..., Any], spec: str, row: dict) -> None:
    """Preflight (env.factory, made on this machine: env.where stage or local): env.factory called with env.kwargs
    once, driven through its adapter (env.adapter) with the data's first `row` as far as can be without an
    episode, its tools read; then closed. What cannot be built is one UserError line naming the field, not a run
    whose every episode fails. A factory with a preflight of its own (the browser's, OpenEnv's: they start
    processes) is checked for its keyword arguments only."""
    import inspect

    from tasks.envs.adapters import kinds as adapters
    from tasks.envs.runtime.tools import tool_schemas

    kwargs = dict(cfg.env.kwargs)
    if (bad := _binds(make, **kwargs)) is not None:
        given = f"with env.kwargs {sorted(kwargs)}" if kwargs else "without env.kwargs"
        raise UserError(f"env.kwargs: {spec} cannot be called {given}: {bad}")
    if callable(getattr(make, "preflight", None)):
        return
    seconds = user_code_seconds()
    try:
        with signals_kept(), deadline(seconds):
            instance = make(**kwargs)
    except DeadlinePassed:
        raise UserError(f"env.factory: {spec}(**env.kwargs) did not return in {seconds:g} s (it waits or loops as it "
                        f"is made; RLFLOW_IMPORT_SECONDS allows more)") from None
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's factory: its failure is one line
        raise UserError(f"env.factory: {spec}(**env.kwargs) raised {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if instance is None:
        raise UserError(f"env.factory: {spec}(**env.kwargs) returned None; expected the episode's environment (an "
                        f"object with reset and step, or a TRL environment_factory class's instance)")
    env = instance
    try:
        kind = cfg.env.adapter if cfg.env.adapter != "auto" else adapters.detect(instance)
        name = type(instance).__name__
        fit = {"rlflow": [("reset", (row,), {}), ("step", ({"role": "assistant", "content": ""},), {})],
               "trl": [("reset", (), row)],
               "gymnasium": [("reset", (), {"seed": 0}), ("step", ("",), {})]}.get(kind, [])
        for method, args, kw in fit:
            fn = getattr(instance, method, None)
            why = "it has none" if not callable(fn) else _binds(fn, *args, **kw)
            if not callable(fn) and kind == "trl" and cfg.env.adapter == "auto":
                a = "an" if name[:1].lower() in "aeiou" else "a"
                value = f" {reprlib.repr(instance)}" if type(instance).__module__ == "builtins" else ""
                raise UserError(f"env.factory: {spec} made {a} {name}{value}, which has no reset method; expected "
                                f"an environment: an object with reset(row) and step(message) (rlflow's protocol), or "
                                f"one with reset(**row) and tools as methods (TRL's environment_factory classes)")
            if why is not None and kind == "trl" and cfg.env.adapter == "auto" and _binds(fn, row) is None:
                raise UserError(f"env.factory: {spec} made a {name}, whose reset(row) is rlflow's protocol's but it "
                                f"has no step(message) method; expected one (or reset(**row) and tools as methods, as "
                                f"TRL's environment_factory classes have)")
            if why is not None:
                call = {"rlflow": {"reset": "reset(row)", "step": "step(message)"}, "trl": {"reset": "reset(**row)"},
                        "gymnasium": {"reset": "reset(seed=...)", "step": "step(text)"}}[kind][method]
                raise UserError(f"env.adapter: {kind}: {spec} made a {name}, whose {method} cannot be called as "
                                f"{call} ({why})")
        try:
            env = environment(cfg, instance, row)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001
            raise UserError(f"env.adapter: {kind}: {spec} made a {name}, which the {kind} adapter cannot drive: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        tools = getattr(env, "tools", None) or []
        if not isinstance(tools, list | tuple):
            raise UserError(f"env.factory: {spec}: {name}.tools is a {type(tools).__name__}, not a list of functions")
        for i, tool in enumerate(tools):
            if not (inspect.isfunction(tool) or inspect.ismethod(tool)):
                raise UserError(f"env.factory: {spec}: {name}.tools[{i}] is {tool!r}, not a function (the model "
                                f"calls tools by name; each must be a Python function with a docstring)")
        try:
            tool_schemas(env)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"env.factory: {spec}: {name}'s tools cannot be described to the model: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        if kind in ("rlflow", "trl"):
            _reset_reads_the_row(cfg, env, row, f"{spec}: {name}", steps=kind == "rlflow")
    finally:
        close = getattr(env, "close", None) or getattr(instance, "close", None)
        try:
            if callable(close) and not inspect.iscoroutinefunction(close):
                close()
        except Exception:  # noqa: BLE001, S110 - a close that fails here says nothing about the run
            pass


def environment(cfg: Config, instance: Any, row: dict) -> Environment:
    """`instance` (what the factory made) driven by the protocol: itself, or through its adapter."""
    from tasks.envs.adapters import kinds as adapters

    kind = cfg.env.adapter
    if kind == "auto":
        kind = adapters.detect(instance)
    if kind == "rlflow":
        if not (callable(getattr(instance, "reset", None)) and callable(getattr(instance, "step", None))):
            raise UserError(f"env.factory: {cfg.env.factory} made a {type(instance).__name__}, which has no "
                            f"reset(row) and step(message) (env.adapter: rlflow)")
        return instance
    return adapters.ADAPTERS[kind](instance, cfg, row)


def state_of(instance: Any) -> dict:
    """The environment object's public attributes that are plain data (JSON-able), e.g. `reward`, `done`."""
    out = {}
    for name, value in (getattr(instance, "__dict__", None) or {}).items():
        if name.startswith("_"):
            continue
        try:
            if len(json.dumps(value)) > MAX_STATE_CHARS and name != PICTURES:
                continue
        except (TypeError, ValueError):
            continue
        out[name] = value
    return out

