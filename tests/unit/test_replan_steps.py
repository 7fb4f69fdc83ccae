"""Where a re-plan's time goes: the switch's log lines, the workers' arrival times, and bench/replan.py's steps."""

from __future__ import annotations

from datetime import datetime

import pytest

from sluice.scheduler.hierarchy.routes import Route, Routing
from sluice.scheduler.hierarchy.switch import switch_notes
from sluice.transport.wire import Kind, Message
from sluice.worker.routing import KEEP_TIMES, Router
from testbed.replan_steps import (
    STEPS,
    evidence,
    false_alarms,
    false_mends,
    first_switch,
    median_steps,
    parse_line,
    steps,
    switches,
)

T0 = datetime(2026, 11, 29, 15, 0, 0).timestamp()  # the cut, at a period boundary of 1 s periods
PERIOD0 = int(T0)  # period k ends at k seconds


def at(seconds: float) -> str:
    whole, frac = divmod(T0 + seconds, 1)
    return datetime.fromtimestamp(whole).strftime("%Y-%m-%d %H:%M:%S") + f",{round(frac * 1000):03d}"


HELD = "(it held the job back)"
LOG = [
    f"{at(-5.0)} INFO sluice.manager: aggregation plan 1: 5 trees, ...",
    f"{at(-4.9)} INFO sluice.scheduler: routing epoch 1: ROUTES sent to 16 aggregators",
    f"{at(1.1)} INFO sluice.manager: uplink of rack srv held the job back in period {PERIOD0 + 1} (1.5 Mbit/s)",
    f"{at(2.1)} INFO sluice.manager: uplink of rack r0 held the job back in period {PERIOD0 + 2} (1.2 Mbit/s; 2.5 "
    "Mbit/s acknowledged across it)",
    f"{at(3.2)} INFO sluice.manager: uplink of rack r0 measured at 1.4 Mbit/s in period {PERIOD0 + 3} {HELD}",
    f"{at(3.2)} INFO sluice.manager: re-planning: the spare bandwidth of uplink:r0 moved from 10.0 to 1.4 Mbit/s",
    f"{at(3.4)} INFO sluice.manager: aggregation plan 2: 1 trees, ...",
    f"{at(3.4)} INFO sluice.scheduler: routing epoch 2: ROUTES sent to 16 aggregators",
    f"{at(3.9)} INFO sluice.scheduler: routing epoch 2: ROUTES sent to 16 workers",
    f"{at(4.5)} INFO sluice.scheduler: routing epoch 2: COMMIT sent to 16 workers",
    "[worker 3] a line that is not a timed log line",
    f"{at(9.0)} INFO sluice.manager: uplink of rack srv measured at 2.2 Mbit/s in period {PERIOD0 + 9} {HELD}",
]


def lines() -> list[tuple[float, str]]:
    return [timed for text in LOG if (timed := parse_line(text)) is not None]


def test_timed_log_lines_parse_and_others_do_not() -> None:
    got = lines()
    assert len(got) == len(LOG) - 1
    assert got[0] == (pytest.approx(T0 - 5.0), "aggregation plan 1: 5 trees, ...")
    assert parse_line("INFO sluice.manager: aggregation plan 1") is None  # without SLUICE_LOG_TIME=1


def test_each_step_is_timed_from_the_cut() -> None:
    got = steps(lines(), T0, 1.0, "r0", 2, committed=[T0 + 4.6, T0 + 4.8], in_force=T0 + 5.0, moved=T0 + 4.7)
    want = {"evidence": 2.0, "seen": 2.1, "confirmed": 3.2, "planned": 3.4, "routes": 3.4, "routes_workers": 3.9,
            "commit": 4.5, "committed": 4.8, "moved": 4.7, "in_force": 5.0}
    assert list(got) == list(STEPS)
    assert got == {step: pytest.approx(t, abs=1e-3) for step, t in want.items()}


def test_a_switch_never_seen_leaves_its_steps_empty() -> None:
    got = steps(lines(), T0, 1.0, "r0", 3, committed=[], in_force=T0 + 9.0)
    assert got["routes"] is None and got["commit"] is None and got["committed"] is None
    assert got["planned"] == pytest.approx(3.4, abs=1e-3)  # the last plan before any ROUTES of epoch 3: none came


def test_evidence_after_the_cut_in_log_order() -> None:
    assert evidence(lines(), T0, 1.0) == [
        ("srv", PERIOD0 + 1, 1.5, "", None), ("r0", PERIOD0 + 2, 1.2, "", 2.5), ("r0", PERIOD0 + 3, 1.4, "held", None),
        ("srv", PERIOD0 + 9, 2.2, "held", None)]


