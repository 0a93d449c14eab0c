"""Writing and reading the record stages exchange (Rollout, tasks/core/contracts.py): one completion of one
prompt, as a JSON line.

generate writes them (reward fields empty); reward fills `rewards` (per function, None = not applicable or
failed), `reward` (the weighted combination) and `extra` (per-completion notes a reward function logged, e.g.
why a program failed); train reads them. Token ids and the generator's behaviour
logprobs travel with the text so the trainer never re-tokenises and can measure the policy mismatch.

A multi-turn episode (tasks/envs/runtime/episodes.py) is one record too: `completion_ids` holds every token after the
prompt, the model's turns and the environment's observations as the chat template renders them, and `mask`
says which are the model's (1: they enter the loss) and which the environment's (0; their `logprobs` are 0).
`turns` holds the messages after the prompt, `turn_rewards` what the environment gave at each step, and
`env_return` the episode's return (None when the environment failed: `env_error` says how), `env_state` the
environment object's public, JSON-able attributes when it ended (what reward functions get as `environments`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.contracts import Rollout

if TYPE_CHECKING:
    from tasks.core.store import Store


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


def load(store: Store, key: str, sub: str = "") -> list[Rollout]:
    """A stored rollouts (or rewards) folder's records, or those of its subfolder `sub` (the evaluate stage's
    greedy ones), verified against its manifest: a file store's read in place, a remote store's through a
    temporary download."""
    if not store.remote:
        return read(store.local(key) / sub)
    with tempfile.TemporaryDirectory(prefix="rlflow-rollouts-") as tmp:
        store.get_folder(key, Path(tmp))
        return read(Path(tmp) / sub)
