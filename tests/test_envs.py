"""Multi-turn episodes (tasks/envs/): tokens in and out, the loss mask, tool calls, environments that fail, the
adapters (TRL's environment classes, gymnasium), and the letters demo through the flow with resume equality."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tasks.algorithms.batching import prepare_batches
from tasks.algorithms.loss import aggregate, behaviour_correction, per_token_loss
from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.contracts import Rollout, Sample, Sampled, SamplingParams, SamplingSession
from tasks.core.processes import alive
from tasks.core.store import Store
from tasks.envs.runtime.episodes import run_episodes
from tasks.envs.runtime.rendering import Renderer
from tasks.envs.runtime.tools import call_tools, parse_tool_calls, schemas

ROOT = Path(__file__).resolve().parents[1]
LETTERS = ROOT / "configs" / "letters.yaml"
class Scripted(SamplingSession):
    """A sampling engine that answers from a script (context text -> reply text): drives the episode loop
    where the tiny model would not write tool calls. The flow tests below use the real hf engine. It is its own
    session: `Scripted(reply).session(policy, path, tokenizer)`."""

    def __init__(self, reply, eos: bool = True):
        self.reply, self.eos, self.calls = reply, eos, []

    def session(self, policy, path, tokenizer) -> Scripted:
        self.tokenizer = tokenizer
        return self

    def sample(self, prompt_ids, params: SamplingParams, keys=None) -> Sampled:
        tokenizer = self.tokenizer
        self.calls.append([list(p) for p in prompt_ids])
        out = []
        for i, ids in enumerate(prompt_ids):
            for _ in range(params.n):
                toks = tokenizer(self.reply(tokenizer.decode(ids)), add_special_tokens=False)["input_ids"]
                toks = toks[:params.max_new_tokens - 1] + ([tokenizer.eos_token_id] if self.eos else [])
                out.append(Sample(i, toks, [-0.5] * len(toks), truncated=not self.eos))
        return Sampled(out, 0.0, 0.0)


def _cfg(factory: str, tmp_path: Path, *more: str):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Say each letter I name.", "letters": s, "seed": i}) + "\n"
                            for i, s in enumerate(["abc", "hgf"])))
    return load_config(LETTERS, [f"data.path={data}", f"env.factory={factory}", "generate.max_completion_length=40",
                                 "env.max_tokens=400", *more])


def _run(cfg, engine, tokenizer, n: int = 2):
    table = {0: {"prompt": "Say each letter I name.", "letters": "abc", "seed": 0},
             1: {"prompt": "Say each letter I name.", "letters": "hgf", "seed": 1}}
    return run_episodes(cfg, table, [0, 1], engine.session("base", "unused", tokenizer),
                        SamplingParams(n=n, max_new_tokens=cfg.generate.max_completion_length, temperature=1.0,
                                       top_p=1.0, seed=3))[0]


# ------------------------------------------------------------------------------------------ tokens in, tokens out

@pytest.mark.parametrize("template", ["tiny", "chatml"])
def test_an_episode_is_the_chat_template_rendering_of_its_conversation(template, tokenizer, chatml, tmp_path):
    """prompt ids + completion ids = the template's rendering of the whole conversation (the model's EOS where
    the template ends a turn with it); the engine saw each turn's context as exactly those ids so far."""
    tok = chatml if template == "chatml" else tokenizer
    cfg = _cfg("tasks.envs.builtin.games:SayTheLetters", tmp_path)
    engine = Scripted(lambda ctx: ctx.rsplit("Say ", 1)[1][0])       # says the letter it was asked for
    records = _run(cfg, engine, tok)
    assert [r.env_return for r in records] == [pytest.approx(1.0)] * 4 and [r.env_error for r in records] == [None] * 4
    r = records[0]
    conversation = r.prompt + r.turns
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    if template == "chatml":
        want = tok(rendered, add_special_tokens=False)["input_ids"]
        assert r.prompt_ids + r.completion_ids == want[:len(r.prompt_ids) + len(r.completion_ids)]
    else:       # the tiny template closes a turn with "\n", not its EOS: the model's EOS stays where it wrote it
        eos = tok.eos_token
        text = tok.decode(r.prompt_ids + r.completion_ids).replace(eos, "")
        assert text == rendered.rstrip("\n") or text + "\n" == rendered
    assert len(r.mask) == len(r.completion_ids) == len(r.logprobs)
    model = [t for t, m in zip(r.completion_ids, r.mask) if m]
    assert tok.decode(model, skip_special_tokens=True) == "abc"
    assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.mask) if not m)
    assert r.turn_rewards == [pytest.approx(1 / 3)] * 3 and [m["role"] for m in r.turns] == \
        ["assistant", "user", "assistant", "user", "assistant"]
    second_turn_context = engine.calls[1][0]
    assert second_turn_context == r.prompt_ids + r.completion_ids[:len(second_turn_context) - len(r.prompt_ids)]


