"""The agents' endpoint against the engine it fronts, side by side in one process on the builtin tiny model (hf):

  1. added latency per call: one completion of one token, called one at a time, straight from the sampling
     session vs through the endpoint with the real openai client (HTTP, the chat template, the record);
  2. episodes per second: the letters game as an agent (tasks/envs/builtin/games.py: letters_agent, the plain openai
     client, lockstep rounds) vs the same game as an environment (SayTheLetters, the episode loop), both with
     every episode of the batch at once, the same engine and the same batch.

    python bench/agents_vs_engine.py [--calls 200] [--episodes 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.core.config import load_config  # noqa: E402
from tasks.core.contracts import SamplingParams  # noqa: E402
from tasks.engines.sampling import open_session  # noqa: E402
from tasks.envs.runtime.agents import run_agents  # noqa: E402
from tasks.envs.runtime.endpoint import Endpoint  # noqa: E402
from tasks.envs.runtime.episodes import run_episodes  # noqa: E402
from tasks.envs.runtime.rendering import Renderer  # noqa: E402

AGENT, LETTERS = ROOT / "configs" / "agent.yaml", ROOT / "configs" / "letters.yaml"
ONE = SamplingParams(n=1, max_new_tokens=1, temperature=1.0, top_p=1.0, seed=1)


def per_call(session, calls: int) -> tuple[float, float]:
    """Milliseconds per call (median), straight and through the endpoint."""
    import openai

    cfg = load_config(AGENT, [])
    messages = [{"role": "user", "content": "Say each letter I name. Say b"}]
    ids = Renderer(session.tokenizer, 512).prompt(messages, None)       # what the endpoint renders
    straight, through = [], []
    with Endpoint(cfg, session, "base", ONE) as ep:
        key = ep.open(0, 1)
        client = openai.OpenAI(base_url=ep.base_url, api_key=key, max_retries=0)
        for i in range(calls + 5):
            t0 = time.perf_counter()
            session.sample([ids], SamplingParams(n=1, max_new_tokens=1, temperature=1.0, top_p=1.0, seed=i))
            t1 = time.perf_counter()
            client.chat.completions.create(model="policy", messages=messages)
            t2 = time.perf_counter()
            if i >= 5:                                           # (the first calls warm imports and the connection)
                straight.append(t1 - t0)
                through.append(t2 - t1)
            ep.episodes[key].calls.clear()                      # (each call a first call: no turn limit)
    return statistics.median(straight) * 1000, statistics.median(through) * 1000


def episodes_per_second(session, episodes: int, agent: bool) -> float:
    rows = [{"prompt": "Say each letter I name.", "letters": "abcd"[i % 4] + "dcba"[i % 3] + "bd"[i % 2]}
            for i in range(episodes // 8)]
    more = [f"env.concurrency={episodes}", "env.isolation=thread"]
    cfg = load_config(AGENT if agent else LETTERS, more)
    params = SamplingParams(n=8, max_new_tokens=1, temperature=1.0, top_p=1.0, seed=3)
    t0 = time.perf_counter()
    if agent:
        records, _ = run_agents(cfg, dict(enumerate(rows)), list(range(len(rows))), session, params, "base")
    else:
        records, _ = run_episodes(cfg, dict(enumerate(rows)), list(range(len(rows))), session, params)
    seconds = time.perf_counter() - t0
    assert len(records) == episodes and all(r.env_error is None for r in records)
    return episodes / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--episodes", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = load_config(AGENT, [])
    with open_session(cfg, "base") as session:
        straight, through = per_call(session, args.calls)
        episodes_per_second(session, 16, True)                   # warm: the agent's imports, its client
        rates = {kind: max(episodes_per_second(session, args.episodes, kind == "agent") for _ in range(args.repeats))
                 for kind in ("environment", "agent")}
    print(f"{'one call, one token':<34} {'ms':>8}")
    print(f"{'the session':<34} {straight:>8.2f}")
    print(f"{'the endpoint (openai client)':<34} {through:>8.2f}   +{through - straight:.2f} ms a call "
          f"(median of {args.calls})")
    print()
    print(f"{'letters game, ' + str(args.episodes) + ' episodes x 3 turns':<34} {'episodes/s':>11} {'vs env':>7}")
    for kind, rate in rates.items():
        print(f"{kind:<34} {rate:>11.1f} {rate / rates['environment']:>6.2f}x")
    print(f"(best of {args.repeats})")


if __name__ == "__main__":
    main()
