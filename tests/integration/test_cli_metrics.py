"""Metrics as Prometheus reads them: the text parsed by prometheus_client's own parser,
on the control socket and scraped over TCP (metrics_address)."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from silofs.control.client import ControlClient
from tests.support.fixtures import needs_fuse
from tests.support.net import free_port
from tests.support.node import Node, drop_file_cache

pytestmark = [needs_fuse, pytest.mark.fuse]


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_parse_and_scrape_over_tcp(
    make_node, local_store, bucket_name, tmp_path: Path, monkeypatch
) -> None:
    local_store.apply_env(monkeypatch)
    objects = {f"f{i}.bin": bytes([i]) * 50_000 for i in range(10)}
    local_store.create(bucket_name, objects)
    port = free_port()
    node: Node = make_node(args=("--metrics-address", f":{port}"))
    uri = local_store.uri(bucket_name)
    mp = node.mount(uri, tmp_path / "mnt", "--job", "train")
    for name in objects:
        assert (mp / name).read_bytes() == objects[name]
        drop_file_cache(mp / name)
    node.settle(str(mp), 500_000)

    with ControlClient(node.socket) as c:
        status, headers, body = c.request_raw("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    fams = families(body.decode())
    fetch = fams["silofs_fetch_seconds"]
    assert fetch.type == "histogram"
    count = next(s for s in fetch.samples if s.name == "silofs_fetch_seconds_count")
    assert count.labels == {"dataset": uri} and count.value == 10  # one GET per file
    assert fams["process_resident_memory_bytes"].samples[0].value > 10 << 20
    cached = fams["silofs_dataset_cached_bytes"].samples[0]
    assert cached.labels == {"dataset": uri} and cached.value == 500_000
    read = fams["silofs_dataset_read_bytes"]
    assert read.type == "counter" and read.samples[0].value == 500_000
    for name in (
        "silofs_admission_dropped_chunks",
        "silofs_admission_damaged_chunks",
        "silofs_admission_map_full_chunks",
        "silofs_dataset_store_errors",
        "silofs_job_limiter_wait_seconds",
        "silofs_job_throughput_bytes_per_second",
    ):
        assert name in fams, name
    assert fams["silofs_dataset_store_errors"].samples[0].value == 0

    # The same text over TCP, on localhost only.
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        tcp = families(resp.read().decode())
    assert tcp["silofs_dataset_cached_bytes"].samples[0].value == 500_000
    assert tcp.keys() == fams.keys()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=10)
    assert err.value.code == 404


def test_label_values_with_quotes_backslashes_and_braces_parse_back_exactly(
    make_node, local_store, tmp_path: Path, monkeypatch
) -> None:
    """A dataset whose path holds a quote, a backslash, braces, '=' and ',' and a job
    named with the punctuation a job may hold: prometheus_client's parser reads the
    labels back exactly (a newline cannot get there: dataset URIs and job names refuse
    control characters)."""
    local_store.apply_env(monkeypatch)
    name = 'we"ird\\na,me={x}'
    local_store.create(name, {"f.bin": b"x" * 1000})
    node: Node = make_node()
    uri = local_store.uri(name)
    job = "j'o{b}=1,x"
    mp = node.mount(uri, tmp_path / "mnt", "--job", job)
    assert (mp / "f.bin").read_bytes() == b"x" * 1000
    with ControlClient(node.socket) as c:
        status, _, body = c.request_raw("GET", "/metrics")
    assert status == 200
    fams = families(body.decode())
    assert {s.labels["dataset"] for s in fams["silofs_dataset_read_bytes"].samples} == {uri}
    assert {s.labels["job"] for s in fams["silofs_job_limiter_wait_seconds"].samples} == {job}
