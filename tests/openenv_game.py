"""A real OpenEnv environment, written the way OpenEnv's docs write one (an `Environment` with its `Action` and
`Observation` models, served by openenv-core's `create_fastapi_app`), for the OpenEnv adapter's tests. It runs
in the OpenEnv Python (.venv-openenv), as a server, as OpenEnv environments do:

    .venv-openenv/bin/python tests/openenv_game.py PORT

Higher or lower: the server picks a number from 1 to 16 (from reset's seed); each guess is answered "higher" or
"lower" until it is right (reward 1) or six guesses are spent (reward 0). The guess "boom" makes the step raise.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

TRIES = 6


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str = ""


class GuessState(State):
    target: int = 0


class HigherLower(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._state = GuessState(episode_id=episode_id, target=random.Random(seed).randint(1, 16))
        return GuessObservation(text="I picked a number from 1 to 16. Guess it.", done=False, reward=None)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        said = action.message.strip()
        if said == "boom":
            raise RuntimeError("the game broke")
        if not said.isdigit():
            return GuessObservation(text="Say a number.", reward=0.0, done=self._state.step_count >= TRIES)
        guess, target = int(said), self._state.target
        if guess == target:
            return GuessObservation(text="right", reward=1.0, done=True)
        if self._state.step_count >= TRIES:
            return GuessObservation(text=f"no: it was {target}", reward=0.0, done=True)
        return GuessObservation(text="higher" if guess < target else "lower", reward=0.0, done=False)

    @property
    def state(self) -> GuessState:
        return self._state


app = create_fastapi_app(HigherLower, GuessAction, GuessObservation, max_concurrent_envs=64)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