def test_observations_render_as_the_template_does_after_any_history(chatml):
    render = Renderer(chatml, 512)
    obs = [{"role": "tool", "content": "42"}]
    ids = render.observation(obs, None, ended_with_eos=True)
    assert chatml.decode(ids) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert chatml.decode(render.observation(obs, None, ended_with_eos=False)).startswith("<|im_end|>\n<|im_start|>tool")


# ------------------------------------------------------------------------------------------ the mask

@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_masked_token_never_changes_the_loss_or_its_gradient(loss_type, level):
    """Environment tokens (mask 0): their logprobs get no gradient, and whatever their policy, old, reference or
    behaviour logprobs are, the loss and every gradient stay the same (token and sequence-level weights, the
    behaviour correction, the KL term)."""
    cfg = load_config(LETTERS, [f"train.learner.loss_type={loss_type}",
                                f"train.learner.importance_sampling_level={level}", "train.beta=0.1"])
    records = [Rollout(group=0, row=0, prompt="p", prompt_ids=[5, 6], completion="", completion_ids=[7, 8, 9, 10, 11],
                       logprobs=[-1.0, -0.5, 0.0, 0.0, -2.0], truncated=False, mask=[1, 1, 0, 0, 1]),
               Rollout(group=0, row=0, prompt="p", prompt_ids=[5], completion="", completion_ids=[7, 8],
                       logprobs=[-0.3, -0.7], truncated=False, mask=None)]
    batch = prepare_batches(records, torch.tensor([0.8, -0.8]), 0, cfg.train, "cpu")[0]
    assert batch.mask.tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    gen = torch.Generator().manual_seed(0)
    base = {k: torch.randn(2, 5, generator=gen) * 0.3 - 1 for k in ("logp", "old", "ref", "mu")}

    def loss_of(values):
        logp = values["logp"].clone().requires_grad_(True)
        rho = behaviour_correction(values["old"], values["mu"], batch.mask, "sequence_truncate" if level ==
                                   "sequence" else "token_truncate", 3.0)
        ptl, _, _ = per_token_loss(logp, values["old"], batch.signal, batch.mask, cfg.train.learner, cfg.train.beta,
                                   values["ref"], rho)
        loss = aggregate(ptl, batch.mask, loss_type, float(batch.mask.sum()), 2, 96)
        loss.backward()
        return loss.detach(), logp.grad

    loss, grad = loss_of(base)
    assert grad[0, 2] == 0 and grad[0, 3] == 0 and grad[1, 2:].abs().sum() == 0
    env = batch.mask == 0
    changed = {k: torch.where(env, v + torch.randn(2, 5, generator=gen) * 3, v) for k, v in base.items()}
    loss2, grad2 = loss_of(changed)
    assert torch.allclose(loss, loss2, atol=1e-6) and torch.allclose(grad, grad2, atol=1e-6)


# ------------------------------------------------------------------------------------------ environments that fail

@pytest.mark.parametrize("mode, isolation", [(m, i) for i in ("process", "thread")
                                             for m in ("raise", "hang", "garbage", "reset")]
                         + [("crash", "process"), ("exit", "process")])
