"""The rules every fleet shares (tasks/core/fleet.py), on their own: the replicas' router, the environment pool and
the judges use these objects (tests/test_replicas.py, tests/test_env_pool.py drive them through the fleets)."""

from __future__ import annotations

import types

from tasks.core import fleet


def test_starts_back_off_and_give_up_by_one_rule(monkeypatch):
    """A member that cannot start is started again at once after its first failure, then BACKOFF s later per
    failure (never more than MAX_BACKOFF), given up after START_TRIES in a row; a start that answers resets it."""
    now = [100.0]
    monkeypatch.setattr(fleet, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    s = fleet.Starts()
    assert s.due() and not s.given_up()
    s.failure(RuntimeError("x" * 600 + "the last words"))
    assert s.due() and s.error.endswith("the last words") and len(s.error) == 500     # at once, its tail kept
    waits = []
    for _ in range(20):
        s.failure("again")
        waits.append(s.retry_at - now[0])
        assert not s.due()
        now[0] = s.retry_at
        assert s.due()
    assert waits[:3] == [fleet.BACKOFF, 2 * fleet.BACKOFF, 3 * fleet.BACKOFF] and max(waits) == fleet.MAX_BACKOFF
    assert s.given_up() and s.failed == 21
    s.started()
    assert s.due() and not s.given_up() and s.error == "" and s.failed == 0

    t = fleet.Starts()
    for k in range(fleet.START_TRIES):
        assert not t.given_up()
        t.failure(k)
    assert t.given_up() and t.error == str(fleet.START_TRIES - 1)


def test_health_loses_a_member_after_lost_after_failures_or_one_refusal():
    h = fleet.Health()
    assert [h.failed() for _ in range(fleet.LOST_AFTER)] == [False] * (fleet.LOST_AFTER - 1) + [True]
    h.answered()
    assert not h.failed()                              # an answer starts the count again
    h.answered()
    assert h.failed(refused=True)                      # a refused connection: lost at once


def test_sticky_keeps_the_newest_keys_and_least_loaded_breaks_ties_by_index():
    sticky = fleet.Sticky(3)
    for i, key in enumerate("abcd"):
        sticky.remember(key, i)
    assert list(sticky) == ["b", "c", "d"]
    sticky.remember("b", 7)                            # used again: newest, so "c" goes next
    sticky.remember("e", 4)
    assert dict(sticky) == {"d": 3, "b": 7, "e": 4}
    members = [(2, 5, 0), (1, 9, 1), (1, 9, 2), (1, 3, 3)]
    assert fleet.least_loaded(members, lambda m: m) == (1, 3, 3)
    assert fleet.least_loaded(members[:3], lambda m: m) == (1, 9, 1)
