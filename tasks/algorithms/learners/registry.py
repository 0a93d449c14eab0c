"""train.algorithm → its learner (tasks/algorithms/learners/): the one place that knows them all."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.algorithms.learners.grpo import Grpo
from tasks.algorithms.learners.ppo import Ppo
from tasks.algorithms.learners.vtrace_awr import VtraceAwr

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import Learner

LEARNERS: dict[str, type] = {"grpo": Grpo, "ppo": Ppo, "vtrace_awr": VtraceAwr}


def learner_class(cfg: Config) -> type:
    """The class of the learner train.algorithm names (what it declares: its rows, statistics, modules)."""
    return LEARNERS[cfg.train.algorithm]


def make(cfg: Config, iteration: int = 1) -> Learner:
    """The learner train.algorithm names, for iteration `iteration`'s update."""
    return learner_class(cfg)(cfg, iteration)
