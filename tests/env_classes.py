"""Environment classes the tests in tests/test_envs.py run, in a module of their own: a process environment's
forkserver imports it, so it stays light (no torch, no transformers)."""

from __future__ import annotations

import os
import time

from tasks.core.contracts import Step


class Flaky:
    """An environment that fails in the way its row says."""

    tools: list = []

    def reset(self, row):
        self.mode = row.get("mode", self.mode)            # (a row may say how its episode fails)
        if row["letters"] == "hgf" and row["seed"] == 1 and self.mode == "reset":
            raise RuntimeError("reset blew up")
        return [{"role": "user", "content": "Say a"}]

    def __init__(self, mode="raise", pids=None):
        self.mode, self.turn, self._pids = mode, 0, pids    # (private: not in the episode's state)

    def step(self, message):
        self.turn += 1
        if self.mode == "raise" and self.turn == 2:
            raise ValueError("step blew up")
        if self.mode == "hang" and self.turn == 2:
            time.sleep(30)
        if self.mode == "garbage" and self.turn == 2:
            return "not a step"
        if self.mode == "crash" and self.turn == 2:
            import ctypes
            ctypes.string_at(0)                           # a segfault
        if self.mode == "exit" and self.turn == 2:
            import os
            os._exit(3)
        if self.mode == "killpg" and self.turn == 2:     # its group: with a fork of its own left behind
            import os
            import signal
            signal.signal(signal.SIGTERM, signal.SIG_IGN)    # (the fork deaf to the group's SIGTERM: left running)
            if os.fork() == 0:
                with open(self._pids, "a") as f:          # (the test looks for it after the episode)
                    f.write(f"{os.getpid()}\n")
                time.sleep(600)
                os._exit(0)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.killpg(0, signal.SIGTERM)
        if self.mode == "chatty" and self.turn == 2:     # prints 8M characters (a debug print left in a loop)
            import sys
            for _ in range(8):
                print("x" * (1 << 20))
                sys.stderr.write("e" * 1000 + "\n")
        if self.mode == "chatty_fd" and self.turn == 2:  # 8 MiB past print: os.write, and a process it starts
            import os
            import subprocess
            for _ in range(8):
                os.write(1, b"x" * (1 << 20))
            subprocess.run(["sh", "-c", "head -c 1000000 /dev/zero | tr '\\0' e >&2"], check=True)
        if self.mode in ("daemonizes", "daemonizes_and_dies") and self.turn == 2:
            # (forks twice into a session of its own; the middle ends)
            import os
            written, told = os.pipe()
            middle = os.fork()
            if middle == 0:
                os.setsid()
                if os.fork() == 0:
                    with open(self._pids, "a") as f:
                        f.write(f"{os.getpid()}\n")
                    os.write(told, b"1")
                    time.sleep(600)
                os._exit(0)
            os.close(told)
            os.waitpid(middle, 0)
            os.read(written, 1)                           # (its pid written before the episode goes on)
            os.close(written)
            if self.mode == "daemonizes_and_dies":        # (no cleanup of its own runs: a crash, the OOM killer)
                import signal
                os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "sys_exit" and self.turn == 2:
            import sys
            sys.exit(0)
        if self.mode == "base" and self.turn == 2:
            raise BaseException("base")
        if self.mode == "huge" and self.turn == 2:       # (50 MB of observation: its rendering took minutes)
            return Step([{"role": "user", "content": "x" * (50 << 20)}], 1.0, False)
        if self.mode == "numpy":                          # (gymnasium's kind of reward: numpy's float32)
            import numpy as np
            return Step([{"role": "user", "content": "Say a"}], np.float32(1.0), self.turn == 3)
        return Step([{"role": "user", "content": "Say a"}], 1.0, self.turn == 3)


class KeepsAConnection(Flaky):
    """An async environment that opens a connection as it resets and never closes it (a client it keeps)."""

    def __init__(self, port: int):
        super().__init__(mode="ok")
        self.port = port

    async def reset(self, row):
        import asyncio

        self._connection = await asyncio.open_connection("127.0.0.1", self.port)
        return super().reset(row)


class BlocksItsLoop(Flaky):
    """An async environment whose reset blocks the event loop it runs on (time.sleep in it)."""

    def __init__(self):
        super().__init__(mode="ok")

    async def reset(self, row):
        time.sleep(60)
        return super().reset(row)


class HangsWhenMade(Flaky):
    """An environment whose __init__ never returns (its pid written first, for the test to look for)."""

    def __init__(self, pids=None):
        import os

        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(600)


