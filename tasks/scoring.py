"""Reward functions: importing them by path and calling them safely on a batch. Shared by the reward and
evaluate stages. A function has TRL's signature f(completions, **columns) -> list[float | None]."""

from __future__ import annotations

import importlib
import math
import os
import sys
from typing import Callable

from tasks import rollout
from tasks.advantage import combine
from tasks.errors import UserError


class RewardFunctionError(UserError):
    """A reward function raised or returned something unusable; the message names the function. It is the
    user's code, so a retry would not help: a user error (exit 2, never retried)."""


def load_functions(cfg) -> list[tuple[str, Callable, float]]:
    """Import every configured function: [(name, fn, weight)]. A bad path is a user error."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # user reward modules live next to where they run rlflow
    out = []
    for i, spec in enumerate(cfg.reward.functions):
        module_name, _, attr = spec.fn.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise UserError(f"reward.functions[{i}].fn: cannot import module {module_name!r}: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise UserError(f"reward.functions[{i}].fn: {module_name!r} has no function {attr!r}")
        out.append((attr, fn, spec.weight))
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        raise UserError(f"reward.functions: two functions share a name ({names}); names key the scores")
    return out


def score(functions, records: list[rollout.Rollout]) -> dict[str, list[float | None]]:
    """Call each function once on the whole batch; validate what it returns."""
    completions = [r.completion for r in records]
    columns: dict[str, list] = {k: [r.columns.get(k) for r in records] for k in (records[0].columns if records else {})}
    columns["prompts"] = [r.prompt for r in records]
    columns["completion_ids"] = [r.completion_ids for r in records]
    scores = {}
    for name, fn, _ in functions:
        try:
            values = fn(completions, **columns)
        except Exception as e:
            raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        values = list(values) if values is not None else []
        if len(values) != len(records):
            raise RewardFunctionError(f"reward function {name!r} returned {len(values)} scores for {len(records)} completions")
        clean = []
        for j, v in enumerate(values):
            if v is None:
                clean.append(None)
                continue
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise RewardFunctionError(f"reward function {name!r} returned {type(v).__name__} for completion {j}") from None
            if not math.isfinite(v):
                raise RewardFunctionError(f"reward function {name!r} returned {v} for completion {j}")
            clean.append(v)
        scores[name] = clean
    return scores


def score_records(functions, records: list[rollout.Rollout], aggregate: str) -> dict[str, list[float | None]]:
    """Score `records` in place: per-function scores in `.rewards`, the combined reward in `.reward`
    (None where no function scored it). Returns the per-function scores."""
    scores = score(functions, records)
    for j, r in enumerate(records):
        r.rewards = {name: scores[name][j] for name in scores}
    totals = combine([r.rewards for r in records], {name: w for name, _, w in functions}, aggregate).tolist()
    for r, t in zip(records, totals):
        r.reward = None if math.isnan(t) else t
    return scores
