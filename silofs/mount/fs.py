"""pyfuse3 Operations: a read-only POSIX view of one dataset manifest.

Owns inode attributes, directory listing, open file handles and the shape of each
read (which chunks cover [off, off+size)), and every errno a reader sees: EROFS for
anything that would write, ENOENT for unknown names, EIO when a miss cannot be served.
lookup/getattr/readdir come from the in-memory manifest and never touch the network.
Never fetches or verifies bytes itself (reader.py does).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass

import pyfuse3

from silofs.mount.manifest import Manifest, Node
from silofs.mount.reader import ChunkReader, MissError, OpenFile

log = logging.getLogger(__name__)

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@dataclass(frozen=True)
class Presentation:
    uid: int
    gid: int
    file_mode: int
    dir_mode: int
    timeout: float


async def _erofs(*_args: object, **_kwargs: object) -> None:
    raise pyfuse3.FUSEError(errno.EROFS)


class SilofsFS(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, manifest: Manifest, reader: ChunkReader, look: Presentation) -> None:
        super().__init__()
        self.manifest = manifest
        self.reader = reader
        self.look = look
        self._files: dict[int, OpenFile] = {}
        self._attrs: dict[int, pyfuse3.EntryAttributes] = {}
        self._next_fh = 1
        self._blocks = sum(-(-n.size // 4096) for n in manifest.nodes[1:] if n)

    # -- attributes ------------------------------------------------------------------
    def _node(self, inode: int) -> Node:
        node = self.manifest.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _attr(self, node: Node) -> pyfuse3.EntryAttributes:
        # The snapshot never changes under a mount, so each inode's attributes are built
        # once; pyfuse3 copies them into every reply.
        a = self._attrs.get(node.inode)
        if a is None:
            a = self._attrs[node.inode] = self._build_attr(node)
        return a

    def _build_attr(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.inode
        a.generation = 0
        a.entry_timeout = self.look.timeout
        a.attr_timeout = self.look.timeout
        if node.is_dir:
            a.st_mode = stat.S_IFDIR | self.look.dir_mode
            assert node.children is not None
            subdirs = sum(1 for i in node.children.values() if self.manifest.nodes[i].is_dir)
            a.st_nlink = 2 + subdirs
            a.st_size = 4096
        else:
            a.st_mode = stat.S_IFREG | self.look.file_mode
            a.st_nlink = 1
            a.st_size = node.size
        a.st_uid = self.look.uid
        a.st_gid = self.look.gid
        a.st_rdev = 0
        a.st_blksize = 1 << 20
        # As a 4 KiB-block disk would allocate it, so `du` agrees with a local copy.
        a.st_blocks = -(-a.st_size // 4096) * 8
        ns = int(node.mtime * 1e9)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = ns
        return a

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        node = self.manifest.lookup(parent_inode, name)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(node)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attr(self._node(inode))

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        return not (mode & os.W_OK)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = self._blocks
        s.f_bfree = s.f_bavail = 0
        s.f_files = self.manifest.inode_count
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 1024
        return s

    # -- directories -----------------------------------------------------------------
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if not self._node(inode).is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        node = self._node(fh)
        assert node.children is not None
        for i in range(start_id, len(node.names)):
            name = node.names[i]
            child = self.manifest.nodes[node.children[name]]
            assert child is not None
            if not pyfuse3.readdir_reply(token, name, self._attr(child), i + 1):
                break

    async def releasedir(self, fh: int) -> None:
        return None

    # -- files -----------------------------------------------------------------------
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self._node(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        fh = self._next_fh
        self._next_fh += 1
        assert node.obj is not None
        self._files[fh] = OpenFile(node.obj)
        # keep_cache: the snapshot never changes under a mount, so the page cache of a
        # file stays valid across opens.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        f = self._files.get(fh)
        if f is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        end = min(off + size, f.obj.size)
        if off >= end:
            return b""
        r = self.reader
        r.renew()
        cs = r.chunk_size
        first, last = off // cs, (end - 1) // cs
        sequential = off == f.next_offset
        f.next_offset = end
        try:
            if first == last:
                data, hit = await r.chunk(f, first)
                self._count(end - off, hit)
                if sequential and f.obj.size > cs:
                    r.prefetch(f, first)
                return memoryview(data)[off - first * cs : end - first * cs]
            return await self._read_span(f, off, end, first, last, sequential)
        except MissError:
            raise pyfuse3.FUSEError(errno.EIO) from None

    async def _read_span(
        self, f: OpenFile, off: int, end: int, first: int, last: int, sequential: bool
    ) -> bytes:
        """A request crossing chunk boundaries: copy each part before the next await."""
        cs = self.reader.chunk_size
        parts = []
        for index in range(first, last + 1):
            data, hit = await self.reader.chunk(f, index)
            lo = max(off, index * cs) - index * cs
            hi = min(end, (index + 1) * cs) - index * cs
            parts.append(bytes(data[lo:hi]))
            self._count(hi - lo, hit)
        if sequential:
            self.reader.prefetch(f, last)
        return b"".join(parts)

    def _count(self, n: int, hit: bool) -> None:
        c = self.reader.counters
        c.bytes_read += n
        if hit:
            c.hits += 1
            c.hit_bytes += n
        else:
            c.misses += 1
            c.miss_bytes += n

    async def release(self, fh: int) -> None:
        self._files.pop(fh, None)

    async def flush(self, fh: int) -> None:
        # ENOSYS once makes the kernel stop sending FLUSH: +55% small-file reads.
        raise pyfuse3.FUSEError(errno.ENOSYS)

    # -- everything that would write -------------------------------------------------
    write = create = mkdir = mknod = symlink = link = unlink = rmdir = _erofs  # type: ignore
    rename = setattr = setxattr = removexattr = fsync = fsyncdir = _erofs  # type: ignore
