"""Cold reads through a real mount on moto, with the GETs counted by a proxy in front of
the store: sequential reads fetch spans in few GETs, random reads and image folders
fetch only the chunks they read, and every byte fetched is charged to the job."""

from __future__ import annotations

import os
import random
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.faultproxy import FaultPlan, FaultProxy
from tests.support.fixtures import needs_fuse
from tests.support.node import Node
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

CHUNK = 256 << 10
PAGE = 4096


def _tree(rnd: random.Random) -> dict[str, bytes]:
    tree = {"big.bin": rnd.randbytes(40 * CHUNK + 999)}
    for i in range(6):  # an image folder: files of two 4 MiB chunks, read at the head
        tree[f"imgs/{i:02d}.jpg"] = rnd.randbytes((4 << 20) + 1000 * i + 1)
    return tree


@pytest.fixture
def cold(make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path):
    """(node, mountpoint, tree, proxy): a fresh mount of a moto bucket whose every
    store request passes a proxy that counts them."""
    s3_server.apply_env(monkeypatch)
    tree = _tree(random.Random(5))
    s3_server.create(bucket_name, tree)
    up = urlsplit(s3_server.endpoint_url)
    with FaultProxy(upstream=(up.hostname or "127.0.0.1", up.port or 80), faults=FaultPlan()) as p:
        node: Node = make_node(cache_size="64M")

        def mount(*args: str) -> Path:
            chunk = () if "--chunk-size" in args else ("--chunk-size", "256K")
            return node.mount(
                s3_server.uri(bucket_name), tmp_path / "mnt", *chunk, "--endpoint-url", p.url, *args
            )

        yield node, mount, tree, p


def _gets(proxy: FaultProxy, name: str) -> int:
    return sum(1 for r in proxy.settled_history() if r.method == "GET" and name in r.target)


def _job(node: Node) -> dict:
    (job,) = node.status()["jobs"]
    return job


