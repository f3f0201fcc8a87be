"""A clustered warm (node/warm.py) fills each member's part of the share with its own
chunks whatever state the members were in: a real Daemon in this process (its store,
Fetcher and Writer; a local directory as the dataset) is one of three members, and
the other two are in-process homes that answer its warm asks as a home does (held,
admitted while their part has room, full). No prober runs: the members are up or
down exactly as each test says.

- A member still down when the warm starts (its startup backoff: issue 22's short
  part) gets its chunks once it answers, and the others never hold them for it.
- A member down all along: its chunks go to the member standing in for it, in the
  last round only, and the warm ends.
- Chunks this node holds that are placed at another member (admitted here while that
  member was down) are asked of it, not counted as held.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from silofs.cache.format import ChunkRef
from silofs.config import ClusterSettings, MemberSpec
from silofs.node import warm
from silofs.node.daemon import Daemon
from silofs.node.state import DatasetState
from silofs.node.warm import WarmState, run_warm
from tests.unit.inprocess import MEMBER_ME, member_daemon, ready, running

CHUNK = 64 << 10
ME, B, C = MEMBER_ME, "tls://127.0.0.1:2", "tls://127.0.0.1:3"


@pytest.fixture(autouse=True)
def _no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warm, "WARM_RETRY_PAUSE", 0.0)


@pytest.fixture
def bucket(tmp_path: Path) -> Path:
    root = tmp_path / "bucket"
    root.mkdir()
    for i in range(12):
        (root / f"f{i}.bin").write_bytes(os.urandom(5 * CHUNK + 1000 * i + 1))
    return root


@pytest.fixture
def daemon(tmp_path: Path, pki: Path) -> Iterator[Daemon]:
    cluster = ClusterSettings(
        name="c",
        address=ME,
        members=tuple(MemberSpec(a) for a in (ME, B, C)),
        peer_timeout_seconds=0.5,
        peer_backoff_seconds=30.0,
    )
    with member_daemon(tmp_path, pki, cluster, CHUNK) as d:
        yield d


class Homes:
    """The two other members' side of warm asks: each holds what it admitted, up to its
    part, as node/peer_serve.py answers (held, admitted, full); asks of a member that is
    down fail, as a refused connection does."""

    def __init__(self, d: Daemon, part: int) -> None:
        self.d = d
        self.part = part
        self.held: dict[str, dict[bytes, int]] = {B: {}, C: {}}
        self.asked: list[tuple[str, bytes]] = []

    async def warm_ask(self, member: Any, ds: Any, limiter: Any, job: str, ref: ChunkRef) -> str:
        self.asked.append((member.address, ref.key))
        await trio.sleep(0)
        if not member.up:
            return "failed"
        held = self.held[member.address]
        if ref.key in held:
            return "held"
        if sum(held.values()) + ref.length > self.part:
            return "full"
        held[ref.key] = ref.length
        return "admitted"


def _refs(d: Daemon, ds: DatasetState) -> list[ChunkRef]:
    return [
        ChunkRef.of(o, CHUNK, i)
        for o in d.store.iter_listing(ds.id)
        for i in range(max(1, -(-o.size // CHUNK)))
    ]


def _warm(d: Daemon, bucket: Path, homes_part: int, setup: Any, *, share: int) -> tuple:
    """Open the bucket, run `setup(d, ds, homes)`, set the share, warm; (ds, homes, the
    warm's state, the bytes this node's dataset holds after)."""
    membership = d.cluster.membership
    assert membership is not None

    async def main() -> tuple:
        async with running(d):
            ds = await ready(d, f"file://{bucket}/")
            homes = Homes(d, homes_part)
            d.cluster.warm_ask = homes.warm_ask  # type: ignore[method-assign]
            await setup(d, ds, homes)
            await d.cluster.set_share(ds.uri.canonical, share)
            w = WarmState(job="prep", paths=[], chunk_size=CHUNK, uid=0)
            with trio.fail_after(60):
                await run_warm(d, ds, w)
            await d.writer.flush()
            return ds, homes, w, d.usage[ds.id].bytes if ds.id in d.usage else 0

    return trio.run(main)


def _pings(d: Daemon, *, answered: bool) -> list[set[str]]:
    """recheck() records the members it pings; `answered`: each is up again (it was
    only in its backoff), else it stays down."""
    membership = d.cluster.membership
    assert membership is not None
    pinged: list[set[str]] = []

    async def recheck(addresses: set[str]) -> None:
        pinged.append(addresses)
        for a in addresses if answered else ():
            membership.mark_up(a)

    d.cluster.recheck = recheck  # type: ignore[method-assign]
    return pinged


async def _c_down(d: Daemon, ds: DatasetState, homes: Homes) -> None:
    """C found down and not pinged again since: the state n0 was in after its members
    started (each one's backoff doubling until it listened)."""
    assert d.cluster.membership is not None
    d.cluster.membership.mark_down(C, "refused", probe=True)


def test_a_member_down_when_the_warm_starts_is_filled_once_it_answers(
    daemon: Daemon, bucket: Path
) -> None:
    d = daemon
    membership = d.cluster.membership
    assert membership is not None
    pinged = _pings(d, answered=True)
    share = sum(p.stat().st_size for p in bucket.iterdir()) // 2
    part = share // 3
    ds, homes, w, here = _warm(d, bucket, part, _c_down, share=share)
    assert w.state == "done" and w.failed_chunks == 0 and pinged == [{C}]
    refs = _refs(d, ds)
    placed = {ref.key: membership.placed(ref.key).address for ref in refs}
    # Every member within one chunk of its part, the one that was down too; or holding
    # every chunk placed at it, where those come to less: placement follows the content
    # ids (inode and mtime here, new each run), and a member of three is placed less
    # than its part less a chunk in ~0.1% of runs (a share of half the dataset).
    want = {a: min(part, sum(r.length for r in refs if placed[r.key] == a)) for a in (ME, B, C)}
    assert want[ME] - CHUNK < here <= part, (here, want[ME], part)
    for a in (B, C):
        got = sum(homes.held[a].values())
        assert want[a] - CHUNK < got <= part, (a, got, want[a], part)
        # Only its own chunks: none of another's, none stood in for.
        assert all(placed[k] == a for k in homes.held[a]), a
    # Nothing placed at C was asked of B meanwhile, nor held here.
    assert not [k for a, k in homes.asked if a == B and placed[k] == C]
    with d.store.read_txn() as txn:
        mine = [k for k, a in placed.items() if d.store.owns(txn, ds.id, k)]
    assert all(placed[k] == ME for k in mine)


def test_a_member_down_all_along_has_its_chunks_asked_of_its_stand_in_last(
    daemon: Daemon, bucket: Path
) -> None:
    d = daemon
    pinged = _pings(d, answered=False)
    size = sum(p.stat().st_size for p in bucket.iterdir())
    # A share bigger than the dataset: every member's part holds every chunk it gets.
    ds, homes, w, here = _warm(d, bucket, 3 * size, _c_down, share=9 * size)
    assert w.state == "done" and w.failed_chunks == 0
    assert pinged == [{C}] * warm.WARM_RETRIES
    assert not [a for a, _ in homes.asked if a == C]  # never asked: it is down
    refs = _refs(d, ds)
    # Every chunk is somewhere: C's at the member that is home while C is down.
    with d.store.read_txn() as txn:
        here_keys = {r.key for r in refs if d.store.owns(txn, ds.id, r.key)}
    assert here_keys | set(homes.held[B]) == {r.key for r in refs}
    assert here == sum(r.length for r in refs if r.key in here_keys)


def test_chunks_held_here_but_placed_at_another_member_are_asked_of_it(
    daemon: Daemon, bucket: Path
) -> None:
    d = daemon
    membership = d.cluster.membership
    assert membership is not None
    size = sum(p.stat().st_size for p in bucket.iterdir())
    foreign: list[bytes] = []

    async def setup(d: Daemon, ds: DatasetState, homes: Homes) -> None:
        # Read here while B was down (this node was their home then): admitted here.
        limiter = d.job("j").limiter
        for ref in _refs(d, ds):
            if membership.placed(ref.key).address == B:
                await d.fetcher.fetch(ds.id, ds.backend, limiter, ref)
                foreign.append(ref.key)
        await d.writer.flush()
        with d.store.read_txn() as txn:
            assert all(d.store.owns(txn, ds.id, k) for k in foreign)

    ds, homes, w, _ = _warm(d, bucket, 3 * size, setup, share=9 * size)
    assert foreign and w.state == "done" and w.failed_chunks == 0
    placed_at_b = {r.key for r in _refs(d, ds) if membership.placed(r.key).address == B}
    assert set(homes.held[B]) == placed_at_b  # all of B's, those held here among them


def test_a_down_members_chunk_held_here_is_not_fetched_again_for_its_stand_in(
    daemon: Daemon, bucket: Path
) -> None:
    """C down all along: its chunks go to the member standing in for it in the last
    round; one of them this node holds already (read here while C was down) is not
    fetched from the store again when this node is that member."""
    d = daemon
    membership = d.cluster.membership
    assert membership is not None
    _pings(d, answered=False)
    # Placement follows content ids (inode and mtime, new each run): a chunk is C's with
    # this node its stand-in for 1 in 6, so none of the fixture's 72 chunks was in
    # (5/6)**72 = 1.9e-6 of runs ('assert held'); 108 chunks make it 2.8e-9.
    for i in range(12, 18):
        (bucket / f"f{i}.bin").write_bytes(os.urandom(5 * CHUNK + 1000 * i + 1))
    size = sum(p.stat().st_size for p in bucket.iterdir())
    gets: list[tuple[str, int]] = []
    held: list[ChunkRef] = []

    async def setup(d: Daemon, ds: DatasetState, homes: Homes) -> None:
        await _c_down(d, ds, homes)
        for ref in _refs(d, ds):
            if membership.placed(ref.key).address == C and membership.home(ref.key).is_self:
                await d.fetcher.fetch(ds.id, ds.backend, d.job("j").limiter, ref)
                held.append(ref)
        await d.writer.flush()
        real = ds.backend.get_range

        def get_range(obj: Any, start: int, length: int) -> bytes:
            gets.append((obj.key, start))
            return real(obj, start, length)

        ds.backend.get_range = get_range  # type: ignore[method-assign]

    _, _, w, _ = _warm(d, bucket, 3 * size, setup, share=9 * size)
    assert held and w.state == "done"
    assert not {(r.obj.key, r.start) for r in held} & set(gets)
