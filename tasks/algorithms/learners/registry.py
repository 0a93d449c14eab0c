"""train.algorithm → its learner (tasks/algorithms/learners/): the learner is the one train.learner's settings
name (`implementation`, "module:Class": the built-ins' in tasks/core/config_train.py, a learner written elsewhere
by the settings it registers there with register_learner), imported when first asked for."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import Learner


def learner_class(cfg: Config) -> type:
    """The class of the learner train.algorithm names (what it declares: its rows, statistics, modules)."""
    module, _, name = type(cfg.train.learner).implementation.partition(":")
    return getattr(importlib.import_module(module), name)


def make(cfg: Config, iteration: int = 1) -> Learner:
    """The learner train.algorithm names, for iteration `iteration`'s update."""
    return learner_class(cfg)(cfg, iteration)
