"""The OpenEnv adapter (tasks/envs/adapters/openenv_adapter.py) against a real OpenEnv server (tests/openenv_game.py, an
openenv-core Environment served by its create_fastapi_app in .venv-openenv), through openenv-core's own client
in the bridge process: episodes played to the end, a step that raises costing only its episode, a server that
goes away, and the flow with the tiny model."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tasks.core.config import load_config
from tasks.core.contracts import SamplingParams
from tasks.core.errors import UserError
from tasks.envs.adapters.openenv_adapter import OpenEnv, _OpenEnvClient
from tasks.envs.builtin.webshop import free_port
from tasks.envs.runtime.episodes import run_episodes
from tests.conftest import OPENENV_PYTHON
from tests.test_envs import Scripted

pytestmark = pytest.mark.openenv
ROOT = Path(__file__).resolve().parents[1]
LETTERS = ROOT / "configs" / "letters.yaml"
FACTORY = "tasks.envs.adapters.openenv_adapter:OpenEnv"


def _serve() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(OPENENV_PYTHON), str(ROOT / "tests" / "openenv_game.py"), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the OpenEnv server did not start: {proc.stderr.read()[-2000:]!r}") from None
            time.sleep(0.1)


@pytest.fixture(scope="module")
def game():
    proc, url = _serve()
    yield url
    proc.kill()
    proc.wait()


def bisect(context: str) -> str:
    """Higher or lower, played from what the model sees: the middle of what the answers so far leave."""
    lo, hi = 1, 16
    for guess, answer in re.findall(r"assistant: (\S+?)(?:</s>)?\n.*?user: (higher|lower)", context, re.S):
        if guess.isdigit():
            lo, hi = (int(guess) + 1, hi) if answer == "higher" else (lo, int(guess) - 1)
    return "boom" if "Break it" in context else str((lo + hi) // 2)


def _cfg(url: str, tmp_path: Path, *more: str):
    return load_config(LETTERS, [f"env.factory={FACTORY}", f"env.kwargs={{base_url: '{url}'}}", "env.max_turns=6",
                                 "env.max_tokens=400", "generate.max_completion_length=8", *more])


def _run(cfg, rows: list[dict], tok, n: int = 2):
    table = dict(enumerate(rows))
    return run_episodes(cfg, table, list(table), Scripted(bisect).session("base", "unused", tok),
                        SamplingParams(n=n, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=3))[0]


def test_episodes_play_an_openenv_server_to_the_end_through_its_own_client(game, tokenizer, tmp_path):
    """Each episode a session of openenv-core's GenericEnvClient on the server; the seed column reaches the
    server's reset; the result's reward and done end the episode; one bridge process serves them all; a step
    that raises on the server costs only its own episodes."""
    rows = [{"prompt": "Guess my number.", "seed": s} for s in (1, 2, 3)] + [{"prompt": "Break it.", "seed": 4}]
    records = _run(_cfg(game, tmp_path, "env.isolation=thread"), rows, tokenizer)
    good, broken = records[:6], records[6:]
    assert [(r.env_error, r.env_return) for r in good] == [(None, 1.0)] * 6
    assert all(r.prompt[0]["content"] == "Guess my number.\n\nI picked a number from 1 to 16. Guess it." for r in good)
    assert all(r.turns[-1]["role"] == "assistant" and r.env_state["observation"]["text"] == "right" for r in good)
    assert len({len(r.turns) for r in good[::2]}) > 1                       # the seeds gave different numbers
    assert [r.env_return for r in broken] == [None, None]
    assert all("RuntimeError: Server error: the game broke" in r.env_error for r in broken)
    assert len(_OpenEnvClient.running) == 1


def test_a_server_that_goes_away_ends_its_episodes_not_the_stage(tokenizer, tmp_path):
    """The server is killed after the first guesses: the episodes still going end with the client's error, the
    stage goes on; the next run's preflight says in one line that nothing answers."""
    proc, url = _serve()

    def reply(context: str) -> str:
        if re.search(r"user: (higher|lower)", context) and proc.poll() is None:
            proc.kill()
            proc.wait()
        return bisect(context)

    table = {i: {"prompt": "Guess.", "seed": s} for i, s in enumerate((1, 2, 3, 5))}
    records = run_episodes(_cfg(url, tmp_path, "env.isolation=thread"), table, list(table),
                           Scripted(reply).session("base", "unused", tokenizer),
                           SamplingParams(n=1, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=3))[0]
    failed = [r for r in records if r.env_error]
    assert failed and all(r.env_return is None and r.env_error.startswith("step raised OpenEnvError") for r in failed)
    assert all(r.env_return == 1.0 for r in records if not r.env_error)     # (a first guess that was right)
    with pytest.raises(UserError, match=r"^env.kwargs.base_url: no OpenEnv server answers at http://127.0.0.1:\d+/health"):
        OpenEnv.preflight(base_url=url)


@pytest.mark.slow
def test_an_openenv_environment_runs_through_the_flow(game, tmp_path, prefect_api, monkeypatch):
    """The flow with the tiny model (hf engine) against the server: episodes, rewards from the return."""
    from flows.training import train_flow
    from tasks.core import layout
    from tasks.core.store import Store

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "Guess a number from 1 to 16.", "seed": {s}}}\n' for s in range(4)))
    out = train_flow(str(LETTERS), [
        f"env.factory={FACTORY}", f"env.kwargs={{base_url: '{game}'}}", "env.isolation=thread", "env.max_turns=3",
        f"data.path={data}", "run.name=openenv", "run.iterations=1", "store.uri=store",
        f"tracking.uri=sqlite:///{tmp_path}/m.db", "generate.prompts_per_iteration=2", "generate.num_generations=2",
        "generate.max_completion_length=2"])
    assert out["iterations_completed"] == 1
    store = Store.open(str(tmp_path / "store"))
    meta = store.manifest(layout.rollouts("openenv", 1))["meta"]["metrics"]
    assert meta["env/episodes"] == 4 and meta["env/errors"] == 0 and meta["env/turns_mean"] >= 1
    assert "reward/env/mean" in store.manifest(layout.rewards("openenv", 1))["meta"]["metrics"]