class Counter:
    """A TRL environment_factory class, as TRL's docs write one: reset(**row), public methods are tools,
    get_reward() scores the episode."""

    def reset(self, **kwargs) -> str | None:
        self.total, self.target = 0, len(kwargs["letters"])
        return f" Reach {self.target} by incrementing."

    def increment(self, step: int) -> str:
        """Add to the counter.

        Args:
            step: how much to add
        """
        self.total += step
        return f"counter is {self.total}"

    def get_reward(self) -> float:
        return 1.0 if self.total == self.target else 0.0


class CountingEnv:
    """TRL's docs' environment: the reward is state on the instance, read by a reward function."""

    def __init__(self):
        self.count, self.reward = 0, 0.0

    def reset(self, **kwargs) -> str | None:
        self.count, self.reward = 0, 0.0
        return "Reach exactly 3 by calling increment."

    def increment(self, step: int) -> str:
        """Increase the counter.

        Args:
            step: Amount to add.
        """
        self.count += step
        self.reward = 1.0 if self.count == 3 else 0.0
        return f"count={self.count}"


try:
    import gymnasium as _gym

    class Echo(_gym.Env):
        """A gymnasium text environment: echo the word, reward 1 each time."""

        observation_space = _gym.spaces.Text(32)
        action_space = _gym.spaces.Text(32)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.word, self.n = f"{seed}-0", 0
            return f"echo {self.word}", {}

        def step(self, action):
            reward = 1.0 if action.strip() == self.word else 0.0
            self.n += 1
            self.word = f"{self.word.split('-')[0]}-{self.n}"
            return f"echo {self.word}", reward, False, False, {}

    _gym.register(id="rlflow-test/Echo-v0", entry_point="tests.env_classes:Echo", max_episode_steps=3)
except ImportError:          # (the gymnasium test is skipped)
    pass


class Mover:
    """A TRL environment whose tool happens to be called `step` (TRL's docs advise against it; people do it)."""

    def reset(self, **kwargs) -> str | None:
        self.position = 0
        return None

    def step(self, direction: str) -> str:
        """Move one square.

        Args:
            direction: left or right
        """
        self.position += 1 if direction == "right" else -1
        return f"at {self.position}"


# TRL's multi-environment form, GRPOTrainer(environment_factory={...}): each row's `environment` picks one
ENVIRONMENTS = {"count": Counter, "move": Mover}
NOT_ALL_FACTORIES = {"count": Counter, "move": "Mover"}


def _marked(hint):
    """A type hint that, each time it is evaluated (typing.get_type_hints: the tool's schema being built), adds this
    process's id to the file $RLFLOW_TEST_MARKS names."""
    if os.environ.get("RLFLOW_TEST_MARKS"):
        with open(os.environ["RLFLOW_TEST_MARKS"], "a") as f:
            f.write(f"{os.getpid()}\n")
    return hint


class Marked:
    """A TRL environment class whose tool's schema says where it was built."""

    def reset(self, **kwargs) -> str | None:
        self.notes = []
        return "Take notes."

    def note(self, text: _marked(str)) -> str:
        """Keep a note.

        Args:
            text: the note
        """
        self.notes.append(text)
        return "noted"


class Stalls:
    """An environment that never answers reset in time (a stalled environment, or its server)."""

    tools: list = []

    def reset(self, row):
        time.sleep(30)
        return [{"role": "user", "content": "Say a"}]

    def step(self, message):
        return Step([], 0.0, True)


class FailsWhenMade(Flaky):
    """An environment whose third construction raises (counted by files `made.N`, in any process or thread)."""

    def __init__(self, made=None):
        import os

        super().__init__(mode="ok")
        n = 1
        while True:                                       # (its number: the first `made.N` it makes, atomically)
            try:
                os.close(os.open(f"{made}.{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                break
            except FileExistsError:
                n += 1
        if n == 3:
            raise RuntimeError("third construction")


class NotThreadSafe(Flaky):
    """An environment whose step in a row with `slow` takes 5 s, and that notes in `overlaps` a close made while
    its step runs (what a driver or a C extension does not survive)."""

    def __init__(self, overlaps: str):
        super().__init__(mode="ok")
        self.overlaps, self.busy = overlaps, False

    def step(self, message):
        self.busy = True
        try:
            if self.mode == "slow":
                time.sleep(5)
            return super().step(message)
        finally:
            self.busy = False

    def close(self):
        if self.busy:
            with open(self.overlaps, "a") as f:
                f.write("closed during a step\n")
