"""SilofsFS (mount/fs.py) and ChunkReader (mount/reader.py) without FUSE.

The FUSE operations a kernel would send (lookup, getattr, opendir/readdir, open, read,
release, and the writes) are called directly on a SilofsFS over a real LMDB env holding
a real listing, with an in-process fake of the daemon's control client answering
GET /v1/chunks. So the errnos a reader sees, one version per open file, the chunk
buffer and the hit path are tested where /dev/fuse is missing. Only the public
operations are driven (their results and what reached the fake daemon are asserted),
not the internals, so the tests hold while the hot path changes.
"""

from __future__ import annotations

import errno
import inspect
import json
import math
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pyfuse3
import pytest
import trio

from silofs.cache.format import ChunkRef, encode_chunk
from silofs.cache.listing import ListingReader
from silofs.cache.store import CacheStore, Usage
from silofs.control.client import ControlError
from silofs.mount import fs as fs_module
from silofs.mount.fs import Presentation, SilofsFS, fuse_name_max, mtime_ns
from silofs.mount.listing_view import ROOT_INODE, ListingView
from silofs.mount.reader import ChunkReader
from silofs.mount.shared import SharedTables
from silofs.node.store_write import PendingChunk, WritableStore
from silofs.records import ObjectInfo

CS = 64 << 10  # chunk size
DSID = 7
LOOK = Presentation(uid=1234, gid=5678, file_mode=0o444, dir_mode=0o555, timeout=60.0)


