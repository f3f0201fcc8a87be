"""Membership (node/membership.py): who is live, a failing member's backoff (doubling to
a minute, back up on its first good probe), which members are due a probe, a new list
in force at runtime, and which certificate names count as a member's."""

from __future__ import annotations

import pytest

from silofs.config import ClusterSettings, MemberSpec
from silofs.node.membership import MAX_BACKOFF, PING_SECONDS, Membership, members_digest


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def config(*hosts: str, version: int = 1, backoff: float = 1.0) -> ClusterSettings:
    return ClusterSettings(
        name="c",
        members=tuple(MemberSpec(f"tls://{h}:7470") for h in hosts),
        version=version,
        peer_backoff_seconds=backoff,
    )


SELF = "tls://a:7470"


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_a_failed_member_is_down_for_a_doubling_backoff_and_up_on_a_good_probe(
    clock: Clock,
) -> None:
    ms = Membership(config("a", "b", "c"), SELF, clock=clock)
    b = ms.members["tls://b:7470"]
    waits = []
    for _ in range(9):
        ms.mark_down(b.address, "refused", probe=True)  # its probe failed again
        waits.append(b.down_until - clock.now)
        assert not b.up and b.address not in [c.address for c in ms.live()]
        assert b not in ms.due()  # not before its backoff ends
        clock.now = b.down_until
        assert b in ms.due()  # then it is probed
    assert waits[:4] == [1.0, 2.0, 4.0, 8.0]
    assert max(waits) == MAX_BACKOFF
    ms.mark_up(b.address)
    assert b.up and b.failures == 0 and b.address in [c.address for c in ms.live()]
    ms.mark_down(b.address, "timeout")
    assert b.down_until - clock.now == 1.0  # the backoff starts over


def test_asks_failing_together_are_one_failure(clock: Clock) -> None:
    ms = Membership(config("a", "b"), SELF, clock=clock)
    b = ms.members["tls://b:7470"]
    for _ in range(8):  # eight reads under way when it died
        ms.mark_down(b.address, "refused")
    assert b.failures == 1 and b.down_until - clock.now == 1.0


def test_self_is_always_live_and_homes_avoid_down_members(clock: Clock) -> None:
    ms = Membership(config("a", "b", "c"), SELF, clock=clock)
    ms.mark_down(SELF, "cannot happen")
    assert ms.members[SELF].up
    keys = [bytes([i, j]) * 8 for i in range(40) for j in range(40)]
    homes = {k: ms.home(k).address for k in keys}
    ms.mark_down("tls://b:7470", "timeout")
    for k in keys:
        now = ms.home(k).address
        assert now != "tls://b:7470"
        if homes[k] != "tls://b:7470":
            assert now == homes[k]  # only b's keys moved


def test_up_members_are_pinged_every_few_seconds(clock: Clock) -> None:
    ms = Membership(config("a", "b"), SELF, clock=clock)
    b = ms.members["tls://b:7470"]
    assert ms.due() == [b]  # never heard from
    ms.mark_up(b.address)
    assert ms.due() == []
    clock.now += PING_SECONDS
    assert ms.due() == [b]
    b.probing = True
    assert ms.due() == []


def test_a_new_list_keeps_the_state_of_members_in_both(clock: Clock) -> None:
    ms = Membership(config("a", "b", "c"), SELF, clock=clock)
    ms.mark_down("tls://b:7470", "refused")
    ms.members["tls://c:7470"].counters.requests_out = 7
    ms.replace(config("a", "b", "d", version=2))
    assert set(ms.members) == {SELF, "tls://b:7470", "tls://d:7470"}
    assert not ms.members["tls://b:7470"].up
    assert ms.version == 2
    with pytest.raises(ValueError, match="not one of the members"):
        ms.replace(config("b", "d", version=3))


def test_parts_are_of_configured_weights_not_live_ones(clock: Clock) -> None:
    c = ClusterSettings(
        "c", (MemberSpec(SELF, 2.0), MemberSpec("tls://b:7470"), MemberSpec("tls://c:7470"))
    )
    ms = Membership(c, SELF, clock=clock)
    ms.mark_down("tls://b:7470", "refused")
    assert ms.self_weight() / ms.total_weight() == 0.5


