"""Refused messages: each kind of reason logged once per interval, the rest counted, strangers banned."""

from __future__ import annotations

import logging

import pytest

from sluice.transport.rejects import MAX_KINDS_PER_INTERVAL, Rejections, reason_kind


def test_names_numbers_and_hex_tags_are_blanked_so_one_kind_covers_every_peer() -> None:
    assert reason_kind("sender 999 on connection 'w-3' is not a worker") == "sender # on connection # is not a worker"
    assert reason_kind("segment sluice-1-2-deadbeef") == reason_kind("segment sluice-7-9-0badf00d")
    assert len(reason_kind("x" * 500)) == 160


def test_each_kind_is_logged_once_per_interval_and_a_summary_counts_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    rejects = Rejections(logging.getLogger("test.rejects"), interval=10.0)
    with caplog.at_level(logging.WARNING, "test.rejects"):
        for n in range(5):
            rejects.refuse("w-1", f"unknown key {n}", now=1.0)
        rejects.refuse("w-2", "bad dtype", now=2.0)
        rejects.tick(11.5)  # the interval is over: its summary, and every kind may be logged again
        rejects.refuse("w-1", "unknown key 77", now=12.0)
    assert [r.getMessage() for r in caplog.records] == [
        "unknown key 0", "bad dtype",
        "4 more messages refused in the last 10 s (most from 'w-1': 4; 0 from banned peers in all)",
        "unknown key 77"]
    assert rejects.total == 7


def test_past_the_cap_kinds_are_counted_not_logged_and_the_cap_exceeds_the_hostile_suites_kinds(
        caplog: pytest.LogCaptureFixture) -> None:
    assert MAX_KINDS_PER_INTERVAL >= 2 * 40  # headroom over the 40 kinds one server refuses in test_hostile.py
    rejects = Rejections(logging.getLogger("test.rejects"))
    words = [f"reason{chr(97 + n // 26)}{chr(97 + n % 26)}" for n in range(MAX_KINDS_PER_INTERVAL + 3)]
    with caplog.at_level(logging.WARNING, "test.rejects"):
        for word in words:
            rejects.refuse("w-1", word, now=0.0)
    assert [r.getMessage() for r in caplog.records] == words[:MAX_KINDS_PER_INTERVAL]
    assert rejects.total == len(words)


def test_a_stranger_sending_only_garbage_is_banned_and_a_member_never(caplog: pytest.LogCaptureFixture) -> None:
    rejects = Rejections(logging.getLogger("test.rejects"), ban_after=3)
    rejects.accept("member")
    got = [rejects.refuse("stranger", "garbage", now=0.0, member=False) for _ in range(4)]
    got_member = [rejects.refuse("member", "garbage", now=0.0) for _ in range(10)]
    assert got == [False, False, True, False]  # banned on the third, once
    assert not any(got_member)
    assert rejects.banned("stranger") and not rejects.banned("member")