def test_an_environment_that_raises_hangs_crashes_or_returns_garbage_costs_only_its_episodes(
        mode, isolation, tokenizer, tmp_path, monkeypatch):
    mod = tmp_path / "flaky_env.py"
    mod.write_text("from tests.env_classes import Flaky  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _cfg("flaky_env:Flaky", tmp_path, f'env.kwargs={{"mode": "{mode}"}}', "env.timeout_seconds=3",
               f"env.isolation={isolation}")
    records = _run(cfg, Scripted(lambda ctx: "a"), tokenizer)
    if mode == "reset":
        assert [r.env_error is None for r in records] == [True, True, False, False]
        assert records[2].env_error == "reset raised RuntimeError: reset blew up" and records[2].completion_ids == []
        assert [r.env_return for r in records[:2]] == [3.0, 3.0]
        return
    assert all(r.env_return is None and r.env_error for r in records), [r.env_error for r in records]
    want = {"raise": "step raised ValueError: step blew up", "hang": "step did not return within env.timeout_seconds",
            "garbage": "step: step returned str, not a Step", "crash": "step: the environment's process died "
            "(killed by SIGSEGV)", "exit": "step: the environment's process died (exit 3)"}[mode]
    assert want in records[0].env_error, records[0].env_error
    assert all(r.completion_ids for r in records)            # the tokens so far are kept


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_base_exception_a_huge_observation_and_a_numpy_reward_cost_at_most_their_episode(isolation, tokenizer,
                                                                                           tmp_path):
    """raise BaseException in a thread-mode step was a traceback that ended the run; a 50 MB observation was
    rendered whole (minutes: the run stalled past any timeout), now the episode ends truncated at once, keeping what
    fits; numpy's float32 reward (gymnasium's kind) was refused as "not a finite number"."""
    cfg = _cfg("tests.env_classes:Flaky", tmp_path, "env.timeout_seconds=60", f"env.isolation={isolation}")
    table = {i: {"prompt": "Say each letter I name.", "letters": "abc", "seed": 0, "mode": m}
             for i, m in enumerate(["base", "huge", "numpy", "ok"])}
    records = run_episodes(cfg, table, [0, 1, 2, 3], Scripted(lambda ctx: "a").session("base", "unused", tokenizer),
                           SamplingParams(n=1, max_new_tokens=40, temperature=1.0, top_p=1.0, seed=3))[0]
    assert records[0].env_error == "step raised BaseException: base", records[0].env_error
    assert (records[1].env_error, records[1].truncated, records[1].env_return) == (None, True, 2.0)
    assert 0 < len(records[1].turns[-1]["content"]) <= cfg.env.max_tokens * 256       # (kept: what could fit)
    assert [r.env_return for r in records[2:]] == [3.0, 3.0] and records[2].env_error is None


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_factory_that_raises_is_said_as_the_factorys_not_resets(isolation, tokenizer, tmp_path):
    """A construction that raised was said as "reset raised ..." (the episode's environment is made, then reset,
    in one call)."""
    cfg = _cfg("tests.env_classes:FailsWhenMade", tmp_path, f"env.kwargs={{made: '{tmp_path / 'made'}'}}",
               f"env.isolation={isolation}")
    table = {i: {"prompt": "Say each letter I name.", "letters": "abc", "seed": 0} for i in range(4)}
    records = run_episodes(cfg, table, [0, 1, 2, 3], Scripted(lambda ctx: "a").session("base", "unused", tokenizer),
                           SamplingParams(n=1, max_new_tokens=40, temperature=1.0, top_p=1.0, seed=3))[0]
    errors = [r.env_error for r in records if r.env_error is not None]
    assert errors == ["the environment's factory raised RuntimeError: third construction"], errors


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_an_episode_that_hangs_does_not_spend_the_time_of_the_others(isolation, tokenizer, tmp_path):
    """Turns are taken together, so the others wait for a hung call; that wait is not their environment's time:
    they go on and finish with their returns."""
    cfg = _cfg("tests.env_classes:Flaky", tmp_path, "env.timeout_seconds=3", f"env.isolation={isolation}")
    table = {i: {"prompt": "Say each letter I name.", "letters": "abc", "seed": 0, "mode": m}
             for i, m in enumerate(["ok", "hang", "ok"])}
    records = run_episodes(cfg, table, [0, 1, 2], Scripted(lambda ctx: "a").session("base", "unused", tokenizer),
                           SamplingParams(n=1, max_new_tokens=40, temperature=1.0, top_p=1.0, seed=3))[0]
    assert [r.env_error for r in records] == [None, "step did not return within env.timeout_seconds", None]
    assert [r.env_return for r in records] == [3.0, None, 3.0]


def test_what_an_async_environment_leaves_open_is_closed_when_its_episodes_end(tokenizer, tmp_path):
    """env.isolation: thread, an async environment keeping a connection it opened: the episodes' end aborts it on
    the environments' loop (loops.UsersLoop.end), as the agents' loop does. Was: the loop
    stopped with the connection open, for as long as the process lived."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    cfg = _cfg("tests.env_classes:KeepsAConnection", tmp_path, f"env.kwargs={{port: {listener.getsockname()[1]}}}",
               "env.isolation=thread")
    records = _run(cfg, Scripted(lambda ctx: "a"), tokenizer, n=1)
    assert [(r.env_error, r.env_return) for r in records] == [(None, 3.0), (None, 3.0)]
    for _ in records:
        connection, _ = listener.accept()            # (made during the stage: waiting in the backlog)
        connection.settimeout(60)
        assert connection.recv(1) == b""             # its other end closed
    listener.close()


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_environments_that_hang_as_they_are_made_fail_their_episodes_not_the_stage(isolation, tokenizer, tmp_path):
    """More episodes than env.concurrency whose environment's __init__ never returns: each fails at its timeout
    and the stage ends (the calls waiting for a slot held for good waited for ever); in a process of its own the
    environment is killed (it was left running: its episode did not yet know it)."""
    pids = tmp_path / "pids"
    cfg = _cfg("tests.env_classes:HangsWhenMade", tmp_path, f'env.kwargs={{pids: "{pids}"}}', "env.timeout_seconds=3",
               f"env.isolation={isolation}", "env.concurrency=1")
    table = {i: {"prompt": "Say each letter I name.", "letters": "abc", "seed": i} for i in range(3)}
    records = run_episodes(cfg, table, [0, 1, 2], Scripted(lambda ctx: "a").session("base", "unused", tokenizer),
                           SamplingParams(n=1, max_new_tokens=40, temperature=1.0, top_p=1.0, seed=3))[0]
    assert [r.env_error for r in records] == ["reset did not return within env.timeout_seconds"] * 3
    if isolation == "process":
        made = pids.read_text().split() if pids.exists() else []
        deadline = time.monotonic() + 60
        while [p for p in made if alive(int(p))] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in made if alive(int(p))]


def test_an_environment_that_hangs_as_it_is_made_is_one_line_before_the_run(tmp_path, monkeypatch):
    """The check before the run makes one environment: one that never returns from __init__ is one line (the
    run waited there for ever)."""
    from tasks.core.errors import UserError
    from tasks.envs.runtime.protocol import check_environment

    monkeypatch.setenv("RLFLOW_IMPORT_SECONDS", "2")
    cfg = _cfg("tests.env_classes:HangsWhenMade", tmp_path, f'env.kwargs={{pids: "{tmp_path / "pids"}"}}')
    with pytest.raises(UserError, match=r"^env.factory: tests.env_classes:HangsWhenMade\(\*\*env.kwargs\) did not "
                                        r"return in 2 s \(it waits or loops as it is made; RLFLOW_IMPORT_SECONDS"):
        check_environment(cfg, {"prompt": "p", "letters": "abc", "seed": 0})


DRIVER = """
import json, os, sys
if __name__ == "__mp_main__":              # (this script run again in an episode's process: multiprocessing's default)
    open(os.environ["RLFLOW_TEST_MARKS"] + ".main", "a").write(f"{os.getpid()}\\n")