CONFIGURED = {"r0": 10.0, "r1": 10.0, "srv": 100_000.0}


@pytest.mark.parametrize(("cut", "extra", "want"), [
    (T0, [], ["srv at 2.2 Mbit/s"]),  # another rack counted
    (None, [], ["srv at 2.2 Mbit/s"]),  # slow from the start: r0 counted is right
    (T0 + 5.0, [], ["r0 at 1.4 Mbit/s", "srv at 2.2 Mbit/s"]),  # r0 counted before it was cut
    # a bottleneck measured near its configured rate re-plans nothing: no alarm; 7.4 is more than 25% below 10
    (T0, [f"{at(9.5)} INFO m: uplink of rack r1 measured at 8.3 Mbit/s in period {PERIOD0 + 9} {HELD}",
          f"{at(9.6)} INFO m: uplink of rack r1 measured at 7.4 Mbit/s in period {PERIOD0 + 10} {HELD}"],
     ["srv at 2.2 Mbit/s", "r1 at 7.4 Mbit/s"]),
])
def test_false_alarms_are_other_racks_and_the_cut_rack_before_its_cut_at_rates_that_re_plan(
        cut: float | None, extra: list[str], want: list[str]) -> None:
    timed = lines() + [t for text in extra if (t := parse_line(text)) is not None]
    assert false_alarms(timed, CONFIGURED, 0.25, "r0", cut) == want


MENDED = "(mended: its traffic crossed 3 periods running without keeping a sender waiting; the plan assumed 2.5)"


def test_false_mends_are_the_cut_racks_mends_counted_before_it_was_set_back() -> None:
    extra = [f"{at(9.1)} INFO m: uplink of rack r0 measured at 10.0 Mbit/s in period {PERIOD0 + 9} {MENDED}",
             f"{at(9.1)} INFO m: uplink of rack r1 measured at 10.0 Mbit/s in period {PERIOD0 + 9} {MENDED}",
             f"{at(12.1)} INFO m: uplink of rack r0 measured at 2.4 Mbit/s in period {PERIOD0 + 12} {HELD}",
             f"{at(31.1)} INFO m: uplink of rack r0 measured at 10.0 Mbit/s in period {PERIOD0 + 31} {MENDED}"]
    timed = lines() + [t for text in extra if (t := parse_line(text)) is not None]
    assert false_mends(timed, "r0", T0, T0 + 25.0, 1.0) == [PERIOD0 + 9]
    assert false_mends(timed, "r0", T0, None, 1.0) == [PERIOD0 + 9, PERIOD0 + 31]
    assert false_mends(timed, "r0", T0 + 10.0, T0 + 25.0, 1.0) == []
    assert false_mends(lines(), "r0", T0, T0 + 25.0, 1.0) == []


def test_the_median_step_over_repeats_skips_the_ones_not_seen() -> None:
    runs = [dict.fromkeys(STEPS, 1.0), {**dict.fromkeys(STEPS, 3.0), "routes": None}, dict.fromkeys(STEPS, 2.0)]
    got = median_steps(runs)
    assert got["evidence"] == 2.0 and got["routes"] == 1.5
    assert median_steps([{**dict.fromkeys(STEPS, 1.0), "seen": None}])["seen"] is None


def test_switch_notes_name_each_kind_and_epoch_once_with_its_roles() -> None:
    routes = Message(Kind.ROUTES, meta={"routes": Routing(4, (Route(1.0, {"worker-0": "aggregator-0"}),)).encode()})
    commit = Message(Kind.COMMIT, meta={"epoch": 4, "rounds": []})
    ack = Message(Kind.HEARTBEAT_ACK)
    outs = [("aggregator-0", routes), ("aggregator-1", routes), ("worker-0", commit), ("worker-1", commit),
            ("worker-1", ack)]
    assert switch_notes(outs) == ["routing epoch 4: ROUTES sent to 2 aggregators",
                                  "routing epoch 4: COMMIT sent to 2 workers"]
    assert switch_notes([("worker-0", ack)]) == []


