"""What reward functions log with TRL's log_metric(name, value), as metric keys beside rlflow's own: the reward
stage's (tasks/reward.py) and the evaluation's (tasks/evaluate.py) by one rule."""

from __future__ import annotations

import sys

from tasks.core.errors import printable
from tasks.core.tracking import metric_key


def logged_metrics(logged: dict[str, float], own: dict[str, float], prefix: str = "reward/") -> dict[str, float]:
    """What reward functions logged with log_metric(name, value), as <prefix><name> (reward/; an evaluation's
    eval/, eval/greedy_; a name MLflow refuses made one it takes, 250 characters at most: tracking.metric_key); a
    name that is one of rlflow's own metrics (`own`:
    reward/mean, reward/std, a function's /errors ...) becomes <prefix>log_metric/<name>, and one that comes out as
    the key of another name logged ("pass@1" and "pass#1"; two long names alike in their first 250 characters)
    gets "-2", "-3" ..., each said once, so that no figure replaces another or is lost."""
    out: dict[str, float] = {}
    for name, value in logged.items():
        key = metric_key(f"{prefix}{name}")
        if key in own:
            key = _renamed(name, key, metric_key(f"{prefix}log_metric/{name}"), "rlflow's own metric")
        if key in out or key in own:
            taken, n = key, 2
            while (key := metric_key(f"{taken[:240]}-{n}")) in out or key in own:
                n += 1
            key = _renamed(name, taken, key, "the key another log_metric name made")
        out[key] = value
    return out


def _renamed(name: str, key: str, renamed: str, why: str) -> str:
    if (name, renamed) not in _RENAMED:
        _RENAMED.add((name, renamed))
        print(printable(f"warning: a reward function's log_metric({name!r}) is logged as {renamed}: {key} is "
                        f"{why}"), file=sys.stderr)
    return renamed


_RENAMED: set[tuple[str, str]] = set()     # log_metric names said to be renamed (once a process)