def payload(key: str, size: int, version: str = "v1") -> bytes:
    """Deterministic bytes of an object version, different per key and version."""
    seed = f"{key}@{version}".encode()
    return (seed * (size // len(seed) + 1))[:size]


def obj(key: str, size: int, version: str = "v1") -> ObjectInfo:
    return ObjectInfo(key, size, 100.0, version, f"cid-{key}-{version}")


OBJECTS = [
    obj("a.txt", 1000),
    obj("dir/big.bin", 2 * CS + 500),  # three chunks
    obj("dir/secret.bin", 10),
    obj("dir/flaky.bin", 10),
    obj("empty", 0),
]


@dataclass
class FakeDaemon:
    """What a mount's AsyncControlClient is asked: GET /v1/chunks, answered from
    `objects` (by key and version) or with a scripted failure per key."""

    objects: dict[tuple[str, str], bytes]
    fail: dict[str, Any] = field(default_factory=dict)  # key -> status, or an exception
    asked: list[dict[str, str]] = field(default_factory=list)
    # As AsyncControlClient: its silence timeout, and when it last heard an answer (a
    # chunk whose ask timed out is asked again with less: ChunkReader._silence_for).
    timeout: float = 30.0
    answered_at: float = -math.inf

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> tuple:
        assert method == "GET" and path.startswith("/v1/chunks?"), path
        q = {k: v[0] for k, v in parse_qs(urlsplit(path).query).items()}
        self.asked.append(q)
        failure = self.fail.get(q["key"])
        if isinstance(failure, Exception):
            raise failure
        if failure is not None:
            msg = json.dumps({"error": f"scripted {failure}"}).encode()
            return failure, {"content-type": "application/json"}, msg
        data = self.objects.get((q["key"], q["version"]))
        if data is None:
            return 409, {}, json.dumps({"error": "no such version"}).encode()
        i = int(q["index"])
        return 200, {"x-silofs-source": "store"}, data[i * CS : (i + 1) * CS]

    def chunks_of(self, key: str) -> list[int]:
        return [int(q["index"]) for q in self.asked if q["key"] == key]


@dataclass
class Mount:
    fs: SilofsFS
    reader: ChunkReader
    daemon: FakeDaemon
    store: CacheStore
    usage: dict[int, Usage] = field(default_factory=dict)

    async def path(self, path: str) -> pyfuse3.EntryAttributes:
        inode = ROOT_INODE
        attr = None
        for part in path.split("/"):
            attr = await self.fs.lookup(inode, part.encode(), None)  # type: ignore[arg-type]
            inode = attr.st_ino
        assert attr is not None
        return attr

    async def open(self, path: str, flags: int = os.O_RDONLY) -> int:
        attr = await self.path(path)
        return (await self.fs.open(attr.st_ino, flags, None)).fh  # type: ignore[arg-type]

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return bytes(await self.fs.read(fh, off, size))

    async def read_all(self, path: str, step: int = 128 << 10) -> bytes:
        fh = await self.open(path)
        out, off = b"", 0
        while chunk := await self.read(fh, off, step):
            out += chunk
            off += len(chunk)
        await self.fs.release(fh)
        return out

    def admit(self, o: ObjectInfo, index: int, data: bytes | None = None) -> None:
        """Put chunk `index` of `o` in the cache, as the daemon's writer would."""
        ref = ChunkRef.of(o, CS, index)
        full = payload(o.key, o.size, o.version)[ref.start : ref.start + ref.length]
        value = encode_chunk(DSID, index, CS, o.key, o.content_id, full if data is None else data)
        usage: dict[int, Usage] = {}
        self.store.admit(
            [PendingChunk(DSID, ref.key, value, ref.length)], usage, lambda *_: 1 << 40
        )

    def relist(self, objects: list[ObjectInfo]) -> None:
        """The daemon lists the dataset again (a --refresh); the mount switches."""
        self.fs.switch(self.store.replace_listing(DSID, objects, {"uri": "file:///d/"}))


def errno_of(exc: pytest.ExceptionInfo[pyfuse3.FUSEError]) -> int:
    return exc.value.errno


@pytest.fixture
def run(store: WritableStore) -> Callable[..., None]:
    """run(test, buffer_bytes=..., readahead=...): test(mount) inside trio, with a
    SilofsFS over `store` holding OBJECTS and a FakeDaemon that has their bytes."""

    def runner(
        test: Callable[[Mount], Awaitable[None]], buffer_bytes: int = 8 * CS, readahead: int = 0
    ) -> None:
        record = store.replace_listing(DSID, OBJECTS, {"uri": "file:///d/"})
        daemon = FakeDaemon({(o.key, o.version): payload(o.key, o.size) for o in OBJECTS})

        async def reregister() -> None:
            raise ControlError("the daemon is gone")

        async def main() -> None:
            reader = ChunkReader(
                store,
                daemon,  # type: ignore[arg-type]
                dataset_id=DSID,
                chunk_size=CS,
                buffer_bytes=buffer_bytes,
                readahead_bytes=readahead * CS,
                reregister=reregister,
            )
            reader.registered("m1", track_hits=False)
            fs = SilofsFS(ListingView(store, DSID, record), reader, LOOK)
            async with trio.open_nursery() as nursery:
                reader.start(nursery)
                with trio.fail_after(20):
                    await test(Mount(fs, reader, daemon, store))
                nursery.cancel_scope.cancel()

        trio.run(main)

    return runner


# -- names and attributes -------------------------------------------------------------


def test_lookup_and_getattr(run: Callable[..., None]) -> None:
    async def test(m: Mount) -> None:
        a = await m.path("a.txt")
        assert stat.S_ISREG(a.st_mode) and stat.S_IMODE(a.st_mode) == 0o444
        assert (a.st_size, a.st_uid, a.st_gid) == (1000, 1234, 5678)
        assert a.entry_timeout == a.attr_timeout == 60.0
        assert a.st_mtime_ns == 100 * 10**9 and a.st_blocks == 8  # a 4 KiB block
        d = await m.path("dir")
        assert stat.S_ISDIR(d.st_mode) and stat.S_IMODE(d.st_mode) == 0o555
        assert (await m.fs.getattr(d.st_ino, None)).st_ino == d.st_ino  # type: ignore[arg-type]
        assert (await m.path("dir/big.bin")).st_size == 2 * CS + 500
        for parent, name in ((ROOT_INODE, b"nope"), (d.st_ino, b"a.txt"), (a.st_ino, b"x")):
            with pytest.raises(pyfuse3.FUSEError) as exc:
                await m.fs.lookup(parent, name, None)  # type: ignore[arg-type]
            assert errno_of(exc) == errno.ENOENT
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await m.fs.getattr(10**9, None)  # type: ignore[arg-type]
        assert errno_of(exc) == errno.ENOENT
        assert m.daemon.asked == []  # names never reach the daemon

    run(test)


def test_a_name_looked_up_while_its_listing_is_written_is_looked_up_again(
    store: WritableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file's LOOKUP reply is kept by name only once its generation is complete: while
    the daemon still writes it, a name found as a file may turn out to be a directory's
    (the directory is kept), and the next LOOKUP must say so. Once complete and
    switched to, the same names answer as the listing does."""
    from silofs.mount import listing_view

    monkeypatch.setattr(listing_view, "RENEW_SECONDS", 0.0)  # a fresh snapshot per request
    dsid = DSID + 1
    b = store.begin_listing(dsid)
    store.add_to_listing(b, [obj("f", 5)])
    view = ListingView(store, dsid, {"gen": b.gen}, building=True)
    fs = SilofsFS(view, None, LOOK)  # type: ignore[arg-type]  # names only: no reads

    async def main() -> None:
        a = await fs.lookup(ROOT_INODE, b"f", None)  # type: ignore[arg-type]
        assert stat.S_ISREG(a.st_mode) and a.st_size == 5
        store.add_to_listing(b, [obj("f/x", 7)])  # "f" is a directory's name now
        a = await fs.lookup(ROOT_INODE, b"f", None)  # type: ignore[arg-type]
        assert stat.S_ISDIR(a.st_mode)
        fs.switch(store.finish_listing(b, {"uri": "file:///d/"}))
        x = await fs.lookup(a.st_ino, b"x", None)  # type: ignore[arg-type]
        assert (await fs.lookup(a.st_ino, b"x", None)).st_size == x.st_size == 7  # type: ignore[arg-type]

    trio.run(main)
    view.close()


def _kernel_buffer(
    monkeypatch: pytest.MonkeyPatch, room: int
) -> tuple[list[tuple[bytes, int]], list[int]]:
    """pyfuse3.readdir_reply as the kernel's buffer: it takes `room[0]` more entries (a
    test may refill it) and records each as (name, next offset) in `replies`."""
    replies: list[tuple[bytes, int]] = []
    left = [room]

    def reply(token: Any, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
        if left[0] == 0:
            return False
        left[0] -= 1
        replies.append((name, next_id))
        return True

    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)
    return replies, left


def test_readdir_lists_resumes_and_refuses_files(
    run: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    replies, room = _kernel_buffer(monkeypatch, 10**6)

    async def test(m: Mount) -> None:
        fh = await m.fs.opendir(ROOT_INODE, None)  # type: ignore[arg-type]
        await m.fs.readdir(fh, 0, None)  # type: ignore[arg-type]
        assert [n for n, _ in replies] == [b".", b"..", b"a.txt", b"dir", b"empty"]
        assert [i for _, i in replies] == [1, 2, 3, 4, 5]
        await m.fs.releasedir(fh)

        # A full buffer: the kernel asks again from the last offset it got (inside the
        # dots, and past them).
        d = await m.path("dir")
        fh = await m.fs.opendir(d.st_ino, None)  # type: ignore[arg-type]
        for first in (1, 4):
            replies.clear()
            room[0] = first
            await m.fs.readdir(fh, 0, None)  # type: ignore[arg-type]
            room[0] = 10**6
            await m.fs.readdir(fh, replies[-1][1], None)  # type: ignore[arg-type]
            names = [b".", b"..", b"big.bin", b"flaky.bin", b"secret.bin"]
            assert [n for n, _ in replies] == names
            assert [i for _, i in replies] == [1, 2, 3, 4, 5]
        replies.clear()
        await m.fs.readdir(fh, 5, None)  # type: ignore[arg-type]  # at the end
        assert replies == []
        await m.fs.releasedir(fh)

        a = await m.path("a.txt")
        for inode, want in ((a.st_ino, errno.ENOTDIR), (10**9, errno.ENOENT)):
            with pytest.raises(pyfuse3.FUSEError) as exc:
                await m.fs.opendir(inode, None)  # type: ignore[arg-type]
            assert errno_of(exc) == want
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await m.fs.readdir(fh, 0, None)  # type: ignore[arg-type]  # released
        assert errno_of(exc) == errno.EBADF

    run(test)


def test_a_name_longer_than_the_kernel_takes_is_left_out_of_readdir_once_logged(
    run: Callable[..., None], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before Linux 6.15 FUSE takes names up to 1024 bytes, and one longer in a readdir
    reply fails the kernel's whole batch (EIO: the directory unreadable). Such a name is
    left out, with one line per directory; the others keep their offsets."""
    replies: list[tuple[bytes, int]] = []

    def reply(token: Any, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
        replies.append((name, next_id))
        return True

    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)

    async def test(m: Mount) -> None:
        m.fs.name_max = len(b"big.bin")  # as if: flaky.bin and secret.bin are too long
        d = await m.path("dir")
        for _ in range(2):
            replies.clear()
            fh = await m.fs.opendir(d.st_ino, None)  # type: ignore[arg-type]
            await m.fs.readdir(fh, 0, None)  # type: ignore[arg-type]
            assert replies == [(b".", 1), (b"..", 2), (b"big.bin", 3)]
            replies.clear()
            await m.fs.readdir(fh, 3, None)  # type: ignore[arg-type]
            assert replies == []
            await m.fs.releasedir(fh)
        m.fs.name_max = len(b"flaky.bin")
        fh = await m.fs.opendir(d.st_ino, None)  # type: ignore[arg-type]
        replies.clear()
        await m.fs.readdir(fh, 3, None)  # type: ignore[arg-type]  # after big.bin
        assert replies == [(b"flaky.bin", 4)]
        await m.fs.releasedir(fh)
        assert (await m.fs.statfs(None)).f_namemax == len(b"flaky.bin")  # type: ignore[arg-type]

    run(test)
    said = [r.getMessage() for r in caplog.records if "left out of its readdir" in r.getMessage()]
    assert len(said) == 1, said


def test_a_name_longer_than_statfs_says_is_enametoolong_listed_or_not(
    run: Callable[..., None],
) -> None:
    """A component past f_namemax is ENAMETOOLONG, as ext4 answers one past its 255
    bytes, whether or not the listing has it (readdir leaves those out): a kernel that
    passes longer names than the mount took for its limit had ENOENT from the mount
    for a missing one, and the name served for a listed one."""

    async def test(m: Mount) -> None:
        d = await m.path("dir")
        m.fs.name_max = len(b"big.bin")  # as if: flaky.bin is past the kernel's limit
        for name in (b"flaky.bin", b"missing.bin"):
            with pytest.raises(pyfuse3.FUSEError) as exc:
                await m.fs.lookup(d.st_ino, name, None)  # type: ignore[arg-type]
            assert errno_of(exc) == errno.ENAMETOOLONG, name
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await m.fs.lookup(d.st_ino, b"nope", None)  # type: ignore[arg-type]
        assert errno_of(exc) == errno.ENOENT  # within the limit: not there
        assert (await m.path("dir/big.bin")).st_size == 2 * CS + 500

    run(test)


def test_a_directory_s_size_is_past_its_last_readdir_offset(
    run: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """lseek(dirfd, 0, SEEK_END) is the kernel's i_size of the directory: the end of it
    as on ext4, where a readdir reads nothing more. A fixed 4096 was an offset inside
    a directory of more names (a readdir there went on from its 4,095th); a small
    directory keeps 4096, a local disk's size of it."""
    replies, room = _kernel_buffer(monkeypatch, 10**6)
    names = [f"n{i:05d}" for i in range(5000)]

    async def test(m: Mount) -> None:
        m.relist([*OBJECTS, *(obj(f"many/{n}", 1) for n in names), obj("many/sub/x", 1)])
        for path, entries in (("many", len(names) + 1), ("dir", 3)):
            d = await m.path(path)
            size = (await m.fs.getattr(d.st_ino, None)).st_size  # type: ignore[arg-type]
            assert size == max(4096, 2 + entries), path
            fh = await m.fs.opendir(d.st_ino, None)  # type: ignore[arg-type]
            replies.clear()
            await m.fs.readdir(fh, size, None)  # type: ignore[arg-type]  # seekdir(SEEK_END)
            assert replies == [], path
            await m.fs.readdir(fh, 2 + entries - 1, None)  # type: ignore[arg-type]
            assert len(replies) == 1, path  # the last name is just before it
            await m.fs.releasedir(fh)

    run(test)


@pytest.mark.parametrize(
    ("release", "most"),
    [("6.18.44-fc-v857", 4095), ("6.15.0", 4095), ("7.0", 4095), ("6.14.11-300.fc41", 1024)]
    + [("5.15.0-105-generic", 1024), ("4.18.0-553.el8_10.x86_64", 1024), ("weird", 1024)],
)
def test_the_kernels_fuse_name_limit(release: str, most: int) -> None:
    assert fuse_name_max(release) == most


def test_readdir_lists_dot_and_dotdot_with_their_inode_numbers(
    run: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """'.' is the directory, '..' its parent, and the root's '..' the root itself (the
    mount point's parent is the kernel's), as a local disk, mountpoint-s3 and rclone
    list them; there were none (`ls -a` showed neither)."""
    replies: list[tuple[bytes, int, int, int]] = []

    def reply(token: Any, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
        replies.append((name, attr.st_ino, stat.S_IFMT(attr.st_mode), next_id))
        return True

    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)

    async def listed(inode: int) -> list[tuple[bytes, int, int, int]]:
        replies.clear()
        fh = await m.fs.opendir(inode, None)  # type: ignore[arg-type]
        await m.fs.readdir(fh, 0, None)  # type: ignore[arg-type]
        await m.fs.releasedir(fh)
        return replies[:2]

    async def test(mount: Mount) -> None:
        nonlocal m
        m = mount
        m.relist([*OBJECTS, obj("dir/sub/deeper/x", 1)])
        d, sub = await m.path("dir"), await m.path("dir/sub")
        deeper = await m.path("dir/sub/deeper")
        assert len({ROOT_INODE, d.st_ino, sub.st_ino, deeper.st_ino}) == 4
        for inode, parent in (
            (ROOT_INODE, ROOT_INODE),
            (d.st_ino, ROOT_INODE),
            (sub.st_ino, d.st_ino),
            (deeper.st_ino, sub.st_ino),
        ):
            assert await listed(inode) == [
                (b".", inode, stat.S_IFDIR, 1),
                (b"..", parent, stat.S_IFDIR, 2),
            ]

    m: Mount
    run(test)


@pytest.mark.parametrize(("marks", "long"), [(None, False), (2, False), (None, True)])
def test_readdir_resumes_inside_its_last_reply_and_at_any_offset_a_seek_names(
    run: Callable[..., None], monkeypatch: pytest.MonkeyPatch, marks: int | None, long: bool
) -> None:
    """The kernel takes fewer names than a reply held (a reader's small getdents64
    buffer) and asks at the offset after the last it took; a seekdir() asks at any
    offset, before or past the names read so far, and after a rewind. Each answer goes
    on with the name after that offset's, in a directory of several marks' worth of
    names (the mount counted from the first name at each such offset), past the marks a
    handle keeps, and with names too long for the kernel left out (their offsets kept).
    The rows each answer reads are counted, so the quadratic count is caught here by a
    count, on any host (tests/integration/test_listing.py reads with the kernel's real
    small-buffer READDIRs; its timeout catches it only by wall clock, at 20,000 names)."""
    if marks is not None:
        monkeypatch.setattr(fs_module, "MARKS", marks)
    replies, room = _kernel_buffer(monkeypatch, 0)
    rows = [0]  # listing rows read (children() reads through entries())
    real_entries = ListingReader.entries

    def entries(self: ListingReader, *args: Any, **kwargs: Any) -> Any:
        for row in real_entries(self, *args, **kwargs):
            rows[0] += 1
            yield row

    monkeypatch.setattr(ListingReader, "entries", entries)

    names = [f"n{i:04d}".encode() + (b"-long" if long and i % 5 == 0 else b"") for i in range(1500)]

    async def test(m: Mount) -> None:
        m.relist([*OBJECTS, *(obj(f"many/{n.decode()}", 1) for n in names)])
        m.fs.name_max = len(b"n0000")
        order = [b".", b"..", *names]  # order[k] ends at offset k + 1
        listed = [(n, k + 1) for k, n in enumerate(order) if len(n) <= m.fs.name_max]
        d = await m.path("many")
        fh = await m.fs.opendir(d.st_ino, None)  # type: ignore[arg-type]

        async def ask(offset: int, take: int) -> list[tuple[bytes, int]]:
            replies.clear()
            room[0] = take
            rows[0] = 0
            await m.fs.readdir(fh, offset, None)  # type: ignore[arg-type]
            return list(replies)

        # Small buffers: a reply of 9 names of which the kernel took 2, over and over.
        # Each answer reads its reply's rows, the long names left out between them (one
        # in five) and the row that did not fit: at most 9 + 3 + 1 (a count from the
        # first name read up to 1,500 rows per answer).
        got, offset = [], 0
        while True:
            part = await ask(offset, 9)
            assert rows[0] <= 13, offset
            if not part:
                break
            got += part[:2]
            offset = part[1][1] if len(part) > 1 else part[0][1]
        assert got == listed
        # Seeks anywhere, in a fresh order, and a rewind between them: each counts from
        # the nearest mark before it (less than MARK rows while the handle keeps marks
        # for the whole directory, as here but for marks=2), then its reply's rows.
        bound = fs_module.MARK + 3 + 1 + 1 if marks is None else len(order)
        for offset in (1200, 3, 700, 2, 1501, 256 + 2, 0, 1490, 40, len(order), 999):
            part = await ask(offset, 3)
            assert part == [e for e in listed if e[1] > offset][:3], offset
            assert rows[0] <= bound, (offset, rows[0])
        await m.fs.releasedir(fh)

    run(test)


@pytest.mark.parametrize("relists", [1, 2])
def test_a_directory_read_across_listings_goes_on_after_its_last_name_in_the_new_one(
    run: Callable[..., None], monkeypatch: pytest.MonkeyPatch, relists: int
) -> None:
    """A handle opened before a refresh reads on in the listing the mount serves, after
    its last name, with the new attributes: two listings on, its own generation's rows
    were gone (the rest of the directory silently missing), and one on, its entries
    carried the old sizes."""
    replies: list[tuple[bytes, int, int]] = []
    room = [3]  # '.', '..' and one name

    def reply(token: Any, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
        if room[0] == 0:
            return False
        room[0] -= 1
        replies.append((name, attr.st_size, next_id))
        return True

    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)

    async def test(m: Mount) -> None:
        d = await m.path("dir")
        fh = await m.fs.opendir(d.st_ino, None)  # type: ignore[arg-type]
        await m.fs.readdir(fh, 0, None)  # type: ignore[arg-type]
        assert replies[2:] == [(b"big.bin", 2 * CS + 500, 3)]
        now = [o for o in OBJECTS if o.key != "dir/secret.bin"]
        now = [obj(o.key, 77, "v2") if o.key == "dir/flaky.bin" else o for o in now]
        for _ in range(relists):
            m.relist([*now, obj("dir/c-new.bin", 5)])
        room[0] = 10**6
        await m.fs.readdir(fh, 3, None)  # type: ignore[arg-type]
        assert replies[3:] == [(b"c-new.bin", 5, 4), (b"flaky.bin", 77, 5)]
        await m.fs.releasedir(fh)

    run(test)


def test_getattr_of_an_open_file_no_listing_has_is_its_handle_s_version(
    run: Callable[..., None],
) -> None:
    """Deleted in the store and listed twice, an open file's inode is in neither listing
    the mount reads: getattr answers the handle's version, no links (fstat, and Python's
    read(), were ENOENT); closed, it is ENOENT."""

    async def test(m: Mount) -> None:
        a = await m.path("a.txt")
        fh = await m.fs.open(a.st_ino, os.O_RDONLY, None)  # type: ignore[arg-type]
        rest = [o for o in OBJECTS if o.key != "a.txt"]
        m.relist(rest)
        m.relist(rest)
        got = await m.fs.getattr(a.st_ino, None)  # type: ignore[arg-type]
        assert (got.st_size, got.st_nlink, got.st_mtime_ns) == (1000, 0, a.st_mtime_ns)
        assert stat.S_ISREG(got.st_mode)
        await m.fs.release(fh.fh)
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await m.fs.getattr(a.st_ino, None)  # type: ignore[arg-type]
        assert errno_of(exc) == errno.ENOENT

    run(test)


def test_getattr_of_an_open_directory_no_listing_has_is_its_handle_s(
    run: Callable[..., None],
) -> None:
    """As for a file: a directory open (an fd, a shell's cwd) whose objects were deleted
    and the dataset listed twice answers getattr as opendir found it, no links (it was
    ENOENT); released, ENOENT."""

    async def test(m: Mount) -> None:
        d = await m.path("dir")
        fh = await m.fs.opendir(d.st_ino, None)  # type: ignore[arg-type]
        rest = [o for o in OBJECTS if not o.key.startswith("dir/")]
        m.relist(rest)
        m.relist(rest)
        got = await m.fs.getattr(d.st_ino, None)  # type: ignore[arg-type]
        assert (got.st_ino, got.st_nlink, got.st_mtime_ns) == (d.st_ino, 0, d.st_mtime_ns)
        assert stat.S_ISDIR(got.st_mode)
        await m.fs.releasedir(fh)
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await m.fs.getattr(d.st_ino, None)  # type: ignore[arg-type]
        assert errno_of(exc) == errno.ENOENT

    run(test)


# -- open, read, release ----------------------------------------------------------------


def test_open_refuses_writes_directories_and_unknown_inodes(run: Callable[..., None]) -> None:
    async def test(m: Mount) -> None:
        a = await m.path("a.txt")
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_RDWR | os.O_APPEND):
            with pytest.raises(pyfuse3.FUSEError) as exc:
                await m.fs.open(a.st_ino, flags, None)  # type: ignore[arg-type]
            assert errno_of(exc) == errno.EROFS
        # O_APPEND of a read-only handle writes nothing: it opens, as on a read-only disk.
        fi = await m.fs.open(a.st_ino, os.O_RDONLY | os.O_APPEND, None)  # type: ignore[arg-type]
        await m.fs.release(fi.fh)
        d = await m.path("dir")
        for inode, want in ((d.st_ino, errno.EISDIR), (10**9, errno.ENOENT)):
            with pytest.raises(pyfuse3.FUSEError) as exc:
                await m.fs.open(inode, os.O_RDONLY, None)  # type: ignore[arg-type]
            assert errno_of(exc) == want
        # Everything that would write is EROFS; FLUSH is ENOSYS (the kernel stops sending it).
        for op, args in (
            (m.fs.write, (1, 0, b"x")),
            (m.fs.mkdir, (ROOT_INODE, b"n", 0o755, None)),
            (m.fs.unlink, (ROOT_INODE, b"a.txt", None)),
            (m.fs.rename, (ROOT_INODE, b"a.txt", ROOT_INODE, b"b", 0, None)),
            (m.fs.setattr, (a.st_ino, None, None, None, None)),
            (m.fs.create, (ROOT_INODE, b"n", 0o644, os.O_WRONLY, None)),
        ):
            with pytest.raises(pyfuse3.FUSEError) as exc:
                await op(*args)
            assert errno_of(exc) == errno.EROFS, op
        # FLUSH, FSYNC and FSYNCDIR are ENOSYS: the kernel stops sending them and answers
        # 0 (a read-only handle has nothing unwritten: `sync FILE` succeeds).
        for op, args in ((m.fs.flush, (1,)), (m.fs.fsync, (1, False)), (m.fs.fsyncdir, (1, True))):
            with pytest.raises(pyfuse3.FUSEError) as exc:
                await op(*args)
            assert errno_of(exc) == errno.ENOSYS, op
        assert m.daemon.asked == []

    run(test)


def test_reads_return_the_objects_bytes_through_the_daemon(run: Callable[..., None]) -> None:
    async def test(m: Mount) -> None:
        big = OBJECTS[1]
        assert await m.read_all("a.txt") == payload("a.txt", 1000)
        assert await m.read_all("dir/big.bin") == payload(big.key, big.size)
        assert await m.read_all("empty") == b""
        # Every miss names the mount, the listed version, and the chunk.
        q = next(q for q in m.daemon.asked if q["key"] == big.key)
        assert (q["mount"], q["version"]) == ("m1", "v1") and "refetch" not in q
        assert sorted(m.daemon.chunks_of(big.key)) == [0, 1, 2]

        fh = await m.open("dir/big.bin")
        whole = payload(big.key, big.size)
        # A read across a chunk boundary, one at the end, one past the end.
        assert await m.read(fh, CS - 10, 20) == whole[CS - 10 : CS + 10]
        assert await m.read(fh, big.size - 5, 100) == whole[-5:]
        assert await m.read(fh, big.size, 100) == b""
        assert await m.read(fh, big.size + CS, 100) == b""
        await m.fs.release(fh)
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await m.fs.read(fh, 0, 10)  # a released handle
        assert errno_of(exc) == errno.EBADF
        c = m.reader.counters
        assert c.bytes_read == 1000 + big.size + 20 + 5
        assert c.hits == 0 and c.store_bytes > 0

    run(test)


@pytest.mark.parametrize(
    ("failure", "want"),
    [
        (403, errno.EACCES),  # the daemon says this user may not read the object
        (404, errno.EIO),
        (409, errno.EIO),  # the object changed in the store
        (500, errno.EIO),
        (502, errno.EIO),
        (ControlError("silent for 30 s", timed_out=True), errno.EIO),  # a frozen daemon
        (ControlError("connection refused"), errno.EIO),  # gone, and re-register fails
    ],
)
def test_failed_misses_map_to_errnos(run: Callable[..., None], failure: Any, want: int) -> None:
    async def test(m: Mount) -> None:
        m.daemon.fail["dir/secret.bin"] = failure
        fh = await m.open("dir/secret.bin")
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await m.read(fh, 0, 10)
        assert errno_of(exc) == want
        # The failure is not cached: the next read asks again, and other files work.
        del m.daemon.fail["dir/secret.bin"]
        assert await m.read(fh, 0, 10) == payload("dir/secret.bin", 10)
        assert await m.read_all("a.txt") == payload("a.txt", 1000)

    run(test)


def test_the_buffer_serves_a_chunk_read_in_pieces_and_is_bounded(
    run: Callable[..., None],
) -> None:
    async def test(m: Mount) -> None:
        big = OBJECTS[1]
        whole = payload(big.key, big.size)
        fh = await m.open(big.key)
        for off in range(0, CS, 4096):  # one chunk in 16 kernel requests
            assert await m.read(fh, off, 4096) == whole[off : off + 4096]
        assert m.daemon.chunks_of(big.key) == [0]  # fetched once
        c = m.reader.counters
        assert c.buffer_bytes == CS - 4096 and c.store_bytes == 4096
        # The buffer holds two chunks: reading chunks 1 and 2 pushes chunk 0 out.
        assert await m.read(fh, CS, 10) == whole[CS : CS + 10]
        assert await m.read(fh, 2 * CS, 10) == whole[2 * CS : 2 * CS + 10]
        assert await m.read(fh, 0, 10) == whole[:10]
        assert m.daemon.chunks_of(big.key) == [0, 1, 2, 0]

    run(test, buffer_bytes=2 * CS)


def test_hits_come_from_lmdb_and_damage_is_refetched(run: Callable[..., None]) -> None:
    async def test(m: Mount) -> None:
        a = OBJECTS[0]
        m.admit(a, 0)
        assert await m.read_all("a.txt") == payload("a.txt", 1000)
        assert m.daemon.asked == []
        c = m.reader.counters
        assert (c.hits, c.hit_bytes, c.misses, c.corrupt_chunks) == (1, 1000, 0, 0)

        # Cached values damaged after admission, in the data of chunk 0 and the header
        # of chunk 1: counted, refetched, never served.
        big = OBJECTS[1]
        m.admit(big, 0)
        m.admit(big, 1)
        with m.store.env.begin(write=True) as txn:
            for index, at in ((0, -100), (1, 20)):
                key = ChunkRef.of(big, CS, index).key
                value = bytearray(txn.get(key, db=m.store.db(b"chunks")))
                value[at] ^= 0xFF
                txn.put(key, bytes(value), db=m.store.db(b"chunks"))
        assert await m.read_all(big.key) == payload(big.key, big.size)
        refetched = [q for q in m.daemon.asked if q.get("refetch") == "1"]
        assert sorted(int(q["index"]) for q in refetched) == [0, 1]
        assert c.corrupt_chunks == 2

    run(test)


def test_a_file_is_one_version_from_open_to_close(run: Callable[..., None]) -> None:
    async def test(m: Mount) -> None:
        big = OBJECTS[1]
        old = payload(big.key, big.size, "v1")
        old_ino = (await m.path(big.key)).st_ino
        fh = await m.open(big.key)
        assert await m.read(fh, 0, 10) == old[:10]

        # The object is rewritten in the store and listed again (another mount's
        # --refresh): new size, new version, new bytes.
        new_obj = obj(big.key, CS + 7, "v2")
        m.daemon.objects[(big.key, "v2")] = payload(big.key, new_obj.size, "v2")
        m.relist([o if o.key != big.key else new_obj for o in OBJECTS])

        # The open handle keeps reading v1, up to v1's size, asking for v1 only.
        assert await m.read(fh, CS, 10) == old[CS : CS + 10]
        assert await m.read(fh, 2 * CS, 1000) == old[2 * CS :]
        assert {q["version"] for q in m.daemon.asked} == {"v1"}
        # The store no longer has v1: EIO, never v2's bytes.
        del m.daemon.objects[(big.key, "v1")]
        # (The buffer holds one chunk, the last one read: chunk 1 is asked for again.)
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await m.read(fh, CS + 100, 10)
        assert errno_of(exc) == errno.EIO

        # A new open reads v2, with v2's attributes.
        assert (await m.path(big.key)).st_size == CS + 7
        assert await m.read_all(big.key) == payload(big.key, CS + 7, "v2")
        assert m.daemon.asked[-1]["version"] == "v2"
        # The new version has an inode of its own (the old one is still open); the old
        # handle, closed, marks its inode for the kernel to look up again.
        assert (await m.path(big.key)).st_ino != old_ino
        await m.fs.release(fh)
        assert old_ino in m.fs.stale_inodes

    run(test, buffer_bytes=CS)


def test_an_open_reads_around_the_pages_of_another_version_still_open(
    run: Callable[..., None],
) -> None:
    """A version listed while a handle of another is open gets an inode of its own (the
    kernel's pages of an inode serve all its handles), though open() does not count the
    handles of a version listed when the mount started until a switch(): one opened at
    the start, one after a relist that changed nothing, then the file rewritten. An OPEN
    through the old number (a kernel entry not dropped yet) reads around its pages."""

    async def test(m: Mount) -> None:
        big = OBJECTS[1]
        ino = (await m.path(big.key)).st_ino
        first = await m.fs.open(ino, os.O_RDONLY, None)  # type: ignore[arg-type]
        assert not first.direct_io
        first_fh = first.fh
        m.relist(OBJECTS)  # nothing changed: `big` is still listed since the start
        second = await m.fs.open(ino, os.O_RDONLY, None)  # type: ignore[arg-type]
        assert not second.direct_io and second.keep_cache
        second_fh = second.fh
        await m.fs.release(first_fh)

        new_obj = obj(big.key, CS + 7, "v2")
        m.daemon.objects[(big.key, "v2")] = payload(big.key, new_obj.size, "v2")
        m.relist([o if o.key != big.key else new_obj for o in OBJECTS])
        old_ino, ino = ino, (await m.path(big.key)).st_ino
        assert ino != old_ino  # `second` (v1) is still open on the old number
        fi = await m.fs.open(ino, os.O_RDONLY, None)  # type: ignore[arg-type]
        assert not fi.direct_io  # its own inode, its own pages
        assert bytes(await m.fs.read(fi.fh, 0, CS + 7)) == payload(big.key, CS + 7, "v2")
        late = await m.fs.open(old_ino, os.O_RDONLY, None)  # type: ignore[arg-type]
        assert late.direct_io and not late.keep_cache  # v2 under v1's number: around
        assert bytes(await m.fs.read(late.fh, 0, CS + 7)) == payload(big.key, CS + 7, "v2")
        assert await m.read(second_fh, 0, 10) == payload(big.key, big.size)[:10]
        assert (await m.fs.getattr(old_ino, None)).st_size == big.size  # type: ignore[arg-type]
        for fh in (fi.fh, late.fh, second_fh):
            await m.fs.release(fh)
        again = await m.fs.open(ino, os.O_RDONLY, None)  # type: ignore[arg-type]
        assert not again.direct_io  # no v1 handle open any more
        await m.fs.release(again.fh)

    run(test)


def test_the_size_given_never_passes_a_page_cache_handles_version(
    run: Callable[..., None],
) -> None:
    """While a handle reads a version through the page cache, getattr of its inode gives
    that version's size (the kernel zero-fills past a short read's end, and would serve
    those zeros below a larger size); the path, a new inode, the listing's."""

    async def test(m: Mount) -> None:
        big = OBJECTS[1]
        fh = await m.open(big.key)
        inode = (await m.path(big.key)).st_ino
        m.relist(
            [o if o.key != big.key else obj(big.key, big.size + 3 * CS, "v2") for o in OBJECTS]
        )
        assert (await m.path(big.key)).st_size == big.size + 3 * CS
        assert (await m.fs.getattr(inode, None)).st_size == big.size  # type: ignore[arg-type]
        await m.fs.release(fh)
        assert (await m.path(big.key)).st_size == big.size + 3 * CS

    run(test)


def test_an_old_versions_inode_lives_until_the_kernel_forgets_it(
    run: Callable[..., None],
) -> None:
    """The old version's number answers its handle's version until the kernel FORGETs
    it; the path's fresh number goes back to the listing inode only once the kernel
    has forgotten both (every lookup of the fresh one given back), never earlier."""

    async def test(m: Mount) -> None:
        big = OBJECTS[1]
        old_ino = (await m.path(big.key)).st_ino
        fh = await m.open(big.key)
        m.relist([o if o.key != big.key else obj(big.key, CS + 7, "v2") for o in OBJECTS])
        fresh = (await m.path(big.key)).st_ino  # a lookup: the kernel counts 1
        assert fresh != old_ino
        assert (await m.path(big.key)).st_ino == fresh  # 2 (from the name cache)
        await m.fs.release(fh)
        # Released but not forgotten: still the old number, the path still the fresh one.
        assert (await m.fs.getattr(old_ino, None)).st_ino == old_ino  # type: ignore[arg-type]
        await m.fs.forget([(old_ino, 1)])
        assert (await m.path(big.key)).st_ino == fresh  # 3: the kernel still holds it
        await m.fs.forget([(fresh, 2)])  # one lookup not given back yet
        assert (await m.fs.getattr(fresh, None)).st_size == CS + 7  # type: ignore[arg-type]
        await m.fs.forget([(fresh, 1)])
        # Neither number held by the kernel: the path has its listing inode again.
        a = await m.path(big.key)
        assert a.st_ino == old_ino and a.st_size == CS + 7
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await m.fs.getattr(fresh, None)  # type: ignore[arg-type]
        assert errno_of(exc) == errno.ENOENT

    run(test)


def test_statfs_shows_the_dataset_and_what_is_cached(run: Callable[..., None]) -> None:
    async def test(m: Mount) -> None:
        s = await m.fs.statfs(None)  # type: ignore[arg-type]
        total = sum(o.size for o in OBJECTS)
        assert s.f_frsize == 4096 and s.f_blocks >= -(-total // 4096)
        assert s.f_bfree == s.f_blocks  # nothing cached
        # df -i: the listing's inodes used, and free ones (0 free was 100% IUse: tools
        # checking for free inodes refused to run)
        assert s.f_files - s.f_ffree == m.fs.listing.inode_count >= len(OBJECTS) + 1
        assert s.f_ffree == s.f_favail > 1000 * s.f_files // 1001
        m.admit(OBJECTS[1], 0)
        s = await m.fs.statfs(None)  # type: ignore[arg-type]
        assert s.f_blocks - s.f_bfree == CS // 4096

    run(test)


def test_every_request_handler_answers_eio_for_an_unforeseen_exception() -> None:
    """pyfuse3 ends main() (the whole mount) on an exception other than FUSEError out of
    a handler: each one is wrapped (survive.answer_eio) or catches its own."""
    for name, base in vars(pyfuse3.Operations).items():
        if name.startswith("_") or not inspect.iscoroutinefunction(base):
            continue
        fn = getattr(SilofsFS, name)
        guarded = getattr(fn, "_answers_eio", False) or getattr(fn, "_catches_own", False)
        assert guarded, f"SilofsFS.{name} may end the mount"


@pytest.mark.parametrize(
    ("mtime", "ns"),
    [
        (1_700_000_000.123, 1_700_000_000_123_000_000),  # int(x * 1e9): ...122999808
        (1_700_000_000.999, 1_700_000_000_999_000_000),
        (1_700_000_000.654321, 1_700_000_000_654_321_000),
        (100.0, 100_000_000_000),
        (0.0, 0),
        (4_102_444_800.001, 4_102_444_800_001_000_000),  # 2100
    ],
)
def test_st_mtime_ns_is_the_stores_stamp_to_the_microsecond(mtime: float, ns: int) -> None:
    assert mtime_ns(mtime) == ns


# -- a kept small file's hot record (mount/hot.py) -------------------------------------


def test_a_hot_record_ends_with_its_listing_generation(run: Callable[..., None]) -> None:
    """A small file opened again is opened from its hot record; after a relist that
    changed it, a handle opened before reads on in its version and a new open reads the
    new version, never the record's place or answers of the old generation."""

    async def test(m: Mount) -> None:
        a = OBJECTS[0]
        m.admit(a, 0)
        v1 = payload(a.key, a.size)
        old_ino = (await m.path(a.key)).st_ino
        first = await m.open(a.key)
        assert await m.read(first, 0, 4096) == v1
        second = await m.open(a.key)
        assert m.fs._files[second].hot is m.fs._files[first].hot is not None  # hot
        assert await m.read(second, 0, 4096) == v1
        assert m.daemon.asked == []

        new = obj(a.key, 1500, "v2")
        m.daemon.objects[(a.key, "v2")] = payload(a.key, new.size, "v2")
        m.relist([o if o.key != a.key else new for o in OBJECTS])
        assert await m.read(second, 0, 4096) == v1  # its version, from the cache
        assert m.daemon.asked == []
        third = await m.open(a.key)
        assert m.fs._files[third].hot is not m.fs._files[first].hot
        assert await m.read(third, 0, 4096) == payload(a.key, 1500, "v2")
        assert [q["version"] for q in m.daemon.asked] == ["v2"]
        for fh in (first, second, third):
            await m.fs.release(fh)
        attr = await m.path(a.key)
        assert attr.st_size == 1500  # an inode of its own (v1 was open at the relist)
        assert old_ino in m.fs.stale_inodes  # v1's: the kernel forgets its size

    run(test)


def test_a_hot_file_s_open_reads_around_the_pages_of_another_version_still_open(
    run: Callable[..., None],
) -> None:
    """As for a file of several chunks (above): a handle opened from the hot record
    before a relist that changed nothing is counted by that switch, and the version a
    later relist brought gets an inode of its own while it is open."""

    async def test(m: Mount) -> None:
        a = OBJECTS[0]
        m.admit(a, 0)
        ino = (await m.path(a.key)).st_ino
        await m.fs.release((await m.fs.open(ino, os.O_RDONLY, None)).fh)  # type: ignore[arg-type]
        kept = (await m.fs.open(ino, os.O_RDONLY, None)).fh  # type: ignore[arg-type]
        assert m.fs._files[kept].hot is not None
        m.relist(OBJECTS)  # nothing changed
        new = obj(a.key, 1500, "v2")
        m.daemon.objects[(a.key, "v2")] = payload(a.key, new.size, "v2")
        m.relist([o if o.key != a.key else new for o in OBJECTS])
        old_ino, ino = ino, (await m.path(a.key)).st_ino
        assert ino != old_ino  # `kept` (v1) is still open
        fi = await m.fs.open(ino, os.O_RDONLY, None)  # type: ignore[arg-type]
        assert not fi.direct_io and not fi.keep_cache  # its own inode, no pages yet
        assert m.fs._files[fi.fh].hot is None
        assert await m.read(fi.fh, 0, 4096) == payload(a.key, 1500, "v2")
        assert await m.read(kept, 0, 4096) == payload(a.key, a.size)
        await m.fs.release(fi.fh)
        await m.fs.release(kept)
        again = await m.fs.open(ino, os.O_RDONLY, None)  # type: ignore[arg-type]
        assert not again.direct_io  # no v1 handle open any more
        await m.fs.release(again.fh)

    run(test)


def test_a_switch_tells_the_kernel_of_a_changed_hot_file(run: Callable[..., None]) -> None:
    """A file opened from its hot record no longer touches the listing's recently used
    entries: switch() compares the hot records' entries too, so the kernel forgets a
    changed one at once (not only when the walk of the whole listing reaches it)."""

    async def test(m: Mount) -> None:
        a = OBJECTS[0]
        ino = (await m.path(a.key)).st_ino
        await m.fs.release((await m.fs.open(ino, os.O_RDONLY, None)).fh)  # type: ignore[arg-type]
        m.fs.listing._cache.clear()  # forgotten there (it is bounded)
        new = obj(a.key, 1500, "v2")
        record = m.store.replace_listing(
            DSID, [o if o.key != a.key else new for o in OBJECTS], {"uri": "file:///d/"}
        )
        assert ino in {e.inode for e in m.fs.switch(record)}

    run(test)


# -- an inode per version with serving processes (mount/shared.py versions) ------------


@dataclass
class Processes:
    """Two serving processes of one mount: a SilofsFS each over the same env, sharing
    one SharedTables (each its own part of it), as forked ones do. `relist` lists again
    and switches the first only: the second follows when a request of it notices."""

    one: Mount
    two: Mount

    def relist(self, objects: list[ObjectInfo]) -> None:
        self.one.relist(objects)


@pytest.fixture
def run_processes(store: WritableStore, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    for name in fs_module.SYNCED:  # as process.py does for serving processes, undone after
        monkeypatch.setattr(SilofsFS, name, getattr(SilofsFS, name))
    fs_module.sync_first(SilofsFS)

    def runner(test: Callable[[Processes], Awaitable[None]]) -> None:
        record = store.replace_listing(DSID, OBJECTS, {"uri": "file:///d/"})
        daemon = FakeDaemon({(o.key, o.version): payload(o.key, o.size) for o in OBJECTS})
        shared = SharedTables(2)
        other = SharedTables.__new__(SharedTables)
        other.__dict__.update(shared.__dict__)
        other._cursor = {}
        other.index = 1

        async def reregister() -> None:
            raise ControlError("the daemon is gone")

        async def main() -> None:
            mounts = []
            for tables in (shared, other):
                reader = ChunkReader(
                    store,
                    daemon,  # type: ignore[arg-type]
                    dataset_id=DSID,
                    chunk_size=CS,
                    buffer_bytes=8 * CS,
                    readahead_bytes=0,
                    reregister=reregister,
                )
                reader.registered("m1", track_hits=False)
                fs = SilofsFS(ListingView(store, DSID, record), reader, LOOK, tables)
                fs.catch_up = _catching_up(fs, store)
                mounts.append(Mount(fs, reader, daemon, store))
            async with trio.open_nursery() as nursery:
                for mount in mounts:
                    mount.reader.start(nursery)
                with trio.fail_after(20):
                    await test(Processes(*mounts))
                nursery.cancel_scope.cancel()

        trio.run(main)

    return runner


def _catching_up(fs: SilofsFS, store: CacheStore) -> Callable[[], None]:
    def catch_up() -> None:  # as process.py's: the dataset's record, switched to
        fs.switch(store.dataset_record(DSID))

    return catch_up


def test_serving_processes_share_an_inode_per_version(
    run_processes: Callable[..., None],
) -> None:
    """A refresh with a handle of the old version open, which another serving process
    opened: the path's fresh number, the old number's version, and the FORGETs that end
    them are the same in either process, whichever the kernel sends a request to."""

    async def test(p: Processes) -> None:
        big = OBJECTS[1]
        old_ino = (await p.two.path(big.key)).st_ino
        fh = await p.two.open(big.key)  # the old version's handle, opened in two
        new = obj(big.key, CS + 7, "v2")
        p.one.daemon.objects[(big.key, "v2")] = payload(big.key, new.size, "v2")
        p.relist([o if o.key != big.key else new for o in OBJECTS])

        fresh = (await p.two.path(big.key)).st_ino  # two switches first (catch_up)
        assert fresh != old_ino and p.two.fs.listing.gen == p.one.fs.listing.gen
        assert (await p.one.path(big.key)).st_ino == fresh  # the same number in one
        for m in (p.one, p.two):  # the old number: its handle's version, in either
            a = await m.fs.getattr(old_ino, None)  # type: ignore[arg-type]
            assert (a.st_ino, a.st_size, a.st_nlink) == (old_ino, big.size, 0)
            assert (await m.fs.getattr(fresh, None)).st_size == new.size  # type: ignore[arg-type]
        fi = await p.one.fs.open(fresh, os.O_RDONLY, None)  # type: ignore[arg-type]
        assert not fi.direct_io  # its own inode: its own pages
        assert await p.two.read(fi.fh, 0, CS + 7) == payload(big.key, new.size, "v2")
        assert await p.one.read(fh, 0, 10) == payload(big.key, big.size)[:10]
        late = await p.two.fs.open(old_ino, os.O_RDONLY, None)  # type: ignore[arg-type]
        assert late.direct_io  # v2 under v1's number (an entry not dropped yet): around
        for fh_ in (fh, fi.fh, late.fh):
            await p.one.fs.release(fh_)

        # The kernel forgets the old number through one process and the fresh one (its
        # two lookups given back) through the other: the path has its own number again.
        await p.one.fs.forget([(old_ino, 1)])
        await p.two.fs.forget([(fresh, 1)])
        assert (await p.one.fs.getattr(fresh, None)).st_ino == fresh  # type: ignore[arg-type]
        await p.two.fs.forget([(fresh, 1)])
        for m in (p.two, p.one):
            a = await m.path(big.key)
            assert (a.st_ino, a.st_size) == (old_ino, new.size)
            with pytest.raises(pyfuse3.FUSEError) as exc:
                await m.fs.getattr(fresh, None)  # type: ignore[arg-type]
            assert errno_of(exc) == errno.ENOENT

    run_processes(test)


def test_a_full_versions_table_keeps_the_number_and_reads_around_its_pages(
    run_processes: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No room for a fresh number in the shared table: the path keeps its number, a new
    open of the new version reads with direct_io (around the old one's pages) and each
    handle reads its own version's bytes, never the other's."""
    monkeypatch.setattr(fs_module, "VERSION_ROWS", 1)

    async def test(p: Processes) -> None:
        big = OBJECTS[1]
        ino = (await p.one.path(big.key)).st_ino
        fh = await p.one.open(big.key)
        new = obj(big.key, big.size, "v2")  # the same size: only the bytes tell
        p.one.daemon.objects[(big.key, "v2")] = payload(big.key, new.size, "v2")
        p.relist([o if o.key != big.key else new for o in OBJECTS])
        assert (await p.two.path(big.key)).st_ino == ino
        fi = await p.two.fs.open(ino, os.O_RDONLY, None)  # type: ignore[arg-type]
        assert fi.direct_io and not fi.keep_cache
        assert await p.one.read(fi.fh, 0, big.size) == payload(big.key, big.size, "v2")
        assert await p.two.read(fh, 0, big.size) == payload(big.key, big.size)
        for fh_ in (fh, fi.fh):
            await p.two.fs.release(fh_)

    run_processes(test)


def test_a_reply_cached_in_one_process_follows_a_number_another_gave_back(
    run_processes: Callable[..., None],
) -> None:
    """A LOOKUP reply one process kept names the path's fresh number; another process
    gives the path its own number back (the kernel forgot both): the first answers
    the path's number, never the fresh one the kernel no longer holds."""

    async def test(p: Processes) -> None:
        big = OBJECTS[1]
        ino = (await p.one.path(big.key)).st_ino
        fh = await p.one.open(big.key)
        p.relist([o if o.key != big.key else obj(big.key, CS + 7, "v2") for o in OBJECTS])
        fresh = (await p.two.path(big.key)).st_ino
        assert fresh != ino and (await p.two.path(big.key)).st_ino == fresh  # kept reply
        await p.one.fs.release(fh)
        await p.one.fs.forget([(ino, 1), (fresh, 2)])
        assert (await p.two.path(big.key)).st_ino == ino

    run_processes(test)


def test_a_path_listed_on_a_number_in_use_for_another_version_gets_its_own(
    run: Callable[..., None],
) -> None:
    """A later listing numbers a new path (a hash of it) with the fresh number another
    path's new version has: the new path is given a number of its own, so its lookup
    never names the other's inode (whose pages the kernel may hold)."""
    extra = obj("dir/new.txt", 300)

    async def test(m: Mount) -> None:
        m.daemon.objects[(extra.key, "v1")] = payload(extra.key, extra.size)
        m.relist([*OBJECTS, extra])
        target = (await m.path(extra.key)).st_ino  # the number a listing gives new.txt
        m.relist(OBJECTS)
        big = OBJECTS[1]
        fh = await m.open(big.key)
        m.fs._iv.next = target  # the next fresh number is new.txt's listing inode
        v2 = obj(big.key, CS + 7, "v2")
        m.daemon.objects[(big.key, "v2")] = payload(big.key, v2.size, "v2")
        relisted = [o if o.key != big.key else v2 for o in OBJECTS]
        m.relist(relisted)
        assert (await m.path(big.key)).st_ino == target  # big's v2 has that number
        m.relist([*relisted, extra])  # and a listing gives it to new.txt too
        a = await m.path(extra.key)
        assert a.st_ino != target and a.st_size == extra.size
        assert (await m.fs.getattr(target, None)).st_size == v2.size  # type: ignore[arg-type]
        assert (await m.fs.getattr(a.st_ino, None)).st_size == extra.size  # type: ignore[arg-type]
        assert await m.read_all(extra.key) == payload(extra.key, extra.size)
        assert await m.read_all(big.key) == payload(big.key, v2.size, "v2")
        await m.fs.release(fh)

    run(test)


def test_a_readdirplus_entry_s_number_is_counted_before_another_process_forgets_it(
    run_processes: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """READDIRPLUS names a path's fresh number (the kernel counts a lookup of it); the
    kernel's FORGET of its earlier lookups reaches another serving process while the
    entry is being replied. The number was counted only after the reply: the FORGET
    took its count to nothing and gave it back, and the kernel held a number no process
    answered (ENOENT), which a later fresh number could be given again. Counted first,
    it stays the path's while the kernel holds it."""

    async def test(p: Processes) -> None:
        big = OBJECTS[1]
        ino = (await p.one.path(big.key)).st_ino
        fh = await p.one.open(big.key)
        new = obj(big.key, CS + 7, "v2")
        p.one.daemon.objects[(big.key, "v2")] = payload(big.key, new.size, "v2")
        p.relist([o if o.key != big.key else new for o in OBJECTS])
        fresh = (await p.two.path(big.key)).st_ino  # the kernel holds one lookup of it
        assert fresh != ino
        await p.one.fs.release(fh)
        await p.one.fs.forget([(ino, 1)])  # the old number: done with
        d = (await p.two.path("dir")).st_ino
        dfh = await p.two.fs.opendir(d, None)  # type: ignore[arg-type]
        named: list[int] = []

        def reply(token: Any, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
            named.append(attr.st_ino)
            if attr.st_ino == fresh:  # its FORGET, in the other process, meanwhile
                one, sh = p.one.fs, p.one.fs.shared
                assert sh is not None
                one._sync_shared()
                sh.lock_versions()
                try:
                    one._load_versions()
                    one._forget([(fresh, 1)])
                    one._store_versions()
                finally:
                    sh.unlock_versions()
            return True

        monkeypatch.setattr(pyfuse3, "readdir_reply", reply)
        await p.two.fs.readdir(dfh, 0, None)  # type: ignore[arg-type]
        assert fresh in named
        for m in (p.one, p.two):  # the number the reply named: answered, in either
            a = await m.fs.getattr(fresh, None)  # type: ignore[arg-type]
            assert (a.st_ino, a.st_size) == (fresh, new.size)
        await p.one.fs.forget([(fresh, 1)])  # the readdir's lookup: the path's own again
        assert (await p.two.path(big.key)).st_ino == ino

    run_processes(test)


def test_a_readdirplus_entry_the_buffer_refused_is_not_counted(
    run: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh number is counted before its entry is replied: an entry the kernel's
    buffer had no room for gives its count back (else the number outlived the kernel's
    last FORGET of it, the path never getting its own number again)."""
    replies, room = _kernel_buffer(monkeypatch, 0)

    async def test(m: Mount) -> None:
        big = OBJECTS[1]
        ino = (await m.path(big.key)).st_ino
        fh = await m.open(big.key)
        v2 = obj(big.key, CS + 7, "v2")
        m.daemon.objects[(big.key, "v2")] = payload(big.key, v2.size, "v2")
        m.relist([o if o.key != big.key else v2 for o in OBJECTS])
        fresh = (await m.path(big.key)).st_ino  # one lookup the kernel holds
        assert fresh != ino
        await m.fs.release(fh)
        await m.fs.forget([(ino, 1)])
        d = (await m.path("dir")).st_ino
        dfh = await m.fs.opendir(d, None)  # type: ignore[arg-type]
        room[0] = 2  # the dots only: dir/big.bin, the first entry, refused
        await m.fs.readdir(dfh, 0, None)  # type: ignore[arg-type]
        assert [n for n, _ in replies] == [b".", b".."]
        await m.fs.forget([(fresh, 1)])  # the one lookup the kernel had
        assert (await m.path(big.key)).st_ino == ino  # the path's own number again

    run(test)