def test_a_router_times_each_epochs_routes_and_commit_and_names_the_epoch_of_a_round() -> None:
    router = Router("worker-0")
    router.declare([(7, 0, 100)])
    trees = (Route(1.0, {"worker-0": "aggregator-0"}),)
    assert router.epoch_of(7, 1) == 0  # nothing committed: straight to the servers
    for epoch in range(1, KEEP_TIMES + 3):
        router.begin(Routing(epoch, trees), {"aggregator-0"})
        router.commit(epoch, [(7, 10 * epoch)])
    assert sorted(router.committed_at) == list(range(3, KEEP_TIMES + 3))  # the latest KEEP_TIMES epochs
    assert sorted(router.routes_at) == sorted(router.committed_at)
    assert all(router.routes_at[e] <= router.committed_at[e] for e in router.committed_at)
    # a round takes the newest epoch whose switch round it reached (no keep_from: every epoch kept)
    last = KEEP_TIMES + 2
    assert router.epoch_of(7, 10 * last) == last and router.epoch_of(7, 10 * last - 1) == last - 1


def test_the_first_switch_after_a_time_is_the_first_routes_sent() -> None:
    assert first_switch(lines(), T0 - 10) == 1 and first_switch(lines(), T0) == 2
    assert first_switch(lines(), T0 + 5) is None


def test_switches_count_the_commits_before_a_time() -> None:
    assert switches(lines()) == 1  # epoch 1's COMMIT is not in the log above, epoch 2's is
    assert switches(lines(), before=T0 + 4.0) == 0


EASED = "(no sender waited long; the plan assumes 1.4)"
COUNTED = "(mended: its traffic crossed 3 periods running without keeping a sender waiting; the plan assumed 1.4)"
MENDED = [  # r0's uplink set back at T0 + 20 s
    f"{at(21.2)} INFO sluice.manager: uplink of rack r0 got through at 2.1 Mbit/s in period {PERIOD0 + 21} {EASED}",
    f"{at(22.2)} INFO sluice.manager: uplink of rack r0 measured at 10.0 Mbit/s in period {PERIOD0 + 22} {COUNTED}",
    f"{at(22.2)} INFO sluice.manager: re-planning: the spare bandwidth of uplink:r0 moved from 1.4 to 10.0 Mbit/s",
    f"{at(22.3)} INFO sluice.manager: aggregation plan 3: 5 trees, ...",
    f"{at(22.3)} INFO sluice.scheduler: routing epoch 3: ROUTES sent to 16 aggregators",
    f"{at(22.5)} INFO sluice.scheduler: routing epoch 3: ROUTES sent to 16 workers",
    f"{at(22.7)} INFO sluice.scheduler: routing epoch 3: COMMIT sent to 16 workers",
]


def test_a_mended_uplink_is_timed_from_when_it_was_set_back_and_is_no_false_alarm() -> None:
    timed = [t for text in LOG + MENDED if (t := parse_line(text)) is not None]
    mended = T0 + 20.0
    assert evidence(timed, mended, 1.0) == [("r0", PERIOD0 + 21, 2.1, "", None),
                                            ("r0", PERIOD0 + 22, 10.0, "eased", None)]
    assert first_switch(timed, mended) == 3
    got = steps(timed, mended, 1.0, "r0", 3, committed=[T0 + 22.8], in_force=T0 + 24.0)
    want = {"evidence": 1.0, "seen": 1.2, "confirmed": 2.2, "planned": 2.3, "routes": 2.3, "routes_workers": 2.5,
            "commit": 2.7, "committed": 2.8, "in_force": 4.0}
    assert got.pop("moved") is None  # no push of the round in flight moved
    assert got == {step: pytest.approx(t, abs=1e-3) for step, t in want.items()}
    assert false_alarms(timed, CONFIGURED, 0.25, "r0", T0) == ["srv at 2.2 Mbit/s"]  # as before: r0's rise is none


def test_a_mend_counted_from_sooner_acknowledgements_says_how_many_times_sooner() -> None:
    sooner = ("(mended: its flows were acknowledged 3.1 times sooner, against the other racks', than in its periods "
              "before, with no sender waiting long; the plan assumed 2.5; 2.4 Mbit/s acknowledged across it)")
    timed = [t for text in [f"{at(21.2)} INFO sluice.manager: uplink of rack r0 measured at 10.0 Mbit/s in period "
                            f"{PERIOD0 + 21} {sooner}"] if (t := parse_line(text)) is not None]
    assert evidence(timed, T0 + 20.0, 1.0) == [("r0", PERIOD0 + 21, 10.0, "sooner 3.1x", 2.4)]
    assert false_mends(timed, "r0", T0, T0 + 30.0, 1.0) == [PERIOD0 + 21]  # still cut until T0 + 30
