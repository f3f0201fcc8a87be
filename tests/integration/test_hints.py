"""Prefetch by hint on a real mount of a real S3 server (moto): a reader that reads in
the order its PrefetchSampler sent finds every file cached before it gets there."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from silofs.control.client import ControlClient
from silofs.hints import Hinter
from silofs.torch import PrefetchSampler
from tests.support.fixtures import needs_fuse
from tests.support.node import drop_file_cache
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

FILES = 30


def test_a_reader_in_hinted_order_sees_hits(
    make_node, s3_server, bucket_name, monkeypatch, tmp_path: Path
) -> None:
    s3_server.apply_env(monkeypatch)
    rnd = random.Random(11)
    objects = {
        f"train/c{i % 3}/img{i:03d}.jpg": rnd.randbytes(rnd.randrange(60_000, 120_000))
        for i in range(FILES)
    }
    s3_server.create(bucket_name, objects)
    node = make_node(cache_size="64M")
    uri = s3_server.uri(bucket_name)
    mp = node.mount(
        uri, tmp_path / "mnt", "--job", "train", "--endpoint-url", s3_server.endpoint_url
    )
    names = sorted(objects)
    order = list(range(FILES))
    rnd.shuffle(order)
    # Two files' worth of window: the walk has to follow the reader to stay ahead.
    hinter = Hinter(str(mp), socket=node.socket, window=250_000)
    sampler = PrefetchSampler(order, [str(mp / n) for n in names], str(mp), hinter=hinter)

    read = 0
    for i in sampler:
        # Before each read: the daemon saw the reads so far, and the window ahead of
        # them is fetched and admitted (polled, with a deadline).
        def ready(read: int = read) -> bool:
            h = hinter.status() or {}
            ds = next(d for d in node.status()["datasets"] if d["uri"] == uri)
            settled = h.get("waiting_for_reader") or h.get("state") == "done"
            return (
                h.get("position", -1) >= read
                and bool(settled)
                and h["in_flight_bytes"] == 0
                and ds["cached_bytes"] >= h["prefetched_bytes"]
            )

        wait_for(ready, what=f"the hint to be ready for the file after {read} bytes")
        path = mp / names[i]
        assert path.read_bytes() == objects[names[i]]
        drop_file_cache(path)
        read += len(objects[names[i]])

    m = node.settle(str(mp), read)
    # Every byte was a hit: the prefetch had each file cached before the reader came.
    assert m["hit_bytes"] == m["bytes_read"] == read, m
    assert m["misses"] == 0, m
    job = next(j for j in node.status()["jobs"] if j["name"] == "train")
    # Each file fetched once, all by the prefetch, all charged to the job.
    assert job["prefetched_bytes"] == job["remote_bytes"] == read, job
    h = wait_for(lambda: (v := hinter.status()) and v["position"] >= read and v, what="position")
    assert h["state"] == "done" and h["hit_chunks"] == FILES and h["missed_chunks"] == 0, h
    assert m["prefetch"]["hinted"] == FILES
    with ControlClient(node.socket) as c:
        _, _, body = c.request_raw("GET", "/metrics")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert fams["silofs_job_prefetched_bytes"].samples[0].value == read
    assert fams["silofs_job_prefetch_hit_chunks"].samples[0].value == FILES


try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_a_dataloader_with_prefetch_sampler_reads_every_file(
    make_node, local_store, bucket_name, monkeypatch, tmp_path: Path
) -> None:
    from torch.utils.data import DataLoader, Dataset, RandomSampler

    local_store.apply_env(monkeypatch)
    objects = {f"d/f{i:02d}.bin": bytes([i]) * 5000 for i in range(20)}
    local_store.create(bucket_name, objects)
    node = make_node(cache_size="64M")
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", "--job", "t")
    paths = [str(mp / k) for k in sorted(objects)]

    class Files(Dataset):
        def __len__(self) -> int:
            return len(paths)

        def __getitem__(self, i: int) -> bytes:
            return Path(paths[i]).read_bytes()

    ds = Files()
    sampler = PrefetchSampler(RandomSampler(ds), paths, str(mp), socket=node.socket)
    loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=list)
    got = sorted(b for batch in loader for b in batch)
    assert got == sorted(objects.values())
    sampler.flush(30)
    assert sampler.failed is None and sampler.sent == len(paths)