sys.path.insert(0, sys.argv[1])
from tasks.core.config import load_config
from tasks.envs.runtime.isolation import start_environment
from tasks.envs.runtime.protocol import factory_of

if __name__ == "__main__":
    cfg = load_config(sys.argv[2], ["env.factory=tests.env_classes:Marked", "env.isolation=process"])
    make, row, seen = factory_of(cfg), {"prompt": "Say each letter I name.", "letters": "abc", "seed": 0}, []
    for _ in range(4):
        env = start_environment(cfg, make, row)
        env.reset(row)
        env.step({"role": "assistant", "content": "done"})
        env.close()
        seen.append([[s["function"]["name"] for s in env.tool_schemas], env.state])
    print(json.dumps({"pid": os.getpid(), "seen": seen}))
"""


def test_an_episodes_process_finds_the_first_use_work_done_once_by_the_forkserver(tmp_path):
    """What a process pays on first use, the forkserver pays once before it forks: 4 episodes of a TRL class build
    its tool's schema once (in the forkserver, not here and not in each child), and no episode's process runs the
    script that started them again (multiprocessing runs the parent's __main__ in each child: a user's script, its
    imports). A fresh interpreter: one forkserver serves a process, prepared for its first config."""
    import os
    import subprocess
    import sys

    (tmp_path / "drive.py").write_text(DRIVER)
    marks = tmp_path / "marks"
    proc = subprocess.run([sys.executable, "drive.py", str(ROOT), str(LETTERS)], cwd=tmp_path, timeout=60,
                          env={**os.environ, "RLFLOW_TEST_MARKS": str(marks)}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["seen"] == [[["note"], {"notes": []}]] * 4                 # (the episodes ran)
    built = marks.read_text().split() if marks.exists() else []
    assert len(built) == 1 and built[0] != str(out["pid"]), built        # once, in the forkserver
    assert not Path(f"{marks}.main").exists(), Path(f"{marks}.main").read_text()


# ------------------------------------------------------------------------------------------ tool calls and adapters

def test_coroutines_of_calls_made_at_once_all_run_on_one_event_loop():
    """Episodes' calls come from many threads at once; an async environment's coroutines must all run on one
    loop (its futures belong to the loop its reset ran on). Two loops made at once hung verifiers' episodes."""
    import asyncio
    import threading

    from tasks.envs.runtime.isolation import Caller

    caller, at_once, loops = Caller(8), threading.Barrier(8), []

    async def where():
        loops.append(asyncio.get_running_loop())

    def call():
        at_once.wait(timeout=10)                 # every thread hands its coroutine over at the same moment
        return where()

    for f in [caller.start(call) for _ in range(8)]:
        f.result(timeout=10)
    caller.stop()
    assert len(loops) == 8 and len(set(map(id, loops))) == 1


def test_tool_calls_parse_from_hermes_blocks_and_mistakes_are_observations():
    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    text = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me add." and calls == [{"type": "function", "function": {"name": "add",
                                                                                      "arguments": {"a": 2, "b": 3}}}]
    assert call_tools(calls, [add]) == [{"role": "tool", "name": "add", "content": "5"}]
    bad = parse_tool_calls("<tool_call>{not json</tool_call><tool_call>{\"name\": \"nope\", \"arguments\": {}}"
                           "</tool_call><tool_call>{\"name\": \"add\", \"arguments\": {\"c\": 1}}</tool_call>")[1]
    out = [m["content"] for m in call_tools(bad, [add])]
    assert out[0].startswith("could not parse the tool call") and "no tool named 'nope'" in out[1]
    assert "bad arguments for add" in out[2]
    assert schemas([add])[0]["function"]["parameters"]["required"] == ["a", "b"]


