"""Listings are persisted and reused; chunks are shared by content; changed objects fail."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fixtures import needs_fuse
from tests.support.node import Node, drop_file_cache
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]


def test_listing_is_reused_until_refresh(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"a.txt": b"a", "d/b.txt": b"b"})
    uri = local_store.uri(bucket_name)
    node: Node = make_node()
    mp = node.mount(uri, tmp_path / "mnt")
    assert sorted(p.name for p in mp.rglob("*.txt")) == ["a.txt", "b.txt"]
    assert node.run("unmount", str(mp)).returncode == 0
    local_store.put(bucket_name, "new.txt", b"new")
    node.stop()
    node.start()  # a new daemon still has the persisted listing
    mp = node.mount(uri, mp)
    assert not (mp / "new.txt").exists()
    assert node.run("unmount", str(mp)).returncode == 0
    mp = node.mount(uri, mp, "--refresh")
    assert (mp / "new.txt").read_bytes() == b"new"


def test_byte_identical_buckets_share_chunks(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    s3_server.apply_env(monkeypatch)
    tree = {f"x/{i}.bin": bytes([i]) * 30_000 for i in range(10)}
    s3_server.create(bucket_name, tree)
    s3_server.create(bucket_name + "-copy", tree)
    node = make_node()
    ep = ["--endpoint-url", s3_server.endpoint_url]
    mp1 = node.mount(s3_server.uri(bucket_name), tmp_path / "one", *ep)
    mp2 = node.mount(s3_server.uri(bucket_name + "-copy"), tmp_path / "two", *ep)
    for k, v in tree.items():
        assert (mp1 / k).read_bytes() == v
    wait_for(
        lambda: sum(d["cached_chunks"] for d in node.status()["datasets"]) == 10, what="admission"
    )
    for k, v in tree.items():
        assert (mp2 / k).read_bytes() == v
    m2 = node.settle(str(mp2), 300_000)
    assert m2["remote_gets"] == 0 and m2["hit_bytes"] == 300_000


def test_an_object_changed_since_listing_is_eio_never_mixed(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    s3_server.apply_env(monkeypatch)
    old = b"o" * 600_000
    s3_server.create(bucket_name, {"f.bin": old, "g.bin": b"g" * 10})
    node = make_node()
    node.expect_errors(r"f\.bin changed or was deleted since listing")
    mp = node.mount(
        s3_server.uri(bucket_name),
        tmp_path / "mnt",
        "--chunk-size",
        "256K",
        "--endpoint-url",
        s3_server.endpoint_url,
    )
    with open(mp / "f.bin", "rb", buffering=0) as f:
        # Random access: no kernel read-ahead, so only chunk 0 is fetched before the change.
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        assert f.read(1000) == old[:1000]
        s3_server.put(bucket_name, "f.bin", b"n" * 600_000)
        f.seek(300_000)
        with pytest.raises(OSError) as exc:
            f.read(1000)
    assert exc.value.errno == errno.EIO
    assert (mp / "g.bin").read_bytes() == b"g" * 10  # the rest keeps serving
    log = (node.logs / "daemon.log").read_text()
    assert "f.bin" in log and "changed" in log
    drop_file_cache(mp / "f.bin")
    with open(mp / "f.bin", "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        assert f.read(1000) == old[:1000]  # chunk 0 is cached: the snapshot's bytes
        f.seek(300_000)
        with pytest.raises(OSError):  # the rest is EIO again, never the new bytes
            f.read(1000)


def test_silofs_ctl_status(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"a.bin": b"a" * 5000})
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", "--job", "train")
    (mp / "a.bin").read_bytes()
    node.settle(str(mp), 5000)

    def ctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "silofs_ctl", *args, "--socket", node.socket],
            capture_output=True,
            text=True,
            check=True,
        )

    text = ctl("status").stdout
    assert bucket_name in text and "train" in text and str(mp) in text
    doc = json.loads(ctl("status", "--json").stdout)
    assert doc["mounts"][0]["bytes_read"] == 5000
    assert doc["datasets"][0]["objects"] == 1
    res = subprocess.run(
        [sys.executable, "-m", "silofs_ctl", "status", "--socket", str(tmp_path / "nothing.sock")],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1
    assert "cannot reach" in res.stderr
