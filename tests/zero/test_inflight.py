"""The bound on ZeRO-3 reductions in flight (hybrid/zero/inflight.py), without a process group."""

from __future__ import annotations

from hybrid.zero.inflight import MAX_INFLIGHT_BUCKETS, InflightReductions, closes_before, inflight_limit


class _Handle:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(("wait", self.name))


def test_a_unit_that_would_overflow_the_open_bucket_launches_it_first():
    assert not closes_before(0, 50, 10)  # an empty bucket takes any unit, however large
    assert not closes_before(4, 6, 10)  # exactly full: joins, then the full bucket launches
    assert closes_before(4, 7, 10)
    assert inflight_limit(10) == MAX_INFLIGHT_BUCKETS * 10


def test_older_reductions_land_oldest_first_until_the_new_one_fits():
    log = []
    q = InflightReductions(limit=10)
    for name, n in (("a", 4), ("b", 4), ("c", 2)):
        q.make_room(n)
        q.add(_Handle(log, name), lambda name=name: log.append(("land", name)), n)
    assert log == [] and q.numel == 10 and len(q) == 3  # 4 + 4 + 2 fit the limit together
    q.make_room(3)  # 13 > 10: a lands, and 6 + 3 fits
    assert log == [("wait", "a"), ("land", "a")] and q.numel == 6
    q.make_room(7)  # 13 > 10: b lands, and 2 + 7 fits
    assert log[-2:] == [("wait", "b"), ("land", "b")] and q.numel == 2
    q.make_room(50)  # larger than the limit: everything lands, and it goes out alone
    assert q.numel == 0 and len(q) == 0 and log[-1] == ("land", "c")
    q.add(_Handle(log, "d"), lambda: log.append(("land", "d")), 50)
    q.land_all()
    assert log[-2:] == [("wait", "d"), ("land", "d")] and q.numel == 0
