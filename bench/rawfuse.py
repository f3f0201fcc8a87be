"""The pyfuse3 ceiling: a minimal read-only pyfuse3 filesystem serving a directory from memory.

Owns nothing of silofs's logic (its device loop aside): at start it reads every file
under DATA into memory, builds each inode's attributes once, mounts with the options a
silofs mount uses (ro, noatime, default_options, entry/attr timeouts of an hour,
keep_cache, FLUSH answered ENOSYS, bdi read_ahead_kb raised to 1024 once INIT is
answered), serves with one pyfuse3 worker task through the device loop silofs uses
(silofs/mount/turns.py: the cheapest of those tried, bench/README.md; `--loop pyfuse3`
for pyfuse3's own), and answers each request with the least Python pyfuse3 allows: a
dict lookup and a memoryview slice.
bench/throughput.py measures it the same way as silofs (page cache dropped before each
pass, CPU of this process from /proc/PID/stat, started in a session of its own as a
silofs mount process is: the kernel's autogroups schedule a session as one group), so
"silofs / ceiling" is the share of what one pyfuse3 process can do that silofs reaches.
Never used by silofs itself.

--from-disk serves the same files from the local disk instead of memory: the SSD
ceiling. Every file is mapped at start (nothing read yet) and a READ answers with a
slice of its map: the reply's copy faults the pages in, reading around them as any
fault does. It pays what silofs pays after the page cache is dropped (bringing its
bytes in from the SSD) and nothing of silofs's own, so "silofs / SSD ceiling" says
what silofs costs beyond a minimal pyfuse3 filesystem over the same disk. Of the
configurations tried (bench/README.md: open and close per file with a preadv into a
reused buffer; descriptors kept open; preadv with RWF_NOWAIT and a worker thread when
it would block; maps) the maps cost the least CPU per file. Mapped pages survive
drop_caches: a bench starts a fresh process for every pass.

--processes N (N >= 2) serves the one mount from N forked processes (silofs/mount/forked.py:
fork after INIT, a cloned device per process, one reader of the device at a time); the
parent then only supervises (it serves nothing, so it stays as it was right after INIT)
and prints the children's pids after "ready" (`ready PID PID ...`) so a bench can add up
their CPU.

    python bench/rawfuse.py DATA MOUNTPOINT [--from-disk] [--processes N] [--loop pyfuse3]
"""

from __future__ import annotations

import argparse
import errno
import mmap
import os
import signal
import stat
import sys

import common  # noqa: F401, E402 - this checkout first on sys.path
import pyfuse3
import trio

from silofs.mount import forked, turns  # noqa: E402
from silofs.mount.process import raise_read_ahead  # noqa: E402

TIMEOUT = 3600.0
READ_AHEAD_KB = 1024  # as a silofs mount's default