TOOLS_WITHOUT_TORCH = '''
import json, sys
from tasks.envs.runtime.tools import schema

def note(text: str, times: int = 1) -> str:
    """Note it.

    Args:
        text: what
        times: how often
    """

plain = schema(note)
print(json.dumps(["torch" in sys.modules, plain["function"]["parameters"]]))
import torch

def hear(clip: torch.Tensor) -> str:
    """Hear it.

    Args:
        clip: the sound
    """

print(json.dumps(schema(hear)["function"]["parameters"]["properties"]))
'''


def test_a_tools_schema_imports_no_torch_and_a_tensor_hint_is_still_audio():
    """transformers' schema builder imported torch for any tool (to map a torch.Tensor hint): ~180 MB in the
    environments' forkserver, paid by each episode's process as it forked and ended. Built here in a fresh
    interpreter: no torch for a tool of plain types; a tool whose hint is torch.Tensor (its module imported torch)
    gets transformers' own 'audio' as before."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", TOOLS_WITHOUT_TORCH], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert first == [False, {"type": "object", "properties": {"text": {"type": "string", "description": "what"},
                                                               "times": {"type": "integer",
                                                                         "description": "how often"}},
                             "required": ["text"]}]
    assert second == {"clip": {"type": "audio", "description": "the sound"}}


def test_the_adapter_is_told_by_the_reset_signature_not_by_a_method_named_step():
    from tasks.envs.adapters.kinds import detect
    from tasks.envs.builtin.games import SayTheLetters
    from tests.env_classes import Counter, Mover

    assert [detect(SayTheLetters()), detect(Counter()), detect(Mover())] == ["rlflow", "trl", "trl"]


def test_a_trl_environment_class_runs_its_tools_until_the_model_stops_calling(chatml, tmp_path):
    cfg = _cfg("tests.env_classes:Counter", tmp_path, "env.max_turns=5", "generate.max_completion_length=80",
               "env.max_tokens=2000")

    def reply(ctx: str) -> str:
        done = ctx.count("counter is")
        return '<tool_call>{"name": "increment", "arguments": {"step": 1}}</tool_call>' if done < 3 else "done"

    records = _run(cfg, Scripted(reply), chatml)
    r = records[0]
    assert r.prompt[-1]["content"].endswith("Say each letter I name. Reach 3 by incrementing.")
    assert [m["role"] for m in r.turns] == ["assistant", "tool"] * 3 + ["assistant"]
    assert r.turns[-2]["content"] == "counter is 3" and r.env_return == 1.0 and r.env_error is None
    assert '"name": "increment"' in chatml.decode(r.prompt_ids)     # the tool's schema is in the prompt


def test_reward_functions_get_the_environments_as_trls_docs_read_them(chatml, tmp_path, monkeypatch):
    """`def reward_func(environments, **kwargs): return [env.reward for env in environments]`, run by the reward
    stage's worker process from the records alone (the episode's environment state travels in them)."""
    from tasks.scoring.functions import load_functions, score_records

    (tmp_path / "env_rewards.py").write_text("def reward_func(environments, **kwargs):\n"
                                             "    return [env.reward for env in environments]\n")
    monkeypatch.chdir(tmp_path)
    cfg = _cfg("tests.env_classes:CountingEnv", tmp_path, "env.max_turns=6", "generate.max_completion_length=80",
               "env.max_tokens=2000", 'reward.functions=[{"fn": "env_rewards:reward_func"}]', "env.reward_weight=0")

    def reply(ctx: str) -> str:                 # increment by 2, then by 1, then stop
        if "count=3" in ctx:
            return "stop"
        step = 1 if "count=2" in ctx else 2
        return '<tool_call>{"name": "increment", "arguments": {"step": ' + str(step) + '}}</tool_call>'

    records = _run(cfg, Scripted(reply), chatml)
    # reset's text after the prompt: TRL glues them; a newline here, as neither has whitespace there (the Counter
    # test above: " Reach 3" is joined as it is)
    assert records[0].prompt[-1]["content"] == "Say each letter I name.\nReach exactly 3 by calling increment."
    assert records[0].env_state == {"count": 3, "reward": 1.0}
    score_records(load_functions(cfg), records, "sum")
    assert [r.rewards["reward_func"] for r in records] == [1.0] * 4 and [r.reward for r in records] == [1.0] * 4


def test_a_gymnasium_text_environment_made_by_gymnasium_make(tokenizer, tmp_path):
    pytest.importorskip("gymnasium")
    # gymnasium's "module:id" form imports the module that registers the environment (in its own process too)
    cfg = _cfg("gymnasium:make", tmp_path, 'env.kwargs={"id": "tests.env_classes:rlflow-test/Echo-v0"}',
               "env.max_turns=5")
    records = _run(cfg, Scripted(lambda ctx: ctx.rsplit("echo ", 1)[1].split("\n")[0]), tokenizer)
    r = records[0]
    assert r.env_error is None and r.turn_rewards == [1.0, 1.0, 1.0] and r.env_return == 3.0   # truncated at 3 steps
    assert records[2].prompt[-1]["content"].endswith("echo 1-0")     # reset(seed=row["seed"])


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_verifiers_multiturn_env_runs_its_own_rollout_and_its_rubric_scores_it(isolation, chatml, tmp_path):
    """verifiers' own rollout loop runs the episode (setup_state, env_response, its stop conditions, max_turns);
    its rubric's score is the return; the system prompt is the environment's."""
    pytest.importorskip("verifiers")
    cfg = _cfg("tests.vf_envs:load_higher_lower", tmp_path, f"env.isolation={isolation}", "env.max_turns=8",
               "generate.max_completion_length=20", "env.max_tokens=400")
    table = {0: {"prompt": "Guess.", "answer": "7"}, 1: {"prompt": "Guess.", "answer": "1"}}

    def reply(ctx: str) -> str:                  # bisection of 1..9 by what the environment said
        low, high = 1, 9
        for said in ctx.split("<|im_start|>user\n")[2:]:
            guess = (low + high) // 2
            low, high = (guess + 1, high) if said.startswith("higher") else (low, guess - 1)
        return str((low + high) // 2)

    records = run_episodes(cfg, table, [0, 1], Scripted(reply).session("base", "unused", chatml),
                           SamplingParams(n=2, max_new_tokens=20, temperature=1.0, top_p=1.0, seed=3))[0]
    first, second = records[0], records[2]
    assert first.prompt[0] == {"role": "system", "content": "Guess the number. Answer with the number only."}
    assert [m["content"] for m in first.turns] == ["5", "higher", "7", "correct"], first.turns
    assert first.env_error is None and first.env_return == pytest.approx(1.0 - 0.2)   # solved at the 2nd guess
    assert first.env_state["stop_condition"] == "has_final_env_response" and first.env_state["reward"] == 0.8
    assert [m["content"] for m in second.turns] == ["5", "lower", "2", "lower", "1", "correct"], second.turns
    assert second.env_return == pytest.approx(0.7) and records[3].env_return == pytest.approx(0.7)


def test_a_verifiers_tool_env_calls_its_tools_and_a_malformed_call_is_an_observation(chatml, tmp_path):
    pytest.importorskip("verifiers")
    cfg = _cfg("tests.vf_envs:load_adder", tmp_path, "env.isolation=thread", "env.max_turns=4",
               "generate.max_completion_length=80", "env.max_tokens=2000")
    table = {0: {"prompt": "What is 20 + 22?", "answer": "42"}}

    def reply(ctx: str) -> str:
        if "<|im_start|>tool" not in ctx:
            return '<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>'
        if ctx.count("<|im_start|>tool") == 1:
            return "<tool_call>not json</tool_call>"
        return "The sum is 42."

    records = run_episodes(cfg, table, [0], Scripted(reply).session("base", "unused", chatml),
                           SamplingParams(n=1, max_new_tokens=80, temperature=1.0, top_p=1.0, seed=3))[0]
    r = records[0]
    assert '"name": "add"' in chatml.decode(r.prompt_ids)             # verifiers' tool_defs, as the prompt's tools
    assert [m["role"] for m in r.turns] == ["assistant", "tool", "assistant", "tool", "assistant"], r.turns
    assert r.turns[1]["content"] == "42" and "Expecting value" in r.turns[3]["content"]
    assert r.env_error is None and r.env_return == 1.0 and r.env_state["stop_condition"] == "no_tools_called"


# ------------------------------------------------------------------------------------------ through the flow

def stopped_and_resumed_equals_whole(config: Path, tmp_path: Path) -> Store:
    """`config` for 2 iterations (4 rows x 4 episodes), and again stopped after 1 and resumed: the same rewards
    and the same published v2. The uninterrupted run's store (run `whole`)."""
    from flows.training import train_flow

    common = ["generate.prompts_per_iteration=4", "generate.num_generations=4", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    whole = train_flow(str(config), [*common, "run.name=whole", "run.iterations=2", "store.uri=whole-store"])
    train_flow(str(config), [*common, "run.name=parts", "run.iterations=1", "store.uri=parts-store"])
    parts = train_flow(str(config), [*common, "run.name=parts", "run.iterations=2", "store.uri=parts-store"])
    assert whole["iterations_completed"] == parts["iterations_completed"] == 2
    assert whole["reward_mean"] == parts["reward_mean"]
    a, b = Store.open(str(tmp_path / "whole-store")), Store.open(str(tmp_path / "parts-store"))
    assert a.manifest(layout.policy("whole", 2))["files"] == b.manifest(layout.policy("parts", 2))["files"]
    return a


@pytest.mark.slow
def test_the_letters_demo_runs_through_the_flow_and_resumes_to_the_same_weights(tmp_path, prefect_api, monkeypatch):
    """The multi-turn demo's config, 2 iterations with the real hf engine: rewards from the environment's
    return, env/* metrics; stopped after 1 and resumed, it publishes the same v2 as an uninterrupted run."""
    monkeypatch.chdir(tmp_path)
    a = stopped_and_resumed_equals_whole(LETTERS, tmp_path)
    meta = a.manifest(layout.rollouts("whole", 1))["meta"]["metrics"]
    assert meta["env/episodes"] == 16 and meta["env/turns_mean"] == 3 and meta["env/errors"] == 0
    rewards = a.manifest(layout.rewards("whole", 1))["meta"]["metrics"]
    assert "reward/env/mean" in rewards


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_trls_dict_of_environments_gives_each_row_the_one_its_environment_column_names(isolation, chatml, tmp_path):
    """`GRPOTrainer(environment_factory={"count": Counter, "move": Mover})`, TRL's multi-environment form: each
    row's `environment` names the environment its episode runs in, and only that one's tools are in its prompt
    (env.factory named such a dict was refused: not a callable)."""
    cfg = _cfg("tests.env_classes:ENVIRONMENTS", tmp_path, f"env.isolation={isolation}", "env.max_turns=3",
               "generate.max_completion_length=80", "env.max_tokens=2000")
    table = {0: {"prompt": "Count.", "letters": "a", "environment": "count"},
             1: {"prompt": "Move.", "letters": "b", "environment": "move"}}

    def reply(ctx: str) -> str:
        if "counter is" in ctx or "at 1" in ctx:
            return "done"
        if '"name": "increment"' in ctx:
            return '<tool_call>{"name": "increment", "arguments": {"step": 1}}</tool_call>'
        return '<tool_call>{"name": "step", "arguments": {"direction": "right"}}</tool_call>'

    records = run_episodes(cfg, table, [0, 1], Scripted(reply).session("base", "unused", chatml),
                           SamplingParams(n=1, max_new_tokens=80, temperature=1.0, top_p=1.0, seed=3))[0]
    count, move = sorted(records, key=lambda r: r.row)
    assert '"name": "increment"' in chatml.decode(count.prompt_ids) and '"name": "step"' not in \
        chatml.decode(count.prompt_ids)
    assert '"name": "step"' in chatml.decode(move.prompt_ids) and '"name": "increment"' not in \
        chatml.decode(move.prompt_ids)
    assert count.turns[1]["content"] == "counter is 1" and count.env_return == 1.0 and count.env_error is None
    assert move.turns[1]["content"] == "at 1" and move.env_error is None


def test_a_dict_of_environments_is_checked_row_by_row_before_the_run(tmp_path):
    """Preflight: every row of every split names one of the dict's environments, and each named one is made
    and reset with its first row; a dict that is empty or holds something not callable is one line too."""
    from datasets import Dataset

    from tasks.core.errors import UserError
    from tasks.envs.runtime.protocol import check_environment, factory_of

    cfg = _cfg("tests.env_classes:ENVIRONMENTS", tmp_path)
    good = Dataset.from_list([{"prompt": "p", "letters": "ab", "environment": "move"},
                              {"prompt": "p", "letters": "ab", "environment": "count"}])
    check_environment(cfg, good[0], [good])
    assert type(factory_of(cfg)(good[1])).__name__ == "Counter"
    with pytest.raises(UserError, match=r"^env.factory: tests.env_classes:ENVIRONMENTS is a dict of environments by "
                                        r"name, and row 2 of the evaluation data has environment 'nope'; expected "
                                        r"one of \['count', 'move'\]$"):
        check_environment(cfg, good[0], [good, Dataset.from_list([good[0], {**good[1], "environment": "nope"}])])
    with pytest.raises(UserError, match=r"expected a column 'environment' naming each row's .* and the training "
                                        r"data has \['prompt', 'letters'\]$"):
        check_environment(cfg, good[0], [good.remove_columns("environment")])
    with pytest.raises(UserError, match=r"a row's 'environment' is None; expected one of \['count', 'move'\]$"):
        factory_of(cfg)({"prompt": "p"})
    without_letters = Dataset.from_list([{"prompt": "p", "environment": "count"}])
    with pytest.raises(UserError, match=r"^env.factory: tests.env_classes:ENVIRONMENTS\['count'\].*KeyError"):
        check_environment(cfg, without_letters[0], [without_letters])     # (Counter.reset reads `letters`)
    with pytest.raises(UserError, match=r"^env.factory: tests.env_classes:NOT_ALL_FACTORIES is a dict, whose 'move' "
                                        r"is str; expected callables by name"):
        factory_of(_cfg("tests.env_classes:NOT_ALL_FACTORIES", tmp_path))


RAISES_LATER = '''
import os
from pathlib import Path
from tasks.core.errors import UserError

class Env:
    """The config's mistake, found by an episode other than the preflight's: its reset raises UserError."""
    def reset(self, row):
        mark = Path(os.environ["KILL_DIR"]) / "reset-once"
        if mark.exists():
            raise UserError("env.kwargs.level: expected one of the levels the game has")
        mark.touch()
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        return [{"role": "user", "content": "ok"}], 0.0, True
'''


def test_a_users_error_in_one_episode_ends_the_run_with_its_line_and_the_others_processes(tmp_path, prefect_api,
                                                                                          monkeypatch):
    """The episode's UserError ended the stage while the other episodes' calls still ran in their processes; left
    running, they kept the CLI from exiting (the interpreter joins its children): the run printed its error and
    hung for good. The other episodes are abandoned and their processes killed."""
    from tests.conftest import TINY, run_cli, user_module

    user_module(tmp_path, monkeypatch, "raises_later", RAISES_LATER)
    out = run_cli(["run", str(TINY), "-o", "env.factory=raises_later:Env", "-o", "run.iterations=1"], tmp_path,
                  prefect_api, timeout=240)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr[-3000:]
    assert lines[-1] == "error: env.kwargs.level: expected one of the levels the game has", lines[-5:]


def test_a_call_past_its_time_in_a_thread_no_longer_holds_its_slot(tokenizer, tmp_path):
    """env.isolation: thread with one slot, the caller kept (as the streaming sampler keeps it for a whole run): a
    step that hangs for good fails its episode at its time, and the calls after it get the slot. Was: the hung
    thread held it, and every later call waited out its own episode's time for it (all failed as stalled)."""
    import threading

    from tasks.envs.runtime.episodes import Episode, _each
    from tasks.envs.runtime.isolation import Caller

    caller, never = Caller(1), threading.Event()
    hung = [Episode(group=0, row=0, data={}, budget=0.5)]
    assert _each(caller, hung, "step", lambda e: never.wait()) == [None]
    assert hung[0].error == "step did not return within env.timeout_seconds"
    later = [Episode(group=g, row=g, data={}, budget=60.0) for g in range(1, 4)]
    assert _each(caller, later, "step", lambda e: e.row * 10) == [10, 20, 30]
    assert [e.error for e in later] == [None] * 3
    never.set()
    caller.stop()


def test_an_environment_whose_call_is_written_off_is_not_closed_beside_it(tokenizer, tmp_path):
    """env.isolation: thread, one slot: a step past its time frees its slot but goes on in its thread; the
    stage's close of that environment must not run beside it (an environment that is not thread-safe broke, or
    took the stage down). Its episode fails as stalled; the other's ends with its return."""
    overlaps = tmp_path / "overlaps"
    cfg = _cfg("tests.env_classes:NotThreadSafe", tmp_path, f'env.kwargs={{overlaps: "{overlaps}"}}',
               "env.timeout_seconds=2", "env.isolation=thread", "env.concurrency=1")
    table = {i: {"prompt": "Say each letter I name.", "letters": "abc", "seed": i, "mode": m}
             for i, m in enumerate(["slow", "ok"])}
    records = run_episodes(cfg, table, [0, 1], Scripted(lambda ctx: "a").session("base", "unused", tokenizer),
                           SamplingParams(n=1, max_new_tokens=40, temperature=1.0, top_p=1.0, seed=3))[0]
    assert [r.env_error for r in records] == ["step did not return within env.timeout_seconds", None]
    time.sleep(4)                                   # (the written-off step ends meanwhile)
    assert not overlaps.exists(), overlaps.read_text()


def test_an_async_environment_that_blocks_its_loop_fails_its_episodes_saying_so(tokenizer, tmp_path):
    """env.isolation: thread: `time.sleep` in an async environment's reset stops the loop every environment's
    coroutine runs on. Was: each call on it ran out its time as if the environment stalled ("did not return
    within env.timeout_seconds"), which a stage reads as the infrastructure failing and retries three times. Now
    they fail saying the loop was blocked, and a stage whose every episode fails so is one line (exit 2)."""
    from tasks.core.errors import UserError
    from tasks.envs.runtime.episodes import STALLED, require_some_episode

    cfg = _cfg("tests.env_classes:BlocksItsLoop", tmp_path, "env.isolation=thread", "env.timeout_seconds=6")
    records = _run(cfg, Scripted(lambda ctx: "a"), tokenizer, n=2)
    assert len(records) == 4 and all(r.env_return is None for r in records)
    for r in records:
        assert r.env_error.startswith("reset: the event loop the environments' coroutines share (env.isolation: "
                                      "thread) ran nothing for") and STALLED not in r.env_error
    with pytest.raises(UserError, match=r"^env.factory: every episode of .* failed \(4 of 4\).*the event loop"):
        require_some_episode(cfg, records, "iteration 1")
