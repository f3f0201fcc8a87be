"""A file is one version from open to close, on real FUSE mounts of one daemon.

Owns: after another mount's `--refresh` lists a changed object, a handle opened before
it reads the old version or gets EIO, never bytes of the new version mixed in (the
mount's chunk requests carry the version it listed; the daemon answers 409 for another
one, or serves the version the handle opened, from the previous listing generation, which
the store then refuses as changed); the refreshing mount reads the new version whole.
"""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from tests.support.fixtures import needs_fuse

pytestmark = [needs_fuse, pytest.mark.fuse]

CHUNK = 256 << 10


def _pread(fd: int, size: int, off: int) -> bytes | int:
    """The bytes read, or the errno of a failed read."""
    try:
        return os.pread(fd, size, off)
    except OSError as exc:
        return exc.errno or -1


def test_an_open_file_never_mixes_versions_after_a_refresh(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    old = random.Random("old").randbytes(4 * CHUNK)
    new = random.Random("new").randbytes(4 * CHUNK)  # same size: size cannot tell them apart
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"d/shard.bin": old})
    uri = local_store.uri(bucket_name)
    node = make_node()
    a = node.mount(uri, tmp_path / "a", "--chunk-size", "256K")
    # The refused reads, logged: the daemon reads the old version (kept from the previous
    # listing generation) and the store refuses it as changed.
    node.expect_errors(r"changed since (this mount listed it|listing)")

    fd = os.open(a / "d/shard.bin", os.O_RDONLY)
    try:
        # No kernel read-ahead and no sequential pattern: chunk 1 is not fetched early.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert os.pread(fd, 4096, 0) == old[:4096]

        local_store.put(bucket_name, "d/shard.bin", new)
        b = node.mount(uri, tmp_path / "b", "--chunk-size", "256K", "--refresh")
        assert (b / "d/shard.bin").read_bytes() == new  # the refreshed listing

        for off in (CHUNK + 100, 2 * CHUNK, 3 * CHUNK + 5000):
            got = _pread(fd, 4096, off)
            assert got != new[off : off + 4096], f"new bytes at {off} through an old handle"
            assert got in (errno.EIO, old[off : off + 4096]), got
        # Here chunk 1.. were never cached in the old version: the store refused them.
        assert _pread(fd, 4096, CHUNK + 100) == errno.EIO
        assert os.pread(fd, 4096, 0) == old[:4096]  # the cached chunk 0 is still served
    finally:
        os.close(fd)
