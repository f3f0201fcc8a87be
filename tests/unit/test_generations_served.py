"""A listing generation a mount still serves is not deleted under it (node/datasets.py
served_generations). A new listing deletes the generations before the current one; a
mount moves to a new generation only at its next look at the record (a quarter second,
longer on a busy host), so a refresh started right after another finished deleted the
rows the mount was still answering lookups from: an unchanged file was ENOENT for a
moment (seen: one open in ~10 of 200 k files failing across 12 back-to-back refreshes).
Mounts say in their reports which generation they serve; the daemon keeps it, and
every generation after it, until they have moved on. A real Daemon and router, called
as a mount would (tests/unit/test_routes_access.py)."""

from __future__ import annotations

from pathlib import Path

import trio

from silofs.node.daemon import Daemon
from silofs.node.datasets import KEPT_GENERATIONS, SERVED_GEN_SECONDS, served_generations
from silofs.node.state import GEN_SETTLE_SECONDS, MountState
from tests.unit.test_routes_access import ROOT, Call, _ready, run_routes


def _counters(**more: object) -> dict:
    return {"bytes_read": 0, "hit_bytes": 0, "miss_bytes": 0, "hits": 0, "misses": 0,
            "corrupt_chunks": 0, **more}  # fmt: skip


async def _refreshed(call: Call, uri: str, gen: int) -> dict:
    s, body = await call(ROOT, "POST", "/v1/datasets", {"uri": uri, "refresh": True})
    assert s == 200, body
    with trio.fail_after(10):
        while True:
            ds = (await call(ROOT, "GET", f"/v1/datasets/{body['id']}"))[1]
            if ds["state"] == "ready" and ds["generation"] == gen:
                return ds
            await trio.sleep(0.01)


def test_a_refresh_keeps_the_generation_a_mount_still_serves(tmp_path: Path, world: Path) -> None:
    (world / "data").mkdir()
    (world / "data" / "a").write_bytes(b"a")
    uri = str(world / "data")

    async def test(d: Daemon, call: Call) -> None:
        ds = await _ready(call, ROOT, uri)
        assert ds["generation"] == 1
        reg = {"dataset": ds["id"], "job": "j", "mountpoint": "/m"}
        s, m = await call(ROOT, "POST", "/v1/mounts", reg)
        assert s == 201, m
        stats = f"/v1/mounts/{m['id']}/stats"
        s, body = await call(ROOT, "PUT", stats, _counters(gen=1))
        assert s == 200, body
        await _refreshed(call, uri, 2)
        # The mount has not looked at the record yet: it serves generation 1. The next
        # refresh starts at once, and must leave generation 1 (and 2) in place.
        await _refreshed(call, uri, 3)
        for gen in (1, 2, 3):
            assert d.store.get_object(ds["id"], "a", gen) is not None, gen
        # Once it reports generation 3 (and no report said 1 for GEN_SETTLE_SECONDS),
        # the next listing deletes the older ones.
        d.mounts[m["id"]].gen_seen -= GEN_SETTLE_SECONDS + 0.1
        assert (await call(ROOT, "PUT", stats, _counters(gen=3)))[0] == 200
        assert d.mounts[m["id"]].gen == 3
        await _refreshed(call, uri, 4)
        assert d.store.get_object(ds["id"], "a", 1) is None
        assert d.store.get_object(ds["id"], "a", 2) is None
        assert d.store.get_object(ds["id"], "a", 3) is not None  # the previous: kept
        s, body = await call(ROOT, "PUT", stats, _counters(gen=-1))
        assert s == 400, body

    run_routes(tmp_path, test)


def test_served_generations_rule() -> None:
    def mount(dsid: int, gen: int | None, seen: float) -> MountState:
        m = MountState("m", "j", dsid, "/m", 1, 0, 1 << 20)
        m.gen, m.gen_seen = gen, seen  # as said_gen would leave them
        return m

    now = 1000.0
    mounts = {
        "a": mount(1, 3, now - 1),
        "b": mount(1, 5, now - 1),
        "c": mount(2, 1, now - 1),  # another dataset's
        "d": mount(1, None, now - 1),  # an older mount that says nothing
        "e": mount(1, 1, now - SERVED_GEN_SECONDS - 1),  # silent for too long
    }
    assert served_generations(mounts.values(), 1, 6, now) == {3, 4, 5, 6}
    assert served_generations([], 1, 6, now) == {6}
    assert served_generations(mounts.values(), 3, None, now) == set()
    # A report naming a generation newer than the current one (a daemon restarted on an
    # older env) keeps nothing extra.
    assert served_generations([mount(1, 9, now)], 1, 6, now) == {6}


