"""The daemon's sealed chunk files (silofs/sealed.py) that a mount maps: shown in status
(each mount's memory.shmem_bytes, the daemon's node.sealed_chunks), and bounded by the
mount's chunk buffer however many big files a reader opens and keeps open."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.fixtures import needs_fuse
from tests.support.node import Node

pytestmark = [needs_fuse, pytest.mark.fuse]

CHUNK = 1 << 20
BUFFER = 4 << 20
FILES = 24


def test_big_files_kept_open_hold_no_more_sealed_memory_than_the_buffer(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    s3_server.apply_env(monkeypatch)
    s3_server.create(bucket_name, {f"f{i:02d}.bin": os.urandom(2 * CHUNK) for i in range(FILES)})
    node: Node = make_node(cache_size="16M")  # most chunks are not admitted: all streamed
    mp = node.mount(
        s3_server.uri(bucket_name), tmp_path / "mnt", "--chunk-size", "1M",
        "--endpoint-url", s3_server.endpoint_url,
        env={"SILOFS_BUFFER_BYTES": str(BUFFER)},
    )  # fmt: skip
    held = [os.open(mp / f"f{i:02d}.bin", os.O_RDONLY) for i in range(FILES)]
    try:
        most = 0
        for fd in held:  # each file read whole, and kept open
            assert len(os.pread(fd, 2 * CHUNK, 0)) == 2 * CHUNK
            memory = node.mount_status(str(mp))["memory"]
            most = max(most, memory["shmem_bytes"])
        sealed = node.status()["node"]["sealed_chunks"]
        print(f"mount shmem at most {most >> 10} KiB; daemon {sealed}")
        assert 0 < most <= BUFFER + 4 * (CHUNK + (64 << 10))  # the buffer, reads in flight
        assert sealed["count"] <= sealed["max"] and set(sealed) == {"count", "bytes", "max"}
    finally:
        for fd in held:
            os.close(fd)
