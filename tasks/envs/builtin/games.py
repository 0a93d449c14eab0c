"""The multi-turn demo's game (configs/letters.yaml): the environment names a letter, the model says it back,
and the environment tells it whether it was right and names the next one, for as many letters as the row has.

    row {"prompt": "Say each letter I name.", "letters": "dbc"}
    user: Say each letter I name. Say d      assistant: d
    user: yes. Say b                         assistant: a
    user: no, it was b. Say c                assistant: c      -> turn rewards 1/3, 0, 1/3: return 2/3

Each letter sits in the newest observation. With the demo's four letters, a policy that always says the same
one scores 0.25 on average; only one that reads what the environment said on each turn scores more. The
0.1M-parameter builtin model gets from 0.005 to ~0.56 in 100 iterations on 2 CPU cores (~2 minutes).

`reference_action` solves it (`rlflow record` makes demonstrations of it for a warm start: tasks/sft.py).
`letters_agent` is the same game written as an agent users would write, with the plain `openai` client against
rlflow's endpoint (env.agent; configs/agent.yaml): the same task, trained from the tokens the endpoint recorded.
"""

from __future__ import annotations

import re

from tasks.core.contracts import Step


class SayTheLetters:
    """rlflow's own protocol: reset(row) -> messages, step(message) -> Step."""

    tools: list = []

    def reset(self, row: dict) -> list[dict]:
        self.letters, self.turn = str(row["letters"]), 0
        return [{"role": "user", "content": f"{row.get('prompt', '')} Say {self.letters[0]}".strip()}]

    def step(self, message: dict) -> Step:
        said, want = (message.get("content") or "").strip(), self.letters[self.turn]
        right = said == want
        self.turn += 1
        reward = 1.0 / len(self.letters) if right else 0.0
        if self.turn == len(self.letters):
            return Step([], reward, True)
        verdict = "yes." if right else f"no, it was {want}."
        return Step([{"role": "user", "content": f"{verdict} Say {self.letters[self.turn]}"}], reward, False)


def reference_action(context: str) -> str:
    """The policy that solves the game from what the model sees: the letter named last."""
    return re.findall(r"Say (\w)", context)[-1]


async def letters_agent(row: dict, base_url: str, api_key: str) -> float:
    """The game as an agent (env.agent: tasks.envs.builtin.games:letters_agent): the model's replies come from rlflow's
    endpoint, the agent keeps the conversation and the score."""
    client = _client(base_url).with_options(api_key=api_key)      # (one connection pool, a key per episode)
    letters = str(row["letters"])
    messages = [{"role": "user", "content": f"{row.get('prompt', '')} Say {letters[0]}".strip()}]
    score = 0.0
    for turn, want in enumerate(letters):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        said = reply.choices[0].message.content or ""
        score += (said.strip() == want) / len(letters)
        if turn + 1 < len(letters):
            verdict = "yes." if said.strip() == want else f"no, it was {want}."
            messages += [{"role": "assistant", "content": said},
                         {"role": "user", "content": f"{verdict} Say {letters[turn + 1]}"}]
    return score


_shared: dict = {}
_retired: list = []


def _client(base_url: str):
    """One openai client per event loop and endpoint: making one costs ~25 ms (its TLS context), 128 episodes an
    iteration would pay ~3 s. `with_options` gives each episode its key on the same connections."""
    import asyncio

    import openai

    loop = asyncio.get_running_loop()
    if _shared.get("loop") is not loop or _shared.get("url") != base_url:
        if "client" in _shared:      # (its loop has ended: kept, not dropped, so that openai's finaliser does not
            _retired.append(_shared["client"])      # try to close it on this one)
        _shared.update(loop=loop, url=base_url, client=openai.AsyncOpenAI(base_url=base_url, api_key="per-episode"))
    return _shared["client"]