class MemFS(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, root: str, from_disk: bool = False) -> None:
        super().__init__()
        self.attrs: dict[int, pyfuse3.EntryAttributes] = {}
        self.children: dict[int, dict[bytes, int]] = {}
        self.data: dict[int, bytes | mmap.mmap] = {}
        self.from_disk = from_disk
        self._next = pyfuse3.ROOT_INODE
        self._add_dir(root, pyfuse3.ROOT_INODE)
        self.initialized = trio.Event()

    def init(self) -> None:
        # Inside libfuse's INIT handling, before its reply (which resets the bdi's
        # read-ahead to the kernel's offer, 128 KiB): serve() raises it afterwards.
        self.initialized.set()

    def _attr(self, ino: int, st: os.stat_result, is_dir: bool) -> None:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.entry_timeout = a.attr_timeout = TIMEOUT
        a.st_mode = (stat.S_IFDIR | 0o555) if is_dir else (stat.S_IFREG | 0o444)
        a.st_nlink = 2 if is_dir else 1
        a.st_size = 4096 if is_dir else st.st_size
        a.st_uid, a.st_gid = os.getuid(), os.getgid()
        a.st_blksize = 1 << 20
        a.st_blocks = -(-a.st_size // 4096) * 8
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = st.st_mtime_ns
        self.attrs[ino] = a

    def _add_dir(self, path: str, ino: int) -> None:
        self._attr(ino, os.stat(path), True)
        kids = self.children[ino] = {}
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            self._next += 1
            child = self._next
            kids[os.fsencode(entry.name)] = child
            if entry.is_dir(follow_symlinks=False):
                self._add_dir(entry.path, child)
            elif self.from_disk:
                self.data[child] = _mapped(entry.path)
                self._attr(child, os.stat(entry.path), False)
            else:
                with open(entry.path, "rb") as f:
                    self.data[child] = f.read()
                self._attr(child, os.stat(entry.path), False)

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        ino = self.children.get(parent_inode, {}).get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.attrs[ino]

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.attrs[inode]

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        for i, (name, ino) in enumerate(list(self.children[fh].items())[start_id:], start_id):
            if not pyfuse3.readdir_reply(token, name, self.attrs[ino], i + 1):
                break

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> memoryview:
        return memoryview(self.data[fh])[off : off + size]

    async def release(self, fh: int) -> None:
        pass

    async def flush(self, fh: int) -> None:
        raise pyfuse3.FUSEError(errno.ENOSYS)


def _mapped(path: str) -> bytes | mmap.mmap:
    """The file at `path` mapped read-only (none of it read yet); b"" if empty."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) if size else b""


async def serve(fs: MemFS, mountpoint: str, loop: str = "turns") -> None:
    """Mount at `mountpoint` (already resolved: once mounted, a stat of it from this
    process would wait for this process) and serve until SIGTERM or an unmount."""
    opts = set(pyfuse3.default_options) | {"fsname=rawfuse", "ro", "noatime"}
    pyfuse3.init(fs, mountpoint, opts)
    signalled = False
    try:
        async with trio.open_nursery() as nursery:

            async def ready() -> None:
                await fs.initialized.wait()
                await trio.lowlevel.checkpoint()  # INIT's reply is out
                raise_read_ahead(mountpoint, READ_AHEAD_KB)
                print("ready", flush=True)

            async def signals() -> None:
                nonlocal signalled
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                    async for _ in sigs:
                        signalled = True
                        pyfuse3.terminate()
                        return

            nursery.start_soon(signals)
            nursery.start_soon(ready)
            # One worker task: its handlers never await, so more tasks only cost (1
            # reader: 164 against 194 and 154 against 176 us of CPU per file; 4 readers:
            # 152 against 197, then 173 against 172; bench/README.md). silofs cannot:
            # a miss would hold up every hit.
            if loop == "turns":
                turns.install()  # no checkpoint per acquire; a queued request taken at once
            await pyfuse3.main(max_tasks=1)
            nursery.cancel_scope.cancel()
    finally:
        # main() also returns when the kernel unmounted us (fusermount3 -u): only a
        # signal leaves the mount for us to remove.
        pyfuse3.close(unmount=signalled)


def serve_forked(fs: MemFS, mountpoint: str, processes: int) -> None:
    """Mount, answer INIT, then serve from `processes` forked children until SIGTERM
    (the parent unmounts) or an unmount (every child's read fails with ENODEV)."""
    forked.release_after_receive(type(fs))
    opts = set(pyfuse3.default_options) | {"fsname=rawfuse", "ro", "noatime"}
    pyfuse3.init(fs, mountpoint, opts)
    forked.run_until_init(fs)  # the kernel sends INIT right after the mount
    raise_read_ahead(mountpoint, READ_AHEAD_KB)
    fd = forked.fuse_fd()
    token = forked.ReadToken()
    forked.install(token)
    pids = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                forked.clone_device(fd)
                trio.run(pyfuse3.main)
            except BaseException as exc:  # noqa: BLE001 - a child reports and exits
                if not forked.is_disconnected(exc):
                    print(f"rawfuse child {os.getpid()}: {exc!r}", file=sys.stderr)
                    code = 1
            finally:
                forked.give_token()  # the next process reads ENODEV in turn
            forked.child_exit(code)
        pids.append(pid)
    print("ready", *pids, flush=True)

    class Stop(Exception):
        pass

    def stop(*_: object) -> None:
        raise Stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    alive = set(pids)
    signalled = False
    try:
        while alive:
            pid, _ = os.wait()
            alive.discard(pid)
    except Stop:
        signalled = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pyfuse3.close(unmount=signalled)  # the children read ENODEV and exit
    for pid in alive:
        os.waitpid(pid, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data")
    ap.add_argument("mountpoint")
    ap.add_argument("--from-disk", action="store_true", help="serve from the local disk")
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument(
        "--loop",
        choices=("pyfuse3", "turns"),
        default="turns",
        help="the device loop: silofs's (silofs/mount/turns.py: no checkpoint per acquire, "
        "a queued request taken at once), or pyfuse3's own",
    )
    args = ap.parse_args()
    data, mountpoint, processes = args.data, args.mountpoint, args.processes
    os.makedirs(mountpoint, exist_ok=True)
    fs = MemFS(data, from_disk=args.from_disk)
    if processes > 1:
        serve_forked(fs, os.path.realpath(mountpoint), processes)
    else:
        trio.run(serve, fs, os.path.realpath(mountpoint), args.loop)


if __name__ == "__main__":
    main()