def test_random_reads_fetch_only_the_chunks_they_touch(cold) -> None:
    node, mount, tree, proxy = cold
    mp = mount()
    data = tree["big.bin"]
    rnd = random.Random(9)
    exact: set[int] = set()  # chunks the reads cover
    paged: set[int] = set()  # chunks the kernel's page-aligned reads can cover
    fd = os.open(mp / "big.bin", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no kernel read-ahead either
        for _ in range(12):
            off = rnd.randrange(0, len(data) - (64 << 10))
            assert os.pread(fd, 64 << 10, off) == data[off : off + (64 << 10)]
            end = off + (64 << 10)
            exact |= set(range(off // CHUNK, (end - 1) // CHUNK + 1))
            lo, hi = off // PAGE * PAGE, -(-end // PAGE) * PAGE
            paged |= set(range(lo // CHUNK, (min(hi, len(data)) - 1) // CHUNK + 1))
    finally:
        os.close(fd)
    m = node.settle(str(mp), 1)
    gets = wait_for(  # the proxy records a GET once its body is sent
        lambda: (
            (n := _gets(proxy, "big.bin")) == node.mount_status(str(mp))["remote_requests"] and n
        ),
        what="the proxy and the daemon to count the same GETs",
    )
    # At most one GET per read (a read across a chunk boundary names both chunks as its
    # span: one GET), every chunk a read covers fetched, none ahead.
    assert 0 < gets <= 12 and len(paged) < 40
    m = node.mount_status(str(mp))
    assert (len(exact) - 1) * CHUNK < m["remote_bytes"] <= len(paged) * CHUNK


def test_an_image_folder_read_at_the_head_reads_no_file_ahead(cold) -> None:
    """With the default 4 MiB chunks. The kernel's own read-ahead (read_ahead_kb 1024)
    reads about the first MiB of a file whose head is read: within the first chunk."""
    node, mount, tree, proxy = cold
    mp = mount("--chunk-size", "4M")
    names = sorted(k for k in tree if k.startswith("imgs/"))
    for name in names:
        with open(mp / name, "rb") as f:
            assert f.read(16 << 10) == tree[name][: 16 << 10]
    # One chunk of each file: silofs read nothing ahead of what the kernel asked for.
    assert _gets(proxy, "imgs/") == len(names)
    m = node.settle(str(mp), len(names) * (16 << 10))
    assert m["remote_bytes"] == len(names) * (4 << 20)


def test_a_sequential_read_fetches_spans_in_few_gets_each_charged(cold) -> None:
    node, mount, tree, proxy = cold
    mp = mount()
    data = tree["big.bin"]
    assert (mp / "big.bin").read_bytes() == data
    m = node.settle(str(mp), len(data))
    # The proxy records a GET once its body is sent: the stream's may be a moment late.
    gets = wait_for(
        lambda: (n := _gets(proxy, "big.bin")) == m["remote_requests"] and n,
        what=f"the proxy to see the daemon's {m['remote_requests']} GETs "
        f"(it saw {_gets(proxy, 'big.bin')}: {[(r.target, r.status) for r in proxy.history]})",
    )
    # One stream from the first read on (the first request names its chunks as a span),
    # continued by every later span; a span that races the stream's start may GET too.
    assert gets <= 3, f"{gets} GETs for 41 chunks read in order"
    assert m["remote_bytes"] == len(data), m  # no chunk fetched twice, none past the end
    # Every byte fetched, read-ahead included, was charged to the job's bucket.
    assert _job(node)["limiter_charged_bytes"] == len(data)


def test_with_an_io_limit_read_ahead_gets_are_charged_and_bounded(cold) -> None:
    node, mount, tree, proxy = cold
    rate = int(4 * CHUNK / 0.05)  # SPAN_SECONDS (0.05 s) of it: four chunks per GET at most
    mp = mount("--io-limit", f"{rate}B/s")
    data = tree["big.bin"]
    assert (mp / "big.bin").read_bytes() == data
    gets = _gets(proxy, "big.bin")
    assert gets >= len(data) // (4 * CHUNK)
    m = node.settle(str(mp), len(data))
    assert m["remote_bytes"] == len(data)
    assert _job(node)["limiter_charged_bytes"] == len(data)


def test_azure_counts_each_get_of_a_range_longer_than_4mib(
    make_node, azurite_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """Azure sends a range's MD5 only up to 4 MiB, so the backend reads a 16 MiB chunk in
    four GETs: remote_requests counts each (it counted one per range read), as the
    proxy in front of Azurite sees them."""
    from tests.support.servers import AZURITE_KEY, connection_string

    azurite_server.apply_env(monkeypatch)
    data = random.Random(7).randbytes((16 << 20) + 999)
    azurite_server.create(bucket_name, {"big.bin": data})
    up = urlsplit(azurite_server.endpoint_url)
    with FaultProxy(upstream=(up.hostname or "127.0.0.1", up.port or 80), faults=FaultPlan()) as p:
        conn = connection_string(f"{p.url}{up.path}", AZURITE_KEY)
        node: Node = make_node(cache_size="64M", env={"AZURE_STORAGE_CONNECTION_STRING": conn})
        uri = azurite_server.uri(bucket_name)
        mp = node.mount(uri, tmp_path / "mnt", "--chunk-size", "16M")
        assert (mp / "big.bin").read_bytes() == data
        m = node.settle(str(mp), len(data))
        gets = wait_for(  # the proxy records a GET once its body is sent
            lambda: (n := _gets(p, "big.bin")) == m["remote_requests"] and n,
            what=f"the proxy to see the daemon's {m['remote_requests']} GETs "
            f"(it saw {_gets(p, 'big.bin')})",
        )
    # 16 MiB + 999 bytes in two chunks: four GETs of 4 MiB and one of 999 bytes, however
    # the spans cut them (a span of both chunks is one range: five GETs again).
    assert gets == 5 and m["remote_gets"] == 2, m
    assert m["remote_bytes"] == len(data)
