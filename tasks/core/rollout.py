"""The record stages exchange: one completion of one prompt, as a JSON line.

generate writes them (reward fields empty); reward fills `rewards` (per function, None = not applicable or
failed), `reward` (the weighted combination) and `extra` (per-completion notes a reward function logged, e.g.
why a program failed); train reads them. Token ids and the generator's behaviour
logprobs travel with the text so the trainer never re-tokenises and can measure the policy mismatch.

A multi-turn episode (tasks/envs/episodes.py) is one record too: `completion_ids` holds every token after the
prompt, the model's turns and the environment's observations as the chat template renders them, and `mask`
says which are the model's (1: they enter the loss) and which the environment's (0; their `logprobs` are 0).
`turns` holds the messages after the prompt, `turn_rewards` what the environment gave at each step, and
`env_return` the episode's return (None when the environment failed: `env_error` says how), `env_state` the
environment object's public, JSON-able attributes when it ended (what reward functions get as `environments`).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.core.store import Store


@dataclass
class Rollout:
    group: int                  # prompt's position in this iteration's batch; completions of a group share it
    row: int                    # dataset row index
    prompt: Any                 # the prompt as in the dataset (string or chat messages)
    prompt_ids: list[int]
    completion: str
    completion_ids: list[int]   # includes the EOS token when the completion stopped on its own
    logprobs: list[float]       # behaviour logprob of each completion token (after temperature)
    truncated: bool             # hit max_completion_length without EOS
    columns: dict[str, Any] = field(default_factory=dict)   # the dataset row's other columns (reward kwargs)
    rewards: dict[str, float | None] = field(default_factory=dict)
    reward: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)     # columns reward functions logged (TRL's log_extra)
    mask: list[int] | None = None         # per completion token: 1 the model's, 0 an observation's (None: all 1)
    turns: list[dict] | None = None       # the messages after the prompt (multi-turn)
    turn_rewards: list[float] | None = None
    env_return: float | None = None
    env_error: str | None = None
    env_state: dict[str, Any] | None = None   # the environment's public attributes when the episode ended


FILE = "rollouts.jsonl"


def write(rollouts: list[Rollout], folder: Path) -> Path:
    path = Path(folder) / FILE
    with open(path, "w") as f:
        for r in rollouts:
            f.write(json.dumps(vars(r)) + "\n")     # (not asdict: it deep-copies every list, ~4x the time)
    return path


def read(folder: Path) -> list[Rollout]:
    with open(Path(folder) / FILE) as f:
        return [Rollout(**json.loads(line)) for line in f if line.strip()]


def load(store: Store, key: str) -> list[Rollout]:
    """A stored rollouts (or rewards) folder's records, verified against its manifest: a file store's read in
    place, a remote store's through a temporary download."""
    if not store.remote:
        return read(store.local(key))
    with tempfile.TemporaryDirectory(prefix="rlflow-rollouts-") as tmp:
        store.get_folder(key, Path(tmp))
        return read(Path(tmp))