def test_member_certificates_are_recognised_by_their_host_names(clock: Clock) -> None:
    ms = Membership(config("a", "gpu02.example", "10.0.0.3", "[fd00::4]"), SELF, clock=clock)
    assert ms.names_a_member(["GPU02.example"])
    assert ms.names_a_member(["10.0.0.3"])
    assert ms.names_a_member(["FD00:0:0:0:0:0:0:4\n"])  # as getpeercert writes IPv6
    assert not ms.names_a_member(["a"])  # this node's own name is no peer
    assert not ms.names_a_member(["10.0.0.33", "gpu02"])


def test_a_ping_answered_from_before_a_failure_does_not_bring_a_member_back_up(
    clock: Clock,
) -> None:
    """A ping sent, then the member killed: an ask fails and marks it down, and only then
    does the loop read the ping's answer (given before the kill). The member stays down
    (it once came back up, a dead member taken for live, and the stand-in sweep this
    started deleted the only copies of its chunks); a ping sent after the failure
    brings it up."""
    ms = Membership(config("a", "b"), SELF, clock=clock)
    b = ms.members["tls://b:7470"]
    assert ms.mark_up(b.address)
    came_up = ms.came_up
    sent = clock.now + 5.0  # its next ping
    clock.now = sent + 0.1
    ms.mark_down(b.address, "refused")  # an ask, after the ping was sent
    clock.now += 0.1
    assert not ms.mark_up(b.address, asked_at=sent)  # the ping's answer, read late
    assert not b.up and ms.came_up == came_up and b.address not in ms.answering()
    clock.now = b.down_until
    assert ms.mark_up(b.address, asked_at=clock.now)
    assert b.up and ms.came_up == came_up + 1


def test_answering_since_counts_only_pings_sent_since(clock: Clock) -> None:
    ms = Membership(config("a", "b", "c"), SELF, clock=clock)
    b, c = ms.members["tls://b:7470"], ms.members["tls://c:7470"]
    assert ms.answering() == frozenset()  # presumed up, never heard from
    ms.mark_up(b.address)
    clock.now += 1.0
    since = clock.now
    ms.mark_up(c.address, asked_at=since)
    assert ms.answering() == {b.address, c.address}
    assert ms.answering(since) == {c.address}


def test_a_member_down_that_calls_is_due_a_probe_at_once(clock: Clock) -> None:
    ms = Membership(config("a", "gpu02.example", "10.0.0.3"), SELF, clock=clock)
    b, c = ms.members["tls://gpu02.example:7470"], ms.members["tls://10.0.0.3:7470"]
    assert not ms.down_hosts and not ms.down_of(["gpu02.example"])  # all up: nothing
    for _ in range(6):  # refused while it was starting: a backoff of 32 s
        ms.mark_down(b.address, "refused", probe=True)
    assert b not in ms.due()
    assert ms.down_of(["GPU02.example", "10.0.0.3"]) == {"gpu02.example"}
    assert ms.contact_due(ms.down_of(["GPU02.example"])) == [b]  # it calls: probe it now
    assert ms.contact_due(ms.down_of(["10.0.0.3"])) == []  # another member's call
    b.probing = True
    assert ms.contact_due(frozenset({"gpu02.example"})) == []  # one probe at a time
    b.probing = False
    ms.mark_down(c.address, "refused")
    assert ms.down_hosts == {"gpu02.example", "10.0.0.3"}
    ms.mark_up(b.address)
    ms.mark_up(c.address)
    assert not ms.down_hosts and ms.contact_due(frozenset({"gpu02.example"})) == []


def test_the_members_digest_is_what_placement_follows() -> None:
    a, b = MemberSpec("tls://a:7470"), MemberSpec("tls://b:7470", 2.0)
    base = ClusterSettings("c", (a, b), version=1)
    # Not the order, the version nor a peer setting: every chunk is placed alike.
    same = ClusterSettings("c", (b, a), version=99, peer_timeout_seconds=5.0)
    assert members_digest(base) == members_digest(same)
    for other in (
        ClusterSettings("c", (a, MemberSpec("tls://b:7470", 3.0))),  # a weight
        ClusterSettings("c", (a,)),  # a member fewer
        ClusterSettings("d", (a, b)),  # the name
    ):
        assert members_digest(other) != members_digest(base), other
