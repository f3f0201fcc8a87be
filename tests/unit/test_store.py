"""The LMDB chunk store (silofs/cache/store.py) on a real env in a temp dir.

Owns the store's invariants: uniform admission under a quota (promise 1), present and
replace semantics, accounting that always equals content (usage rows == owners rows ==
chunks, checked by walking the env after every operation), random eviction, listings,
persistence across a reopen (promise 4) and a full map. The quota here is a plain
function; the policy that computes it is tested in test_admission.py.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import lmdb
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from silofs.cache.format import chunk_key, decode_header, encode_chunk, verify_chunk
from silofs.cache.store import DSID, CacheStore, Usage
from silofs.node.store_write import AdmitResult, PendingChunk, WritableStore, env_map_size
from silofs.records import ObjectInfo

MAP = 64 << 20
Quota = Callable[[int, Mapping[int, Usage]], int]


def unlimited(_dsid: int, _usage: Mapping[int, Usage]) -> int:
    return 1 << 62


def fixed(quotas: dict[int, int]) -> Quota:
    return lambda dsid, _usage: quotas.get(dsid, 0)


def chunk(
    dsid: int,
    i: int,
    size: int = 100,
    *,
    cid: str | None = None,
    replace: bool = False,
    fill: int | None = None,
) -> PendingChunk:
    """A chunk of `size` data bytes; `cid` defaults to one object per dataset."""
    cid = cid if cid is not None else f"obj-{dsid}"
    data = bytes([(i if fill is None else fill) % 256]) * size
    value = encode_chunk(dsid, i, 1 << 20, f"key-{i}", cid, data)
    return PendingChunk(dsid, chunk_key(cid, 1 << 20, i), value, size, replace)


# -- the invariant walker ---------------------------------------------------------------
@dataclass
class EnvState:
    chunks: dict[bytes, bytes]  # key -> value
    owners: dict[bytes, tuple[int, int]]  # chunk key -> (dataset, length)
    usage: dict[int, Usage]  # from the usage rows


def walk(store: CacheStore) -> EnvState:
    with store.env.begin() as txn:
        chunks = {bytes(k): bytes(v) for k, v in txn.cursor(db=store.db(b"chunks"))}
        owner_rows = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=store.db(b"owners"))]
        usage_rows = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=store.db(b"usage"))]
    owners: dict[bytes, tuple[int, int]] = {}
    for k, v in owner_rows:
        assert len(k) == 8 + 16, "owners row key is dataset id + chunk key"
        dsid = struct.unpack(">Q", k[:8])[0]
        key = k[8:]
        assert key not in owners, f"chunk {key.hex()} has two owners"
        owners[key] = (dsid, struct.unpack("<I", v)[0])
    usage = {struct.unpack(">Q", k)[0]: Usage(*struct.unpack("<QQ", v)) for k, v in usage_rows}
    return EnvState(chunks, owners, usage)


def check(store: CacheStore, usage: Mapping[int, Usage] | None = None) -> EnvState:
    """Walk the env and assert the accounting invariants; compare with `usage` if given."""
    s = walk(store)
    assert set(s.owners) == set(s.chunks), "every chunk has exactly one owner row and back"
    for key, value in s.chunks.items():
        h = decode_header(value)
        dsid, length = s.owners[key]
        assert h.length == length, "owners row length is the chunk's data length"
        assert h.dataset == dsid, "the owner is the dataset that admitted the chunk"
        verify_chunk(value, h.content_id, h.chunk_size, h.index, h.length)
    expected: dict[int, Usage] = {}
    for dsid, length in s.owners.values():
        u = expected.setdefault(dsid, Usage())
        u.bytes += length
        u.chunks += 1
    nonzero_rows = {d: u for d, u in s.usage.items() if u != Usage()}
    assert nonzero_rows == expected, "usage rows == sum of owners rows and chunk counts"
    if usage is not None:
        nonzero = {d: u for d, u in usage.items() if u != Usage()}
        assert nonzero == expected, "the in-memory usage is the committed usage"
    return s


def owned(store: CacheStore, dsid: int) -> set[bytes]:
    return {k for k, (d, _) in walk(store).owners.items() if d == dsid}


# -- admission ----------------------------------------------------------------------------
def test_every_page_of_the_reader_table_has_a_block(store: WritableStore) -> None:
    """lock.mdb is written through a shared map: a page of it without a block of the
    disk, touched while the disk is full (the 64th read txn open at once), is SIGBUS.
    LMDB makes it sparse (4 KiB of its 64 KiB for 1,024 readers); the daemon allocates
    it all at start."""
    st = os.stat(os.path.join(store.path, "lock.mdb"))
    assert st.st_size > 4096 and st.st_blocks * 512 >= st.st_size, (st.st_size, st.st_blocks)


def test_admission_never_exceeds_the_quota(store: WritableStore) -> None:
    usage: dict[int, Usage] = {}
    res = store.admit([chunk(1, i) for i in range(25)], usage, fixed({1: 1000}))
    assert (res.admitted, res.admitted_bytes, res.rejected, res.full) == (10, 1000, 15, False)
    assert usage[1] == Usage(1000, 10)
    check(store, usage)
    # A chunk that would take the dataset over is rejected even when smaller ones fit.
    res = store.admit([chunk(1, 100, size=1)], usage, fixed({1: 1000}))
    assert res.rejected == 1 and res.admitted == 0


def test_a_full_dataset_admits_nothing_and_evicts_nothing(store: WritableStore) -> None:
    usage: dict[int, Usage] = {}
    store.admit([chunk(1, i) for i in range(10)], usage, fixed({1: 1000}))
    before = walk(store)
    for batch in range(5):
        res = store.admit(
            [chunk(1, 100 + batch * 10 + j) for j in range(10)], usage, fixed({1: 1000})
        )
        assert res == AdmitResult(rejected=10)
    after = check(store, usage)
    assert after.chunks == before.chunks
    assert usage[1] == Usage(1000, 10)


def test_quota_sees_the_batch_so_far(store: WritableStore) -> None:
    # Within one batch the quota function is asked with usage including earlier items.
    seen: list[int] = []

    def quota(dsid: int, usage: Mapping[int, Usage]) -> int:
        seen.append(usage.get(dsid, Usage()).bytes)
        return 350

    usage: dict[int, Usage] = {}
    res = store.admit([chunk(1, i) for i in range(5)], usage, quota)
    assert res.admitted == 3
    assert seen == [0, 100, 200, 300, 300]
    check(store, usage)


def test_quota_zero_admits_nothing(store: WritableStore) -> None:
    usage: dict[int, Usage] = {}
    res = store.admit([chunk(1, i) for i in range(3)], usage, fixed({}))
    assert res.rejected == 3 and res.admitted == 0
    check(store, usage)
    assert walk(store).chunks == {}


def test_present_chunks_are_not_charged_twice(store: WritableStore) -> None:
    usage: dict[int, Usage] = {}
    store.admit([chunk(1, 0)], usage, unlimited)
    res = store.admit([chunk(1, 0), chunk(1, 0)], usage, unlimited)
    assert (res.present, res.admitted) == (2, 0)
    # Another dataset with the same content shares the chunk; the first owner pays.
    res = store.admit([chunk(2, 0, cid="obj-1")], usage, unlimited)
    assert (res.present, res.admitted) == (1, 0)
    s = check(store, usage)
    assert len(s.chunks) == 1 and usage[1] == Usage(100, 1) and usage.get(2, Usage()) == Usage()
    # Duplicates inside one batch: the first is admitted, the second is present.
    res = store.admit([chunk(3, 5), chunk(3, 5)], usage, unlimited)
    assert (res.admitted, res.present) == (1, 1)
    check(store, usage)


def test_a_chunk_put_earlier_in_the_batch_is_present_not_damaged(store: WritableStore) -> None:
    # A value with overflow pages put earlier in the same write txn lies in the txn's
    # own pages (heap), not in data.mdb: the bounds check must not take it for damage.
    usage: dict[int, Usage] = {}
    big = 110_000
    res = store.admit([chunk(5, 1, size=big), chunk(6, 1, size=big, cid="obj-5")], usage, unlimited)
    assert (res.admitted, res.present, res.damaged) == (1, 1, 0)
    # ... and it can be replaced in the same batch (its first page header is checked).
    items = [chunk(5, 2, size=big), chunk(5, 2, size=big, replace=True, fill=9)]
    res = store.admit(items, usage, unlimited)
    assert (res.admitted, res.present, res.damaged) == (2, 0, 0)
    s = check(store, usage)
    assert s.chunks[items[1].key] == items[1].value and usage[5] == Usage(2 * big, 2)


def test_replace_overwrites_and_moves_the_charge(store: WritableStore) -> None:
    usage: dict[int, Usage] = {}
    store.admit([chunk(1, 0, cid="shared", fill=1)], usage, unlimited)
    # A reader of dataset 2 found the value bad and refetched it: replace.
    res = store.admit([chunk(2, 0, size=150, cid="shared", replace=True, fill=2)], usage, unlimited)
    assert (res.admitted, res.present) == (1, 0)
    s = check(store, usage)
    (value,) = s.chunks.values()
    assert decode_header(value).dataset == 2 and value.endswith(b"\x02" * 150)
    assert usage.get(1, Usage()) == Usage() and usage[2] == Usage(150, 1)


def test_replace_of_an_absent_chunk_is_an_admission(store: WritableStore) -> None:
    usage: dict[int, Usage] = {}
    res = store.admit([chunk(1, 0, replace=True)], usage, unlimited)
    assert res.admitted == 1
    check(store, usage)


def test_replace_in_a_full_dataset_frees_its_own_bad_chunk_first(store: WritableStore) -> None:
    usage: dict[int, Usage] = {}
    store.admit([chunk(1, i) for i in range(10)], usage, fixed({1: 1000}))
    res = store.admit([chunk(1, 3, replace=True, fill=99)], usage, fixed({1: 1000}))
    assert res.admitted == 1
    s = check(store, usage)
    assert usage[1] == Usage(1000, 10)
    assert s.chunks[chunk(1, 3).key].endswith(bytes([99]) * 100)


def test_replace_over_quota_drops_the_bad_chunk(store: WritableStore) -> None:
    # Dataset 2 is full; its refetch of dataset 1's bad chunk is not admitted, but the
    # bad value must not stay either (it would fail verification forever).
    usage: dict[int, Usage] = {}
    store.admit([chunk(1, 0, cid="shared")], usage, unlimited)
    store.admit([chunk(2, i) for i in range(3)], usage, fixed({2: 300}))
    res = store.admit([chunk(2, 0, cid="shared", replace=True)], usage, fixed({1: 999, 2: 300}))
    assert res.rejected == 1
    s = check(store, usage)
    assert chunk(1, 0, cid="shared").key not in s.chunks
    assert usage.get(1, Usage()) == Usage()


# -- stand-in copies (node/standins.py) --------------------------------------------------
def test_the_sweep_drops_only_copies_whose_home_is_live_and_never_this_nodes_own(
    store: WritableStore,
) -> None:
    """Chunks admitted standing in for a member (elsewhere) are first eviction victims;
    the sweep deletes those whose home answers again, across batches, uncharged, and
    leaves copies of a member still down, the node's own chunks, and a copy placed at
    this node now (the member list changed since it was admitted)."""
    usage: dict[int, Usage] = {}
    homes = {chunk(d, i).key: ("b" if i % 3 == 0 else "c" if i % 3 == 1 else "here")
             for d in (1, 2) for i in range(1500)}  # fmt: skip
    store.elsewhere = lambda key: homes[key] != "here"
    for d in (1, 2):
        fill(store, usage, d, 1500)
    store.elsewhere = None
    moved = chunk(1, 3).key  # admitted for b; placed here now
    homes[moved] = "here"
    live = {"b"}
    after: bytes | None = b""
    freed = removed = batches = 0
    while after is not None:
        f, n, after = store.sweep_elsewhere(lambda k: homes[k] in live, after, usage)
        freed, removed, batches = freed + f, removed + n, batches + 1
    assert batches > 1  # 2,000 victim rows: more than one txn
    b_chunks = sum(1 for h in homes.values() if h == "b")
    assert removed == b_chunks and freed == 100 * b_chunks
    state = check(store, usage)
    assert not any(homes[k] == "b" for k in state.owners)
    assert {k for k in state.owners} == {k for k, h in homes.items() if h != "b"}
    assert moved in state.owners
    assert usage[1].chunks + usage[2].chunks == 3000 - b_chunks


# -- eviction -------------------------------------------------------------------------
def fill(store: WritableStore, usage: dict[int, Usage], dsid: int, n: int, size: int = 100) -> None:
    for start in range(0, n, 500):
        items = [chunk(dsid, i, size) for i in range(start, min(n, start + 500))]
        res = store.admit(items, usage, unlimited)
        assert res.admitted == len(items)


def test_evict_random_reaches_the_target_and_touches_only_its_dataset(store: WritableStore) -> None:
    usage: dict[int, Usage] = {}
    fill(store, usage, 1, 300)
    fill(store, usage, 2, 200)
    others = owned(store, 2)
    freed = store.evict_random(1, 12_345, usage)
    check(store, usage)
    assert usage[1].bytes <= 12_345
    assert usage[1].bytes > 12_345 - 100, "evicts no more than needed"
    assert freed == 30_000 - usage[1].bytes
    assert owned(store, 2) == others
    assert usage[2] == Usage(20_000, 200)
    # Already under the target: nothing happens.
    assert store.evict_random(1, 12_345, usage) == 0
    assert store.evict_random(3, 0, usage) == 0
    # To zero.
    assert store.evict_random(1, 0, usage) > 0
    assert usage.get(1, Usage()) == Usage() and owned(store, 1) == set()
    check(store, usage)


def test_an_owners_row_of_the_wrong_size_is_uncharged_as_nothing(store: WritableStore) -> None:
    """LMDB checksums no page: a flipped byte in a leaf gave an owners row 3 bytes, and
    its struct.error failed every eviction or admission batch reaching that chunk, and
    the daemon's last flush with a traceback (test_byteflips.py's long form). It is
    uncharged as 0 bytes (usage at most that much high, never negative) and removed."""
    usage: dict[int, Usage] = {}
    fill(store, usage, 1, 10)
    victim = sorted(owned(store, 1))[0]
    with store.env.begin(write=True) as txn:
        txn.put(DSID.pack(1) + victim, b"\x01\x02\x03", db=store.db(b"owners"))
    assert store.evict_random(1, 0, usage) == 9 * 100  # the damaged row's 100 not counted
    u = usage.get(1, Usage())
    assert owned(store, 1) == set() and u.chunks == 0 and 0 <= u.bytes <= 100, u


def test_evict_random_with_a_negative_target_empties_the_dataset(store: WritableStore) -> None:
    usage: dict[int, Usage] = {}
    fill(store, usage, 1, 10)
    assert store.evict_random(1, -1, usage) == 1000
    assert store.evict_random(4, -1, usage) == 0  # unknown dataset: returns, no loop
    check(store, usage)


def test_evict_random_large_batches(store: WritableStore) -> None:
    # More than one eviction txn (_EVICT_BATCH is 512).
    usage: dict[int, Usage] = {}
    fill(store, usage, 1, 1500, size=10)
    store.evict_random(1, 1000, usage)
    check(store, usage)
    assert usage[1] == Usage(1000, 100)


def test_eviction_is_random_and_spread_over_the_key_space(tmp_path: Path) -> None:
    base = WritableStore(str(tmp_path / "base"), MAP)
    usage0: dict[int, Usage] = {}
    fill(base, usage0, 1, 1000)
    keys = sorted(owned(base, 1))
    for name in ("a", "b"):
        os.makedirs(tmp_path / name)
        base.env.copy(str(tmp_path / name))
    base.close()
    survivors = []
    for name in ("a", "b"):
        s = WritableStore(str(tmp_path / name), MAP)
        usage = s.load_usage()
        assert usage == usage0
        s.evict_random(1, 50_000, usage)
        check(s, usage)
        survivors.append(owned(s, 1))
        s.close()
    a, b = survivors
    assert len(a) == len(b) == 500
    assert a != b, "two evictions from the same state chose the same chunks"
    # Two independent uniform halves would share ~250 chunks. This selection prefers
    # keys behind large gaps in both runs, so they share more (simulated: 272..327);
    # a deterministic choice would share all 500.
    assert 150 < len(a & b) < 420
    # Survivors are spread over the key space, not a prefix, suffix or one range. The
    # bounds are loose on purpose: eviction takes the successor of a random probe, which
    # clusters (a deleted key's gap goes to its successor), so per-tenth counts vary
    # about twice as much as a uniform sample's (simulated: 16..79 kept per tenth, and
    # at most 66 evicted in a row, over 2000 runs). A prefix eviction gives 0 and 500.
    for s_ in (a, b):
        for part in range(10):
            kept = sum(1 for k in keys[part * 100 : (part + 1) * 100] if k in s_)
            assert 5 <= kept <= 95, f"tenth {part} kept {kept}/100"
        run = longest = 0
        for k in keys:
            run = 0 if k in s_ else run + 1
            longest = max(longest, run)
        assert longest < 150, f"{longest} consecutive keys evicted"


# -- randomized sequences across 3 datasets --------------------------------------------
class StoreMachine(RuleBasedStateMachine):
    """admit / replace / evict in any order; the walker checks every step."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.store = WritableStore(self.dir.name, MAP)
        self.usage: dict[int, Usage] = {}
        self.quotas = {1: 2000, 2: 1500, 3: 800}
        self.known: list[tuple[int, int, str]] = []  # (dataset, index, cid) ever offered

    def teardown(self) -> None:
        self.store.close()
        self.dir.cleanup()

    @rule(
        dsid=st.sampled_from([1, 2, 3]),
        specs=st.lists(
            st.tuples(st.integers(0, 40), st.integers(1, 400), st.sampled_from(["x", "y"])),
            min_size=1,
            max_size=8,
        ),
    )
    def admit(self, dsid: int, specs: list[tuple[int, int, str]]) -> None:
        items = [chunk(dsid, i, size, cid=cid) for i, size, cid in specs]
        before = {d: Usage(u.bytes, u.chunks) for d, u in self.usage.items()}
        owners_before = walk(self.store).owners
        res = self.store.admit(items, self.usage, fixed(self.quotas))
        assert res.admitted + res.rejected + res.present == len(items)
        assert not res.full
        for d in (1, 2, 3):
            assert self.usage.get(d, Usage()).bytes <= max(
                self.quotas[d], before.get(d, Usage()).bytes
            )
        # Present chunks keep their owner and bytes; no chunk was evicted to make room.
        owners_after = walk(self.store).owners
        for key, owner in owners_before.items():
            assert owners_after[key] == owner
        new_keys = set(owners_after) - set(owners_before)
        assert len(new_keys) == res.admitted
        assert sum(owners_after[k][1] for k in new_keys) == res.admitted_bytes
        assert res.present >= sum(1 for i in items if i.key in owners_before)
        self.known += [(dsid, i, cid) for i, _, cid in specs]

    @precondition(lambda self: self.known)
    @rule(data=st.data(), dsid=st.sampled_from([1, 2, 3]), size=st.integers(1, 400))
    def replace(self, data: st.DataObject, dsid: int, size: int) -> None:
        _, i, cid = data.draw(st.sampled_from(self.known))
        item = chunk(dsid, i, size, cid=cid, replace=True, fill=7)
        res = self.store.admit([item], self.usage, fixed(self.quotas))
        assert res.present == 0
        s = walk(self.store)
        if res.admitted:
            assert s.owners[item.key] == (dsid, size)
        else:
            assert item.key not in s.chunks

    @rule(dsid=st.sampled_from([1, 2, 3]), frac=st.floats(0, 1))
    def evict(self, dsid: int, frac: float) -> None:
        others = {d: owned(self.store, d) for d in (1, 2, 3) if d != dsid}
        have = self.usage.get(dsid, Usage()).bytes
        target = int(have * frac)
        freed = self.store.evict_random(dsid, target, self.usage)
        assert self.usage.get(dsid, Usage()).bytes <= target
        assert freed == have - self.usage.get(dsid, Usage()).bytes
        for d, keys in others.items():
            assert owned(self.store, d) == keys

    @rule()
    def change_quota(self) -> None:
        self.quotas = {d: q // 2 + 100 for d, q in self.quotas.items()}

    @invariant()
    def accounting(self) -> None:
        check(self.store, self.usage)
        rows = {d: u for d, u in self.store.load_usage().items() if u != Usage()}
        assert rows == {d: u for d, u in self.usage.items() if u != Usage()}


StoreMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = pytest.mark.slow(StoreMachine.TestCase)


def test_randomized_sequence_seeded() -> None:
    """A longer plain random walk than the state machine takes, same checks."""
    rng = random.Random(1234)
    with tempfile.TemporaryDirectory() as d:
        store = WritableStore(d, MAP)
        usage: dict[int, Usage] = {}
        quotas = {1: 30_000, 2: 20_000, 3: 10_000}
        for _ in range(150):
            op = rng.random()
            dsid = rng.choice([1, 2, 3])
            if op < 0.6:
                items = [
                    chunk(
                        dsid,
                        rng.randrange(300),
                        rng.randrange(1, 900),
                        cid=rng.choice("abc"),
                        replace=rng.random() < 0.1,
                    )
                    for _ in range(rng.randrange(1, 30))
                ]
                store.admit(items, usage, fixed(quotas))
            elif op < 0.9:
                store.evict_random(dsid, rng.randrange(0, 20_000), usage)
            else:
                quotas[dsid] = rng.randrange(0, 40_000)
            check(store, usage)
            for d in (1, 2, 3):
                u = usage.get(d, Usage())
                assert u.bytes <= max(quotas[d], 40_000)
        store.close()


# -- listings -------------------------------------------------------------------------
def objects(n: int, prefix: str = "") -> list[ObjectInfo]:
    return [
        ObjectInfo(
            f"{prefix}dir{i % 3}/file-{i}.bin", i * 10, 1_700_000_000.5 + i, f"v{i}", f"etag-{i}"
        )
        for i in range(n)
    ]


UNICODE = [
    ObjectInfo("ümlaut/ñandú.jpg", 1, 1.0, "v", "c1"),
    ObjectInfo("日本語/ファイル.txt", 2, 2.0, "v", "c2"),
    ObjectInfo("emoji/🚀 rocket.png", 3, 3.0, "v", "c3"),
    ObjectInfo("spaces and\ttabs/x", 4, 4.0, "v", "c4"),
    ObjectInfo("a", 5, 5.0, "v", "c5"),
]


def test_dataset_ids(store: WritableStore) -> None:
    a = store.dataset_id("s3://b/a/", create=True)
    b = store.dataset_id("s3://b/b/", create=True)
    assert a != b
    assert store.dataset_id("s3://b/a/", create=True) == a
    assert store.dataset_id("s3://b/a/", create=False) == a
    assert store.dataset_id("s3://b/c/", create=False) is None
    assert store.all_datasets() == {a: {"uri": "s3://b/a/"}, b: {"uri": "s3://b/b/"}}


def test_listing_round_trip(store: WritableStore) -> None:
    ds1 = store.dataset_id("s3://b/one/", create=True)
    ds2 = store.dataset_id("s3://b/two/", create=True)
    assert ds1 is not None and ds2 is not None
    objs = objects(50) + UNICODE
    record = {"uri": "s3://b/one/", "objects": len(objs), "size": 123, "listed_at": 1.5}
    store.replace_listing(ds1, objs, record)
    store.replace_listing(ds2, objects(7, "other/"), {"uri": "s3://b/two/"})
    got = list(store.iter_listing(ds1))
    assert sorted(got, key=lambda o: o.key) == sorted(objs, key=lambda o: o.key)
    assert len(got) == len(objs)
    for o in objs:
        assert store.get_object(ds1, o.key) == o
        assert store.get_object(ds2, o.key) is None
    assert store.get_object(ds1, "missing") is None
    assert store.get_object(ds1, "dir0") is None
    saved = store.dataset_record(ds1)
    assert saved["uri"] == record["uri"] and saved["listed_at"] == 1.5
    # The listing's own totals replace what the caller guessed.
    assert saved["objects"] == len(objs) and saved["size"] == sum(o.size for o in objs)
    assert list(store.iter_listing(999)) == []
    # Replacing swaps the whole listing and leaves the other dataset alone.
    store.replace_listing(ds1, UNICODE[:2], {"uri": "s3://b/one/", "objects": 2})
    assert sorted(store.iter_listing(ds1), key=lambda o: o.key) == sorted(
        UNICODE[:2], key=lambda o: o.key
    )
    assert store.get_object(ds1, "dir0/file-0.bin") is None
    assert len(list(store.iter_listing(ds2))) == 7
    store.replace_listing(ds2, [], {"uri": "s3://b/two/"})
    assert list(store.iter_listing(ds2)) == []
    assert len(list(store.iter_listing(ds1))) == 2


def test_listings_of_neighbouring_ids_do_not_mix(store: WritableStore) -> None:
    # Dataset 1's rows must end where dataset 2's begin, whatever the keys' bytes. (A key
    # with NUL names no path, so it is not listed at all: "\x01" is the lowest byte.)
    store.replace_listing(1, [ObjectInfo("\x7f\uffff", 1, 1.0, "v", "c")], {})
    store.replace_listing(2, [ObjectInfo("\x01zero", 2, 2.0, "v", "c")], {})
    store.replace_listing(256, [ObjectInfo("x", 3, 3.0, "v", "c")], {})
    assert [o.key for o in store.iter_listing(1)] == ["\x7f\uffff"]
    assert [o.key for o in store.iter_listing(2)] == ["\x01zero"]
    assert [o.key for o in store.iter_listing(256)] == ["x"]
    store.replace_listing(1, [], {})
    assert [o.key for o in store.iter_listing(2)] == ["\x01zero"]


@pytest.mark.parametrize("length", [400, 503, 504, 1024])
def test_long_object_keys(store: WritableStore, length: int) -> None:
    # S3 allows keys of 1024 bytes; LMDB keys stop at 511. Listing must not fail.
    long = "k/" + "é" * ((length - 2) // 2) + "x" * ((length - 2) % 2)
    assert len(long.encode()) == length
    twin = long[:-1] + "y"  # same first 510 bytes
    objs = [
        ObjectInfo(long, 1, 1.0, "v1", "c1"),
        ObjectInfo(twin, 2, 2.0, "v2", "c2"),
        ObjectInfo("short", 3, 3.0, "v3", "c3"),
    ]
    store.replace_listing(1, objs, {})
    assert sorted(store.iter_listing(1), key=lambda o: o.key) == sorted(objs, key=lambda o: o.key)
    assert store.get_object(1, long) == objs[0]
    assert store.get_object(1, twin) == objs[1]
    assert store.get_object(1, long + "z") is None
    store.replace_listing(1, objs[2:], {})
    assert list(store.iter_listing(1)) == objs[2:]
    assert store.get_object(1, long) is None


def test_meta(store: WritableStore) -> None:
    assert store.get_meta("allocation:s3://b/a/") is None
    store.put_meta("allocation:s3://b/a/", 1 << 30)
    store.put_meta("allocation:s3://b/b/", {"bytes": 5})
    store.put_meta("other", [1, 2])
    assert store.get_meta("allocation:s3://b/a/") == 1 << 30
    assert dict(store.iter_meta("allocation:")) == {
        "allocation:s3://b/a/": 1 << 30,
        "allocation:s3://b/b/": {"bytes": 5},
    }
    store.put_meta("allocation:s3://b/a/", None)
    assert store.get_meta("allocation:s3://b/a/") is None
    assert list(store.iter_meta("zzz")) == []


# -- persistence --------------------------------------------------------------------------
def test_reopen_keeps_everything(tmp_path: Path) -> None:
    path = str(tmp_path / "cache")
    s = WritableStore(path, MAP)
    usage: dict[int, Usage] = {}
    ds = s.dataset_id("s3://b/p/", create=True)
    assert ds is not None
    s.replace_listing(ds, UNICODE, {"uri": "s3://b/p/", "objects": 5})
    fill(s, usage, ds, 120)
    fill(s, usage, 7, 30, size=33)
    s.evict_random(ds, 5000, usage)
    s.put_meta("allocation:s3://b/p/", 4096)
    before = walk(s)
    s.close()

    s = WritableStore(path, MAP)
    assert s.load_usage() == usage
    after = check(s, s.load_usage())
    assert after.chunks == before.chunks and after.owners == before.owners
    assert s.dataset_id("s3://b/p/", create=False) == ds
    assert s.dataset_id("s3://b/q/", create=True) != ds  # ids are not reused
    assert sorted(s.iter_listing(ds), key=lambda o: o.key) == sorted(UNICODE, key=lambda o: o.key)
    assert s.get_meta("allocation:s3://b/p/") == 4096
    s.close()

    # A mount process opens the same env read-only and sees the same.
    r = CacheStore(path, MAP)
    with r.read_txn() as txn:
        assert {d: r.usage_of(txn, d) for d in usage} == usage
        e = r.listing(ds, r.dataset_record(ds)["gen"]).resolve(txn, "a")
        assert e is not None and e.obj == UNICODE[-1]
        key = next(iter(before.chunks))
        value = txn.get(key, db=r.db(b"chunks"))
        assert isinstance(value, memoryview) and bytes(value) == before.chunks[key]
    r.close()


def test_store_version_mismatch_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "cache")
    s = WritableStore(path, MAP)
    s.put_meta("store_version", 99)
    s.close()
    with pytest.raises(Exception, match="store version 99"):
        WritableStore(path, MAP)


def test_load_usage_reads_the_usage_rows_only(tmp_path: Path) -> None:
    path = str(tmp_path / "cache")
    s = WritableStore(path, MAP)
    usage: dict[int, Usage] = {}
    fill(s, usage, 1, 200)
    fill(s, usage, 2, 10)
    s.close()

    class Spy:
        """Wraps the env and records which databases load_usage reads."""

        def __init__(self, env: lmdb.Environment, names: dict[int, bytes]) -> None:
            self.env, self.names, self.read = env, names, []

        def begin(self, *args: object, **kwargs: object) -> object:
            txn = self.env.begin(*args, **kwargs)
            spy = self

            class T:
                def __enter__(self) -> T:
                    txn.__enter__()
                    return self

                def __exit__(self, *exc: object) -> None:
                    txn.__exit__(*exc)

                def cursor(self, db: object) -> object:
                    spy.read.append(spy.names[id(db)])
                    return txn.cursor(db=db)

                def get(self, key: bytes, db: object) -> object:
                    spy.read.append(spy.names[id(db)])
                    return txn.get(key, db=db)

            return T()

    s = WritableStore(path, MAP)
    spy = Spy(s.env, {id(db): name for name, db in s.dbs.items()})
    s.env = spy  # type: ignore[assignment]
    assert s.load_usage() == usage
    assert spy.read == [b"usage"]
    s.env = spy.env
    s.close()


# -- a full map -------------------------------------------------------------------------
SMALL_MAP = 1 << 20


def test_map_full_is_a_clean_full_result(tmp_path: Path) -> None:
    s = WritableStore(str(tmp_path / "cache"), SMALL_MAP)
    usage: dict[int, Usage] = {}
    store_before = walk(s)
    # One batch bigger than the whole map: nothing of it may be written.
    res = s.admit([chunk(1, i, size=20_000) for i in range(80)], usage, unlimited)
    assert res == AdmitResult(full=True, unplaced=80)
    assert walk(s) == store_before and usage == {}
    check(s, usage)
    # The env is still usable: a batch that fits is admitted.
    res = s.admit([chunk(1, i, size=20_000) for i in range(5)], usage, unlimited)
    assert res.admitted == 5 and not res.full
    check(s, usage)
    s.close()


def test_map_full_error_aborts_the_whole_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = WritableStore(str(tmp_path / "cache"), SMALL_MAP)
    usage: dict[int, Usage] = {}
    s.admit([chunk(1, i, size=1000) for i in range(5)], usage, unlimited)
    before = walk(s)
    usage_before = {d: Usage(u.bytes, u.chunks) for d, u in usage.items()}
    real_put_usage = WritableStore._put_usage
    calls = 0

    def put_usage_then_fail(
        self: WritableStore, txn: lmdb.Transaction, dsid: int, u: Usage
    ) -> None:
        nonlocal calls
        real_put_usage(self, txn, dsid, u)
        calls += 1
        if calls == 3:  # two chunks fully written, the third half way
            raise lmdb.MapFullError("simulated")

    monkeypatch.setattr(WritableStore, "_put_usage", put_usage_then_fail)
    res = s.admit([chunk(2, i, size=1000) for i in range(5)], usage, unlimited)
    monkeypatch.undo()
    assert res.full and res.admitted == 0 and res.unplaced == 5 and res.rejected == 0
    assert usage == usage_before
    assert walk(s) == before
    check(s, usage)
    s.close()


def test_a_filled_map_can_still_evict_and_then_admit(tmp_path: Path) -> None:
    # Small chunks fill the map's pages without reaching the quota. Eviction must still
    # work afterwards (LMDB needs free pages even to delete), or a full cache could never
    # shrink an allocation again.
    s = WritableStore(str(tmp_path / "cache"), SMALL_MAP)
    usage: dict[int, Usage] = {}
    i = 0
    for _ in range(2000):
        res = s.admit([chunk(1 + i % 3, i + j, size=60) for j in range(10)], usage, unlimited)
        i += 10
        if res.full:
            break
    else:
        pytest.fail("the map never filled")
    check(s, usage)
    for dsid in (1, 2, 3):
        target = usage[dsid].bytes // 2
        s.evict_random(dsid, target, usage)
        assert usage[dsid].bytes <= target
        check(s, usage)
    res = s.admit([chunk(1, 10**6 + j, size=60) for j in range(10)], usage, unlimited)
    assert res.admitted == 10 and not res.full
    check(s, usage)
    s.close()


def test_env_map_size() -> None:
    assert env_map_size(0) == 256 << 20
    assert env_map_size(8 << 30) >= (8 << 30) * 1.25
    assert DSID.pack(1) == b"\0" * 7 + b"\x01"


# -- chunks of versions no listing names (mark_stale) ------------------------------------
def test_stale_chunks_make_room_in_a_full_dataset_first(store: WritableStore) -> None:
    """Uniform admission evicts nothing, except chunks marked stale: those make room for
    new chunks, and only those."""
    usage: dict[int, Usage] = {}
    store.admit([chunk(1, i) for i in range(10)], usage, fixed({1: 1000}))
    stale = {chunk(1, i).key for i in (2, 5, 7)}
    assert store.mark_stale(1, [*stale, chunk(1, 99).key]) == 3  # 99 is not held: ignored
    assert store.mark_stale(2, list(stale)) == 0  # another dataset does not own them
    assert store.stale_count(1) == 3
    res = store.admit([chunk(1, 100 + j) for j in range(5)], usage, fixed({1: 1000}))
    assert (res.admitted, res.rejected) == (3, 2)
    assert owned(store, 1) == {chunk(1, i).key for i in range(10) if i not in (2, 5, 7)} | {
        chunk(1, 100 + j).key for j in range(3)
    }
    assert store.stale_count(1) == 0 and usage[1] == Usage(1000, 10)
    check(store, usage)


def test_evictions_take_stale_chunks_first(store: WritableStore) -> None:
    usage: dict[int, Usage] = {}
    store.admit([chunk(1, i) for i in range(20)], usage, unlimited)
    stale = {chunk(1, i).key for i in range(0, 20, 4)}
    store.mark_stale(1, list(stale))
    store.evict_random(1, 1500, usage)
    assert owned(store, 1).isdisjoint(stale)
    assert len(owned(store, 1)) == 15 and store.stale_count(1) == 0
    check(store, usage)
    # A stale row of a chunk evicted by other means goes with it.
    store.mark_stale(1, [chunk(1, 1).key])
    store.evict_random(1, 0, usage)
    assert store.stale_count(1) == 0 and owned(store, 1) == set()
    check(store, usage)


def test_a_mount_opens_an_env_an_older_daemon_made(tmp_path: Path) -> None:
    """Read-only (a mount), an env without the dbs newer daemons add for themselves
    (stale) opens; the daemon creates them."""
    env = lmdb.open(str(tmp_path), map_size=MAP, max_dbs=20, subdir=True)
    for name in (b"chunks", b"owners", b"usage", b"datasets", b"names", b"objects",
                 b"meta", b"dirents", b"inodes"):  # fmt: skip
        env.open_db(name)
    env.close()
    ro = CacheStore(str(tmp_path), MAP)
    assert b"stale" not in ro.dbs
    ro.close()
    rw = WritableStore(str(tmp_path), MAP)
    assert b"stale" in rw.dbs
    rw.close()


def test_an_env_removed_or_replaced_under_the_store_is_noticed(tmp_path: Path) -> None:
    """The daemon's watch (Daemon.watch_cache_dir) asks this every 2 s."""
    path = tmp_path / "cache"
    s = WritableStore(str(path), 16 << 20)
    try:
        assert not s.removed()
        os.rename(path / "data.mdb", tmp_path / "moved.mdb")
        assert s.removed()  # nothing at the path
        (path / "data.mdb").write_bytes(b"")
        assert s.removed()  # another file at the path
        os.unlink(path / "data.mdb")
        os.rename(tmp_path / "moved.mdb", path / "data.mdb")
        assert not s.removed()  # its own file back
        shutil.rmtree(path)
        assert s.removed()
    finally:
        s.close()