def test_the_oldest_generation_a_mounts_processes_say_is_the_one_kept() -> None:
    """--serve-processes: each process reports under the mount's id, and each moves to
    a new generation at its own look at the record."""
    m = MountState("m", "j", 1, "/m", 1, 0, 1 << 20)
    m.said_gen(4, 100.0)
    m.said_gen(5, 100.3)  # one process moved; the other still says 4
    m.said_gen(4, 100.6)
    m.said_gen(5, 101.0)
    assert m.gen == 4
    m.said_gen(5, 100.6 + GEN_SETTLE_SECONDS + 0.1)  # no one has said 4 since
    assert m.gen == 5
    m.said_gen(3, 200.0)  # an older one is kept at once (a restarted process)
    assert m.gen == 3


def test_a_refresh_keeps_the_generation_of_a_handle_still_open(tmp_path: Path, world: Path) -> None:
    """--serve-processes: a handle another process opened is read, in a process that
    never saw it, from the generation it was opened in (mount/fs.py _adopt). A file
    changed by a refresh, its old version open: two refreshes later that generation was
    deleted under it, and a read served by another process was EIO. The mount says the
    generations its open handles need (`held`); they are kept, and only they."""
    (world / "data").mkdir()
    (world / "data" / "a").write_bytes(b"a")
    uri = str(world / "data")

    async def test(d: Daemon, call: Call) -> None:
        ds = await _ready(call, ROOT, uri)
        reg = {"dataset": ds["id"], "job": "j", "mountpoint": "/m"}
        s, m = await call(ROOT, "POST", "/v1/mounts", reg)
        assert s == 201, m
        stats = f"/v1/mounts/{m['id']}/stats"
        for gen in (2, 3, 4):
            await _refreshed(call, uri, gen)
            d.mounts[m["id"]].gen_seen -= GEN_SETTLE_SECONDS + 0.1
            s, body = await call(ROOT, "PUT", stats, _counters(gen=gen, held=[1]))
            assert s == 200, body
        await _refreshed(call, uri, 5)
        assert d.store.get_object(ds["id"], "a", 1) is not None  # the open handle's
        for gen in (2, 3):  # no one's: not kept (a handle open for days keeps its own)
            assert d.store.get_object(ds["id"], "a", gen) is None, gen
        s, body = await call(ROOT, "PUT", stats, _counters(gen=5, held=[]))  # closed
        assert s == 200, body
        await _refreshed(call, uri, 6)
        assert d.store.get_object(ds["id"], "a", 1) is None
        for bad in ([-1], "1", [1] * 1025, ["x"]):
            s, body = await call(ROOT, "PUT", stats, _counters(gen=6, held=bad))
            assert s == 400, (bad, body)

    run_routes(tmp_path, test)


def test_kept_generations_are_bounded_whatever_mounts_say() -> None:
    """A mount's report is its word: one that says a generation long gone (stuck, or
    hostile), or handles opened in many, kept every listing since, each a whole
    listing's rows, until the env was full. At most KEPT_GENERATIONS before the current
    one are kept (a real mount follows within a report period)."""
    now = 1000.0
    stuck = MountState("s", "j", 1, "/s", 1, 0, 1 << 20)
    stuck.gen, stuck.gen_seen = 0, now
    current = 10**6
    keep = served_generations([stuck], 1, current, now)
    assert keep == set(range(current - KEPT_GENERATIONS, current + 1))
    holding = MountState("h", "j", 1, "/h", 1, 0, 1 << 20)
    holding.gen, holding.gen_seen = current, now
    holding.held, holding.held_seen = frozenset({1, 2, current - 3}), now
    assert served_generations([holding], 1, current, now) == {current - 3, current}
    holding.held_seen = now - SERVED_GEN_SECONDS - 1  # silent for too long
    assert served_generations([holding], 1, current, now) == {current}
